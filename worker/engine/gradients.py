"""Deterministic, device-independent initial parameters and gradient streams.

Same (seed, step) -> the same bits on the CPU and on any GPU, whatever the CPU's vector ISA:

* Random numbers come only from `torch.randint` on a CPU `torch.Generator` (integer output of the
  generator, no vectorised transcendental functions: `torch.randn` on the CPU uses SIMD log/cos
  whose last bits differ between AVX2 and scalar code).
* Values are built from those integers with exact float64 arithmetic (a sum of four 24-bit
  uniforms, an exact power-of-two exponent spread), then rounded once to float32. Every step is an
  IEEE operation that is correctly rounded, so every device agrees. Only then do tensors move to
  the device.
* The closed-loop gradient h*(p - c) is computed with two elementwise float32 torch ops (separate
  kernels, so no FMA contraction), each correctly rounded on every device.

The distribution (a roughly bell-shaped core spread over exponents 2**-4..2**4) is not Gaussian,
and does not need to be: it needs many magnitudes, so rounding is exercised across exponents.
"""

from __future__ import annotations

import hashlib

import torch

from service.core.results import GradientStreamSpec

_UNIFORM_BITS = 24
_EXPONENT_SPREAD = 4  # values scaled by 2**e, e uniform in [-4, 4]


def derive_seed(seed: int, purpose: str, step: int = 0) -> int:
    """A 63-bit generator seed for one purpose and step, stable across platforms and versions."""
    digest = hashlib.blake2b(f"optdrift:{seed}:{purpose}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _generator(seed: int, purpose: str, step: int = 0) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(derive_seed(seed, purpose, step))


def _uniform01(size: int, gen: torch.Generator) -> torch.Tensor:
    """float64 in [0, 1) with 24 random bits: k / 2**24, exact."""
    k = torch.randint(0, 1 << _UNIFORM_BITS, (size,), generator=gen, dtype=torch.int64)
    return k.to(torch.float64) / float(1 << _UNIFORM_BITS)


def spread_values(size: int, gen: torch.Generator) -> torch.Tensor:
    """float32 values of mean 0 and many magnitudes, exact up to the final rounding to float32."""
    # Irwin-Hall of four uniforms, centred: in (-2, 2), all sums exact in float64.
    core = _uniform01(size, gen) + _uniform01(size, gen) + _uniform01(size, gen) + _uniform01(size, gen) - 2.0
    exponent = torch.randint(-_EXPONENT_SPREAD, _EXPONENT_SPREAD + 1, (size,), generator=gen, dtype=torch.int64)
    return torch.ldexp(core, exponent.to(torch.float64)).to(torch.float32)


def initial_parameters(seed: int, size: int) -> torch.Tensor:
    """float32 CPU tensor; a case casts it to its parameter dtype (and the reference upcasts that)."""
    return spread_values(size, _generator(seed, "init"))


def zero_mask(seed: int, step: int, size: int, zero_fraction: float) -> torch.Tensor | None:
    """Boolean CPU mask of the elements forced to exactly 0 at this step (None: no zeros)."""
    if zero_fraction <= 0.0:
        return None
    u = _uniform01(size, _generator(seed, "zeros", step))
    return u < zero_fraction


class GradientStream:
    """The gradients of one case, step by step (steps are 1-based).

    `kernel_gradient(step, param)` is what the kernel under test gets (dtype `grad_dtype`, on the
    param's device). `reference_gradient(step, ref_param)` is what a reference following its own
    trajectory gets, in the reference's dtype:

    * open loop: the same values as the kernel's gradient (upcast exactly), so any difference comes
      from the update rule alone;
    * closed loop: h*(p - c) at the reference's own parameters. The reference must follow its own
      path: fed the kernel's gradients it would be dragged along the kernel's trajectory and would
      only measure one step of error, hiding drift that compounds the way it does in training.
    """

    def __init__(self, spec: GradientStreamSpec, *, seed: int, size: int, device: torch.device | str,
                 grad_dtype: torch.dtype):
        self.spec = spec
        self.seed = seed
        self.size = size
        self.device = torch.device(device)
        self.grad_dtype = grad_dtype
        if spec.kind == "closed":
            gen = _generator(seed, "quadratic")
            curvature = (0.5 + 1.5 * _uniform01(size, gen)) * spec.scale  # h in [0.5, 2) * scale
            self.curvature32 = curvature.to(torch.float32)
            self.centre32 = spread_values(size, gen)
            self._device_constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _constants(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        if key not in self._device_constants:
            # float32 constants upcast exactly when a float64 reference asks for them.
            self._device_constants[key] = (self.curvature32.to(device=device, dtype=dtype),
                                           self.centre32.to(device=device, dtype=dtype))
        return self._device_constants[key]

    def _open_values(self, step: int) -> torch.Tensor:
        values = spread_values(self.size, _generator(self.seed, "grad", step))
        if self.spec.scale != 1.0:
            values = (values.to(torch.float64) * self.spec.scale).to(torch.float32)
        return values

    def _apply_zeros(self, step: int, grad: torch.Tensor) -> torch.Tensor:
        mask = zero_mask(self.seed, step, self.size, self.spec.zero_fraction)
        if mask is not None:
            grad = grad.masked_fill(mask.to(grad.device), 0.0)
        return grad

    def kernel_gradient(self, step: int, param: torch.Tensor) -> torch.Tensor:
        if self.spec.kind == "open":
            grad = self._open_values(step).to(self.grad_dtype).to(param.device)
        else:
            h, c = self._constants(param.device, torch.float32)
            grad = (h * (param.to(torch.float32) - c)).to(self.grad_dtype)
        return self._apply_zeros(step, grad)

    def reference_gradient(self, step: int, ref_param: torch.Tensor) -> torch.Tensor:
        if self.spec.kind == "open":
            # The kernel's exact gradient values (rounded to grad_dtype), upcast exactly.
            grad = self._open_values(step).to(self.grad_dtype).to(device=ref_param.device, dtype=ref_param.dtype)
        else:
            h, c = self._constants(ref_param.device, ref_param.dtype)
            grad = h * (ref_param - c)
        return self._apply_zeros(step, grad)
