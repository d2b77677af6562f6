"""The noise model of kernel timings: is a commit's kernel slower than its baseline's?

Both runs time the kernel many times (worker/speed/timing.py); each sample is one step. The
statistic is the ratio of medians, commit / baseline (the median: a kernel's time distribution
has a long right tail — a preempted launch, a clock dip — that a mean would follow). Its
uncertainty is a percentile bootstrap: both sample sets are resampled with replacement, the ratio
of the resampled medians computed each time, and the central CONFIDENCE interval of those ratios
taken. A kernel is `slower` only when the whole interval lies above 1 + SLOWDOWN_THRESHOLD (a
difference too small to matter is not a regression even when it is real), `faster` when the whole
interval lies below 1 / (1 + SLOWDOWN_THRESHOLD), `same` otherwise.

Shared by the worker (summaries of what it timed) and the service (the comparison of stored
samples), like service/core/verdicts.py: numpy only, no torch, imported lazily by the API so the web
process does not load numpy until a speed page is asked for. The bootstrap is seeded, so the
same samples always give the same verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

# Practical threshold: a slowdown under 5 % is not flagged even when it is certain. Kernel timings
# move by a percent or two between processes (clocks, placement) — more than the within-run
# bootstrap sees — and the target is a 10 % slowdown flagged (tests/service/core/test_kernel_speed_noise.py).
SLOWDOWN_THRESHOLD = 0.05
CONFIDENCE = 0.99
BOOTSTRAP_RESAMPLES = 2000
MIN_SAMPLES = 5

SpeedVerdict = Literal["slower", "faster", "same"]


@dataclass(frozen=True)
class SampleSummary:
    median_s: float
    spread_s: float  # interquartile range (p75 - p25), seconds
    count: int

    @property
    def relative_spread(self) -> float:
        return self.spread_s / self.median_s if self.median_s > 0 else float("nan")


@dataclass(frozen=True)
class SpeedComparison:
    ratio: float  # median(commit) / median(baseline); > 1: the commit is slower
    low: float  # the bootstrap interval of the ratio
    high: float
    verdict: SpeedVerdict


def _checked(samples: Sequence[float], which: str) -> np.ndarray:
    values = np.asarray(samples, dtype=np.float64)
    if values.ndim != 1 or values.size < MIN_SAMPLES:
        raise ValueError(f"{which}: need at least {MIN_SAMPLES} timing samples, got {values.size}; "
                         "time the kernel more often (worker/speed/timing.py repeats)")
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError(f"{which}: timing samples must be finite and positive seconds")
    return values


def summarize(samples: Sequence[float]) -> SampleSummary:
    values = _checked(samples, "samples")
    p25, median, p75 = np.percentile(values, [25, 50, 75])
    return SampleSummary(median_s=float(median), spread_s=float(p75 - p25), count=int(values.size))


def compare(commit: Sequence[float], baseline: Sequence[float], *, threshold: float = SLOWDOWN_THRESHOLD,
            confidence: float = CONFIDENCE, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> SpeedComparison:
    """The commit's samples against the baseline's: ratio of medians, its bootstrap interval, verdict."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    new = _checked(commit, "commit samples")
    old = _checked(baseline, "baseline samples")
    rng = np.random.default_rng(seed)
    new_medians = np.median(rng.choice(new, size=(resamples, new.size), replace=True), axis=1)
    old_medians = np.median(rng.choice(old, size=(resamples, old.size), replace=True), axis=1)
    ratios = new_medians / old_medians
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail])
    if low > 1 + threshold:
        verdict: SpeedVerdict = "slower"
    elif high < 1 / (1 + threshold):
        verdict = "faster"
    else:
        verdict = "same"
    return SpeedComparison(ratio=float(np.median(new) / np.median(old)), low=float(low), high=float(high),
                           verdict=verdict)


def worst(verdicts: Sequence[str]) -> str:
    """A run's speed verdict from its kernels': slower > faster > same."""
    for verdict in ("slower", "faster", "same"):
        if verdict in verdicts:
            return verdict
    return "same"
