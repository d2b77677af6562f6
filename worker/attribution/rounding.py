"""Attribution's second phase, the rounding test: whether a change is rounding-level (bounded in
each dtype's own ulps), semantic, a change of the quantizer, or not attributable.

From the Reading (worker/attribution/reading.py): `ulps[t]` = max over elements of |commit −
baseline| in scale ulps. 32-bit cases are rounding-level when it stays within
ROUNDING_ULPS_PER_STEP for each step since the first divergent one (a rounding that always falls
the same way accumulates linearly); given the states, theirs must stay within it too, each in its
own dtype's ulps (worker/attribution/states.py).

Quantized states (issue 37): a change of the quantizer (codes, scales, block layout) is its own
class, "quantization", never rounding-level. Rounding-level means bounded in each dtype's own ulp
over the trajectory, for parameters and states alike; for a quantized case that is judged up to
the first step where a code moves, since after it a code step (not the arithmetic) moves the
parameters. With the states (`states=`): a layout change, or codes that move beyond what one
rounding before requantization moves (more than one code, or more than 1 % of them), or scales
beyond rounding while the parameters agree within rounding, is "quantization"; parameters beyond
rounding before any code moved are "semantic". Without the states (the co-run keeps parameters
only), a quantized case is judged over its whole trajectory: within rounding throughout is
rounding-level, beyond it at the first divergent step semantic, and within it there but beyond
later "quantization": the divergence began where the parameters agreed, in the quantized state,
and grew through requantization.

No moved element: where no parameter moved by one ulp at any step and the states were not read,
nothing shows what changed or how much: the case is not attributed ("unknown", with that reason),
never semantic (and never rounding-level: the state's change is unbounded).

Within rounding is not yet rounding-level: the drift phase (worker/attribution/drift_call.py) tests
a case within rounding for a change that moves one way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.core.wording import size
from worker.attribution import states as state_compare
from worker.attribution.reading import Reading

# "A few ulps": a reordering, a contraction or an intermediate's precision moves an element by at
# most ~1-2 roundings of its scale in the step where it first acts (measured on the bundled kernels:
# 2 for Adam's step size in float32, 1 for an FMA contraction), and by as much again at each later
# step: a rounding that always falls the same way (p * (1 - lr wd) rounded or fused) accumulates
# linearly (20 ulps after 20 steps, measured). So a change is rounding-level while it stays within
# ROUNDING_ULPS_PER_STEP for each step since the first divergent one.
ROUNDING_ULPS_PER_STEP = 2.0
# Where a change first acts, a same-math reorder of the whole update (issue 37: sqrt(v / bc2) for
# sqrt(v) / sqrt(bc2), measured 4-8 scale ulps at step 1 on tests/fixtures/lowbit, 4-6 on torchao)
# differs by the roundings of both evaluations: Adam's update is ~8 float32 operations, each within
# half an ulp of its result, and an update can be as large as the element's scale, so up to
# 2 x 8 x 0.5 = 8 float32 ulps of the scale. float16 / bfloat16 parameters are computed in float32
# and rounded once to their dtype, so there the first step keeps ROUNDING_ULPS_PER_STEP: float32's
# roundings are 2**-13 / 2**-16 of their ulp, and only the final rounding of each build can flip.
ROUNDING_ULPS_FIRST_STEP = {"float32": 8.0}


def rounding_allowance(first_divergent_step: int, steps: int, dtype: str = "bfloat16") -> np.ndarray:
    """Scale ulps a rounding-level change may have reached after each step (0 before divergence):
    the first divergent step's allowance for `dtype` (ROUNDING_ULPS_FIRST_STEP), then
    ROUNDING_ULPS_PER_STEP more for each later step."""
    since = np.arange(1, steps + 1) - first_divergent_step
    first = ROUNDING_ULPS_FIRST_STEP.get(dtype, ROUNDING_ULPS_PER_STEP)
    return np.where(since >= 0, first + ROUNDING_ULPS_PER_STEP * np.maximum(since, 0), 0.0)


@dataclass(frozen=True)
class RoundingTest:
    """The phase's output: whether the change stayed within rounding, and, where that settles the
    case without any variant (a quantizer change; nothing moved and the states unread), the call."""

    allowance: np.ndarray        # rounding_allowance per step
    judged_peak: float           # the largest ulps over the judged steps (the change's size)
    within_rounding: bool
    judged_over: str             # which steps were judged, in words
    settled: dict | None         # the call's fields where this phase makes it (class quantization / unknown)
    state_note: str | None       # why the states, not the parameters, put the case beyond rounding

    @property
    def scale(self) -> str:
        return "rounding-level" if self.within_rounding else "semantic"


def judge_rounding(reading: Reading) -> RoundingTest:
    """The rounding test of one Reading (module doc)."""
    s, ulps, last = reading.first_divergent_step, reading.ulps, reading.last_judged_step
    allowance = rounding_allowance(s, reading.case.steps, reading.case.param_dtype)
    judged = ulps[s - 1:last]
    within = all(u <= a for u, a in zip(judged, allowance[s - 1:last]))
    settled = state_note = None
    if reading.quantized:
        within, quantization = _judge_quantized(reading, allowance)
        if quantization is not None:
            settled = {"class": "quantization", "variant": None, "note": quantization}
    elif reading.comparisons is not None:  # float states: bounded in their own ulps as the parameters are
        within, state_note = _judge_float_states(reading, allowance, within)
    elif not reading.parameters_moved:
        # The digests differ and the parameters never do: the state alone changed (states swapped
        # in their slots, a moment stored wrong), which the parameters cannot bound. Nothing here
        # to call it by either: no parameter moved by one ulp, so no variant can be matched and no
        # size measured, and the state that did change was not read. Not rounding-level (its size
        # is unbounded: a swapped moment read only after the last step), not semantic (no evidence
        # of a different rule): not attributed, saying why.
        within = False
        settled = {"class": "unknown", "variant": None, "scale": "unknown", "moved_elements": 0,
                   "note": f"the state changed and the parameters did not: none of the {reading.case.size} elements "
                           f"moved by one ulp at any step from {s}, and the states were not read, so neither "
                           "the size nor the kind of the state's change is known"}
    return RoundingTest(allowance, max(judged), within, _judged_over(reading), settled, state_note)


def _judged_over(reading: Reading) -> str:
    if not reading.quantized:
        return "steps from the first divergent one"
    if reading.comparisons is not None:
        return "steps from the first divergent one to the first moved code"
    return "steps from the first divergent one (states not read)"


def state_steps(reading: Reading) -> int:
    """The last step whose states both builds computed from the same gradients. Every step of an
    open loop; in a closed loop only the first divergent step (after it the gradient carries the
    parameters' difference, amplified where h (p - c) cancels, into the states: not their
    arithmetic). And in either loop no later than the first step whose parameters differ: the next
    step's state reads those parameters (weight decay, a closed loop's gradient), so a bfloat16 or
    float16 parameter one ulp apart moves a float32 moment by thousands of its own ulps without any
    difference in the state's arithmetic."""
    s, steps, ulps = reading.first_divergent_step, reading.case.steps, reading.ulps
    parameters_moved = next((t for t in range(s, steps + 1) if ulps[t - 1] > 0), steps)
    return min(steps if reading.case.gradient.kind == "open" else s, parameters_moved)


