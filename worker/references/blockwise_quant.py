"""The quantization-aware float64 reference of a blockwise low-bit optimizer, and the distance of a
kernel's states to it in quantization steps (issue 37: direction for quantized states).

The algorithm is the bundled 8-bit kernels' per-element rule in float64
(worker.references.blockwise8.rule_step: the six optimizers, gnorm_scale, skip_zeros, the
non-finite gradient rule), run free from a zero state with its states requantized after every
step exactly as the library stores them (a codec), so the reference carries the quantization a
correct implementation must carry, and nothing else. The parameter is updated from the
unquantized states (the bundled kernels', bitsandbytes' and torchao's order: a state's
quantization shows in the next step). Two codecs:

* `Codec`, linear codes: per block of `block_size`, absmax over `levels` equal steps (the low-bit
  fixture tests/fixtures/lowbit and torchao-style 4-bit; second moments stored as their square
  root when `sqrt_unsigned`);
* `DynamicMapCodec`, a sorted map of 2**bits values in [-1, 1] (signed) or [0, 1] (unsigned), per
  block absmax, code = nearest map entry, ties toward zero: the bundled 8-bit kernels
  (csrc/quant_map.h; the maps of worker.references.quant_map, which the adapter hands the kernels)
  and bitsandbytes' dynamic map.

Against torch.optim in float64 a quantized case's distance is its quantization error, which
swamps any commit's move; against this reference a correct float32 implementation differs only
where a value lies within float32 rounding of a code boundary (a few elements, one code), so a
commit that moves the states, e.g. by rounding codes down, shows as a shift of about half a step
on every element.

`state_steps` is that figure: the mean over the states' elements of |kernel − reference| divided
by the element's local quantization step. Linear codes: the block's step (absmax / levels) in the
stored domain, where codes are linear. A dynamic map: the gap between the two map entries around
the reference's normalised value (value / block absmax), times the block's absmax; the reference
sits on a map entry, so "around" is taken toward the kernel's value: a kernel one code off reads
exactly 1 whatever the local density of the map. The service judges direction on it
(service.core.verdicts, QUANT_STEP_MARGIN), the figure recorded per step in
Trajectory.quant_ref_steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from service.core.families import family as state_family
from worker.references.blockwise8 import STATE_SIGNED, Bounded, block_max, nearest_codes, per_element, rule_step

# Whether each state the reference knows is signed (first moments) or not (second moments, sums).
SIGNED_STATES: dict[str, bool] = {name: signed for states in STATE_SIGNED.values() for name, signed in states}
# The optimizers whose quantized cases the engine measures against this reference. The reference
# has every rule of blockwise8.RULES; the margin the verdict judges with (QUANT_STEP_MARGIN) was
# measured on Adam (the low-bit fixture and the bundled kernels: tests/worker/references/).
QUANT_AWARE_OPTIMIZERS = frozenset({"adam"})


class StateCodec(Protocol):
    """How a library stores a quantized state: what the reference requantizes with and the unit
    the distance is measured in."""

    def roundtrip(self, values: torch.Tensor, signed: bool) -> torch.Tensor:
        """Quantize to the nearest code and dequantize, in the values' dtype and shape."""

    def steps_apart(self, kernel: torch.Tensor, reference: torch.Tensor, signed: bool) -> torch.Tensor:
        """Per element (flat): |kernel − reference| in the reference's local quantization steps."""


