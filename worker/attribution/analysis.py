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
first divergent one (a rounding that always falls the same way accumulates linearly). An
8-bit case is judged at its first divergent step only: after it, a one-ulp change in a state can
move a code, and requantization turns that into a whole code step (the documented quantization
error, docs/KERNELS_8BIT.md), which is not the kernel's arithmetic growing.

Which semantic change: each float64 variant V of worker/attribution/variants.py replays the case's
gradients from the same start as the correct algorithm V0. If the commit implements V and the
baseline V0, then commit − baseline = (V − V0) + the difference of their roundings, so
`residual_V[t]` = max over elements of |(commit − baseline) − (V − V0)|, in scale ulps, is at most
MATCH_ULPS_PER_STEP per step since the first divergent one for the right variant and the size of the unexplained change for every other (for V0 it is
`ulps` itself). The rounding difference cancels in pairs of steps that differ only where the
algorithms differ, which is why the residual is taken on the difference and not on |commit − V|
(that one carries the commit's whole rounding drift, ~ the baseline's distance to float64, and
cannot resolve a change smaller than it, such as the decay reorder at lr 1e-3 / wd 1e-2). A variant
*matches* when its residual stays within that allowance at every step from the first divergent one and is at most 1/SEPARATION of the change itself (`ulps` at its peak); the best match is
named with the next best's residual beside it. No match and a change beyond rounding: "unexplained".
"""

from __future__ import annotations

import math

import numpy as np
import torch

from service.results import CaseSpec
from worker.attribution import variants as catalogue
from worker.attribution.ulps import check_representable, ulp, ulp_distance
from worker.engine.gradients import initial_parameters

# "A few ulps": a reordering, a contraction or an intermediate's precision moves an element by at
# most ~1-2 roundings of its scale in the step where it first acts (measured on the bundled kernels:
# 2 for Adam's step size in float32, 1 for an FMA contraction), and by as much again at each later
# step: a rounding that always falls the same way (p * (1 - lr wd) rounded or fused) accumulates
# linearly (20 ulps after 20 steps, measured). So a change is rounding-level while it stays within
# ROUNDING_ULPS_PER_STEP for each step since the first divergent one.
ROUNDING_ULPS_PER_STEP = 2.0
# The right variant leaves only the difference of two independent roundings of the whole update
# (commit and baseline each err by a few u of an update that can be as large as the element's scale:
# measured up to 7 scale ulps at the first step, 10 after 20 steps, at lr 0.1 in float32), per step
# since the first divergent one; and it must explain the change, leaving at most 1/SEPARATION of it,
# so a change that is itself a few ulps is not "explained" by a variant that differs as little.
MATCH_ULPS_PER_STEP = 8.0
SEPARATION = 4.0
# A residual below half an ulp is exact; the floor keeps ratios finite.
RESIDUAL_FLOOR_ULPS = 0.5


def rounding_allowance(first_divergent_step: int, steps: int) -> np.ndarray:
    """Scale ulps a rounding-level change may have reached after each step (0 before divergence)."""
    since = np.arange(1, steps + 1) - first_divergent_step + 1
    return ROUNDING_ULPS_PER_STEP * np.maximum(since, 0)


def _series_max(values: np.ndarray) -> list[float]:
    with np.errstate(invalid="ignore"):
        return [float(x) for x in np.nanmax(values, axis=1)] if values.size else []


def scale_units(case: CaseSpec, baseline: np.ndarray) -> np.ndarray:
    """(steps, size) float64: the ulp of each element's running max |baseline parameter|."""
    start = initial_parameters(case.seed, case.size).to(catalogue._DTYPES[case.param_dtype]).float().numpy()
    magnitude = np.maximum.accumulate(np.abs(np.vstack([start[None, :], baseline]).astype(np.float64)), axis=0)[1:]
    return ulp(magnitude, case.param_dtype)


