"""One changed case: is the change rounding-level or semantic, and which semantic change is it?

Inputs: the commit's and the baseline's parameters after every step (float32, exact for every
parameter dtype), the first divergent step the digests gave, and the baseline's stored distances to
the float64 reference. Everything is measured per element in ulps of the element's *scale*: the
`ulp` (parameter dtype) of the largest |baseline parameter| the element has had up to that step,
start included. A reordering or contraction errs by a few ulps of the largest value the element's
arithmetic has handled, even where the parameter itself has cancelled down to a tiny value (whose
own ulp would make one rounding look like thousands).

Rounding-level or semantic: `ulps[t]` = max over elements of |commit − baseline| in scale ulps.
32-bit cases are rounding-level when it stays within ROUNDING_ULPS_PER_STEP for each step since the
first divergent one (a rounding that always falls the same way accumulates linearly); given the
states, theirs must stay within it too, each in its own dtype's ulps (worker/attribution/states.py).

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

Within rounding is not yet rounding-level: a rounding-level change is *unbiased*, its flipped
roundings go either way, while a systematic change below one ulp (decay after the update at
lr = wd = 1e-2 on bfloat16, ~1/4000 of an ulp per step) flips them one way. A case within rounding
is tested for that (worker/attribution/drift.py: a sign test of the elements' moves against the
float64 reference's update and against the parameter's sign, allowing what a float32 rounding of a
factor shared by all elements moves, at a false-alarm rate of 1e-3 per case); a systematic drift
is semantic (or precision), named after the variant whose own sub-ulp difference predicts as much
drift along its signs as there is, or unexplained.

Which semantic change: each float64 variant V of worker/attribution/variants.py replays the case's
gradients from the same start as the correct algorithm V0. If the commit implements V and the
baseline V0, then commit − baseline = (V − V0) + the difference of their roundings, so
`residual_V[t]` = max over elements of |(commit − baseline) − (V − V0)|, in ulps of the larger of
the baseline's and the commit's scales (each rounds at its own magnitude), is at most
MATCH_ULPS_PER_STEP per step since the first divergent one for the right variant and the size of the unexplained change for every other (for V0 it is
`ulps` itself). The rounding difference cancels in pairs of steps that differ only where the
algorithms differ, which is why the residual is taken on the difference and not on |commit − V|
(that one carries the commit's whole rounding drift, ~ the baseline's distance to float64, and
cannot resolve a change smaller than it, such as the decay reorder at lr 1e-3 / wd 1e-2). A variant
*matches* when its residual stays within that allowance at every step from the first divergent one and is at most 1/SEPARATION of the change itself (`ulps` at its peak); the best match is
named with the next best's residual beside it. No match and a change beyond rounding: "unexplained".

From the baseline's rule (issue 47): the baseline need not be the algorithm. DeepSpeed's CPU Adam
already takes its bias corrections from float32 powers, and its 0.19.0 keeps them as running
float32 products: from V0 neither variant explains commit − baseline. So each catalogued rule B the
baseline follows clearly better than V0 (its peak distance to B at most 1/SEPARATION of its
distance to V0, in ulps of its own scale) is a hypothesis too, with the commit following V0 (a
revert: "reverts: <B>"; for decay coupling the direction is said) or another setting C of B's own
switches: residual max |(commit − baseline) − (C − B)|, matched as a variant is
(variants.Transition). Cross-switch combinations (B kept, C added beside it) are not tried.

No moved element: where no parameter moved by one ulp at any step and the states were not read,
nothing shows what changed or how much: the case is not attributed ("unknown", with that reason),
never semantic (and never rounding-level: the state's change is unbounded).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from service.core.results import CaseSpec
from service.core.wording import number, size
from worker.attribution import drift
from worker.attribution import states as state_compare
from worker.attribution import variants as catalogue
from worker.attribution.ulps import check_representable, ulp, ulp_distance
from worker.engine import states_file
from worker.engine.gradients import initial_parameters

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
# The right variant leaves only the difference of two independent roundings of the whole update
# (commit and baseline each err by a few u of an update that can be as large as the element's scale:
# measured up to 7 scale ulps at the first step, 10 after 20 steps, at lr 0.1 in float32), per step
# since the first divergent one; and it must explain the change, leaving at most 1/SEPARATION of it,
# so a change that is itself a few ulps is not "explained" by a variant that differs as little.
MATCH_ULPS_PER_STEP = 8.0
SEPARATION = 4.0
# A residual below half an ulp is exact; the floor keeps ratios finite.
RESIDUAL_FLOOR_ULPS = 0.5


def rounding_allowance(first_divergent_step: int, steps: int, dtype: str = "bfloat16") -> np.ndarray:
    """Scale ulps a rounding-level change may have reached after each step (0 before divergence):
    the first divergent step's allowance for `dtype` (ROUNDING_ULPS_FIRST_STEP), then
    ROUNDING_ULPS_PER_STEP more for each later step."""
    since = np.arange(1, steps + 1) - first_divergent_step
    first = ROUNDING_ULPS_FIRST_STEP.get(dtype, ROUNDING_ULPS_PER_STEP)
    return np.where(since >= 0, first + ROUNDING_ULPS_PER_STEP * np.maximum(since, 0), 0.0)


def match_allowance(first_divergent_step: int, steps: int) -> np.ndarray:
    """Scale ulps the right variant's residual may reach after each step: MATCH_ULPS_PER_STEP
    for each step since the first divergent one."""
    since = np.arange(1, steps + 1) - first_divergent_step + 1
    return MATCH_ULPS_PER_STEP * np.maximum(since, 0)


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


class _Residuals:
    """Per hypothesis (a variant the commit follows from a baseline that is the algorithm, or a
    transition: the baseline follows one catalogued variant and the commit the algorithm or another
    setting of the same switches): the peak residual (scale ulps), whether every step is within the
    allowance, and the largest |commit − the commit's rule|. Per catalogued rule (the algorithm
    included): the baseline's peak distance to it, in ulps of the baseline's scale, which says
    whether the baseline follows it better than the algorithm (`admissible_transitions`). Fed one
    step at a time."""

    def __init__(self, candidates: list):
        self.names = [v.name for v in candidates]
        self.transitions = catalogue.transitions(candidates)
        keys = self.names + [t.name for t in self.transitions]
        self.peak = dict.fromkeys(keys, 0.0)
        self.fits = dict.fromkeys(keys, True)
        self.distance = dict.fromkeys(keys, 0.0)
        self.baseline_peak = dict.fromkeys([catalogue.CORRECT.name, *self.names], 0.0)
        self.reference_distance = 0.0
        self.difference: dict[str, np.ndarray] = {}  # V − V0 at the latest step (the drift's naming)

    def add(self, params: dict, delta: np.ndarray, commit: np.ndarray, baseline: np.ndarray, units: np.ndarray,
            baseline_units: np.ndarray, allowed: float) -> None:
        reference_name = catalogue.CORRECT.name
        reference = params[reference_name].numpy()
        with np.errstate(invalid="ignore", over="ignore"):
            self.reference_distance = max(self.reference_distance, _finite_max(np.abs(commit - reference)))
            self._baseline(reference_name, baseline - reference, baseline_units)
            for name in self.names:
                path = params[name].numpy()
                self.difference[name] = path - reference
                self._fit(name, np.abs(delta - self.difference[name]) / units, allowed,
                          np.abs(commit - path))
                self._baseline(name, baseline - path, baseline_units)
            for move in self.transitions:
                # commit − baseline = (C − V0) − (B − V0); the algorithm's own difference is 0.
                after = 0.0 if move.reverts else self.difference[move.commit.name]
                predicted = after - self.difference[move.baseline.name]
                self._fit(move.name, np.abs(delta - predicted) / units, allowed,
                          np.abs(commit - (reference + after)))

    def _fit(self, key: str, residual: np.ndarray, allowed: float, distance: np.ndarray) -> None:
        peak = _finite_max(residual)
        self.peak[key] = max(self.peak[key], peak)
        self.fits[key] = self.fits[key] and peak <= allowed
        self.distance[key] = max(self.distance[key], _finite_max(distance))

    def _baseline(self, name: str, gap: np.ndarray, units: np.ndarray) -> None:
        self.baseline_peak[name] = max(self.baseline_peak[name], _finite_max(np.abs(gap) / units))

    def admissible_transitions(self) -> list:
        """The transitions whose baseline rule the baseline follows clearly better than the
        algorithm: its distance to B at most 1/SEPARATION of its distance to V0, as a commit's
        variant must explain the change. Only then is "the baseline was B" a hypothesis at all: a
        baseline that is the algorithm makes every transition from B predict −(B − V0) beside the
        commit's own change, and a B that barely differs from V0 on this case (within the
        baseline's own rounding drift) would be admitted by chance and renamed a forward match."""
        exact = self.baseline_peak[catalogue.CORRECT.name]
        return [t for t in self.transitions
                if max(self.baseline_peak[t.baseline.name], RESIDUAL_FLOOR_ULPS) * SEPARATION <= exact]


