"""Paired seeds and two controls turned into a verdict: does a commit's optimizer change move the loss?

Inputs are three (K, steps) arrays of per-step training loss, one row per seed (seed k: the same
initial parameters and data order in every array; NaN or inf where a run diverged):

  commit    trained with the commit's optimizer kernels
  baseline  trained with the baseline's
  floor     the baseline again, from initial parameters perturbed by one ulp: how far ANY bit change
            drifts the model by that step (training is chaotic; this is the floor under every change)

Each run is summarised by its windowed loss, the mean of its last `window_for(steps)` steps
(max(10, steps // 10), capped at `steps`): the last step alone moves with the last batch, a window
averages that out and still describes the end of training. The paired differences
d_k = commit_k - baseline_k and f_k = floor_k - baseline_k (windowed) are what the tests compare.

The verdict, first rule that applies:

  identical     commit == baseline, every element (NaN where NaN): the change never reached the loss.
  diverged      the commit's loss is not finite in a seed where the baseline's is. Seeds where the
                baseline (or the floor) diverged too are left out of every figure, and `reason` says so.
  not_judged    fewer than MIN_SEEDS seeds finite on all three sides (a t-interval of 2 seeds has 1
                degree of freedom and is as wide as it is useless).
  within_floor  the commit's differences are not significantly larger than the floor's. Test: an
                exact one-sided permutation test of mean(d^2) against mean(f^2), level alpha. Mean
                squares, not means: a bit change drifts the loss either way, so the question is one
                of magnitude (RMS), and a consistent shift counts as magnitude too. Permutation, not
                an F-test of the two mean squares: with K = 6..16 seeds the chaotic drift's
                distribution is unknown (heavy-tailed at high learning rates), and the permutation
                test is exact for any distribution under the null that the commit's drift is one
                more draw of what a one-ulp change does (d and f exchangeable). All C(2K, K) splits
                of the pooled values are enumerated for K <= EXACT_PERMUTATION_MAX_SEEDS; above that
                RANDOM_SPLITS random splits (a fixed generator: the same losses give the same
                verdict) plus the observed one. p_floor is the share of splits whose
                mean(group1^2) - mean(group2^2) is at least the observed one; beyond the floor when
                p_floor <= alpha. If every f_k is exactly 0 (the floor did not move) and some d_k is
                not, the commit is beyond the floor with p_floor = 0.
  within_noise  beyond the floor, but Welch's two-sample t-test of the commit's windowed losses
  beyond_noise  against the baseline's gives p_noise >= alpha (within) or < alpha (beyond).
                Unpaired on purpose: "within seed noise" means another seed, another data order,
                could explain the shift, so the shift is measured against the spread over seeds,
                not against the (much smaller) spread of the paired differences. The paired
                interval below is still reported, so a consistent shift smaller than the seed
                spread is visible. Welch, not Student: the commit may change the spread too.

False alarms, per test at level alpha (tests/worker/training/test_stats.py measures them):
  - a commit that drifts the loss like a one-ulp change does is called beyond the floor in at most
    alpha of cases (exact: a permutation test's level holds for any distribution);
  - a commit that does not shift the mean loss is called beyond_noise in at most about alpha of
    cases (Welch's t is approximate for normal seeds; the pairing of the two samples makes it
    conservative here, because the shared seed levels enter both samples' spreads but cancel in
    the difference of their means). beyond_noise needs both tests, so its false-alarm rate is at
    most the smaller of the two.

Figures (ImpactStats): the mean paired shift of the windowed loss (and of the last step's) with its
95 % paired t-interval, both also relative to the baseline's mean windowed loss (a fraction), the
seed spread (sample standard deviation over seeds of the baseline's windowed loss), and the RMS of
the floor's and of the commit's paired differences. A figure that could not be measured is None.

Pure numpy and scipy: no torch, no I/O.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, fields
from functools import lru_cache

import numpy as np
from scipy import stats as scipy_stats

VERDICTS = ("identical", "within_floor", "within_noise", "beyond_noise", "diverged", "not_judged")
# The fewest seeds a verdict is drawn from: a paired t-interval needs two degrees of freedom to be
# narrower than the shift it brackets, and a permutation test of 2 x 2 values cannot reach p <= 0.05.
MIN_SEEDS = 3
CONFIDENCE = 0.95
# C(20, 10) = 184756 splits at K = 10 (a few milliseconds); C(24, 12) = 2.7 million would not be.
EXACT_PERMUTATION_MAX_SEEDS = 10
RANDOM_SPLITS = 20000


def window_for(steps: int) -> int:
    """How many of the last steps the windowed loss averages: max(10, steps // 10), capped at steps."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    return min(steps, max(10, steps // 10))


def windowed(losses: np.ndarray, window: int) -> np.ndarray:
    """(K, steps) -> (K,): the mean of each row's last `window` steps."""
    losses = np.asarray(losses, dtype=np.float64)
    if losses.ndim != 2:
        raise ValueError(f"losses must be (seeds, steps), got shape {losses.shape}")
    if not 1 <= window <= losses.shape[1]:
        raise ValueError(f"window must be between 1 and the {losses.shape[1]} steps, got {window}")
    return losses[:, -window:].mean(axis=1)


@dataclass(frozen=True)
class Interval:
    low: float
    high: float


@dataclass(frozen=True)
class ImpactStats:
    verdict: str                           # one of VERDICTS
    seeds: int                             # seeds compared: finite on all three sides
    window: int
    baseline_mean: float | None            # mean over seeds of the baseline's windowed loss
    shift: float | None                    # mean paired difference commit - baseline, windowed loss
    shift_ci: Interval | None              # its 95 % paired t-interval
    relative_shift: float | None           # shift / |baseline_mean| (a fraction)
    relative_ci: Interval | None
    final_shift: float | None              # the same for the last step's loss alone
    final_shift_ci: Interval | None
    seed_spread: float | None              # sample std over seeds of the baseline's windowed loss
    floor_rms: float | None                # RMS over seeds of (floor - baseline), windowed
    change_rms: float | None               # RMS over seeds of (commit - baseline), windowed
    p_floor: float | None                  # one-sided: the commit's differences larger than the floor's
    p_noise: float | None                  # two-sided Welch t-test, commit vs baseline windowed losses
    diverged_commit: int                   # seeds whose commit run has a non-finite loss
    diverged_baseline: int
    reason: str | None                     # why, for not_judged and diverged; seeds left out otherwise

    def as_json(self) -> dict:
        """Plain Python values at full precision (no rounding); None where a figure is absent."""
        out: dict = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Interval):
                value = {"low": float(value.low), "high": float(value.high)}
            elif isinstance(value, (float, np.floating)):
                value = float(value)
            elif isinstance(value, (int, np.integer)):
                value = int(value)
            out[field.name] = value
        return out