def _judge_float_states(reading: Reading, allowance: np.ndarray, within: bool) -> tuple[bool, str | None]:
    """(within rounding, the note saying why not where the states alone are beyond it) of a case
    whose float states were read: each must stay within the allowance in its own ulps."""
    s = reading.first_divergent_step
    beyond = next(((t, c) for t, (c, a) in enumerate(zip(reading.comparisons[s - 1:state_steps(reading)],
                                                         allowance[s - 1:]), start=s)
                   if not c.same_layout or c.float_ulps > a), None)
    if beyond is None:
        return within, None
    if not within:
        return False, None
    t, c = beyond
    return False, (f"the parameters stay within rounding, the state does not: at step {t} "
                   + (f"its layout differs ({', '.join(c.differing)})" if not c.same_layout else
                      f"{', '.join(c.differing)} moved {size(c.float_ulps, 'ulps')} of its own"))


def _judge_quantized(reading: Reading, allowance: np.ndarray) -> tuple[bool, str | None]:
    """(within rounding, the quantization call's reason or None) of a case with quantized states
    (module doc), judged over steps s..state_steps (the steps where both builds' states saw the
    same gradients). Parameters beyond rounding at the first divergent step: not rounding-level,
    and no quantization call (the semantic path, variants at step 1)."""
    params_within = [u <= a for u, a in zip(reading.ulps, allowance)]
    if reading.comparisons is None:
        return _judge_quantized_unread(reading, params_within)
    comparisons, s = reading.comparisons, reading.first_divergent_step
    layout = next((t for t, c in enumerate(comparisons, start=1) if not c.same_layout), None)
    if layout is not None:
        differing = ", ".join(comparisons[layout - 1].differing)
        return False, f"the state's block layout differs from step {layout} ({differing})"
    if not params_within[s - 1]:
        return False, None
    last = state_steps(reading)
    first_code = next((t for t in range(s, last + 1) if comparisons[t - 1].codes_differ), None)
    for t in range(s, (first_code or last) + 1):
        reason = _quantization_at(comparisons[t - 1], t, t == first_code, reading.ulps[t - 1], allowance[t - 1])
        if reason is not None:
            return False, reason
        if not params_within[t - 1]:
            return False, None  # the arithmetic moved the parameters before any code did: semantic
    return True, None


def _quantization_at(comparison: state_compare.StepComparison, t: int, first_code: bool, ulps: float,
                     allowed: float) -> str | None:
    """The quantization call's reason at step t of a case whose parameters agreed within rounding
    so far, or None: codes moved beyond one rounding at the first step any moved, or scales
    beyond the rounding allowance."""
    if first_code and not state_compare.quantization_event_is_rounding(comparison):
        return (f"codes moved by up to {comparison.code_steps} at {comparison.code_fraction:.1%} of them at "
                f"step {t} while the parameters agreed within rounding ({size(ulps, 'ulps')})")
    if comparison.float_ulps > allowed:
        return (f"the state's scales moved {size(comparison.float_ulps, 'ulps')} at step {t} while the "
                f"parameters agreed within rounding ({', '.join(comparison.differing)})")
    return None


def _judge_quantized_unread(reading: Reading, params_within: list[bool]) -> tuple[bool, str | None]:
    """_judge_quantized without the states: the whole trajectory, as a closed loop's later steps are
    all there is."""
    s, ulps = reading.first_divergent_step, reading.ulps
    if not params_within[s - 1]:
        return False, None
    if np.array_equal(reading.baseline[s - 1], reading.commit[s - 1]):
        return False, (f"the parameters are the same at step {s}, the first divergent one, and the state is "
                       "not: its codes or scales changed (states not read)")
    beyond = next((t for t in range(s, len(ulps) + 1) if not params_within[t - 1]), None)
    if beyond is None:
        return True, None
    return False, (f"the parameters agreed within rounding at step {s} and went beyond it from step {beyond} "
                   f"({size(ulps[beyond - 1], 'ulps')}): the change began in the quantized state and grew through "
                   "requantization (states not read)")