def _finite_max(values: np.ndarray) -> float:
    """max, or inf when any value is not finite (a variant gone to inf/NaN fits nothing)."""
    return float(np.max(values)) if values.size and np.isfinite(values).all() else (0.0 if not values.size else math.inf)


def analyze(case: CaseSpec, commit: np.ndarray, baseline: np.ndarray, first_divergent_step: int,
            baseline_ref64: list[float] | None = None, states: tuple[list[dict], list[dict]] | None = None,
            state_dtypes: dict[str, str] | None = None, within: tuple[int, int] | None = None) -> dict:
    """The attribution of one changed case (JSON-ready; floats at full precision). `commit` and
    `baseline`: (steps, size) float32 (a memmap is read one step at a time). `states`, when
    given: (commit's, baseline's) state leaves per step, leaf name -> values
    (worker.attribution.states.states_of); `state_dtypes` names float16/bfloat16 leaves.
    `within` (start, stop): replay only these elements (one tensor of a layout case; the caller
    has made the others equal on both sides, analyze_layout)."""
    steps, dtype, s = case.steps, case.param_dtype, first_divergent_step
    commit = np.asarray(commit, dtype=np.float32).reshape(steps, case.size)
    baseline = np.asarray(baseline, dtype=np.float32).reshape(steps, case.size)
    if not 1 <= s <= steps:
        raise ValueError(f"attribution of {case.case_id}: first divergent step {s} is outside 1..{steps}")
    eight_bit = case.family != "32bit"
    last = s if eight_bit else steps  # 8-bit: judged at the first divergent step alone
    allowance = rounding_allowance(s, steps, dtype)
    matching = match_allowance(s, steps)
    # Variants carry no quantization: an 8-bit step is the 32-bit rule only from zero states.
    matched = not (eight_bit and s != 1)
    candidates = catalogue.applicable(case) if matched else []
    if within is None:
        elements = replayed_elements(case.size, commit[s - 1].astype(np.float64) - baseline[s - 1])
    else:
        start, stop = within
        inner = replayed_elements(stop - start, commit[s - 1, start:stop].astype(np.float64) - baseline[s - 1, start:stop])
        elements = np.arange(start, stop) if inner is None else inner + start
    chosen = slice(None) if elements is None else elements
    replay = catalogue.replay_steps(case, [catalogue.CORRECT, *candidates],
                                    None if elements is None else torch.from_numpy(elements)) if matched else None
    residuals = _Residuals(candidates)

    running = np.abs(initial_parameters(case.seed, case.size).to(catalogue._DTYPES[dtype]).float().numpy()
                     ).astype(np.float64)
    # The residual's unit: the commit rounds at its own magnitude, which a semantic change can take
    # far beyond the baseline's (AdEMAMix without its second-moment bias correction: 1e8 times),
    # so its rounding is counted in ulps of the larger of the two scales.
    running_either = running.copy()
    ulps, max_abs_diff = [], 0.0
    for t in range(1, steps + 1):
        params = next(replay)[1] if replay is not None and t <= last else None
        c, b = commit[t - 1], baseline[t - 1]
        check_representable(c, dtype)
        check_representable(b, dtype)
        np.maximum(running, np.abs(b), out=running)
        # (a non-finite commit value leaves the scale as it was: its residual is non-finite anyway)
        np.maximum(running_either, np.maximum(running, np.nan_to_num(np.abs(c), nan=0.0, posinf=0.0)),
                   out=running_either)
        units = ulp(running, dtype)
        with np.errstate(invalid="ignore"):
            delta = c.astype(np.float64) - b
            ulps.append(float(np.nanmax(np.abs(delta) / units)))
        if t < s:
            continue
        max_abs_diff = max(max_abs_diff, float(np.nanmax(np.abs(delta))))
        if params is not None:
            allowed = matching[t - 1]
            residuals.add(params, delta[chosen], c.astype(np.float64)[chosen], b.astype(np.float64)[chosen],
                          ulp(running_either[chosen], dtype), units[chosen], allowed)

    comparisons = state_compare.compare(*states, state_dtypes) if states is not None else None
    quantized = eight_bit or any(np.issubdtype(v.dtype, np.integer) for step in (states or ([],))[0] for v in step.values())
    judged = ulps[s - 1:last]
    change_peak = max(judged)
    within_rounding = all(u <= a for u, a in zip(judged, allowance[s - 1:last]))
    quantization = None
    state_note = None
    # Where both builds' states saw the same gradients: every step of an open loop; in a closed
    # loop only the first divergent step (after it the gradient carries the parameters'
    # difference, amplified where h (p - c) cancels, into the states: not their arithmetic).
    # And in either loop no later than the first step whose parameters differ: the next step's
    # state reads those parameters (weight decay, a closed loop's gradient), so a bfloat16 or float16
    # parameter one ulp apart moves a float32 moment by thousands of its own ulps without any
    # difference in the state's arithmetic.
    parameters_moved = next((t for t in range(s, steps + 1) if ulps[t - 1] > 0), steps)
    state_steps = min(steps if case.gradient.kind == "open" else s, parameters_moved)
    if quantized:
        within_rounding, quantization = _judge_quantized(ulps, allowance, s, comparisons, state_steps,
                                                         baseline[s - 1], commit[s - 1])
    elif comparisons is not None:  # float states: bounded in their own ulps as the parameters are
        beyond = next(((t, c) for t, (c, a) in enumerate(zip(comparisons[s - 1:state_steps], allowance[s - 1:]), start=s)
                       if not c.same_layout or c.float_ulps > a), None)
        if within_rounding and beyond is not None:
            t, c = beyond
            state_note = (f"the parameters stay within rounding, the state does not: at step {t} "
                          + (f"its layout differs ({', '.join(c.differing)})" if not c.same_layout else
                             f"{', '.join(c.differing)} moved {size(c.float_ulps, 'ulps')} of its own"))
        within_rounding = within_rounding and beyond is None
    elif max(ulps[s - 1:]) == 0:
        # The digests differ and the parameters never do: the state alone changed (states swapped
        # in their slots, a moment stored wrong), which the parameters cannot bound.
        within_rounding = False
    result = {
        "first_divergent_step": s,
        "first_step_ulps": ulps[s - 1],
        "first_step_ulps_elementwise": int(ulp_distance(commit[s - 1], baseline[s - 1], dtype).max()),
        "peak_ulps": max(ulps[s - 1:]),
        "judged_ulps": change_peak,
        "ulps_per_step": ulps,
        "max_abs_diff": max_abs_diff,
        "scale": "rounding-level" if within_rounding else "semantic",
        "rounding_ulps_per_step": ROUNDING_ULPS_PER_STEP,
        "rounding_ulps_first_step": float(allowance[s - 1]),
        "judged_over": ("steps from the first divergent one" if not quantized else
                        "steps from the first divergent one to the first moved code" if comparisons is not None
                        else "steps from the first divergent one (states not read)"),
        "states_read": comparisons is not None,
        "replayed_elements": case.size if elements is None else int(elements.size),
    }
    if baseline_ref64:
        band = max(baseline_ref64[s - 1:])
        result["baseline_ref64_peak"] = band
        result["change_vs_baseline_distance"] = max_abs_diff / band if band > 0 else math.inf
    if quantization is not None:
        result.update({"class": "quantization", "variant": None, "note": quantization})
        return result
    if comparisons is None and not quantized and max(ulps[s - 1:]) == 0:
        # Nothing here to call it by: no parameter moved by one ulp, so no variant can be matched
        # and no size measured, and the state that did change was not read. Not rounding-level (its
        # size is unbounded: a swapped moment read only after the last step), not semantic (no
        # evidence of a different rule): not attributed, saying why.
        result.update({"class": "unknown", "variant": None, "scale": "unknown", "moved_elements": 0,
                       "note": f"the state changed and the parameters did not: none of the {case.size} elements "
                               f"moved by one ulp at any step from {s}, and the states were not read, so neither "
                               "the size nor the kind of the state's change is known"})
        return result
    if not matched:
        result.update({"class": result["scale"], "variant": None,
                       "note": "8-bit case first divergent after step 1: variants carry no quantization, not matched"})
    else:
        result.update(_verdict(candidates, residuals, change_peak, result["scale"]))
    if state_note and not result.get("note"):
        result["note"] = state_note
    if result["class"] == "rounding-level":
        # Within rounding in every dtype's ulps: unbiased, or a systematic drift below one ulp?
        # Variants name it only where they were replayed to the last step (32-bit cases).
        named = residuals if matched and not eight_bit else None
        result.update(_judge_drift(case, commit, baseline, elements, candidates, named))
    return result