def analyze(case: CaseSpec, commit: np.ndarray, baseline: np.ndarray, first_divergent_step: int,
            baseline_ref64: list[float] | None = None) -> dict:
    """The attribution of one changed case (JSON-ready; floats at full precision)."""
    steps = case.steps
    commit = np.asarray(commit, dtype=np.float32).reshape(steps, case.size)
    baseline = np.asarray(baseline, dtype=np.float32).reshape(steps, case.size)
    for side in (commit, baseline):
        check_representable(side, case.param_dtype)
    s = first_divergent_step
    if not 1 <= s <= steps:
        raise ValueError(f"attribution of {case.case_id}: first divergent step {s} is outside 1..{steps}")
    units = scale_units(case, baseline)
    with np.errstate(invalid="ignore"):
        delta = commit.astype(np.float64) - baseline.astype(np.float64)
        ulps = _series_max(np.abs(delta) / units)
    eight_bit = case.family != "32bit"
    window = slice(s - 1, s) if eight_bit else slice(s - 1, steps)
    change_peak = max(ulps[window])
    allowance = rounding_allowance(s, steps)[window]
    within_rounding = bool(np.all(np.asarray(ulps[window]) <= allowance))
    elementwise_first = int(ulp_distance(commit[s - 1], baseline[s - 1], case.param_dtype).max())
    result = {
        "first_divergent_step": s,
        "first_step_ulps": ulps[s - 1],
        "first_step_ulps_elementwise": elementwise_first,
        "peak_ulps": max(ulps[s - 1:]),
        "judged_ulps": change_peak,
        "ulps_per_step": ulps,
        "max_abs_diff": float(np.nanmax(np.abs(delta[s - 1:]))),
        "scale": "rounding-level" if within_rounding else "semantic",
        "rounding_ulps_per_step": ROUNDING_ULPS_PER_STEP,
        "judged_over": "first divergent step" if eight_bit else "steps from the first divergent one",
    }
    if baseline_ref64:
        band = max(baseline_ref64[s - 1:])
        result["baseline_ref64_peak"] = band
        result["change_vs_baseline_distance"] = result["max_abs_diff"] / band if band > 0 else math.inf
    match_allowance = allowance * (MATCH_ULPS_PER_STEP / ROUNDING_ULPS_PER_STEP)
    result.update(_match(case, commit, baseline, units, window, change_peak, match_allowance, result["scale"]))
    return result


def _match(case: CaseSpec, commit: np.ndarray, baseline: np.ndarray, units: np.ndarray, window: slice,
           change_peak: float, allowance: np.ndarray, scale: str) -> dict:
    """Each applicable variant's residual; the verdict: which one, none, or rounding-level."""
    if case.family != "32bit" and window.start != 0:
        # Variants are the 32-bit rule in float64: exactly an 8-bit step only from zero states.
        return {"class": scale, "variant": None,
                "note": "8-bit case first divergent after step 1: variants carry no quantization, not matched"}
    candidates = catalogue.applicable(case)
    paths = catalogue.replay(case, [catalogue.CORRECT, *candidates])
    reference = paths.pop(catalogue.CORRECT.name).numpy()
    delta = (commit.astype(np.float64) - baseline.astype(np.float64))[window]
    scored = []
    for variant in candidates:
        path = paths[variant.name].numpy()
        with np.errstate(invalid="ignore", over="ignore"):
            residual = np.abs(delta - (path - reference)[window]) / units[window]
            distance = np.abs(commit.astype(np.float64)[window] - path[window])
        per_step = np.max(residual, axis=1) if np.isfinite(residual).all() else np.full(len(allowance), math.inf)
        fits = bool(np.all(per_step <= allowance))
        scored.append((float(np.max(per_step)), float(np.max(distance)) if np.isfinite(distance).all() else math.inf,
                       variant, fits))
    scored.sort(key=lambda item: item[0])
    with np.errstate(invalid="ignore"):
        reference_distance = float(np.max(np.abs(commit.astype(np.float64)[window] - reference[window])))
    out = {"reference_distance": reference_distance,
           "candidates": [{"variant": v.name, "label": v.label, "kind": v.kind, "residual_ulps": r, "distance": d}
                          for r, d, v, _ in scored[:3]]}
    best = scored[0] if scored else None
    if best and best[3] and max(best[0], RESIDUAL_FLOOR_ULPS) * SEPARATION <= change_peak:
        residual, distance, variant, _ = best
        following = scored[1][0] if len(scored) > 1 else math.inf
        out.update({"class": "semantic", "variant": variant.name, "label": variant.label, "kind": variant.kind,
                    "residual_ulps": residual, "distance": distance,
                    "next_best": scored[1][2].name if len(scored) > 1 else None,
                    "next_best_ratio": following / max(residual, RESIDUAL_FLOOR_ULPS)})
    elif scale == "rounding-level":
        out.update({"class": "rounding-level", "variant": None})
    else:
        out.update({"class": "semantic", "variant": None, "label": "unexplained"})
    return out


def analyze_files(case: CaseSpec, commit_file: str, baseline_file: str, first_divergent_step: int,
                  baseline_ref64: list[float] | None = None) -> dict:
    commit = np.fromfile(commit_file, dtype="<f4")
    baseline = np.fromfile(baseline_file, dtype="<f4")
    expected = case.steps * case.size
    if commit.size != expected or baseline.size != expected:
        raise ValueError(f"attribution of {case.case_id}: parameter files hold {commit.size} and "
                         f"{baseline.size} values, expected steps x size = {expected}")
    torch.set_num_threads(1)
    return analyze(case, commit, baseline, first_divergent_step, baseline_ref64)
