"""Attribution's first phase, reading: the commit's and the baseline's parameters step by step, in
ulps of each element's scale, and their states compared.

The phases of worker/attribution/analysis.py: reading -> rounding test -> variant match -> drift.

Inputs: the commit's and the baseline's parameters after every step (float32, exact for every
parameter dtype), the first divergent step the digests gave, and, where both builds wrote them,
their state leaves per step. Everything is measured per element in ulps of the element's *scale*:
the `ulp` (parameter dtype) of the largest |baseline parameter| the element has had up to that step,
start included. A reordering or contraction errs by a few ulps of the largest value the element's
arithmetic has handled, even where the parameter itself has cancelled down to a tiny value (whose
own ulp would make one rounding look like thousands). `ulps[t]` = max over elements of
|commit − baseline| in scale ulps; the next phase (worker/attribution/rounding.py) bounds it.

The reading also picks the elements the variants replay (worker/attribution/matching.py) and the
drift test counts (worker/attribution/drift_call.py): all of them, or for a large case a subset
chosen from the first divergent step's change.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.core.results import CaseSpec
from worker.attribution import states as state_compare
from worker.attribution import variants as catalogue
from worker.attribution.ulps import check_representable, ulp, ulp_distance
from worker.engine.gradients import initial_parameters

# Cases larger than this replay the variants on a subset of elements (every rule is elementwise,
# so a subset replays exactly): the TOP_CHANGED_ELEMENTS that changed most at the first divergent
# step and an even spread of the rest. A wrong variant misses on most changed elements, so the
# subset finds it; memory stays ~30 variants x this many float64 values, not x 2**20 x 100 steps.
MAX_REPLAYED_ELEMENTS = 65536
TOP_CHANGED_ELEMENTS = 4096


def replayed_elements(size: int, first_change: np.ndarray) -> np.ndarray | None:
    """Indices the variants replay (sorted), or None for all of them."""
    if size <= MAX_REPLAYED_ELEMENTS:
        return None
    with np.errstate(invalid="ignore"):
        top = np.argsort(-np.nan_to_num(np.abs(first_change), nan=np.inf))[:TOP_CHANGED_ELEMENTS]
    spread = np.linspace(0, size - 1, MAX_REPLAYED_ELEMENTS - TOP_CHANGED_ELEMENTS).astype(np.int64)
    return np.unique(np.concatenate([top, spread]))


class RunningScale:
    """Each element's scale so far (module doc), fed one step at a time: `baseline`, the largest
    |baseline parameter| since the start; `either`, the larger of that and the largest |commit
    parameter|. The commit rounds at its own magnitude, which a semantic change can take far
    beyond the baseline's (AdEMAMix without its second-moment bias correction: 1e8 times), so a
    residual that carries the commit's rounding is counted in ulps of `either`. Kept for the
    elements `chosen` only: the running maximum is elementwise, so a subset's is exact."""

    def __init__(self, case: CaseSpec, chosen: slice | np.ndarray = slice(None)):
        start = initial_parameters(case.seed, case.size).to(catalogue._DTYPES[case.param_dtype]).float().numpy()
        self.baseline = np.abs(start).astype(np.float64)[chosen]
        self.either = self.baseline.copy()

    def add(self, commit: np.ndarray, baseline: np.ndarray) -> None:
        np.maximum(self.baseline, np.abs(baseline), out=self.baseline)
        # (a non-finite commit value leaves the scale as it was: its residual is non-finite anyway)
        np.maximum(self.either, np.maximum(self.baseline, np.nan_to_num(np.abs(commit), nan=0.0, posinf=0.0)),
                   out=self.either)


