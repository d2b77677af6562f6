"""Attribution's third phase, the variant match: which catalogued semantic change of the
algorithm, if any, explains commit − baseline.

Each float64 variant V of worker/attribution/variants.py replays the case's gradients from the same
start as the correct algorithm V0. If the commit implements V and the baseline V0, then commit −
baseline = (V − V0) + the difference of their roundings, so `residual_V[t]` = max over elements of
|(commit − baseline) − (V − V0)|, in ulps of the larger of the baseline's and the commit's scales
(each rounds at its own magnitude; reading.RunningScale), is at most MATCH_ULPS_PER_STEP per step
since the first divergent one for the right variant and the size of the unexplained change for
every other (for V0 it is `ulps` itself). The rounding difference cancels in pairs of steps that
differ only where the algorithms differ, which is why the residual is taken on the difference and
not on |commit − V| (that one carries the commit's whole rounding drift, ~ the baseline's distance
to float64, and cannot resolve a change smaller than it, such as the decay reorder at lr 1e-3 /
wd 1e-2). A variant *matches* when its residual stays within that allowance at every step from the
first divergent one and is at most 1/SEPARATION of the change itself (`ulps` at its peak); the best
match is named with the next best's residual beside it. No match and a change beyond rounding:
"unexplained".

From the baseline's rule (issue 47): the baseline need not be the algorithm. DeepSpeed's CPU Adam
already takes its bias corrections from float32 powers, and its 0.19.0 keeps them as running
float32 products: from V0 neither variant explains commit − baseline. So each catalogued rule B the
baseline follows clearly better than V0 (its peak distance to B at most 1/SEPARATION of its
distance to V0, in ulps of its own scale) is a hypothesis too, with the commit following V0 (a
revert: "reverts: <B>"; for decay coupling the direction is said) or another setting C of B's own
switches: residual max |(commit − baseline) − (C − B)|, matched as a variant is
(variants.Transition). Cross-switch combinations (B kept, C added beside it) are not tried.

Variants carry no quantization: an 8-bit case is matched only where it first diverges at step 1
(from zero states an 8-bit step is the 32-bit rule), and then at that step alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from worker.attribution import variants as catalogue
from worker.attribution.reading import Reading, RunningScale
from worker.attribution.rounding import RoundingTest
from worker.attribution.ulps import ulp

# The right variant leaves only the difference of two independent roundings of the whole update
# (commit and baseline each err by a few u of an update that can be as large as the element's scale:
# measured up to 7 scale ulps at the first step, 10 after 20 steps, at lr 0.1 in float32), per step
# since the first divergent one; and it must explain the change, leaving at most 1/SEPARATION of it,
# so a change that is itself a few ulps is not "explained" by a variant that differs as little.
MATCH_ULPS_PER_STEP = 8.0
SEPARATION = 4.0
# A residual below half an ulp is exact; the floor keeps ratios finite.
RESIDUAL_FLOOR_ULPS = 0.5


def match_allowance(first_divergent_step: int, steps: int) -> np.ndarray:
    """Scale ulps the right variant's residual may reach after each step: MATCH_ULPS_PER_STEP
    for each step since the first divergent one."""
    since = np.arange(1, steps + 1) - first_divergent_step + 1
    return MATCH_ULPS_PER_STEP * np.maximum(since, 0)


def finite_max(values: np.ndarray) -> float:
    """max, or inf when any value is not finite (a variant gone to inf/NaN fits nothing)."""
    if not values.size:
        return 0.0
    return float(np.max(values)) if np.isfinite(values).all() else math.inf


class Residuals:
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
            self.reference_distance = max(self.reference_distance, finite_max(np.abs(commit - reference)))
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
        peak = finite_max(residual)
        self.peak[key] = max(self.peak[key], peak)
        self.fits[key] = self.fits[key] and peak <= allowed
        self.distance[key] = max(self.distance[key], finite_max(distance))

    def _baseline(self, name: str, gap: np.ndarray, units: np.ndarray) -> None:
        self.baseline_peak[name] = max(self.baseline_peak[name], finite_max(np.abs(gap) / units))

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


@dataclass(frozen=True)
class VariantMatch:
    """The phase's output: the hypotheses tried and their residuals, and the call's fields (class,
    variant, the best candidates; or why nothing was matched)."""

    candidates: list             # the catalogued variants tried (none where the case is not matched)
    residuals: Residuals
    replayed_to_last_step: bool  # the residuals cover every step: a drift may be named after a variant
    fields: dict

    @property
    def naming(self) -> Residuals | None:
        """The residuals the drift phase may name a variant from, or None."""
        return self.residuals if self.replayed_to_last_step else None


def match_variants(reading: Reading, rounding: RoundingTest) -> VariantMatch:
    """The variant match of one case (module doc), from its Reading and its RoundingTest (the
    change's size, and the class where no variant explains it)."""
    matched = not (reading.eight_bit and reading.first_divergent_step != 1)
    candidates = catalogue.applicable(reading.case) if matched else []
    residuals = Residuals(candidates)
    if not matched:
        return VariantMatch(candidates, residuals, False, {
            "class": rounding.scale, "variant": None,
            "note": "8-bit case first divergent after step 1: variants carry no quantization, not matched"})
    _replay(reading, candidates, residuals)
    return VariantMatch(candidates, residuals, not reading.eight_bit,
                        verdict(candidates, residuals, rounding.judged_peak, rounding.scale))


def _replay(reading: Reading, candidates: list, residuals: Residuals) -> None:
    """Feed `residuals` every judged step from the first divergent one, the algorithm and the
    candidates replayed on the Reading's elements."""
    case, s, dtype, chosen = reading.case, reading.first_divergent_step, reading.case.param_dtype, reading.chosen
    replay = catalogue.replay_steps(case, [catalogue.CORRECT, *candidates],
                                    None if reading.elements is None else torch.from_numpy(reading.elements))
    matching = match_allowance(s, case.steps)
    scale = RunningScale(case, chosen)
    for t in range(1, reading.last_judged_step + 1):
        params = next(replay)[1]
        c, b = reading.commit[t - 1][chosen], reading.baseline[t - 1][chosen]
        scale.add(c, b)
        if t < s:
            continue
        c64, b64 = c.astype(np.float64), b.astype(np.float64)
        with np.errstate(invalid="ignore"):
            delta = c64 - b64
        residuals.add(params, delta, c64, b64, ulp(scale.either, dtype), ulp(scale.baseline, dtype), matching[t - 1])


def verdict(candidates: list, residuals: Residuals, change_peak: float, scale: str) -> dict:
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


def _transition_fields(move: catalogue.Transition, residuals: Residuals) -> dict:
    """What a matched transition adds: the commit's rule as the variant, the baseline's rule and how
    much better the baseline follows it than the algorithm, and what a revert reverts."""
    fields = {"variant": move.commit.name, "transition": move.name, "baseline_variant": move.baseline.name,
              "baseline_variant_label": move.baseline.label,
              "baseline_residual_ulps": residuals.baseline_peak[move.baseline.name],
              "baseline_reference_ulps": residuals.baseline_peak[catalogue.CORRECT.name]}
    if move.reverts:
        fields.update({"reverts": move.baseline.name, "reverts_label": move.baseline.label})
    return fields