def _judge_drift(case: CaseSpec, commit: np.ndarray, baseline: np.ndarray, elements: np.ndarray | None,
                 candidates: list, residuals: _Residuals | None) -> dict:
    """The drift tests (worker/attribution/drift.py) of a case within rounding, and the call they
    make: nothing more when no test is systematic; otherwise semantic (or precision), named after
    the variant that explains the drift, or unexplained."""
    chosen = slice(None) if elements is None else elements
    dtype = case.param_dtype
    counter = drift.DriftCounter(case.size if elements is None else int(elements.size))
    replay = catalogue.replay_steps(case, [catalogue.CORRECT], None if elements is None else torch.from_numpy(elements))
    start = initial_parameters(case.seed, case.size).to(catalogue._DTYPES[dtype]).double().numpy()[chosen]
    reference_before, baseline_before, delta_before = start, start, np.zeros_like(start)
    for t in range(1, case.steps + 1):
        reference_after = next(replay)[1][catalogue.CORRECT.name].numpy()
        b = baseline[t - 1][chosen].astype(np.float64)
        delta = commit[t - 1][chosen].astype(np.float64) - b
        counter.add(delta - delta_before, reference_after - reference_before, baseline_before, b, dtype)
        reference_before, baseline_before, delta_before = reference_after, b, delta
    tests = counter.tests()
    out: dict = {"drift": [test.as_dict() for test in tests]}
    systematic = [test for test in tests if test.systematic]
    if not systematic:
        return out
    strongest = min(systematic, key=lambda test: test.p_value)
    where = ({"with": "with the update", "against": "against the update"} if strongest.direction == "step"
             else {"with": "away from zero", "against": "toward zero"})[strongest.way]
    note = (f"a drift below one ulp, one way: {strongest.one_way} of the {strongest.moved} elements that moved went "
            f"{where} "
            f"(p = {number(strongest.p_value)}; a rounding-level change's shared factor allows "
            f"{number(strongest.allowance)} of them)")
    out.update({"class": "semantic", "variant": None, "label": "unexplained", "note": note})
    if residuals is None:
        return out
    own = ulp(np.maximum(np.abs(baseline_before), np.abs(baseline_before + delta_before)), dtype)
    observed = delta_before / own
    fits = sorted((drift.drift_fit(v.name, observed, residuals.difference[v.name] / own)
                   for v in candidates if residuals.fits[v.name] and v.name in residuals.difference),
                  key=lambda fit: fit.deviation)
    out["drift_fits"] = [{"variant": f.variant, "predicted_ulps": f.predicted, "observed_ulps": f.observed,
                          "sigma": f.sigma} for f in fits[:3]]
    explaining = [fit for fit in fits if fit.explains]
    if not explaining:
        return out
    best = explaining[0]
    variant = catalogue.BY_NAME[best.variant]
    others = [fit for fit in fits if fit is not best]
    following = others[0] if others else None
    out.update({"class": "precision" if variant.kind == "precision" else "semantic", "variant": variant.name,
                "label": variant.label, "kind": variant.kind, "residual_ulps": residuals.peak[variant.name],
                "distance": residuals.distance[variant.name], "next_best": following.variant if following else None,
                # how many times farther the next best's prediction is from the drift, in sigmas
                "next_best_ratio": (following.deviation / max(best.deviation, 1.0 / drift.NAMING_SIGMAS)
                                    if following else math.inf),
                "note": note + f"; {variant.name} predicts {size(best.predicted, 'ulps')} of it along its signs, "
                               f"{number(best.observed)} observed (sigma {number(best.sigma)})"})
    return out


