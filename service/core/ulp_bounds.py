"""How many ulps two runs of one case are apart, from what each run stored on its own: a lower
bound, so any two releases can be compared in ulps without running them side by side.

Each run stores, per step t, e(t) = max_i |p_i - r_i| / max(|r_i|, 2**-126) against the float64
reference r (worker/engine/trajectory.py, `ref64_max_rel`). The reference is the same for both runs
when their references' digests are equal (the same case, the same torch.optim and float64 rules), so
for two runs a and b, by the reverse triangle inequality in the max norm,

    |e_a(t) - e_b(t)|  <=  max_i |p_a,i - p_b,i| / max(|r_i|, 2**-126).

In float32 and bfloat16 an element's ulp at r_i is at most eps · max(|r_i|, 2**-126) (eps = 2**-23
or 2**-7; below 2**-126 the ulp is that of the smallest normal, eps · 2**-126). So
|e_a(t) - e_b(t)| / eps is at most the largest per-element gap measured in ulps at the reference's
magnitude: the two runs are at least that many ulps apart at step t. It can be 0 while the runs
differ (their largest errors may be equally large), never more than the real gap.

float16 has no such bound: its smallest normal is 2**-14, so below it its ulp (2**-24) is coarser
than eps · max(|r|, 2**-126), and a gap of one ulp there could read as hundreds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Machine epsilon (the ulp of 1.0) of the parameter dtypes for which the bound holds.
EPSILON: dict[str, float] = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float64": 2.0 ** -52}
NO_BOUND = {"float16": "no ulp bound for float16 (its subnormals' ulp is coarser than the stored "
                       "relative error's floor)"}


@dataclass(frozen=True)
class UlpBound:
    ulps: float        # the largest lower bound over the steps both runs reached with finite errors
    step: int | None   # 1-based step where it is largest; None when no step differs


def ulps_at_least(relative_a: Sequence[float], relative_b: Sequence[float], dtype: str) -> UlpBound | None:
    """The lower bound above over every step two runs share; None where the dtype has no bound.
    Steps where either error is not finite (a NaN, an overflow) are left out: they bound nothing."""
    eps = EPSILON.get(dtype)
    if eps is None:
        return None
    best, where = 0.0, None
    for step, (a, b) in enumerate(zip(relative_a, relative_b), start=1):
        if not (math.isfinite(a) and math.isfinite(b)):
            continue
        gap = abs(a - b) / eps
        if gap > best:
            best, where = gap, step
    return UlpBound(ulps=best, step=where)


def why_no_bound(dtype: str) -> str | None:
    """Why a dtype has no ulp bound (None where it has one)."""
    if dtype in EPSILON:
        return None
    return NO_BOUND.get(dtype, f"no ulp bound for the parameter dtype {dtype}")