def _blocks(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat values as (blocks, block_size), the last block padded with zeros (a zero changes no
    block's absmax, and padding is cut off again)."""
    flat = values.reshape(-1)
    padded = flat.new_zeros(-(-flat.numel() // block_size) * block_size)
    padded[:flat.numel()] = flat
    return padded.view(-1, block_size)


@dataclass(frozen=True)
class Codec:
    """Linear codes: `block_size` elements per absmax scale, signed states on codes
    -levels..levels, unsigned ones on 0..unsigned_levels, unsigned states stored as their square
    root when `sqrt_unsigned` (torchao's and the fixture's second moment)."""

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
        blocks = _blocks(values, self.block_size)
        return blocks if signed or not self.sqrt_unsigned else blocks.clamp_min(0).sqrt()

    def step(self, values: torch.Tensor, signed: bool) -> torch.Tensor:
        """Per block (blocks, 1): the quantization step, the block's absmax over its code steps."""
        return self.stored(values, signed).abs().amax(dim=1, keepdim=True) / (self.levels if signed
                                                                              else self.unsigned_levels)

    def roundtrip(self, values: torch.Tensor, signed: bool) -> torch.Tensor:
        stored, step = self.stored(values, signed), self.step(values, signed)
        safe = torch.where(step > 0, step, torch.ones_like(step))
        back = torch.round(stored / safe) * safe
        if not signed and self.sqrt_unsigned:
            back = back * back
        return back.reshape(-1)[:values.numel()].reshape(values.shape)

    def steps_apart(self, kernel: torch.Tensor, reference: torch.Tensor, signed: bool) -> torch.Tensor:
        step = self.step(reference, signed)
        step = torch.where(step > 0, step, torch.ones_like(step))  # a zero block: both sides 0 when correct
        apart = (self.stored(kernel.to(reference.dtype), signed) - self.stored(reference, signed)).abs() / step
        return apart.reshape(-1)[:reference.numel()]


@dataclass(frozen=True)
class DynamicMapCodec:
    """A sorted quantization map per sign (`signed_map` in [-1, 1], `unsigned_map` in [0, 1]),
    `block_size` elements per absmax: value = map[code] * absmax, code = the nearest map entry to
    value / absmax (ties toward zero; an all-zero block keeps the zero code), csrc/quant_map.h's
    rule. The maps are the tensors the library quantizes with (any device, float32 or float64)."""

    signed_map: torch.Tensor
    unsigned_map: torch.Tensor
    block_size: int
    _maps64: dict = field(default_factory=dict, compare=False, repr=False)

    def map64(self, signed: bool, device: torch.device) -> torch.Tensor:
        """The map in float64 on `device` (exact: a float32 map upcasts exactly), made once each."""
        key = (signed, str(device))
        if key not in self._maps64:
            self._maps64[key] = (self.signed_map if signed else self.unsigned_map).to(device=device,
                                                                                      dtype=torch.float64)
        return self._maps64[key]

    def _normalised(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(value / its block's absmax, that absmax), flat, per element; 0 and 0 in an all-zero block."""
        flat = values.reshape(-1)
        absmax = per_element(block_max(flat.abs(), flat.numel(), self.block_size), flat.numel(), self.block_size)
        safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        return torch.where(absmax > 0, flat / safe, torch.zeros_like(flat)), absmax

    def roundtrip(self, values: torch.Tensor, signed: bool) -> torch.Tensor:
        qmap = self.map64(signed, values.device).to(values.dtype)
        x, absmax = self._normalised(values)
        return (qmap[nearest_codes(x, qmap, ties="zero")] * absmax).reshape(values.shape)

    def local_step(self, reference: torch.Tensor, signed: bool, upward: torch.Tensor) -> torch.Tensor:
        """Per element (flat): the gap between the map entries around the reference's normalised
        value, times its block's absmax. On an entry (a requantized reference always is) the gap
        on the side `upward` says (True: toward the next larger entry); at either end of the map,
        the one gap there is. An all-zero block's step is 1."""
        qmap = self.map64(signed, reference.device)
        x, absmax = self._normalised(reference.to(torch.float64))
        last = qmap.numel() - 1
        code = nearest_codes(x, qmap, ties="zero")
        gap_up = qmap[(code + 1).clamp_max(last)] - qmap[code]
        gap_down = qmap[code] - qmap[(code - 1).clamp_min(0)]
        gap_up = torch.where(code < last, gap_up, gap_down)
        gap_down = torch.where(code > 0, gap_down, gap_up)
        # Off an entry (a reference that was not requantized): the gap of the interval x lies in.
        # An entry times absmax divided by absmax may miss the entry by an ulp: that is "on" it.
        on_entry = (x - qmap[code]).abs() <= 1e-9 * torch.minimum(gap_up, gap_down)
        inside = (torch.searchsorted(qmap, x, right=True) - 1).clamp(0, last - 1)
        gap = torch.where(on_entry, torch.where(upward.reshape(-1), gap_up, gap_down),
                          qmap[inside + 1] - qmap[inside])
        return torch.where(absmax > 0, gap * absmax, torch.ones_like(absmax))

    def steps_apart(self, kernel: torch.Tensor, reference: torch.Tensor, signed: bool) -> torch.Tensor:
        delta = kernel.reshape(-1).to(torch.float64) - reference.reshape(-1).to(torch.float64)
        return delta.abs() / self.local_step(reference, signed, delta > 0)


class QuantAwareReference:
    """`optimizer` in float64 from a zero state (worker.references.blockwise8.rule_step), its states
    requantized by `codec` after every step (None: never, the plain float64 reference)."""

    def __init__(self, optimizer: str, hyper: dict, param: torch.Tensor, codec: StateCodec | None) -> None:
        self.optimizer, self.hyper, self.codec, self.t = optimizer, dict(hyper), codec, 0
        self.p = param.detach().to(torch.float64).clone()
        self.names = STATE_SIGNED[optimizer]
        self._states = [torch.zeros_like(self.p) for _ in self.names]

    def step(self, grad: torch.Tensor) -> None:
        self.t += 1
        # Bounded carries the kernels' float32 error bound beside each value; only the values count here.
        new_p, new_states = rule_step(self.optimizer, self.hyper, self.t, Bounded(self.p),
                                      Bounded(grad.detach().to(torch.float64)),
                                      [Bounded(s) for s in self._states])
        self.p = new_p.v
        self._states = [s.v if self.codec is None else self.codec.roundtrip(s.v, signed)
                        for s, (_, signed) in zip(new_states, self.names)]

    def states(self) -> dict[str, torch.Tensor]:
        return {name: state for (name, _), state in zip(self.names, self._states)}


class QuantAwareAdamW(QuantAwareReference):
    """AdamW (decoupled decay, the bundled kernels' rule) as a QuantAwareReference."""

    def __init__(self, param: torch.Tensor, codec: StateCodec | None, *, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float) -> None:
        super().__init__("adam", {"lr": lr, "beta1": betas[0], "beta2": betas[1], "eps": eps,
                                  "weight_decay": weight_decay, "gnorm_scale": 1.0}, param, codec)


def state_steps_tensor(kernel: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                       codec: StateCodec) -> torch.Tensor:
    """Mean over every element of the named states of |kernel − reference| in the reference's
    local quantization steps (module docstring; a zero block's step is taken as 1: both sides are
    0 there in a correct run), as a float64 0-d tensor on the states' device (the engines read it
    once a case is done, not at every step)."""
    total = sum(codec.steps_apart(kernel[name], ref, SIGNED_STATES[name]).sum() for name, ref in reference.items())
    return total / sum(ref.numel() for ref in reference.values())


def state_steps(kernel: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor], codec: StateCodec) -> float:
    """`state_steps_tensor` as a float."""
    return float(state_steps_tensor(kernel, reference, codec))
