"""State families as data (issue 37): what a case's optimizer state is, and how it is judged.

A case claims one family (CaseSpec.family). Each family here names its label, how its states are
stored (dtype, bits, block size), its quantization step (the spacing of the values a state can
hold: `quantization_step`), the reference it is judged against, and the battery group that
exercises it. Everything that used to name "32bit" / "8bit_blockwise" reads this table: the result
models' KernelFamily (service.core.results, checked equal to `FAMILY_NAMES` by
tests/service/core/test_families.py), the case-id parser (service.core.verdicts.case_scale), the
adapters' declarations (worker.adapters.*), and the direction of quantized cases, which is judged
in units of the quantization step against the quantization-aware float64 reference
(worker.references.blockwise_quant, service.core.verdicts).

Stored values stay as they were: rows say "32bit" or "8bit_blockwise", names that never change.
Pure: no torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Reference = Literal["float64", "quantization_aware_float64"]
Quantizer = Literal["none", "blockwise_absmax", "fp8"]


@dataclass(frozen=True)
class StateFamily:
    name: str  # the stored value (CaseSpec.family); never renamed
    label: str  # what the surfaces show
    state_dtype: str  # the dtype the state's values are stored in
    bits: int  # bits per stored state value
    quantizer: Quantizer
    block_size: int | None  # blockwise families: the elements sharing one scale (the library's default)
    reference: Reference  # float64: torch.optim in float64; quantization-aware: float64 with the
    # states requantized every step as the family stores them (worker.references.blockwise_quant)
    battery_group: str  # the battery group name that exercises it (worker.battery)
    mantissa_bits: int | None = None  # fp8 only: explicit mantissa bits
    min_normal_exponent: int | None = None  # fp8 only: the smallest normal exponent
    paged: bool = False  # states may live in host memory (paged / offloaded); same numerics

    @property
    def quantized(self) -> bool:
        return self.quantizer != "none"

    @property
    def levels(self) -> int | None:
        """Blockwise: the code steps between 0 and the block's absmax (signed states use one bit
        for the sign: 2**(bits-1) - 1 of them)."""
        return 2 ** (self.bits - 1) - 1 if self.quantizer == "blockwise_absmax" else None


def _blockwise(name: str, label: str, bits: int, block_size: int, group: str, paged: bool = False) -> StateFamily:
    return StateFamily(name, label, "uint8", bits, "blockwise_absmax", block_size, "quantization_aware_float64",
                       group, paged=paged)


FAMILIES: dict[str, StateFamily] = {f.name: f for f in (
    StateFamily("32bit", "32-bit", "float32", 32, "none", None, "float64", "32bit"),
    _blockwise("8bit_blockwise", "8-bit blockwise", 8, 256, "8bit"),
    _blockwise("4bit_blockwise", "4-bit blockwise", 4, 128, "4bit"),
    StateFamily("fp8_e4m3", "FP8 (e4m3)", "float8_e4m3fn", 8, "fp8", None, "quantization_aware_float64", "fp8",
                mantissa_bits=3, min_normal_exponent=-6),
    StateFamily("fp8_e5m2", "FP8 (e5m2)", "float8_e5m2", 8, "fp8", None, "quantization_aware_float64", "fp8",
                mantissa_bits=2, min_normal_exponent=-14),
    _blockwise("paged_8bit_blockwise", "8-bit blockwise, paged", 8, 256, "8bit", paged=True),
)}
FAMILY_NAMES: tuple[str, ...] = tuple(FAMILIES)
QUANTIZED: frozenset[str] = frozenset(name for name, f in FAMILIES.items() if f.quantized)


def family(name: str) -> StateFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"no state family {name!r} (known: {', '.join(FAMILY_NAMES)})") from None


def label(name: str | None) -> str:
    """The family's label; an unknown or missing one is shown as it was stored."""
    return FAMILIES[name].label if name in FAMILIES else (name or "unknown family")


def quantization_step(name: str, magnitude: float) -> float:
    """The spacing of the values a state of family `name` can hold near `magnitude`:
    blockwise: the block's absmax over its code steps (linear codes; a non-linear map such as
    bitsandbytes' dynamic one is finer near 0, so this is its coarsest step, the conservative
    unit); fp8: one ulp of the format at `magnitude` (its subnormal spacing below the smallest
    normal); 32bit: one float32 ulp. `magnitude` is the block's absmax for blockwise families and
    the value itself otherwise."""
    f = family(name)
    magnitude = abs(magnitude)
    if f.quantizer == "blockwise_absmax":
        return magnitude / f.levels
    mantissa, min_exponent = (f.mantissa_bits, f.min_normal_exponent) if f.quantizer == "fp8" else (23, -126)
    exponent = max(math.frexp(magnitude)[1] - 1 if magnitude > 0 else min_exponent, min_exponent)
    return math.ldexp(1.0, exponent - mantissa)