@dataclass(frozen=True)
class _Figures:
    """What judge measures on the seeds finite on all three sides."""

    baseline_mean: float
    shift: float
    shift_ci: Interval
    relative_shift: float | None
    relative_ci: Interval | None
    final_shift: float
    final_shift_ci: Interval
    seed_spread: float
    floor_rms: float
    change_rms: float
    p_floor: float
    p_noise: float


def judge(commit: np.ndarray, baseline: np.ndarray, floor: np.ndarray, *, alpha: float = 0.05) -> ImpactStats:
    """The verdict and figures of one model x configuration (the module docstring gives the rules)."""
    commit, baseline, floor = (_losses(name, array) for name, array in
                               (("commit", commit), ("baseline", baseline), ("floor", floor)))
    if not baseline.shape == commit.shape == floor.shape:
        raise ValueError(f"commit, baseline and floor must have the same (seeds, steps) shape, got "
                         f"{commit.shape}, {baseline.shape} and {floor.shape}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be between 0 and 1, got {alpha}")
    seeds_total, steps = baseline.shape
    window = window_for(steps)

    commit_finite = np.isfinite(commit).all(axis=1)
    baseline_finite = np.isfinite(baseline).all(axis=1)
    floor_finite = np.isfinite(floor).all(axis=1)
    usable = commit_finite & baseline_finite & floor_finite
    counts = {"diverged_commit": int((~commit_finite).sum()), "diverged_baseline": int((~baseline_finite).sum())}

    if np.array_equal(commit, baseline, equal_nan=True):
        return _identical(baseline[usable], floor[usable], window, counts)

    commit_only = int((~commit_finite & baseline_finite).sum())
    dropped = _dropped_seeds(baseline_finite, floor_finite, commit_finite)
    if commit_only:
        verdict = "diverged"
        reason = (f"the commit's loss is not finite in {commit_only} of {int(baseline_finite.sum())} seeds "
                  f"where the baseline's is")
    elif usable.sum() < MIN_SEEDS:
        verdict = "not_judged"
        reason = (f"only {int(usable.sum())} of {seeds_total} seeds have a finite loss on the commit, the "
                  f"baseline and the one-ulp floor; at least {MIN_SEEDS} are needed (train more seeds, or a "
                  f"configuration that does not diverge)")
    else:
        verdict, reason = None, dropped

    figures = (_measure(commit[usable], baseline[usable], floor[usable], window)
               if usable.sum() >= MIN_SEEDS else None)
    if verdict is None:
        if figures.p_floor > alpha:
            verdict = "within_floor"
        elif figures.p_noise < alpha:
            verdict = "beyond_noise"
        else:
            verdict = "within_noise"
    return ImpactStats(verdict=verdict, seeds=int(usable.sum()), window=window, **_figure_fields(figures),
                       **counts, reason=reason)


