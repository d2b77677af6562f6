"""Systematic drift below one ulp (worker/attribution/drift.py): a change that only flips final
roundings, but flips them one way, is not rounding-level; a reorder's flips, and a float32 shared
factor's, are.

The synthetic trajectories here are the two builds of one update rule, p <- round(p - u), with the
commit's update scaled by a factor: a systematic one (1 - 1e-4, the decay-after-update shortening at
lr = wd = 1e-2), a float32 shared one (1 +- 2**-24 per step, Adam's step size rounded in float32),
or an unbiased per-element one (1 +- 2**-23 at each element, a reorder's roundings). Every test
states its false-alarm rate: the drift test's is drift.FALSE_ALARM (1e-3) per case.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from worker.attribution import drift
from worker.attribution.analysis import analyze

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import attribution_lowbit as labelled  # noqa: E402

STEPS, SIZE = 20, 4096


def _rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values rounded to float32, then to `dtype` (as a kernel writes its parameter)."""
    as32 = torch.from_numpy(values.astype(np.float32))
    return as32.to(getattr(torch, dtype)).to(torch.float64).numpy()


def _tests(dtype: str, factor, seed: int = 0, size: int = SIZE) -> list[drift.SignTest]:  # noqa: ANN001
    """The drift tests of a commit whose update at step t is scaled by factor(t, rng) against a
    baseline that applies it as it is; the updates are lr-sized (1e-2), as Adam's are."""
    rng = np.random.default_rng(seed)
    start = _rounded(rng.uniform(-2, 2, size) * 2.0 ** rng.integers(-4, 5, size), dtype)
    baseline, commit = start.copy(), start.copy()
    counter = drift.DriftCounter(size)
    for t in range(STEPS):
        update = 1e-2 * rng.standard_normal(size)
        before, delta_before = baseline, commit - baseline
        baseline = _rounded(baseline - update, dtype)
        commit = _rounded(commit - update * factor(t, rng), dtype)
        counter.add(commit - baseline - delta_before, -update, before, baseline, dtype)
    return counter.tests()


def _systematic(tests: list[drift.SignTest]) -> bool:
    return any(test.systematic for test in tests)


