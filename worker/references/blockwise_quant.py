"""The quantization-aware float64 reference of a blockwise low-bit optimizer, and the distance of a
kernel's states to it in quantization steps (issue 37: direction for quantized states).

Generalised from worker.references.blockwise8 (bitsandbytes' dynamic map, one step, with error
bounds) to any blockwise-absmax family of service.core.families: the algorithm runs in float64 and
its states are requantized after every step exactly as the family stores them (`Codec`), so the
reference carries the quantization a correct implementation must carry, and nothing else. Against
torch.optim in float64 a quantized case's distance is its quantization error, which swamps any
commit's move; against this reference a correct float32 implementation differs only where a value
lies within float32 rounding of a code boundary (a few elements, one code), so a commit that moves
the states, e.g. by rounding codes down, shows as a shift of about half a step on every element.

`state_steps` is that figure: the mean over the states' elements of |kernel − reference| divided
by the reference block's quantization step, in the stored domain (where codes are linear). The
service judges direction on it (service.core.verdicts, QUANT_STEP_MARGIN), the figure recorded per
step in Trajectory.quant_ref_steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from service.core.families import family as state_family


@dataclass(frozen=True)
class Codec:
    """How a library stores a blockwise state: `block_size` elements per absmax scale, signed
    states on codes -levels..levels, unsigned ones on 0..unsigned_levels, unsigned states stored as
    their square root when `sqrt_unsigned` (torchao's and the fixture's second moment)."""

    block_size: int
    levels: int
    unsigned_levels: int
    sqrt_unsigned: bool = True

    @classmethod
    def for_family(cls, name: str, block_size: int | None = None, sqrt_unsigned: bool = True) -> "Codec":
        f = state_family(name)
        if f.quantizer != "blockwise_absmax":
            raise ValueError(f"{name} is not a blockwise-absmax family")
        return cls(block_size or f.block_size, f.levels, 2 ** f.bits - 1, sqrt_unsigned)

    def stored(self, values: torch.Tensor, signed: bool) -> torch.Tensor:
        """The values in the domain the codes are linear in, as (blocks, block_size)."""
        blocks = values.reshape(-1, self.block_size)
        return blocks if signed or not self.sqrt_unsigned else blocks.clamp_min(0).sqrt()

    def step(self, values: torch.Tensor, signed: bool) -> torch.Tensor:
        """Per block (blocks, 1): the quantization step, the block's absmax over its code steps."""
        return self.stored(values, signed).abs().amax(dim=1, keepdim=True) / (self.levels if signed
                                                                              else self.unsigned_levels)

    def roundtrip(self, values: torch.Tensor, signed: bool) -> torch.Tensor:
        """Quantize to nearest and dequantize, in the values' dtype (float64 for the reference)."""
        stored, step = self.stored(values, signed), self.step(values, signed)
        safe = torch.where(step > 0, step, torch.ones_like(step))
        back = torch.round(stored / safe) * safe
        if not signed and self.sqrt_unsigned:
            back = back * back
        return back.reshape(values.shape)


class QuantAwareAdamW:
    """AdamW in float64 with both moments requantized by `codec` after every step (None: never,
    the plain float64 reference); the parameter is updated from the unquantized moments (torchao's
    order: the state's quantization shows in the next step)."""

    def __init__(self, param: torch.Tensor, codec: Codec | None, *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float) -> None:
        self.p = param.detach().to(torch.float64).clone()
        self.m, self.v = torch.zeros_like(self.p), torch.zeros_like(self.p)
        self.codec, self.lr, self.betas, self.eps, self.wd, self.t = codec, lr, betas, eps, weight_decay, 0

    def step(self, grad: torch.Tensor) -> None:
        b1, b2 = self.betas
        g = grad.to(torch.float64)
        self.t += 1
        self.p.mul_(1 - self.lr * self.wd)
        m, v = self.m * b1 + (1 - b1) * g, self.v * b2 + (1 - b2) * g * g
        denom = v.sqrt() / math.sqrt(1 - b2 ** self.t) + self.eps
        self.p.sub_(self.lr / (1 - b1 ** self.t) * m / denom)
        if self.codec is None:  # the unquantized float64 reference (torch.optim's AdamW in float64)
            self.m, self.v = m, v
        else:
            self.m, self.v = self.codec.roundtrip(m, signed=True), self.codec.roundtrip(v, signed=False)

    def states(self) -> dict[str, torch.Tensor]:
        return {"exp_avg": self.m, "exp_avg_sq": self.v}


def state_steps(kernel: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], codec: Codec) -> float:
    """Mean over every element of the named states of |kernel − reference| in the stored domain,
    in units of the reference block's quantization step (a zero block's step is taken as 1: both
    sides are 0 there in a correct run)."""
    total, count = 0.0, 0
    for name, ref in reference.items():
        signed = name == "exp_avg"
        step = codec.step(ref, signed)
        step = torch.where(step > 0, step, torch.ones_like(step))
        mine = codec.stored(kernel[name].to(torch.float64), signed)
        total += ((mine - codec.stored(ref, signed)).abs() / step).sum().item()
        count += ref.numel()
    return total / count