def _losses(name: str, array: np.ndarray) -> np.ndarray:
    losses = np.asarray(array, dtype=np.float64)
    if losses.ndim != 2 or losses.shape[0] < 1 or losses.shape[1] < 1:
        raise ValueError(f"{name} must be a (seeds, steps) array of per-step losses, got shape {losses.shape}")
    return losses


def _dropped_seeds(baseline_finite: np.ndarray, floor_finite: np.ndarray, commit_finite: np.ndarray) -> str | None:
    total = baseline_finite.size
    parts = []
    if (~baseline_finite).any():
        parts.append(f"the baseline's loss is not finite in {int((~baseline_finite).sum())} of {total} seeds")
    floor_only = ~floor_finite & baseline_finite & commit_finite
    if floor_only.any():
        parts.append(f"the one-ulp floor's loss is not finite in {int(floor_only.sum())} more")
    if not parts:
        return None
    return "; ".join(parts) + "; those seeds are left out of the comparison"


def _identical(baseline: np.ndarray, floor: np.ndarray, window: int, counts: dict) -> ImpactStats:
    seeds = baseline.shape[0]
    zero = Interval(0.0, 0.0)
    baseline_w = windowed(baseline, window) if seeds else np.empty(0)
    floor_rms = _rms(windowed(floor, window) - baseline_w) if seeds else None
    return ImpactStats(verdict="identical", seeds=seeds, window=window,
                       baseline_mean=float(baseline_w.mean()) if seeds else None,
                       shift=0.0, shift_ci=zero, relative_shift=0.0, relative_ci=zero,
                       final_shift=0.0, final_shift_ci=zero,
                       seed_spread=float(baseline_w.std(ddof=1)) if seeds >= 2 else None,
                       floor_rms=floor_rms, change_rms=0.0, p_floor=None, p_noise=None,
                       **counts, reason=None)


def _measure(commit: np.ndarray, baseline: np.ndarray, floor: np.ndarray, window: int) -> _Figures:
    commit_w, baseline_w, floor_w = (windowed(losses, window) for losses in (commit, baseline, floor))
    change = commit_w - baseline_w
    drift = floor_w - baseline_w
    shift, shift_ci = _paired_interval(change)
    final_shift, final_shift_ci = _paired_interval(commit[:, -1] - baseline[:, -1])
    baseline_mean = float(baseline_w.mean())
    scale = abs(baseline_mean)
    relative_shift = shift / scale if scale > 0 else None
    relative_ci = Interval(shift_ci.low / scale, shift_ci.high / scale) if scale > 0 else None
    return _Figures(baseline_mean=baseline_mean, shift=shift, shift_ci=shift_ci,
                    relative_shift=relative_shift, relative_ci=relative_ci,
                    final_shift=final_shift, final_shift_ci=final_shift_ci,
                    seed_spread=float(baseline_w.std(ddof=1)),
                    floor_rms=_rms(drift), change_rms=_rms(change),
                    p_floor=floor_p_value(change, drift), p_noise=_welch_p(commit_w, baseline_w))