@dataclass(frozen=True)
class Reading:
    """What the trajectories and states say before any judgement: the phase's output, every later
    phase's input."""

    case: CaseSpec
    first_divergent_step: int
    commit: np.ndarray                  # (steps, size) float32
    baseline: np.ndarray                # (steps, size) float32
    ulps: list[float]                   # per step: max |commit − baseline| in scale ulps
    max_abs_diff: float                 # max |commit − baseline| from the first divergent step on
    elements: np.ndarray | None         # the replayed elements (sorted), None for all of them
    comparisons: list[state_compare.StepComparison] | None  # per step, None where the states were not read
    quantized: bool                     # an 8-bit family, or integer (code) state leaves

    @property
    def eight_bit(self) -> bool:
        return self.case.family != "32bit"

    @property
    def last_judged_step(self) -> int:
        """An 8-bit case is judged at the first divergent step alone; a 32-bit one over the rest."""
        return self.first_divergent_step if self.eight_bit else self.case.steps

    @property
    def chosen(self) -> slice | np.ndarray:
        return slice(None) if self.elements is None else self.elements

    @property
    def parameters_moved(self) -> bool:
        """Whether any element moved by any amount at or after the first divergent step."""
        return max(self.ulps[self.first_divergent_step - 1:]) != 0

    def first_step_ulps_elementwise(self) -> int:
        """The largest ulp distance (parameter dtype) of one element at the first divergent step."""
        s = self.first_divergent_step
        return int(ulp_distance(self.commit[s - 1], self.baseline[s - 1], self.case.param_dtype).max())


def read_trajectories(case: CaseSpec, commit: np.ndarray, baseline: np.ndarray, first_divergent_step: int,
         states: tuple[list[dict], list[dict]] | None = None, state_dtypes: dict[str, str] | None = None,
         within: tuple[int, int] | None = None) -> Reading:
    """The case's Reading. `commit`, `baseline`: steps x size float32 (a memmap is read one step
    at a time); `states`: (commit's, baseline's) state leaves per step; `within` (start, stop):
    replay only these elements (analysis.analyze_layout's one tensor)."""
    s = first_divergent_step
    commit = np.asarray(commit, dtype=np.float32).reshape(case.steps, case.size)
    baseline = np.asarray(baseline, dtype=np.float32).reshape(case.steps, case.size)
    if not 1 <= s <= case.steps:
        raise ValueError(f"attribution of {case.case_id}: first divergent step {s} is outside 1..{case.steps}")
    elements = _elements(case.size, commit[s - 1], baseline[s - 1], within)
    ulps, max_abs_diff = _scale_ulps(case, commit, baseline, s)
    comparisons = state_compare.compare(*states, state_dtypes) if states is not None else None
    quantized = case.family != "32bit" or any(np.issubdtype(values.dtype, np.integer)
                                              for step in (states or ([],))[0] for values in step.values())
    return Reading(case, s, commit, baseline, ulps, max_abs_diff, elements, comparisons, quantized)


def _elements(size: int, commit_first: np.ndarray, baseline_first: np.ndarray,
              within: tuple[int, int] | None) -> np.ndarray | None:
    """replayed_elements over the whole case, or over `within` (then never None)."""
    if within is None:
        return replayed_elements(size, commit_first.astype(np.float64) - baseline_first)
    start, stop = within
    inner = replayed_elements(stop - start, commit_first[start:stop].astype(np.float64) - baseline_first[start:stop])
    return np.arange(start, stop) if inner is None else inner + start


def _scale_ulps(case: CaseSpec, commit: np.ndarray, baseline: np.ndarray, s: int) -> tuple[list[float], float]:
    """(ulps per step, max |commit − baseline| from step s on), checking that every value is one
    of the parameter dtype's (its ulps would be wrong otherwise)."""
    dtype = case.param_dtype
    scale = RunningScale(case)
    ulps, max_abs_diff = [], 0.0
    for t in range(1, case.steps + 1):
        c, b = commit[t - 1], baseline[t - 1]
        check_representable(c, dtype)
        check_representable(b, dtype)
        scale.add(c, b)
        with np.errstate(invalid="ignore"):
            delta = c.astype(np.float64) - b
            ulps.append(float(np.nanmax(np.abs(delta) / ulp(scale.baseline, dtype))))
        if t >= s:
            max_abs_diff = max(max_abs_diff, float(np.nanmax(np.abs(delta))))
    return ulps, max_abs_diff
