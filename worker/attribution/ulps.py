"""Units in the last place of float32, float16 and bfloat16 values, numpy only.

Parameters reach the attribution as float32 (the co-run's files; exact for all three dtypes), so
every function here takes float32 arrays and the dtype the values really have:

* `ulp(x, dtype)`: the gap between |x| and the next larger magnitude representable in `dtype`
  (numpy's `spacing` convention: at a power of two it is the gap *above*, the larger one). Zero and
  subnormals have the smallest subnormal gap; non-finite values have none (NaN).
* `ulp_distance(a, b, dtype)`: how many representable values of `dtype` lie between a and b, counted
  on the ordered integer encoding of the bits, so a step across a binade boundary or across zero
  counts exactly (+0 and -0 are the same place). Used for equal-dtype values only.
"""

from __future__ import annotations

import numpy as np

# Explicit significand bits (without the implicit one), smallest normal exponent, and bits in all.
_FORMATS = {"float32": (23, -126, 32), "float16": (10, -14, 16), "bfloat16": (7, -126, 16)}


def _format(dtype: str) -> tuple[int, int, int]:
    try:
        return _FORMATS[dtype]
    except KeyError:
        raise ValueError(f"ulps: unknown parameter dtype {dtype!r}; expected one of {sorted(_FORMATS)}") from None


def ulp(x: np.ndarray | float, dtype: str) -> np.ndarray:
    """float64 array: the spacing of `dtype` at |x| (see the module doc)."""
    mantissa_bits, min_exponent, _ = _format(dtype)
    magnitude = np.abs(np.asarray(x, dtype=np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        # frexp: magnitude = f * 2**e with f in [0.5, 1), so the binade's exponent is e - 1.
        _, exponent = np.frexp(magnitude)
    binade = np.where(magnitude > 0, np.maximum(exponent.astype(np.int64) - 1, min_exponent), min_exponent)
    spacing = np.ldexp(1.0, binade - mantissa_bits)
    return np.where(np.isfinite(magnitude), spacing, np.nan)


def _ordered(values: np.ndarray, dtype: str) -> np.ndarray:
    """int64 ranks of the values in `dtype`: consecutive representable values differ by 1."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "float32":
        bits = values.view(np.int32).astype(np.int64)
        sign_bit = 1 << 31
    elif dtype == "float16":
        bits = values.astype(np.float16).view(np.int16).astype(np.int64)  # exact: they are float16 values
        sign_bit = 1 << 15
    else:
        bits = (values.view(np.int32) >> 16).astype(np.int64)  # bfloat16 is float32's upper half
        sign_bit = 1 << 15
    # Two's complement view of sign-magnitude: negatives count down from zero.
    magnitude = bits & (sign_bit - 1)
    return np.where(bits < 0, -magnitude, magnitude)


def ulp_distance(a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    """int64 array: representable `dtype` values between a and b, elementwise (0 when equal)."""
    _format(dtype)
    return np.abs(_ordered(a, dtype) - _ordered(b, dtype))


def check_representable(values: np.ndarray, dtype: str) -> None:
    """Raise if `values` (float32) are not all exactly `dtype` values: their ranks would be wrong."""
    values = np.asarray(values, dtype=np.float32)
    if dtype == "float16":
        exact = values.astype(np.float16).astype(np.float32)
    elif dtype == "bfloat16":
        exact = (values.view(np.int32) & ~0xFFFF).view(np.float32)
    else:
        return
    same = (exact == values) | (np.isnan(exact) & np.isnan(values))
    if not same.all():
        raise ValueError(f"ulps: {int((~same).sum())} values are not exact {dtype} values; "
                         "pass the dtype the parameters were stored in")
