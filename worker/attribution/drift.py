"""Systematic drift below one ulp: whether a change that stays within rounding moves one way.

A rounding-level change (a reorder, a contraction, an intermediate's precision) flips final
roundings either way: where the two builds' unrounded values straddle a rounding boundary, which of
them lies above it does not depend on which way the update goes. A systematic change smaller than
one ulp (decay after the update at lr = wd = 1e-2 on bfloat16: each update shortened by
lr·wd ~ 1e-4 of itself, ~1/4000 of a bfloat16 ulp) also moves the trajectory only by flipped final
roundings, and stays within every ulp allowance; but its flips go one way. So, per element, over
the steps: the sign of each move of the difference (commit − baseline), against two directions the
change cannot see its own roundings in:
  * "step": the sign of the update, taken from the float64 reference's step at the same element
    (worker/attribution/variants.py, CORRECT); the baseline's own rounded step would not do, as
    its rounding is the one the flips cross: it correlates with their direction by itself;
  * "parameter": the sign of the baseline parameter before the step (a decay-like change moves
    every element toward or away from zero).
An element whose moves net along a direction counts "with" it, net against it "against"; a sign
test over the elements that moved. Elements, not moves: a rounding that falls the same way at
every step of one element (an FMA, measured 1 ulp per step on float32) is one vote, not twenty.

A rounding-level change may still carry a shared factor: a scalar of the update computed in float32
(Adam's step size lr / bc1: every update scaled by the same 1 + ε, |ε| <= 2**-24, at a step) moves
each element by ε·|update|, all one way. That is what "rounding-level" allows, so the test's null
hypothesis allows it: the element moves such a factor can make at most
SHARED_FACTOR_ROUNDINGS[direction] x 2**-24 x |direction's value| / ulp per step (the chance that a
shift that small crosses a rounding boundary), all one way; the other moves are a fair coin. With
A that allowance summed over the elements (each capped at one) and N elements that moved, the
chance an element moves one way is at most p0 = 1/2 + A / (2 N), and a count of K one way is
systematic when P(Binomial(N, p0) >= K) <= FALSE_ALARM / 4 (two directions, two signs each).
The test has no power below the float32 shared factor, by construction: there a change *is*
rounding-level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from worker.attribution.ulps import ulp

# The chance that a rounding-level change reads systematic, per case (the four tails together).
# One in a thousand: the labelled set has ~60 rounding-level cases, so an expected 0.06 false calls.
FALSE_ALARM = 1e-3
TAILS = 4
UNIT_ROUNDOFF = 2.0 ** -24  # float32's: the intermediates of every parameter dtype are float32
# How many float32 roundings of a factor shared by all elements a rounding-level change may move:
# the update passes through ~8 float32 operations (Adam's, analysis.ROUNDING_ULPS_FIRST_STEP's
# count), any of which may round a shared scalar (lr / bc1, sqrt(bc2)) differently; the parameter's
# own factor (1 − lr·wd) is one rounding in each build, two in all.
SHARED_FACTOR_ROUNDINGS = {"step": 8.0, "parameter": 2.0}
DIRECTIONS = tuple(SHARED_FACTOR_ROUNDINGS)


def binomial_upper_tail(n: int, k: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), exact (summed in log space)."""
    if k <= 0 or p >= 1.0:
        return 1.0
    if k > n or p <= 0.0:
        return 0.0
    j = np.arange(k, n + 1, dtype=np.float64)
    log_choose = math.lgamma(n + 1) - np.array([math.lgamma(x + 1) + math.lgamma(n - x + 1) for x in j])
    logs = log_choose + j * math.log(p) + (n - j) * math.log1p(-p)
    top = float(logs.max())
    return float(min(1.0, math.exp(top) * float(np.exp(logs - top).sum())))


@dataclass(frozen=True)
class SignTest:
    """One direction: of `moved` elements, `one_way` netted `way` ("with" / "against") it."""

    direction: str      # "step" or "parameter"
    moved: int
    with_count: int
    against_count: int
    allowance: float    # elements a rounding-level shared factor could have moved (A)
    p_value: float      # the smaller tail, P(Binomial(moved, p0) >= the larger count)

    @property
    def way(self) -> str:
        return "with" if self.with_count >= self.against_count else "against"

    @property
    def one_way(self) -> int:
        return max(self.with_count, self.against_count)

    @property
    def systematic(self) -> bool:
        return self.p_value <= FALSE_ALARM / TAILS

    def as_dict(self) -> dict:
        return {"direction": self.direction, "moved": self.moved, "with": self.with_count,
                "against": self.against_count, "allowance": self.allowance, "p_value": self.p_value,
                "systematic": self.systematic}


