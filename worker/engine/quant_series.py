"""The quantization-aware float64 reference beside one quantized case, and its two per-step figures
(Trajectory.quant_ref_steps, quant_ref_max_abs), the same for both engines: run_case steps it
after each kernel step, worker.engine.fast after each step of a wave, with the same operations on
the same tensors, so both record the same bits.

A case gets one where its family adapter names a codec (FamilyAdapter.quantization_codec) and
its optimizer is one the verdict's margin was measured on (blockwise_quant.QUANT_AWARE_OPTIMIZERS).
The reference follows its own trajectory: it has its own gradient stream (the kernel's values in
an open loop, h*(p - c) at its own parameters in a closed one), as the float64 reference does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from service.core.results import CaseSpec
from worker.adapters.base import FamilyAdapter
from worker.engine.gradients import GradientStream
from worker.references.blockwise_quant import QUANT_AWARE_OPTIMIZERS, QuantAwareReference, StateCodec, state_steps_tensor


class QuantRefSeries:
    """One case's quantization-aware reference; `observe` after each step, `series` at the end.
    The figures stay on the device until read."""

    def __init__(self, case: CaseSpec, family: FamilyAdapter, codec: StateCodec, param: torch.Tensor) -> None:
        self.case, self.family, self.codec = case, family, codec
        self.reference = QuantAwareReference(case.optimizer, case.hyper, param, codec)
        self.stream = GradientStream(case.gradient, seed=case.seed, size=case.size, device=param.device,
                                     grad_dtype=param.dtype)
        self.steps: list[torch.Tensor] = []
        self.max_abs: list[torch.Tensor] = []

    @classmethod
    def for_case(cls, case: CaseSpec, family: FamilyAdapter, param: torch.Tensor) -> "QuantRefSeries | None":
        """The series of a case that gets one (module docstring), from its parameter before step 1."""
        if case.optimizer not in QUANT_AWARE_OPTIMIZERS:
            return None
        codec = family.quantization_codec(case)
        return None if codec is None else cls(case, family, codec, param)

    def observe(self, step: int, handle: Any, param: torch.Tensor) -> None:  # noqa: ANN401 - the adapter's handle
        """Step the reference and record both figures, after the kernel's step `step`."""
        self.reference.step(self.stream.reference_gradient(step, self.reference.p))
        states: Mapping[str, torch.Tensor] = self.family.dequantized_states(handle)
        self.steps.append(state_steps_tensor(states, self.reference.states(), self.codec))
        self.max_abs.append((param.to(torch.float64) - self.reference.p).abs().max())

    def series(self) -> tuple[list[float], list[float]]:
        """(quant_ref_steps, quant_ref_max_abs), one value per observed step."""
        return torch.stack(self.steps).cpu().tolist(), torch.stack(self.max_abs).cpu().tolist()
