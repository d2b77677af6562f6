"""worker.attribution.ulps on constructed values at the float32 / float16 / bfloat16 boundaries:
exact integer ulp counts, so every assertion is equality (no tolerance)."""

from __future__ import annotations

import numpy as np
import pytest

from worker.attribution.ulps import check_representable, ulp, ulp_distance

F32_MIN_SUBNORMAL = 2.0 ** -149
F16_MIN_SUBNORMAL = 2.0 ** -24
BF16_MIN_SUBNORMAL = 2.0 ** -133


@pytest.mark.parametrize("dtype, values, expected", [
    # float32: 1 has 2^-23 above it; at 2 the gap above doubles; zero and subnormals: the smallest gap.
    ("float32", [1.0, 2.0, np.nextafter(np.float32(2), np.float32(0)), 0.0, F32_MIN_SUBNORMAL, 2.0 ** -126, -3.0],
     [2.0 ** -23, 2.0 ** -22, 2.0 ** -23, F32_MIN_SUBNORMAL, F32_MIN_SUBNORMAL, 2.0 ** -149, 2.0 ** -22]),
    # float16: 10 significand bits; the largest finite (65504) sits in the 2^15 binade, gap 32.
    ("float16", [1.0, 2.0, 65504.0, 0.0, F16_MIN_SUBNORMAL, 2.0 ** -14], [2.0 ** -10, 2.0 ** -9, 32.0,
                                                                           F16_MIN_SUBNORMAL, F16_MIN_SUBNORMAL,
                                                                           F16_MIN_SUBNORMAL]),
    # bfloat16: 7 significand bits, float32's exponent range.
    ("bfloat16", [1.0, 256.0, 0.0, 2.0 ** -126], [2.0 ** -7, 2.0, BF16_MIN_SUBNORMAL, BF16_MIN_SUBNORMAL]),
])
def test_ulp_is_the_gap_above_the_magnitude(dtype, values, expected):  # noqa: ANN001
    assert ulp(np.array(values, dtype=np.float64), dtype).tolist() == expected


def test_ulp_of_float32_matches_numpy_spacing_across_binades():
    values = np.float32([1e-40, 1e-30, 0.1, 1.0, 3.0, 1e10, 3e38])
    assert ulp(values, "float32").tolist() == np.spacing(values).astype(np.float64).tolist()
    assert np.isnan(ulp(np.array([np.inf, np.nan]), "float32")).all()


def _up(x: float, dtype: type, n: int = 1) -> np.float32:
    value = dtype(x)
    for _ in range(n):
        value = np.nextafter(value, dtype(np.inf))
    return np.float32(value)


def test_ulp_distance_counts_representable_values_across_binades_and_zero():
    one = np.float32(1.0)
    below_two = np.nextafter(np.float32(2), np.float32(0))
    # float32: one step across the binade boundary at 2 is one ulp; -min and +min are two apart (0 between).
    assert ulp_distance(np.float32([below_two, one, -F32_MIN_SUBNORMAL, 0.0]),
                        np.float32([2.0, _up(1.0, np.float32, 5), F32_MIN_SUBNORMAL, -0.0]), "float32").tolist() \
        == [1, 5, 2, 0]
    # float16 values held in float32 (as the co-run files hold them): counted in float16 steps.
    assert ulp_distance(np.float32([1.0, np.float16(-F16_MIN_SUBNORMAL)]),
                        np.float32([_up(1.0, np.float16, 3), np.float16(F16_MIN_SUBNORMAL)]), "float16").tolist() \
        == [3, 2]
    # bfloat16: 1 + 2^-7 is the next value after 1; 2^-126 to 2 * 2^-126 is 2^7 steps.
    assert ulp_distance(np.float32([1.0, 2.0 ** -126]), np.float32([1.0 + 2.0 ** -7, 2.0 ** -125]),
                        "bfloat16").tolist() == [1, 128]


def test_bad_dtype_and_unrepresentable_values_are_refused():
    with pytest.raises(ValueError, match="unknown parameter dtype 'float64'"):
        ulp(1.0, "float64")
    with pytest.raises(ValueError, match="not exact bfloat16"):
        check_representable(np.float32([1.0 + 2.0 ** -10]), "bfloat16")
    check_representable(np.float32([1.0 + 2.0 ** -7, np.nan]), "bfloat16")
