"""The dynamic quantization maps of the 8-bit blockwise optimizers, built from their definition.

An 8-bit state element is stored as a code, an index into a sorted table of 256 float32 values in
[-1, 1] (the map); the element's value is `map[code] * absmax`, where absmax is the largest |value|
of its block of 256 elements. The kernels take the map as a tensor argument, so it is data: this
module is where it comes from.

The "dynamic" map (the convention bitsandbytes uses for its 8-bit optimizers) reads a code's bits
as a small floating-point number with a decimal exponent:

    signed map:   [sign] [z zero bits] [1] [6 - z fraction bits]      z = 0 .. 6
    unsigned map:        [z zero bits] [1] [7 - z fraction bits]      z = 0 .. 6

* The run of z zero bits is the exponent: the value's scale is 10**-z, so the 7 decades from 1 down
  to 1e-6 are covered, and each decade below gets half the codes of the one above it, because
  every extra zero bit of exponent costs one fraction bit.
* The single 1 bit ends the run (an indicator, as in a unary code).
* The f fraction bits pick one of 2**f equal slices of [0.1, 1]; the value is the slice's
  midpoint, 0.1 + 0.9 * (k + 1/2) / 2**f for fraction k, times 10**-z.

So decade z holds 2**(6-z) magnitudes (signed) or 2**(7-z) (unsigned): 1 + 2 + ... + 64 = 127
magnitudes with each sign, or 2 + 4 + ... + 128 = 254 non-negative values. The two bit patterns the
formula leaves over (signed: the all-zero magnitude with either sign; unsigned: the patterns with
seven and eight leading zeros) are given to the two values a blockwise scheme needs exactly:
0, so that a fresh (zero) state is represented exactly, and 1, so that a block's absmax element
with a positive sign is. The signed map therefore is symmetric apart from one extra code, +1
(there is no -1: a block whose largest element is negative stores it as -0.99296875·absmax, within
half a code gap).

Values are computed in float64 and rounded to float32 once; the codes the kernels use are indices
into the sorted table, so only the sorted values matter, not which bit pattern produced which one.
(bitsandbytes computes the same table partly in float32; individual entries may differ from it in
the last bit, which is why the map travels as data with every kernel call.)
"""

from __future__ import annotations

import weakref
from functools import lru_cache

import torch

MAP_SIZE = 256
BLOCK_SIZE = 256
DECADES = 7  # exponents z = 0 .. 6: magnitudes from ~1 down to ~1e-6


def dynamic_map_values(*, signed: bool) -> list[float]:
    """The map's 256 values in float64, sorted ascending (see the module docstring)."""
    fraction_bits_at_z0 = 6 if signed else 7
    magnitudes: list[float] = []
    for zeros in range(DECADES):
        slices = 2 ** (fraction_bits_at_z0 - zeros)
        scale = 10.0 ** -zeros
        magnitudes += [scale * (0.1 + 0.9 * (k + 0.5) / slices) for k in range(slices)]
    values = magnitudes + ([-m for m in magnitudes] if signed else [])
    values += [0.0, 1.0]
    if len(values) != MAP_SIZE:  # the definition above fills exactly 2**8 codes
        raise AssertionError(f"dynamic map has {len(values)} values, expected {MAP_SIZE}")
    return sorted(values)


@lru_cache(maxsize=None)
def _dynamic_map_cpu(signed: bool) -> torch.Tensor:
    return torch.tensor(dynamic_map_values(signed=signed), dtype=torch.float64).to(torch.float32)


def dynamic_map(*, signed: bool, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256-entry float32 map as a tensor on `device` (a fresh tensor each call)."""
    return _dynamic_map_cpu(signed).clone().to(device)


# id(map tensor) -> (a weak reference to it, its version counter when read, its zero code).
# Reading the code of a GPU map waits for the device; a battery makes ~800 8-bit states from the
# same two maps, so each map is read once while it is unchanged (an in-place write bumps the
# version, and it is read again). Entries of maps that are gone are dropped as the table grows.
_zero_codes: dict[int, tuple[weakref.ref, int, int]] = {}


def zero_code(qmap: torch.Tensor) -> int:
    """The code whose value is exactly 0: what a fresh state's codes are filled with."""
    entry = _zero_codes.get(id(qmap))
    if entry is not None and entry[0]() is qmap and entry[1] == qmap._version:
        return entry[2]
    hits = (qmap == 0).nonzero().flatten().tolist()
    if len(hits) != 1:
        raise ValueError(f"a quantization map must contain exactly one 0, this one has {len(hits)}")
    if len(_zero_codes) >= 64:
        for key in [key for key, (ref, _, _) in _zero_codes.items() if ref() is None]:
            del _zero_codes[key]
    _zero_codes[id(qmap)] = (weakref.ref(qmap), qmap._version, int(hits[0]))
    return int(hits[0])


def num_blocks(numel: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks of `block_size` covering `numel` elements; the last one may be partial."""
    return (numel + block_size - 1) // block_size


def new_state(numel: int, qmap: torch.Tensor, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """A zero state: (uint8 codes all pointing at 0, float32 absmax of zeros, one per block)."""
    codes = torch.full((numel,), zero_code(qmap), dtype=torch.uint8, device=device)
    absmax = torch.zeros(num_blocks(numel), dtype=torch.float32, device=device)
    return codes, absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor,
               block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """code -> map[code] * absmax[block], in the map's dtype (float64 map -> float64 values)."""
    per_element_absmax = absmax.to(qmap.dtype).repeat_interleave(block_size)[: codes.numel()]
    return qmap[codes.long().reshape(-1)] * per_element_absmax
