"""Attribution's fourth phase, the drift call: whether a case within rounding drifts one way
below one ulp, and which variant that drift follows.

Within rounding is not yet rounding-level: a rounding-level change is *unbiased*, its flipped
roundings go either way, while a systematic change below one ulp (decay after the update at
lr = wd = 1e-2 on bfloat16, ~1/4000 of an ulp per step) flips them one way. A case within rounding
is tested for that (worker/attribution/drift.py: a sign test of the elements' moves against the
float64 reference's update and against the parameter's sign, allowing what a float32 rounding of a
factor shared by all elements moves, at a false-alarm rate of 1e-3 per case); a systematic drift
is semantic (or precision), named after the variant whose own sub-ulp difference predicts as much
drift along its signs as there is (worker/attribution/matching.py's residuals keep each variant's
difference from the algorithm at the last step), or unexplained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from service.core.wording import number, size
from worker.attribution import drift
from worker.attribution import variants as catalogue
from worker.attribution.matching import Residuals, VariantMatch
from worker.attribution.reading import Reading
from worker.attribution.ulps import ulp
from worker.engine.gradients import initial_parameters


@dataclass(frozen=True)
class DriftCall:
    """The phase's output: the sign tests, and the fields they add to the attribution (the tests
    always; the call, a note and the variants' fits where a test is systematic)."""

    tests: list[drift.SignTest]
    fields: dict


@dataclass(frozen=True)
class _LastStep:
    """The replay's end: the baseline and commit − baseline after the last step (float64, the
    replayed elements), which the variants' sub-ulp differences are compared with."""

    baseline: np.ndarray
    delta: np.ndarray


def judge_drift(reading: Reading, match: VariantMatch) -> DriftCall:
    """The drift tests of a case within rounding, and the call they make: nothing more when no test
    is systematic; otherwise semantic (or precision), named after the variant that explains the
    drift, or unexplained. Variants name it only where they were replayed to the last step."""
    tests, last = _sign_tests(reading)
    fields: dict = {"drift": [test.as_dict() for test in tests]}
    systematic = [test for test in tests if test.systematic]
    if not systematic:
        return DriftCall(tests, fields)
    note = _note(min(systematic, key=lambda test: test.p_value))
    fields.update({"class": "semantic", "variant": None, "label": "unexplained", "note": note})
    if match.naming is not None:
        fields.update(_named(reading.case.param_dtype, match.candidates, match.naming, last, note))
    return DriftCall(tests, fields)


def _sign_tests(reading: Reading) -> tuple[list[drift.SignTest], _LastStep]:
    """The DriftCounter fed every step: each move of commit − baseline against the float64
    reference's step and the baseline's sign before it (worker/attribution/drift.py)."""
    case, chosen, elements = reading.case, reading.chosen, reading.elements
    dtype = case.param_dtype
    counter = drift.DriftCounter(case.size if elements is None else int(elements.size))
    replay = catalogue.replay_steps(case, [catalogue.CORRECT], None if elements is None else torch.from_numpy(elements))
    start = initial_parameters(case.seed, case.size).to(catalogue._DTYPES[dtype]).double().numpy()[chosen]
    reference_before, baseline_before, delta_before = start, start, np.zeros_like(start)
    for t in range(1, case.steps + 1):
        reference_after = next(replay)[1][catalogue.CORRECT.name].numpy()
        b = reading.baseline[t - 1][chosen].astype(np.float64)
        delta = reading.commit[t - 1][chosen].astype(np.float64) - b
        counter.add(delta - delta_before, reference_after - reference_before, baseline_before, b, dtype)
        reference_before, baseline_before, delta_before = reference_after, b, delta
    return counter.tests(), _LastStep(baseline_before, delta_before)


def _note(strongest: drift.SignTest) -> str:
    """The systematic test's finding, in words."""
    where = ({"with": "with the update", "against": "against the update"} if strongest.direction == "step"
             else {"with": "away from zero", "against": "toward zero"})[strongest.way]
    return (f"a drift below one ulp, one way: {strongest.one_way} of the {strongest.moved} elements that moved went "
            f"{where} "
            f"(p = {number(strongest.p_value)}; a rounding-level change's shared factor allows "
            f"{number(strongest.allowance)} of them)")


def _named(dtype: str, candidates: list, residuals: Residuals, last: _LastStep, note: str) -> dict:
    """The variants' fits to the drift (the best three), and the variant that explains it, if any:
    its own sub-ulp difference at the last step predicts as much drift along its signs as there is."""
    own = ulp(np.maximum(np.abs(last.baseline), np.abs(last.baseline + last.delta)), dtype)
    observed = last.delta / own
    fits = sorted((drift.drift_fit(v.name, observed, residuals.difference[v.name] / own)
                   for v in candidates if residuals.fits[v.name] and v.name in residuals.difference),
                  key=lambda fit: fit.deviation)
    out: dict = {"drift_fits": [{"variant": f.variant, "predicted_ulps": f.predicted, "observed_ulps": f.observed,
                                 "sigma": f.sigma} for f in fits[:3]]}
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
