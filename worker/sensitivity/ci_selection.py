"""The `ci` battery from evidence: the fewest, cheapest cases of the candidate pool
(batteries/pool.json) that still catch every catalogued defect.

Input: a recorded sensitivity run of the whole catalogue on the pool (recorded/cpu_pool.json),
which says, per defect, which pool cases caught it on the CPU. The defects that only exist in
csrc/cuda/ cannot run here; for each, `CUDA_ONLY_NEEDS` states which cases would reach the defect
(the code path it breaks), and bench/gpu/sensitivity_cuda.sh checks that claim on the H200.

Selection is weighted greedy set cover (cost = elements x steps; repeatedly the case with the
lowest cost per newly caught defect), then a pass that drops any chosen case whose defects the
others already catch. Greedy is not guaranteed minimal, but on ~60 defects and ~200 candidates
it lands within a case or two of it, and the battery stays a readable list of single-case groups.

Set cover sees only the defects the catalogue has. Two classes it once missed (issue 37: an 8-bit
tail count wrong only at sizes that are a multiple of the block, a one-ulp AdEMAMix bias
correction that first shows at step 5) are kept covered by rule as well (`COVERAGE_RULES`): every
blockwise family has a case whose size is a multiple of its block, every optimizer with bias
corrections a case run for at least `bias_correction_steps` of its betas, and (issue 45) an Adam
layout case of two param groups, one with several tensors, run for at least 5 steps. A rule the
cover leaves unmet adds the pool's cheapest case that meets it.

    python -m worker.sensitivity.ci_selection   # prints the ci battery's groups as JSON
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from service.core.results import CaseSpec
from worker.battery import BatterySpec, battery_from_file
from worker.sensitivity.catalogue import DEFAULT_CATALOGUE, load_catalogue
from worker.sensitivity.results import SensitivityReport

HERE = Path(__file__).resolve().parent
POOL = HERE / "batteries" / "pool.json"
RECORDED_POOL = HERE / "recorded" / "cpu_pool.json"


def _32bit(case: CaseSpec) -> bool:
    return case.family == "32bit"


def _8bit(case: CaseSpec) -> bool:
    return case.family == "8bit_blockwise"


# Which cases reach the code path each CUDA-only defect breaks (see its `expect` in the catalogue).
CUDA_ONLY_NEEDS: dict[str, Callable[[CaseSpec], bool]] = {
    "beta/cuda_lion_betas_swapped": lambda c: _32bit(c) and c.optimizer == "lion" and c.steps >= 2,
    # A 1-2 ulp change of state/absmax moves a code only near a midpoint between two codes: on the
    # CPU its analogue (precision/quant_reciprocal) needed 8-bit cases of >= 10k elements x steps.
    "precision/cuda_fast_divide": lambda c: _8bit(c) and c.size * c.steps >= 10_000,
    "quant8/adam_sq_signed_map_cuda": lambda c: _8bit(c) and c.optimizer == "adam",
    "quant8/absmax_signed_max_cuda": lambda c: _8bit(c) and c.optimizer in ("adam", "ademamix", "lion", "momentum")
    and c.size >= 2,
    "quant8/cuda_half_warps": lambda c: _8bit(c) and c.size > 128,
    "quant8/cuda_shuffle_from_8": lambda c: _8bit(c) and c.size > 16,
    "tail/cuda_8bit_partial_block_dropped": lambda c: _8bit(c) and c.size % 256 != 0,
    "tail/cuda_tail_loop_dropped": lambda c: _32bit(c) and c.size % 4 != 0,
    "writeback/cuda_pack_last_state_lost": lambda c: _32bit(c) and c.size >= 4 and c.steps >= 2,
    "writeback/cuda_tail_states_lost": lambda c: _32bit(c) and c.size % 4 != 0 and c.steps >= 2,
    "writeback/adam_states_swapped_cuda": lambda c: _32bit(c) and c.optimizer == "adam",
    "gnorm_scale/cuda_adagrad_args_swapped": lambda c: _32bit(c) and c.optimizer == "adagrad"
    and c.hyper["gnorm_scale"] != c.hyper["weight_decay"],
}


# The blockwise families and their block (elements per absmax; docs/KERNELS_8BIT.md).
BLOCK_SIZES = {"8bit_blockwise": 256}
# The optimizers whose update holds bias corrections 1 - beta^t, and the betas they correct.
BIAS_CORRECTED = {"adam": ("beta1", "beta2"), "ademamix": ("beta1", "beta2")}


def bias_correction_steps(betas: tuple[float, ...], horizon: int = 100) -> int:
    """The step by which each one-rounding way of getting a bias-correction term wrong has shown:
    for each beta, the kernel's terms 1/(1 - beta^t) and 1/sqrt(1 - beta^t) computed in double
    and rounded once to float32, against the same in float32 arithmetic (the reciprocal of the
    float32 correction, its float32 square root, the square root of the float32 reciprocal). Each
    differs by one ulp on some steps and not others; the latest first difference is the number
    of steps a battery needs to see all of them (5 at beta1 = 0.9, beta2 = 0.999: 1/(1 - 0.9^t)
    in float32 first differs at t = 5)."""
    f32 = np.float32
    needed = 1
    for beta in betas:
        t = np.arange(1, horizon + 1, dtype=np.float64)
        correction = 1.0 - beta ** t
        exact_inverse = (1.0 / correction).astype(f32)
        exact_inverse_sqrt = (1.0 / np.sqrt(correction)).astype(f32)
        rounded = correction.astype(f32)
        for wrong, right in ((f32(1) / rounded, exact_inverse), (f32(1) / np.sqrt(rounded), exact_inverse_sqrt),
                             (np.sqrt(exact_inverse), exact_inverse_sqrt)):
            differing = np.flatnonzero(wrong != right)
            if differing.size:
                needed = max(needed, int(differing[0]) + 1)
    return needed


def coverage_rules() -> dict[str, Callable[[CaseSpec], bool]]:
    """Rule name -> which cases meet it (module doc): a block-multiple size per blockwise family,
    enough steps per bias-corrected optimizer (at each case's own betas)."""
    rules: dict[str, Callable[[CaseSpec], bool]] = {}
    for family, block in BLOCK_SIZES.items():
        rules[f"{family}: a size that is a multiple of its block ({block})"] = \
            lambda c, family=family, block=block: c.family == family and c.size % block == 0
    for optimizer, names in BIAS_CORRECTED.items():
        rules[f"{optimizer}: steps enough for every bias-correction term"] = \
            lambda c, optimizer=optimizer, names=names: c.optimizer == optimizer and \
            c.steps >= bias_correction_steps(tuple(float(c.hyper[n]) for n in names))
    # Issue 45: shared state across tensors (step counters, bias-correction powers kept between the
    # tensors of a step, one group's hyperparameters on another) exists only in a layout case; the
    # DeepSpeed 0.19.0 pattern first differs at step 3, from the second tensor of a group on.
    rules["a layout case: one Adam over several tensors in two param groups, >= 5 steps"] = \
        lambda c: c.optimizer == "adam" and c.layout is not None and len(c.layout.groups) >= 2 \
        and any(len(group.sizes) >= 2 for group in c.layout.groups) and c.steps >= 5
    return rules


def unmet_rules(cases: list[CaseSpec]) -> list[str]:
    """The coverage rules no case of `cases` meets."""
    return [name for name, meets in coverage_rules().items() if not any(meets(c) for c in cases)]


def catch_sets(report: SensitivityReport, pool: BatterySpec) -> dict[str, set[str]]:
    """Defect id -> the pool cases that catch it: measured on the CPU, or CUDA_ONLY_NEEDS."""
    cases = pool.expand()
    sets = {mutant_id: caught for mutant_id, caught in report.catching_cases().items()}
    for mutant in load_catalogue(DEFAULT_CATALOGUE):
        if mutant.kind == "defect" and mutant.reaches == frozenset({"cuda"}):
            needs = CUDA_ONLY_NEEDS.get(mutant.id)
            if needs is None:
                raise ValueError(f"CUDA-only defect {mutant.id} has no entry in CUDA_ONLY_NEEDS: say which "
                                 "cases reach the code it breaks")
            sets[mutant.id] = {case.case_id for case in cases if needs(case)}
    return sets


def select_cases(sets: dict[str, set[str]], costs: dict[str, int]) -> list[str]:
    """A small, cheap set of case ids that meets every non-empty set (weighted greedy + pruning)."""
    uncovered = {mutant for mutant, caught in sets.items() if caught}
    chosen: list[str] = []
    while uncovered:
        def value(case_id: str) -> tuple[float, str]:
            gained = sum(case_id in sets[m] for m in uncovered)
            return (costs[case_id] / gained if gained else float("inf"), case_id)

        best = min((c for m in uncovered for c in sets[m]), key=value)
        chosen.append(best)
        uncovered = {m for m in uncovered if best not in sets[m]}
    for case_id in sorted(chosen, key=lambda c: -costs[c]):  # the dearest first: drop what is redundant
        rest = [c for c in chosen if c != case_id]
        if all(not caught or caught & set(rest) for caught in sets.values()):
            chosen = rest
    return sorted(chosen, key=lambda c: (costs[c], c))


def group_of(case: CaseSpec) -> dict:
    """A battery group that expands to exactly `case` (a layout case: its layout, each group's
    point being what its hyperparameters change from the case's)."""
    shape: dict = {"sizes": [case.size]}
    if case.layout is not None:
        shape = {"layouts": [{"groups": [
            {"sizes": list(group.sizes),
             **({"point": changed} if (changed := {k: v for k, v in group.hyper.items() if case.hyper.get(k) != v})
                else {})}
            for group in case.layout.groups]}]}
    return {"optimizers": [case.optimizer], "families": [case.family], "param_dtypes": [case.param_dtype],
            "points": [case.hyper], "gradients": [case.gradient.model_dump(mode="json")], "seeds": [case.seed],
            **shape, "steps": case.steps}


def ci_groups(report_path: Path = RECORDED_POOL, pool_path: Path = POOL) -> list[dict]:
    pool = battery_from_file(pool_path)
    report = SensitivityReport.model_validate_json(Path(report_path).read_text())
    if report.battery_digest != pool.digest:
        raise ValueError(f"{report_path} was recorded on another version of {pool_path}; record it again "
                         "(optdrift sensitivity --battery worker/sensitivity/batteries/pool.json --json-out ...)")
    by_id = {case.case_id: case for case in pool.expand()}
    costs = {i: c.size * c.steps for i, c in by_id.items()}
    chosen = select_cases(catch_sets(report, pool), costs)
    sets = catch_sets(report, pool)
    rules = coverage_rules()
    for name, meets in rules.items():
        if not any(meets(by_id[c]) for c in chosen):
            candidates = [i for i, c in by_id.items() if meets(c)]
            if not candidates:
                raise ValueError(f"no case of {pool_path} meets the coverage rule {name!r}: add one to the pool")
            chosen.append(min(candidates, key=lambda i: (costs[i], i)))
    # A case a rule brought in may make one of the cover's redundant: drop the dearest first, as
    # long as every defect is still caught and every rule still met.
    for case_id in sorted(chosen, key=lambda c: -costs[c]):
        rest = [c for c in chosen if c != case_id]
        if all(not caught or caught & set(rest) for caught in sets.values()) and \
                not unmet_rules([by_id[c] for c in rest]):
            chosen = rest
    return [group_of(by_id[case_id]) for case_id in sorted(chosen, key=lambda c: (costs[c], c))]


if __name__ == "__main__":
    json.dump(ci_groups(*(Path(a) for a in sys.argv[1:3])), sys.stdout, indent=1)
    print()
