"""service/core/ulp_bounds.py: the ulps two runs are apart, bounded from below by what each stored
alone. The claim is an inequality, so it is tested as one: over random float32 and bfloat16
parameters beside a shared float64 reference, the bound never exceeds the real largest per-element
gap in ulps (measured element by element, as nothing in the service can), and it reaches that gap
where the most-wrong element is the one that moved."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.core.ulp_bounds import EPSILON, ulps_at_least, why_no_bound

FLOOR = 2.0 ** -126          # worker/engine/trajectory.py RELATIVE_ERROR_FLOOR
MANTISSA = {"float32": 23, "bfloat16": 7}


def _round(x: float, dtype: str) -> float:
    """x rounded to the dtype (bfloat16: float32 with its low 16 bits cut, round to nearest even)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    if dtype == "bfloat16":
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _ulp(r: float, dtype: str) -> float:
    """The dtype's ulp at the reference's magnitude (below the smallest normal: the subnormals' ulp)."""
    exponent = max(math.floor(math.log2(abs(r))), -126) if r else -126
    return 2.0 ** (exponent - MANTISSA[dtype])


def _relative_error(params: list[float], reference: list[float]) -> float:
    """What a run stores per step: max |p - r| / max(|r|, 2**-126), in float64."""
    return max(abs(p - r) / max(abs(r), FLOOR) for p, r in zip(params, reference))


magnitudes = st.floats(min_value=1e-40, max_value=1e6, allow_nan=False, allow_infinity=False)
signed = st.tuples(magnitudes, st.booleans()).map(lambda t: -t[0] if t[1] else t[0])


@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from(["float32", "bfloat16"]),
       steps=st.lists(st.lists(st.tuples(signed, st.integers(-40, 40), st.integers(-40, 40)), min_size=1, max_size=6),
                      min_size=1, max_size=5))
def test_the_bound_never_exceeds_the_real_gap_in_ulps(dtype: str, steps: list) -> None:
    """Per step, two runs' parameters a few ulps either side of one float64 reference; the bound
    over the steps is at most the largest per-element gap in ulps at any step. Tolerance: 1e-9
    relative, the float64 roundings of the stored errors' difference (the gaps are under 2**7 ulps)."""
    rel_a, rel_b, real = [], [], 0.0
    for elements in steps:
        reference = [r for r, _da, _db in elements]
        a = [_round(r, dtype) + da * _ulp(r, dtype) for r, da, _db in elements]
        b = [_round(r, dtype) + db * _ulp(r, dtype) for r, _da, db in elements]
        rel_a.append(_relative_error(a, reference))
        rel_b.append(_relative_error(b, reference))
        real = max(real, max(abs(x - y) / _ulp(r, dtype) for x, y, r in zip(a, b, reference)))
    bound = ulps_at_least(rel_a, rel_b, dtype)
    assert bound is not None
    assert bound.ulps <= real * (1 + 1e-9) + 1e-9, (bound, real)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("r", "reads"), [(2.0 ** -3, 5.0), (0.75 * 2.0 ** -3, 5 / 1.5)])
def test_the_bound_reaches_the_gap_where_the_moved_element_is_the_most_wrong(dtype: str, r: float,
                                                                           reads: float) -> None:
    """One element, one ulp from its reference, moved to six ulps at step 3: the bound is found at
    step 3 and is the 5-ulp move measured in eps·|r|. At a power of two that is the ulp itself (5);
    at 0.75·2**-3 the ulp is eps·2**-4, two thirds of eps·|r|, so it reads 5/1.5: within the factor
    of two the bound's docstring gives, never above 5. Exact: every quantity is a power of two times
    a small integer."""
    ulp = _ulp(r, dtype)
    rel_a = [_relative_error([r + ulp], [r])] * 4
    rel_b = rel_a[:2] + [_relative_error([r + 6 * ulp], [r])] + rel_a[3:]
    bound = ulps_at_least(rel_a, rel_b, dtype)
    assert bound.step == 3
    assert bound.ulps == pytest.approx(reads, rel=1e-12)


def test_steps_that_are_not_finite_bound_nothing_and_float16_has_no_bound() -> None:
    bound = ulps_at_least([1e-7, math.nan, 2e-7], [1e-7, 1.0, 2e-7 + 4 * EPSILON["float32"]], "float32")
    assert bound.step == 3 and bound.ulps == pytest.approx(4, rel=1e-9)
    same = ulps_at_least([1e-7, 2e-7], [1e-7, 2e-7], "float32")
    assert (same.ulps, same.step) == (0.0, None)
    assert ulps_at_least([0.0], [1.0], "float16") is None
    assert "float16" in why_no_bound("float16") and why_no_bound("float32") is None
