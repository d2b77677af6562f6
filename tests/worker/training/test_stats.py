"""worker/training/stats.py: the verdict's false-alarm rates and power, measured by Monte-Carlo on
synthetic loss curves whose truth is known, and its rules on hand-made cases.

Each trial builds K = 8 seeds x 200 steps: baseline_k = a decaying curve + a per-seed level
N(0, SIGMA_SEED) + per-step noise N(0, SIGMA_STEP); floor_k = baseline_k + a drift N(0, SIGMA_FLOOR)
per step, growing as sqrt(step / steps) (chaotic drift grows); commit_k = baseline_k + shift + the
same kind of drift with SIGMA_CHANGE. The generators are seeded, so every rate is reproducible.

Tolerance of every measured rate: 3 standard errors of a binomial proportion over TRIALS trials at
the rate the claim names, sqrt(rate * (1 - rate) / TRIALS) — a true claim fails by chance about
once in 700 (one-sided 3 sigma); the seeds are fixed, so it does not flake.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields

import numpy as np
import pytest
from scipy import integrate, stats as scipy_stats

from service.core.training import IMPACT_VERDICTS, ImpactFigures
from worker.training.stats import (VERDICTS, ImpactStats, Interval, floor_p_value, judge, window_for,
                                   windowed)

SEEDS = 8
STEPS = 200
WINDOW = window_for(STEPS)
TRIALS = 1000
ALPHA = 0.05
SIGMA_SEED = 0.02
SIGMA_STEP = 0.01
SIGMA_FLOOR = 1e-4
_STEP_INDEX = np.arange(STEPS)
_CURVE = 2.0 * np.exp(-_STEP_INDEX / 40.0) + 0.5
_DRIFT_GROWTH = np.sqrt((_STEP_INDEX + 1) / STEPS)
# The windowed drift (mean of the last WINDOW steps of sigma * growth * N(0, 1)) has standard
# deviation sigma * DRIFT_SCALE.
DRIFT_SCALE = math.sqrt(float(np.sum(_DRIFT_GROWTH[-WINDOW:] ** 2))) / WINDOW
# The windowed baseline's standard deviation over seeds.
SIGMA_WINDOWED = math.sqrt(SIGMA_SEED ** 2 + SIGMA_STEP ** 2 / WINDOW)

BEYOND_FLOOR = ("within_noise", "beyond_noise")


def _tolerance(rate: float) -> float:
    return 3.0 * math.sqrt(rate * (1.0 - rate) / TRIALS)


def _trial(rng: np.random.Generator, *, shift: float = 0.0, sigma_change: float = SIGMA_FLOOR):
    baseline = (_CURVE + rng.normal(0.0, SIGMA_SEED, (SEEDS, 1))
                + rng.normal(0.0, SIGMA_STEP, (SEEDS, STEPS)))
    floor = baseline + SIGMA_FLOOR * _DRIFT_GROWTH * rng.normal(size=(SEEDS, STEPS))
    commit = baseline + shift + sigma_change * _DRIFT_GROWTH * rng.normal(size=(SEEDS, STEPS))
    return commit, baseline, floor


def _run(seed: int, **scenario) -> list[ImpactStats]:
    rng = np.random.default_rng(seed)
    return [judge(*_trial(rng, **scenario), alpha=ALPHA) for _ in range(TRIALS)]


def _share(results: list[ImpactStats], verdicts: tuple[str, ...]) -> float:
    return sum(result.verdict in verdicts for result in results) / len(results)


def _welch_power(shift: float, sigma_commit: float, sigma_baseline: float) -> float:
    """Power of Welch's test at ALPHA for two INDEPENDENT normal samples of SEEDS (noncentral t, the
    Welch-Satterthwaite degrees of freedom of the true variances). The paired samples here share
    each seed's level, which cancels in the difference of the means and so only raises the power
    at a shift this far above the noise."""
    variance_of_difference = (sigma_commit ** 2 + sigma_baseline ** 2) / SEEDS
    dof = variance_of_difference ** 2 / ((sigma_commit ** 2 / SEEDS) ** 2 / (SEEDS - 1)
                                         + (sigma_baseline ** 2 / SEEDS) ** 2 / (SEEDS - 1))
    noncentrality = shift / math.sqrt(variance_of_difference)
    critical = scipy_stats.t.ppf(1 - ALPHA / 2, dof)
    return float(scipy_stats.nct.sf(critical, dof, noncentrality) + scipy_stats.nct.cdf(-critical, dof, noncentrality))


def _floor_power_lower_bound(mean_change: float, sigma_change: float, sigma_floor: float) -> float:
    """A lower bound on the permutation test's power, for d_k ~ N(mean_change, sigma_change) and
    f_k ~ N(0, sigma_floor). If at least K - j of the d_k^2 each exceed S = sum(f^2), every split
    whose group-1 sum is at least the observed one keeps those K - j values (dropping one loses more
    than any f's can add back), so at most C(K + j, j) of the C(2K, K) splits count and p_floor <=
    C(K + j, j) / C(2K, K). With the largest j that makes this <= ALPHA (j = 4 at K = 8):
    P(beyond floor) >= P(#{k: |d_k| > sqrt(S)} >= K - j), S = sigma_floor^2 * chi2(K)."""
    splits = math.comb(2 * SEEDS, SEEDS)
    j = max(j for j in range(SEEDS + 1) if math.comb(SEEDS + j, j) <= ALPHA * splits)

    def given_floor_sum(chi2_value: float) -> float:
        threshold = sigma_floor * math.sqrt(chi2_value)
        exceeds = (scipy_stats.norm.sf((threshold - mean_change) / sigma_change)
                   + scipy_stats.norm.cdf((-threshold - mean_change) / sigma_change))
        return scipy_stats.chi2.pdf(chi2_value, SEEDS) * scipy_stats.binom.sf(SEEDS - j - 1, SEEDS, exceeds)

    bound, _ = integrate.quad(given_floor_sum, 0.0, np.inf)
    return bound


# --- Monte-Carlo: false alarms and power ----------------------------------------------------------


def test_a_change_like_the_floor_is_beyond_it_at_most_alpha_of_the_time():
    results = _run(1, shift=0.0, sigma_change=SIGMA_FLOOR)
    beyond_floor = _share(results, BEYOND_FLOOR)
    beyond_noise = _share(results, ("beyond_noise",))
    assert beyond_floor <= ALPHA + _tolerance(ALPHA), beyond_floor
    assert beyond_noise <= ALPHA + _tolerance(ALPHA), beyond_noise


def test_a_shift_of_three_seed_spreads_is_beyond_noise():
    shift = 3 * SIGMA_SEED
    sigma_drift = SIGMA_FLOOR * DRIFT_SCALE
    welch = _welch_power(shift, math.sqrt(SIGMA_WINDOWED ** 2 + sigma_drift ** 2), SIGMA_WINDOWED)
    floor = _floor_power_lower_bound(shift, sigma_drift, sigma_drift)
    # beyond_noise needs both tests: P(both) >= P(floor) + P(Welch) - 1.
    expected = welch + floor - 1.0
    assert expected > 0.99  # the design's claim: three seed spreads are found at K = 8
    results = _run(2, shift=shift, sigma_change=SIGMA_FLOOR)
    beyond_noise = _share(results, ("beyond_noise",))
    assert beyond_noise >= expected - _tolerance(expected), (beyond_noise, expected)


def test_a_drift_ten_times_the_floor_is_beyond_it_but_not_beyond_noise():
    sigma_drift = SIGMA_FLOOR * DRIFT_SCALE
    expected = _floor_power_lower_bound(0.0, 10 * sigma_drift, sigma_drift)
    assert expected > 0.9
    results = _run(3, shift=0.0, sigma_change=10 * SIGMA_FLOOR)
    beyond_floor = _share(results, BEYOND_FLOOR)
    beyond_noise = _share(results, ("beyond_noise",))
    assert beyond_floor >= expected - _tolerance(expected), (beyond_floor, expected)
    assert beyond_noise <= ALPHA + _tolerance(ALPHA), beyond_noise


def test_a_consistent_shift_far_under_the_seed_spread_is_within_noise_and_shown_by_the_paired_interval():
    # A tenth of a seed spread, but a thousand times the drift: every seed moves the same way. Welch
    # (unpaired) must call it within noise; the paired 95 % interval must exclude 0.
    shift = 0.1 * SIGMA_SEED
    sigma_drift = SIGMA_FLOOR * DRIFT_SCALE
    floor = _floor_power_lower_bound(shift, sigma_drift, sigma_drift)
    sigma_difference = sigma_drift  # d_k = shift + the commit's windowed drift
    paired_power = float(scipy_stats.nct.sf(scipy_stats.t.ppf(0.975, SEEDS - 1), SEEDS - 1,
                                            shift / (sigma_difference / math.sqrt(SEEDS))))
    results = _run(5, shift=shift, sigma_change=SIGMA_FLOOR)
    beyond_floor = _share(results, BEYOND_FLOOR)
    beyond_noise = _share(results, ("beyond_noise",))
    excludes_zero = sum(result.shift_ci.low > 0 for result in results) / TRIALS
    # The true mean shift of the windowed loss is `shift`: the 95 % interval covers it 95 % of the time.
    covers = sum(result.shift_ci.low <= shift <= result.shift_ci.high for result in results) / TRIALS
    assert beyond_floor >= floor - _tolerance(floor), (beyond_floor, floor)
    assert beyond_noise <= ALPHA + _tolerance(ALPHA), beyond_noise
    assert excludes_zero >= paired_power - _tolerance(paired_power), (excludes_zero, paired_power)
    assert abs(covers - 0.95) <= _tolerance(0.95), covers


def test_the_floor_test_has_size_alpha_when_the_change_is_one_more_floor_draw():
    # Directly on the permutation test (no curves): exact, so the rate is alpha itself, not just at
    # most alpha (a test that never fires would pass the Monte-Carlo tests above). 5000 draws: the
    # tolerance is 3 standard errors at that count.
    rng = np.random.default_rng(4)
    draws = 5000
    p_values = [floor_p_value(rng.normal(size=SEEDS), rng.normal(size=SEEDS)) for _ in range(draws)]
    rate = sum(p <= ALPHA for p in p_values) / draws
    assert abs(rate - ALPHA) <= 3.0 * math.sqrt(ALPHA * (1 - ALPHA) / draws), rate


# --- rules on hand-made cases ---------------------------------------------------------------------


def _curves(seed: int = 0, seeds: int = SEEDS, shift: float = 0.0):
    return _trial(np.random.default_rng(seed), shift=shift) if seeds == SEEDS else tuple(
        array[:seeds] for array in _trial(np.random.default_rng(seed), shift=shift))


def test_window_for_and_windowed():
    assert [window_for(steps) for steps in (1, 5, 10, 50, 200, 1000, 2000)] == [1, 5, 10, 10, 20, 100, 200]
    losses = np.arange(2 * 30, dtype=np.float64).reshape(2, 30)
    assert windowed(losses, 10).tolist() == [losses[0, 20:].mean(), losses[1, 20:].mean()]
    with pytest.raises(ValueError, match="window"):
        windowed(losses, 31)


def test_identical_curves_are_identical_with_zero_shifts():
    commit, baseline, floor = _curves()
    result = judge(baseline.copy(), baseline, floor)
    assert result.verdict == "identical"
    assert (result.shift, result.final_shift, result.change_rms, result.relative_shift) == (0.0, 0.0, 0.0, 0.0)
    assert result.shift_ci == result.final_shift_ci == Interval(0.0, 0.0)
    assert result.p_floor is None and result.p_noise is None and result.reason is None
    assert result.seeds == SEEDS and result.floor_rms > 0
    # A seed that diverged on both sides, at the same step, bit for bit: still identical.
    baseline[3, 150:] = np.nan
    assert judge(baseline.copy(), baseline, floor).verdict == "identical"


def test_a_commit_that_diverges_where_the_baseline_does_not_is_diverged():
    commit, baseline, floor = _curves()
    commit[[2, 5], 120:] = np.nan
    commit[5, 119] = np.inf
    result = judge(commit, baseline, floor)
    assert result.verdict == "diverged"
    assert result.reason == "the commit's loss is not finite in 2 of 8 seeds where the baseline's is"
    assert (result.diverged_commit, result.diverged_baseline, result.seeds) == (2, 0, 6)
    # The figures are measured on the seeds that are left.
    kept = [0, 1, 3, 4, 6, 7]
    assert result.shift == judge(commit[kept], baseline[kept], floor[kept]).shift


def test_a_seed_where_the_baseline_diverges_is_left_out_and_said():
    commit, baseline, floor = _curves(shift=3 * SIGMA_SEED)
    baseline[4, 60:] = np.nan
    result = judge(commit, baseline, floor)
    kept = [0, 1, 2, 3, 5, 6, 7]
    on_the_rest = judge(commit[kept], baseline[kept], floor[kept])
    assert result.verdict == on_the_rest.verdict == "beyond_noise"
    assert (result.seeds, result.diverged_baseline, result.diverged_commit) == (7, 1, 0)
    assert result.reason == "the baseline's loss is not finite in 1 of 8 seeds; those seeds are left out of the comparison"
    measured = ("shift", "shift_ci", "final_shift", "seed_spread", "floor_rms", "change_rms", "p_floor", "p_noise")
    assert [getattr(result, name) for name in measured] == [getattr(on_the_rest, name) for name in measured]


def test_fewer_than_three_seeds_is_not_judged():
    commit, baseline, floor = _curves(seeds=2, shift=3 * SIGMA_SEED)
    result = judge(commit, baseline, floor)
    assert result.verdict == "not_judged" and result.seeds == 2
    assert "only 2 of 2 seeds" in result.reason and "at least 3" in result.reason
    assert result.shift is None and result.p_floor is None and result.shift_ci is None
    # Five seeds, three of whose floors diverged: two left on all three sides.
    commit, baseline, floor = _curves(seeds=5)
    floor[:3, -1] = np.nan
    result = judge(commit, baseline, floor)
    assert (result.verdict, result.seeds) == ("not_judged", 2)


def test_equal_paired_differences_give_a_zero_width_interval():
    # Dyadic values, so the windowed differences are exactly 0.25 in every seed.
    baseline = np.repeat((1.0 + np.arange(SEEDS) / 8.0)[:, None], STEPS, axis=1)
    commit = baseline + 0.25
    floor = baseline + np.random.default_rng(7).normal(0.0, 1e-6, baseline.shape)
    result = judge(commit, baseline, floor)
    assert result.shift == 0.25 and result.shift_ci == Interval(0.25, 0.25)
    assert result.final_shift_ci == Interval(0.25, 0.25)
    assert result.relative_ci == Interval(0.25 / result.baseline_mean, 0.25 / result.baseline_mean)


def test_a_floor_that_never_moved_puts_any_change_beyond_it():
    assert floor_p_value(np.array([0.0, 1e-12, 0.0]), np.zeros(3)) == 0.0
    assert floor_p_value(np.zeros(3), np.zeros(3)) == 1.0
    commit, baseline, _ = _curves(shift=1e-9)
    assert judge(commit, baseline, baseline.copy()).p_floor == 0.0


def test_more_than_ten_seeds_sample_splits_reproducibly():
    rng = np.random.default_rng(11)
    drift = rng.normal(0.0, 1.0, 12)
    null = rng.normal(0.0, 1.0, 12)
    assert floor_p_value(null, drift) == floor_p_value(null, drift)
    assert 0.0 < floor_p_value(null, drift) <= 1.0
    # Every |d| above every |f|: only splits near the observed one count.
    assert floor_p_value(10.0 + np.abs(null), drift) < 1e-3


def test_the_verdicts_are_the_services():
    assert VERDICTS == IMPACT_VERDICTS


def test_as_json_round_trips_at_full_precision_and_is_what_the_service_reads():
    for result in (judge(*_curves(shift=SIGMA_SEED)), judge(*_curves(seeds=2)), judge(*_curves()[1:2] * 3)):
        as_json = result.as_json()
        assert set(as_json) == {field.name for field in fields(ImpactStats)}
        assert result.verdict in VERDICTS
        assert json.loads(json.dumps(as_json, allow_nan=False)) == as_json
        for name, value in as_json.items():
            attribute = getattr(result, name)
            if isinstance(attribute, Interval):
                assert value == {"low": attribute.low, "high": attribute.high}
            else:
                assert value == attribute and type(value) in (float, int, str, type(None)), name
        assert ImpactFigures.model_validate(as_json).model_dump() == as_json