def _figure_fields(figures: _Figures | None) -> dict:
    names = [field.name for field in fields(_Figures)]
    if figures is None:
        return dict.fromkeys(names)
    return {name: getattr(figures, name) for name in names}


def _rms(values: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(values))))


@lru_cache(maxsize=64)
def _t_quantile(degrees_of_freedom: int) -> float:
    return float(scipy_stats.t.ppf(0.5 + CONFIDENCE / 2, degrees_of_freedom))


def _paired_interval(differences: np.ndarray) -> tuple[float, Interval]:
    """The mean of `differences` and its CONFIDENCE t-interval (one value per seed)."""
    mean = float(differences.mean())
    if np.all(differences == differences[0]):
        # No spread to estimate; the sample mean of equal values may be an ulp off them.
        return mean, Interval(mean, mean)
    seeds = differences.size
    half_width = _t_quantile(seeds - 1) * float(differences.std(ddof=1)) / math.sqrt(seeds)
    return mean, Interval(mean - half_width, mean + half_width)


def _welch_p(commit_w: np.ndarray, baseline_w: np.ndarray) -> float:
    if commit_w.std() == 0 and baseline_w.std() == 0:
        # Welch's statistic is 0 / 0 with no spread on either side; with no seed noise at all, any
        # difference of the means is beyond it.
        return 1.0 if commit_w.mean() == baseline_w.mean() else 0.0
    return float(scipy_stats.ttest_ind(commit_w, baseline_w, equal_var=False).pvalue)


def _membership(chosen: np.ndarray, seeds: int) -> np.ndarray:
    """One row per split, 1.0 at the pooled positions of its first group: a split's group sum is
    then one row of a matrix-vector product (a tenth of the time of gathering by index)."""
    membership = np.zeros((chosen.shape[0], 2 * seeds))
    np.put_along_axis(membership, chosen.astype(np.intp), 1.0, axis=1)
    membership.setflags(write=False)  # cached: shared by every call
    return membership


@lru_cache(maxsize=EXACT_PERMUTATION_MAX_SEEDS)
def _all_splits(seeds: int) -> np.ndarray:
    """Every choice of `seeds` of the 2 * seeds pooled positions (30 MB at the largest, K = 10)."""
    count = math.comb(2 * seeds, seeds)
    chosen = itertools.chain.from_iterable(itertools.combinations(range(2 * seeds), seeds))
    return _membership(np.fromiter(chosen, dtype=np.int8, count=count * seeds).reshape(count, seeds), seeds)


@lru_cache(maxsize=4)
def _random_splits(seeds: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return _membership(np.argsort(rng.random((RANDOM_SPLITS, 2 * seeds)), axis=1)[:, :seeds], seeds)


def floor_p_value(change: np.ndarray, drift: np.ndarray) -> float:
    """One-sided permutation p-value: are the commit's paired differences (`change`, one per seed)
    larger in mean square than the one-ulp floor's (`drift`)? The share of splits of the pooled
    values into two groups of K whose mean(group1^2) - mean(group2^2) is at least the observed."""
    change = np.asarray(change, dtype=np.float64)
    drift = np.asarray(drift, dtype=np.float64)
    if change.shape != drift.shape or change.ndim != 1:
        raise ValueError(f"change and drift must be two vectors of one value per seed, got {change.shape} "
                         f"and {drift.shape}")
    if not drift.any() and change.any():
        return 0.0
    seeds = change.size
    squares = np.concatenate([change, drift]) ** 2
    total = float(squares.sum())
    if seeds <= EXACT_PERMUTATION_MAX_SEEDS:
        splits = _all_splits(seeds)
        extra = 0
    else:
        splits = _random_splits(seeds)
        extra = 1  # the observed split, counted with the random ones so p is never 0
    # mean(g1^2) - mean(g2^2) = (2 * sum(g1^2) - total) / K, increasing in sum(g1^2): compare sums.
    group_sums = splits @ squares
    observed = float(squares[:seeds].sum())
    # The observed split's own sum, added in another order, may come out an ulp below `observed`;
    # a relative margin far under any real difference keeps it (and exact ties) counted.
    margin = 1e-12 * total
    at_least = int(np.count_nonzero(group_sums >= observed - margin)) + extra
    return at_least / (splits.shape[0] + extra)
