"""Which changed cases attribution analyses: a bounded sample, one case per kind of case in turn.

Attribution re-runs a changed case's kernels on both builds with every step's parameters kept and
replays the float64 variant references over its whole trajectory: per case it costs more than the
case's battery run did. A change that moves 250 cases of the standard battery (the weight-decay
reorder) would make attribution the larger part of the run, while the 250 answers say the same
few things: cases of one optimizer, family, parameter dtype and hyperparameter point change the
same way. So at most `limit` cases are analysed, picked round-robin over those groups (every group
gets one before any gets two). The groups take their turns coarsest first: the first group of every
optimizer x family, then of every optimizer x family x dtype, then the rest, so a change that moves
many 32-bit hyperparameter points still has its 8-bit cases analysed (in battery order they come
last). The cases left out are listed with the case that stands for their group, or, for a group that
did not fit, the nearest analysed case of the same optimizer and family.
"""

from __future__ import annotations

from service.core.results import CaseSpec

# Enough for one case of every (optimizer, family, dtype) group of the standard battery's changed
# cases and a second hyperparameter point for most; the analysis of one case is a fraction of a
# second on a GPU and about a second on a 2-core CPU.
DEFAULT_LIMIT = 32


def group_of(case: CaseSpec) -> tuple:
    """Cases that change the same way: one optimizer, kernel family, dtype, hyperparameter point."""
    return (case.optimizer, case.family, case.param_dtype, tuple(sorted(case.hyper.items())))


def _turns(groups: dict[tuple, list[CaseSpec]]) -> list[tuple]:
    """The groups in the order they take their turns: the first group (battery order) of each
    optimizer x family, then of each optimizer x family x dtype, then the others."""
    first_of: dict[tuple, tuple] = {}
    for width in (2, 3):
        for key in groups:
            first_of.setdefault(key[:width], key)
    leading = list(dict.fromkeys(first_of.values()))
    return leading + [key for key in groups if key not in leading]


def sample(cases: list[CaseSpec], limit: int = DEFAULT_LIMIT) -> tuple[list[CaseSpec], dict[str, str]]:
    """(the cases to analyse, in battery order; {left-out case id: the analysed case id standing
    for it, "" when none of its optimizer and family was}). Round-robin over groups (module doc: the
    coarsest kinds first), so every group is represented before any has two; within a group, battery
    order."""
    groups: dict[tuple, list[CaseSpec]] = {}
    for case in cases:
        groups.setdefault(group_of(case), []).append(case)
    queues = [list(groups[key]) for key in _turns(groups)]
    picked: list[CaseSpec] = []
    while len(picked) < limit and any(queues):
        for queue in queues:
            if queue and len(picked) < limit:
                picked.append(queue.pop(0))
    chosen = {case.case_id for case in picked}
    stands_for: dict[str, str] = {}
    for key, members in groups.items():
        representative = next((case.case_id for case in members if case.case_id in chosen), None)
        for case in members:
            if case.case_id not in chosen:
                stands_for[case.case_id] = representative or _nearest(case, picked)
    order = {case.case_id: index for index, case in enumerate(cases)}
    return sorted(picked, key=lambda case: order[case.case_id]), stands_for


def _nearest(case: CaseSpec, picked: list[CaseSpec]) -> str:
    """An analysed case of the same optimizer and family, of the same dtype where there is one; ""."""
    key = group_of(case)
    kin = [other for other in picked if group_of(other)[:2] == key[:2]]
    same_dtype = [other for other in kin if group_of(other)[2] == key[2]]
    return (same_dtype or kin or [None])[0].case_id if kin else ""


def left_out_entry(representative: str, *, same_group: bool = True) -> dict:
    """What a case that was not analysed reads in the stored attribution (class unknown, a note):
    the analysed case of its group, or (`same_group` False) the nearest one of its optimizer and
    family, or none."""
    bounded = "only a sample is analysed, one case per optimizer, family, dtype and hyperparameter point in turn"
    if not representative:
        note = f"{bounded}, and no case of this optimizer and family fitted in it"
    elif same_group:
        note = f"{bounded}; {representative} stands for this case's group"
    else:
        note = (f"{bounded}; this case's group did not fit in it, {representative} is the nearest analysed case "
                f"(same optimizer and family)")
    return {"class": "unknown", "note": note, "sampled_out": True}


def left_out_entries(cases: list[CaseSpec], stands_for: dict[str, str]) -> dict[str, dict]:
    """case id -> left_out_entry of every case `sample` left out."""
    by_id = {case.case_id: case for case in cases}
    return {case_id: left_out_entry(representative, same_group=not representative
                                    or group_of(by_id[representative]) == group_of(by_id[case_id]))
            for case_id, representative in stands_for.items()}
