"""One changed case: is the change rounding-level or semantic, and which semantic change is it?

Inputs: the commit's and the baseline's parameters after every step (float32, exact for every
parameter dtype), the first divergent step the digests gave, the baseline's stored distances to
the float64 reference, and, where both builds wrote them, their states. `analyze` is four phases,
each a module beside this one with its own typed output:

  reading.py     read the trajectories and states: per step, |commit − baseline| in ulps of each
                 element's scale; the states compared (Reading)
  rounding.py    the rounding test: within rounding or not, in every dtype's own ulps; a change of
                 the quantizer, or nothing moved with the states unread, settles the case here
                 (RoundingTest)
  matching.py    the variant match: which catalogued float64 variant, or transition from the
                 baseline's own rule, explains commit − baseline (VariantMatch)
  drift_call.py  a case still rounding-level after the match: does it drift one way below one
                 ulp, and after which variant (DriftCall)

Each module's doc gives its phase's rule and the reasons for its allowances. `analyze_layout`
attributes a case of several tensors through the tensor that changed first; `analyze_files` reads
a co-run's files for either.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from service.core.results import CaseSpec
from worker.attribution.drift_call import judge_drift
from worker.attribution.matching import MATCH_ULPS_PER_STEP, SEPARATION, match_allowance, match_variants
from worker.attribution.reading import Reading, read_trajectories
from worker.attribution.rounding import (ROUNDING_ULPS_FIRST_STEP, ROUNDING_ULPS_PER_STEP, RoundingTest,
                                         judge_rounding, rounding_allowance)
from worker.engine import states_file

# The allowances are the phases' own; these names are the ones callers read from here.
__all__ = ["MATCH_ULPS_PER_STEP", "ROUNDING_ULPS_FIRST_STEP", "ROUNDING_ULPS_PER_STEP", "SEPARATION", "analyze",
           "analyze_files", "analyze_layout", "match_allowance", "rounding_allowance"]


def analyze(case: CaseSpec, commit: np.ndarray, baseline: np.ndarray, first_divergent_step: int,
            baseline_ref64: list[float] | None = None, states: tuple[list[dict], list[dict]] | None = None,
            state_dtypes: dict[str, str] | None = None, within: tuple[int, int] | None = None) -> dict:
    """The attribution of one changed case (JSON-ready; floats at full precision). `commit` and
    `baseline`: (steps, size) float32 (a memmap is read one step at a time). `states`, when
    given: (commit's, baseline's) state leaves per step, leaf name -> values
    (worker.attribution.states.states_of); `state_dtypes` names float16/bfloat16 leaves.
    `within` (start, stop): replay only these elements (one tensor of a layout case; the caller
    has made the others equal on both sides, analyze_layout)."""
    reading = read_trajectories(case, commit, baseline, first_divergent_step, states, state_dtypes, within)
    rounding = judge_rounding(reading)
    result = _measured(reading, rounding, baseline_ref64)
    if rounding.settled is not None:  # a quantizer change, or nothing to attribute: no variant says more
        return {**result, **rounding.settled}
    match = match_variants(reading, rounding)
    result.update(match.fields)
    if rounding.state_note and not result.get("note"):
        result["note"] = rounding.state_note
    if result["class"] == "rounding-level":  # within rounding in every dtype's ulps: unbiased, or a drift?
        result.update(judge_drift(reading, match).fields)
    return result


def _measured(reading: Reading, rounding: RoundingTest, baseline_ref64: list[float] | None) -> dict:
    """The attribution's measurements, before any call: the change's size per step and at its
    peak, the rounding test's scale and allowance, and beside the baseline's distance to float64."""
    s, ulps = reading.first_divergent_step, reading.ulps
    result = {
        "first_divergent_step": s,
        "first_step_ulps": ulps[s - 1],
        "first_step_ulps_elementwise": reading.first_step_ulps_elementwise(),
        "peak_ulps": max(ulps[s - 1:]),
        "judged_ulps": rounding.judged_peak,
        "ulps_per_step": ulps,
        "max_abs_diff": reading.max_abs_diff,
        "scale": rounding.scale,
        "rounding_ulps_per_step": ROUNDING_ULPS_PER_STEP,
        "rounding_ulps_first_step": float(rounding.allowance[s - 1]),
        "judged_over": rounding.judged_over,
        "states_read": reading.comparisons is not None,
        "replayed_elements": reading.case.size if reading.elements is None else int(reading.elements.size),
    }
    if baseline_ref64:
        band = max(baseline_ref64[s - 1:])
        result["baseline_ref64_peak"] = band
        result["change_vs_baseline_distance"] = reading.max_abs_diff / band if band > 0 else math.inf
    return result


def analyze_files(case: CaseSpec, commit_file: str, baseline_file: str, first_divergent_step: int,
                  baseline_ref64: list[float] | None = None,
                  states_files: tuple[str | None, str | None] = (None, None)) -> dict:
    """analyze over the parameter files a co-run's re-run wrote, and, where both sides wrote one, the
    state files (worker.engine.states_file): a state file that cannot be read leaves the states out,
    and the result says why (`states_unread`)."""
    commit = np.memmap(commit_file, dtype="<f4", mode="r")
    baseline = np.memmap(baseline_file, dtype="<f4", mode="r")
    expected = case.steps * case.size
    if commit.size != expected or baseline.size != expected:
        raise ValueError(f"attribution of {case.case_id}: parameter files hold {commit.size} and "
                         f"{baseline.size} values, expected steps x size = {expected}")
    torch.set_num_threads(1)
    states, dtypes, unread = None, None, None
    if all(states_files):
        limit = states_file.byte_limit(case.size, case.steps)
        try:
            read = [states_file.read(path, steps=case.steps, max_bytes=limit) for path in states_files]
            states, dtypes = (read[0].steps, read[1].steps), {**read[1].dtypes, **read[0].dtypes}
        except states_file.StatesUnreadable as error:
            unread = str(error)
    if case.layout is not None:
        result = analyze_layout(case, commit, baseline, baseline_ref64, states, dtypes)
    else:
        result = analyze(case, commit, baseline, first_divergent_step, baseline_ref64, states=states,
                         state_dtypes=dtypes)
    if unread:
        result["states_unread"] = unread
    return result


def _first_differing_step(commit: np.ndarray, baseline: np.ndarray) -> int | None:
    """1-based first step whose values differ in their bits (NaN == NaN), or None."""
    for t in range(commit.shape[0]):
        if commit[t].tobytes() != baseline[t].tobytes():
            return t + 1
    return None


def analyze_layout(case: CaseSpec, commit: np.ndarray, baseline: np.ndarray, baseline_ref64: list[float] | None,
                   states: tuple[list[dict], list[dict]] | None, dtypes: dict[str, str] | None) -> dict:
    """A layout case attributed through the tensor that changed first: its elements replayed under
    its group's hyperparameters (the flat case with that group's hyper and no layout: the same
    initial vector and gradient stream, so the replay is exact for its elements), the other
    tensors made equal on both sides, its own "t<i>." state leaves compared. The result names the
    tensor ("tensor", "tensor_group") and lists each tensor's first divergent step
    ("tensor_first_steps"); guard elements written by either build read "out of bounds"."""
    steps, size = case.steps, case.size
    commit = np.asarray(commit, dtype=np.float32).reshape(steps, size)
    baseline = np.asarray(baseline, dtype=np.float32).reshape(steps, size)
    slots = case.tensor_slots()
    firsts = [_first_differing_step(commit[:, s.offset:s.stop], baseline[:, s.offset:s.stop]) for s in slots]
    guard_step = _guard_step(slots, commit, baseline)
    per_tensor = {f"t{slot.index}": step for slot, step in zip(slots, firsts)}
    changed = [(step, slot) for slot, step in zip(slots, firsts) if step is not None]
    if guard_step is not None and (not changed or guard_step <= min(step for step, _ in changed)):
        return {"class": "semantic", "variant": None, "label": "out-of-bounds write", "scale": "semantic",
                "first_divergent_step": guard_step, "tensor": None, "tensor_first_steps": per_tensor,
                "note": f"guard elements between the tensors were written from step {guard_step}: a kernel wrote "
                        "past a tensor's end (a chunk boundary off by one)"}
    if not changed:
        # No element of any tensor moved: as analyze's case of the state alone, not attributed.
        return {"class": "unknown", "variant": None, "scale": "unknown", "moved_elements": 0,
                "tensor": None, "tensor_first_steps": per_tensor,
                "note": "the parameters did not change (no element of any tensor moved by one ulp); the library's "
                        "shared state did (step counters, powers): its kind is not known from the parameters"}
    step, slot = min(changed, key=lambda pair: (pair[0], pair[1].index))
    one = case.model_copy(update={"hyper": case.group_hyper(slot.group), "layout": None})
    inside = np.zeros(size, dtype=bool)
    inside[slot.offset:slot.stop] = True
    commit_one = np.where(inside, commit, baseline)  # the other tensors equal on both sides
    own_states, own_dtypes = _tensor_states(f"t{slot.index}.", states, dtypes)
    result = analyze(one, commit_one, baseline, step, baseline_ref64, states=own_states, state_dtypes=own_dtypes,
                     within=(slot.offset, slot.stop))
    result.update({"tensor": slot.index, "tensor_group": slot.group, "tensor_first_steps": per_tensor})
    if guard_step is not None:
        result["note"] = (result.get("note", "") + f"; guard elements written from step {guard_step}").lstrip("; ")
    return result


def _guard_step(slots: list, commit: np.ndarray, baseline: np.ndarray) -> int | None:
    """The first step at which the elements between and after the tensors (the guards) differ."""
    covered = np.zeros(commit.shape[1], dtype=bool)
    for slot in slots:
        covered[slot.offset:slot.stop] = True
    return _first_differing_step(commit[:, ~covered], baseline[:, ~covered])


def _tensor_states(prefix: str, states: tuple[list[dict], list[dict]] | None,
                   dtypes: dict[str, str] | None) -> tuple[tuple[list[dict], list[dict]] | None, dict[str, str]]:
    """One tensor's state leaves (those named `prefix`..., the prefix taken off) and their dtypes."""
    own_states = None
    if states is not None:
        own_states = tuple([{name[len(prefix):]: values for name, values in leaves.items() if name.startswith(prefix)}
                            for leaves in side] for side in states)
    own_dtypes = {name[len(prefix):]: d for name, d in (dtypes or {}).items() if name.startswith(prefix)}
    return own_states, own_dtypes