def _judge_quantized(ulps: list[float], allowance: np.ndarray, s: int,
                     comparisons: list[state_compare.StepComparison] | None, state_steps: int,
                     baseline_first: np.ndarray, commit_first: np.ndarray) -> tuple[bool, str | None]:
    """(within rounding, the quantization call's reason or None) of a case with quantized states
    (module doc), judged over steps s..state_steps (the steps where both builds' states saw the
    same gradients). Parameters beyond rounding at the first divergent step: not rounding-level,
    and no quantization call (the semantic path, variants at step 1)."""
    params_within = [u <= a for u, a in zip(ulps, allowance)]
    if comparisons is None:
        if not params_within[s - 1]:
            return False, None
        if np.array_equal(baseline_first, commit_first):
            return False, (f"the parameters are the same at step {s}, the first divergent one, and the state is "
                           "not: its codes or scales changed (states not read)")
        # Without the states, the whole trajectory: a closed loop's later steps are all there is.
        beyond = next((t for t in range(s, len(ulps) + 1) if not params_within[t - 1]), None)
        if beyond is None:
            return True, None
        return False, (f"the parameters agreed within rounding at step {s} and went beyond it from step {beyond} "
                       f"({size(ulps[beyond - 1], 'ulps')}): the change began in the quantized state and grew through "
                       "requantization (states not read)")
    layout = next((t for t, c in enumerate(comparisons, start=1) if not c.same_layout), None)
    if layout is not None:
        return False, f"the state's block layout differs from step {layout} ({', '.join(comparisons[layout - 1].differing)})"
    if not params_within[s - 1]:
        return False, None
    first_code = next((t for t in range(s, state_steps + 1) if comparisons[t - 1].codes_differ), None)
    until = first_code or state_steps
    for t in range(s, until + 1):
        comparison = comparisons[t - 1]
        if t == first_code and not state_compare.quantization_event_is_rounding(comparison):
            return False, (f"codes moved by up to {comparison.code_steps} at {comparison.code_fraction:.1%} of them at "
                           f"step {t} while the parameters agreed within rounding ({size(ulps[t - 1], 'ulps')})")
        if comparison.float_ulps > allowance[t - 1]:
            return False, (f"the state's scales moved {size(comparison.float_ulps, 'ulps')} at step {t} while the "
                           f"parameters agreed within rounding ({', '.join(comparison.differing)})")
        if not params_within[t - 1]:
            return False, None  # the arithmetic moved the parameters before any code did: semantic
    return True, None