def sign_test(direction: str, score: np.ndarray, allowance: np.ndarray) -> SignTest:
    """The test on per-element net scores (> 0: with the direction) and per-element allowances."""
    moved = int(np.count_nonzero(score))
    with_count, against_count = int(np.count_nonzero(score > 0)), int(np.count_nonzero(score < 0))
    budget = float(np.minimum(allowance, 1.0).sum())
    p0 = min(1.0, 0.5 + budget / (2 * moved)) if moved else 1.0
    p_value = binomial_upper_tail(moved, max(with_count, against_count), p0) if moved else 1.0
    return SignTest(direction, moved, with_count, against_count, budget, p_value)


class DriftCounter:
    """Per element, fed one step at a time: the net sign of the difference's moves against each
    direction, and the allowance of a rounding-level shared factor (module doc)."""

    def __init__(self, size: int):
        self.score = {name: np.zeros(size, dtype=np.int64) for name in DIRECTIONS}
        self.allowance = {name: np.zeros(size, dtype=np.float64) for name in DIRECTIONS}

    def add(self, move: np.ndarray, reference_step: np.ndarray, parameter_before: np.ndarray,
            parameter_after: np.ndarray, dtype: str) -> None:
        """`move`: (commit − baseline) after the step minus before it; `reference_step`: the float64
        reference's step; the baseline's parameter before and after it (float64 arrays)."""
        moved = np.sign(np.nan_to_num(move, nan=0.0))
        # A flip crosses the grid at the value the step lands on: its own ulp there.
        own = ulp(np.maximum(np.abs(parameter_after), np.abs(parameter_before)), dtype)
        for name, values in (("step", reference_step), ("parameter", parameter_before)):
            values = np.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
            self.score[name] += (moved * np.sign(values)).astype(np.int64)
            with np.errstate(invalid="ignore", divide="ignore"):
                share = SHARED_FACTOR_ROUNDINGS[name] * UNIT_ROUNDOFF * np.abs(values) / own
            self.allowance[name] += np.nan_to_num(share, nan=1.0, posinf=1.0)

    def tests(self) -> list[SignTest]:
        return [sign_test(name, self.score[name], self.allowance[name]) for name in DIRECTIONS]


# Naming a drift below one ulp. Each step's flips are a stochastic rounding of that step's shift
# (a boundary lies within the shift with probability |shift| / ulp), so the difference an element
# has drifted by is, in expectation, the variant's own difference from the reference, in ulps:
# E[commit − baseline] = V − V0 for the right variant V even where |V − V0| is a small fraction of
# an ulp. Summed along the variant's signs: observed O = sum sign(V − V0)·(commit − baseline),
# predicted E = sum |V − V0| (ulps), and O − E has a standard deviation of at most
# sqrt(sum (commit − baseline)²) (each element's flips have variance at most their mean square).
# The variant explains the drift when O is NAMING_SIGMAS of those beyond zero (the drift goes its
# way) and within NAMING_SIGMAS of E (it predicts as much drift as there is).
NAMING_SIGMAS = 3.0


@dataclass(frozen=True)
class DriftFit:
    variant: str
    predicted: float    # E, ulps
    observed: float     # O, ulps
    sigma: float

    @property
    def deviation(self) -> float:
        """|O − E| in sigmas."""
        return abs(self.observed - self.predicted) / self.sigma

    @property
    def explains(self) -> bool:
        return self.predicted > 0 and self.observed >= NAMING_SIGMAS * self.sigma and self.deviation <= NAMING_SIGMAS


def drift_fit(variant: str, observed_ulps: np.ndarray, predicted_ulps: np.ndarray) -> DriftFit:
    """How well the variant's difference from the reference (`predicted_ulps`, per element, in the
    element's own ulps) explains the observed commit − baseline (`observed_ulps`, same units)."""
    along = np.sign(np.nan_to_num(predicted_ulps, nan=0.0))
    acting = along != 0
    observed = np.nan_to_num(observed_ulps, nan=0.0)
    sigma = math.sqrt(max(float(np.sum(observed[acting] ** 2)), 1.0))
    predicted = float(np.abs(predicted_ulps[acting]).sum()) if acting.any() else 0.0
    return DriftFit(variant, predicted if math.isfinite(predicted) else math.inf,
                    float((along * observed).sum()), sigma)