def test_a_systematic_shortening_below_one_ulp_is_caught_on_bfloat16():
    tests = _tests("bfloat16", lambda t, rng: 1 - 1e-4)
    step = next(test for test in tests if test.direction == "step")
    # The shortened update moves every flipped element back against the step: one way.
    assert step.systematic and step.way == "against", step
    assert step.with_count <= step.moved // 10, step


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_unbiased_roundings_are_not_systematic(dtype):
    # A reorder: each element's update off by its own float32 rounding, either way.
    assert not _systematic(_tests(dtype, lambda t, rng: 1 + rng.uniform(-2.0 ** -23, 2.0 ** -23, SIZE)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_a_float32_shared_factor_is_within_the_allowance(dtype):
    # Adam's step size rounded in float32: every update of a step scaled by the same 1 + eps,
    # |eps| = 2**-24, one sign per step. On float32 its flips are many and all one way within a
    # step; the allowance (8 float32 roundings of a shared factor) covers them.
    tests = _tests(dtype, lambda t, rng: 1 + (-1) ** t * 2.0 ** -24)
    assert not _systematic(tests), tests


def test_the_shared_factor_allowance_is_what_keeps_float32_step_size_rounding_level():
    # The same factor, held one way at every step, read against a null without the allowance:
    # float32's flips are then far from a fair coin. (Proves the allowance is doing the work.)
    step = next(t for t in _tests("float32", lambda t, rng: 1 + 2.0 ** -24) if t.direction == "step")
    assert not step.systematic
    assert drift.binomial_upper_tail(step.moved, step.one_way, 0.5) < drift.FALSE_ALARM / drift.TAILS


def test_false_alarms_stay_at_the_stated_rate():
    # 100 unbiased bfloat16 cases, each a reorder plus a float32 shared factor: at FALSE_ALARM
    # = 1e-3 per case, 0.1 false calls are expected; 3 or more would happen with probability
    # 1.6e-4 if the rate held, so the test allows 2.
    calls = sum(_systematic(_tests("bfloat16", lambda t, rng: 1 + rng.uniform(-2.0 ** -23, 2.0 ** -23, 1024)
                                   + 2.0 ** -24, seed=seed, size=1024))
                for seed in range(100))
    assert calls <= 2


def test_binomial_upper_tail_is_exact():
    for n, k, p in ((10, 10, 0.5), (10, 7, 0.5), (40, 30, 0.6), (1, 1, 0.25)):
        expected = sum(math.comb(n, j) * p ** j * (1 - p) ** (n - j) for j in range(k, n + 1))
        assert drift.binomial_upper_tail(n, k, p) == pytest.approx(expected, rel=1e-9)
    assert drift.binomial_upper_tail(5, 0, 0.5) == 1.0 and drift.binomial_upper_tail(5, 6, 0.5) == 0.0


def test_a_variant_predicting_the_drift_explains_it_and_one_predicting_twice_as_much_does_not():
    # Stochastic rounding: each element drifts by its predicted fraction of an ulp in expectation.
    rng = np.random.default_rng(3)
    predicted = rng.uniform(0.01, 0.05, 20000) * np.sign(rng.standard_normal(20000))
    observed = np.where(rng.uniform(size=20000) < np.abs(predicted), np.sign(predicted), 0.0)
    right, double = drift.drift_fit("v", observed, predicted), drift.drift_fit("w", observed, 2 * predicted)
    assert right.explains and right.deviation <= drift.NAMING_SIGMAS
    assert not double.explains and double.deviation > drift.NAMING_SIGMAS
    assert not drift.drift_fit("none", observed, np.zeros_like(predicted)).explains


# Through the analysis, on tests/fixtures/lowbit's 8-bit AdamW run in this process
# (bench/attribution_lowbit.py's labelled set): bfloat16 parameters, lr = wd = 1e-2, 20 steps.
def _fixture_case(family: str, kind: str, lr: float):  # noqa: ANN202
    return next(c for c in labelled.cases(20) if c.family == family and c.param_dtype == "bfloat16"
                and c.gradient.kind == kind and c.hyper["lr"] == lr and c.size == 4096)


def _fixture_attribution(case, mutant: str) -> dict:  # noqa: ANN001
    base_params, base_states, base_digests = labelled.trajectory(case, {})
    params, states, digests = labelled.trajectory(case, labelled.MUTANTS[mutant][0])
    first = next(t for t, (a, b) in enumerate(zip(digests, base_digests), start=1) if a != b)
    return analyze(case, params, base_params, first, states=(states, base_states))


@pytest.mark.parametrize("family", ["8bit_blockwise", "32bit"])
@pytest.mark.parametrize("kind", ["open", "closed"])
def test_decay_after_the_update_below_one_bfloat16_ulp_is_not_rounding_level(family, kind):
    found = _fixture_attribution(_fixture_case(family, kind, 1e-2), "decay_after")
    # Within every ulp allowance (only final roundings flipped) ...
    assert found["scale"] == "rounding-level", found
    # ... but ~100 elements moved and nearly all of them back against the update: p < 1e-10
    # where the test calls at 2.5e-4 per tail.
    step = next(test for test in found["drift"] if test["direction"] == "step")
    assert step["systematic"] and step["against"] >= 0.8 * step["moved"] and step["p_value"] < 1e-10, step
    assert found["class"] == "semantic" and found["note"].startswith("a drift below one ulp, one way"), found


@pytest.mark.parametrize("family", ["8bit_blockwise", "32bit"])
@pytest.mark.parametrize("kind", ["open", "closed"])
def test_a_reorder_on_bfloat16_stays_rounding_level(family, kind):
    found = _fixture_attribution(_fixture_case(family, kind, 0.1), "reorder")
    assert found["class"] == "rounding-level", found
    assert not any(test["systematic"] for test in found["drift"]), found["drift"]
