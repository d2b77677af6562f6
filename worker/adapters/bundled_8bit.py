"""The bundled kernels' 8-bit blockwise family (worker.adapters.bundled.FAMILIES).

States are exposed to the engine as a flat dict of tensors, codes and absmax side by side
(`exp_avg_codes`, `exp_avg_absmax`, ...), so the per-step digest the engine takes over
`[param, *states.values()]` covers every code and every block absmax: a one-code or one-ulp-of-
absmax change is a digest change. The maps come from worker.references.quant_map, once per device.

Against the float64 torch.optim reference the engine measures, a one-step case from a zero state
is the closed-form check: step 1 of torch.optim.AdamW from zero is p(1 - lr wd) - lr g/(|g|+eps)
(worker/references/blockwise8.py), and the 8-bit kernel's step 1 is that to float32 rounding.

The family names its codec (`quantization_codec`: the dynamic maps it hands the kernels, per
block of quant_map.BLOCK_SIZE) and gives its states' values (`dequantized_states`), so the engine
measures the states against the quantization-aware float64 reference in quantization steps
(worker.references.blockwise_quant), which the direction of an 8-bit case is judged on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from service.core.results import CaseSpec
from worker.adapters.base import CaseStates, HandedOverStates

if TYPE_CHECKING:  # pragma: no cover
    from worker.references.blockwise_quant import DynamicMapCodec


class EightBitBlockwiseAdapter(HandedOverStates):
    def __init__(self) -> None:
        self._maps: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._codec: DynamicMapCodec | None = None

    def quantization_codec(self, case: CaseSpec) -> "DynamicMapCodec":
        """The codec of every case: the maps step_states hands the kernels (their CPU copies: the
        same values on every device), BLOCK_SIZE elements per absmax, nearest code."""
        from worker.references.blockwise_quant import DynamicMapCodec
        from worker.references.quant_map import BLOCK_SIZE

        if self._codec is None:
            signed_map, unsigned_map = self.maps(torch.device("cpu"))
            self._codec = DynamicMapCodec(signed_map, unsigned_map, BLOCK_SIZE)
        return self._codec

    def dequantized_states(self, handle: CaseStates) -> dict[str, torch.Tensor]:
        """map[code] * absmax of each state, in float64 (exact: a float32 product of two float32s)."""
        from worker.adapters import bundled_ops
        from worker.references.quant_map import dequantize

        states, optimizer = handle.states, handle.case.optimizer
        values = {}
        for name, signed in zip(bundled_ops.OPTIMIZER_STATES[optimizer], bundled_ops.STATE_SIGNED_8BIT[optimizer]):
            codes = states[f"{name}_codes"]
            qmap = self.maps(codes.device)[0 if signed else 1].to(torch.float64)
            values[name] = dequantize(codes, states[f"{name}_absmax"], qmap).reshape(codes.shape)
        return values

    def maps(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        from worker.references.quant_map import dynamic_map

        key = str(device)
        if key not in self._maps:
            self._maps[key] = (dynamic_map(signed=True, device=device), dynamic_map(signed=False, device=device))
        return self._maps[key]

    def init_states(self, case: CaseSpec, param: torch.Tensor) -> dict[str, torch.Tensor]:
        from worker.adapters import bundled_ops

        signed_map, unsigned_map = self.maps(param.device)
        flat: dict[str, torch.Tensor] = {}
        for name, (codes, absmax) in bundled_ops.new_states_8bit(case.optimizer, param, signed_map, unsigned_map).items():
            flat[f"{name}_codes"] = codes
            flat[f"{name}_absmax"] = absmax
        return flat

    def step_states(self, case: CaseSpec, param: torch.Tensor, grad: torch.Tensor,
             states: dict[str, torch.Tensor], step: int) -> None:
        from worker.adapters import bundled_ops

        signed_map, unsigned_map = self.maps(param.device)
        pairs = {name: (states[f"{name}_codes"], states[f"{name}_absmax"])
                 for name in bundled_ops.OPTIMIZER_STATES[case.optimizer]}
        bundled_ops.step_8bit(case.optimizer, param, grad, pairs, step=step, hyper=dict(case.hyper),
                             signed_map=signed_map, unsigned_map=unsigned_map)

    def bind_states(self, case: CaseSpec, param: torch.Tensor, grad: torch.Tensor,
             states: dict[str, torch.Tensor]) -> Callable[[int], None]:
        """`step` on these exact tensors, checked once (worker.engine.fast)."""
        from worker.adapters import bundled_ops

        signed_map, unsigned_map = self.maps(param.device)
        pairs = {name: (states[f"{name}_codes"], states[f"{name}_absmax"])
                 for name in bundled_ops.OPTIMIZER_STATES[case.optimizer]}
        return bundled_ops.bind_step_8bit(case.optimizer, param, grad, pairs, hyper=dict(case.hyper),
                                         signed_map=signed_map, unsigned_map=unsigned_map)