def _verdict(candidates: list, residuals: _Residuals, change_peak: float, scale: str) -> dict:
    """Which variant or transition, none (unexplained), or rounding-level, from the residuals. The
    hypotheses: each variant from a baseline that is the algorithm, and each transition whose
    baseline rule the baseline follows better than the algorithm (a baseline that already keeps
    float32 powers, a defect the commit reverts)."""
    hypotheses = [*candidates, *residuals.admissible_transitions()]
    scored = sorted(hypotheses, key=lambda h: residuals.peak[h.name])
    out = {"reference_distance": residuals.reference_distance,
           "candidates": [{"variant": h.name, "label": h.label, "kind": h.kind,
                           "residual_ulps": residuals.peak[h.name], "distance": residuals.distance[h.name]}
                          for h in scored[:3]]}
    best = scored[0] if scored else None
    if best and residuals.fits[best.name] and \
            max(residuals.peak[best.name], RESIDUAL_FLOOR_ULPS) * SEPARATION <= change_peak:
        residual = residuals.peak[best.name]
        following = residuals.peak[scored[1].name] if len(scored) > 1 else math.inf
        # A variant of kind "precision" is the same algorithm with an intermediate in a lower
        # precision whose loss shows far beyond a rounding: named, but not called semantic.
        out.update({"class": "precision" if best.kind == "precision" else "semantic", "variant": best.name,
                    "label": best.label, "kind": best.kind,
                    "residual_ulps": residual, "distance": residuals.distance[best.name],
                    "next_best": scored[1].name if len(scored) > 1 else None,
                    "next_best_ratio": following / max(residual, RESIDUAL_FLOOR_ULPS)})
        if isinstance(best, catalogue.Transition):
            out.update(_transition_fields(best, residuals))
    elif scale == "rounding-level":
        out.update({"class": "rounding-level", "variant": None})
    else:
        out.update({"class": "semantic", "variant": None, "label": "unexplained"})
    return out


