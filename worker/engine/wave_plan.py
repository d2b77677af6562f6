"""How the fast engine lays a battery out (worker.engine.fast): rows of width classes, cases in
waves. Plain planning over CaseSpecs, no torch: the fast engine runs the plan, and a spare host's
prepared inputs (worker.engine.step_inputs) follow the same plan, without either importing the
other."""

from __future__ import annotations

from collections import defaultdict

from service.core.results import CaseSpec

ALIGN = 512  # elements; 2 KiB for float32 rows, 1 KiB for 16-bit rows, 512 B for uint8 codes
# A narrower width class is merged into the next wider one while the padding this adds stays
# under this fraction of the merged class's elements: fewer bundles, so fewer reference launches.
# That pays on a GPU, where launches cost more than arithmetic on padding; on the CPU the padding's
# arithmetic is the cost, so nothing is merged there.
MERGE_PADDING_FRACTION = {"cuda": 0.75, "cpu": 0.0}


def round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def reference_key(case: CaseSpec) -> tuple:
    """What a reference object depends on: the optimizer and every hyperparameter."""
    return (case.optimizer, tuple(sorted(case.hyper.items())))


# ----------------------------------------------------------------------------- planning
def width_classes(sizes: list[int], merge_fraction: float = MERGE_PADDING_FRACTION["cuda"]) -> dict[int, int]:
    """round_up(size) -> the width of its class. Walking from the narrowest width up, the next
    wider width joins the current class while the class's padding (its narrower rows widened to
    the new width) stays at most `merge_fraction` of the class's elements."""
    rows: dict[int, int] = defaultdict(int)
    for size in sizes:
        rows[round_up(size)] += 1
    target: dict[int, int] = {}
    members: list[int] = []
    for width in sorted(rows):
        if members:
            candidate = members + [width]
            padding = sum(rows[w] * (width - w) for w in candidate)
            if padding > merge_fraction * sum(rows[w] for w in candidate) * width:
                target.update({w: members[-1] for w in members})
                members = []
        members.append(width)
    target.update({w: members[-1] for w in members})
    return target


def plan_waves(cases: list[CaseSpec], max_wave_elements: int) -> list[list[int]]:
    """Indices of `cases` in waves: cases of one step count together (a wave runs as many steps
    as its longest case, so a one-step case in a 100-step wave would be observed 99 times for
    nothing), at most `max_wave_elements` padded parameter elements each (a case wider than that
    is a wave of its own), cases of one reference key kept together where they fit so that
    their bundles are not split."""
    by_key: dict[tuple, list[int]] = defaultdict(list)
    for index, case in enumerate(cases):
        by_key[(case.steps, reference_key(case))].append(index)
    waves: list[list[int]] = []
    current: list[int] = []
    used, steps = 0, None
    for (key_steps, _), indices in sorted(by_key.items(), key=lambda kv: kv[0][0]):
        for index in indices:
            cost = round_up(cases[index].size)
            if current and (used + cost > max_wave_elements or key_steps != steps):
                waves.append(current)
                current, used = [], 0
            current.append(index)
            used += cost
            steps = key_steps
    if current:
        waves.append(current)
    return waves


def plan_wave_indices(cases: list, max_wave_elements: int) -> list[list[int]]:
    """plan_waves over the cases a wave can hold: a layout case (several tensors under one
    optimizer, CaseSpec.layout) is left out; the engines run it alone through the group lifecycle."""
    members = [index for index, case in enumerate(cases) if getattr(case, "layout", None) is None]
    return [[members[j] for j in planned] for planned in plan_waves([cases[i] for i in members], max_wave_elements)]