def _transition_fields(move: catalogue.Transition, residuals: _Residuals) -> dict:
    """What a matched transition adds: the commit's rule as the variant, the baseline's rule and how
    much better the baseline follows it than the algorithm, and what a revert reverts."""
    fields = {"variant": move.commit.name, "transition": move.name, "baseline_variant": move.baseline.name,
              "baseline_variant_label": move.baseline.label,
              "baseline_residual_ulps": residuals.baseline_peak[move.baseline.name],
              "baseline_reference_ulps": residuals.baseline_peak[catalogue.CORRECT.name]}
    if move.reverts:
        fields.update({"reverts": move.baseline.name, "reverts_label": move.baseline.label})
    return fields


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
    covered = np.zeros(size, dtype=bool)
    for slot in slots:
        covered[slot.offset:slot.stop] = True
    guard_step = _first_differing_step(commit[:, ~covered], baseline[:, ~covered])
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
    own_states = None
    if states is not None:
        prefix = f"t{slot.index}."
        own_states = tuple([{name[len(prefix):]: values for name, values in leaves.items() if name.startswith(prefix)}
                            for leaves in side] for side in states)
    own_dtypes = {name[len(f"t{slot.index}."):]: d for name, d in (dtypes or {}).items()
                  if name.startswith(f"t{slot.index}.")}
    result = analyze(one, commit_one, baseline, step, baseline_ref64, states=own_states, state_dtypes=own_dtypes,
                     within=(slot.offset, slot.stop))
    result.update({"tensor": slot.index, "tensor_group": slot.group, "tensor_first_steps": per_tensor})
    if guard_step is not None:
        result["note"] = (result.get("note", "") + f"; guard elements written from step {guard_step}").lstrip("; ")
    return result
