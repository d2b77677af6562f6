"""The bundled csrc kernels (torch.ops.optdrift.*), built by worker.build, and their families: the
32-bit ops through worker.adapters.bundled_ops.step (`ThirtyTwoBitAdapter`) and the 8-bit blockwise ops
(worker/adapters/bundled_8bit.py). The engines default to these families.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from worker.adapters.base import AdapterError, HandedOverStates, ProjectAdapter
from worker.adapters.bundled_8bit import EightBitBlockwiseAdapter

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from service.core.results import CaseSpec


class ThirtyTwoBitAdapter(HandedOverStates):
    """fp32 states, one op call per step (worker.adapters.bundled_ops over torch.ops.optdrift.*)."""

    def init_states(self, case: "CaseSpec", param: "torch.Tensor") -> dict[str, "torch.Tensor"]:
        import torch

        from worker.adapters import bundled_ops

        return {name: torch.zeros(param.shape, dtype=torch.float32, device=param.device)
                for name in bundled_ops.OPTIMIZER_STATES[case.optimizer]}

    def step_states(self, case: "CaseSpec", param: "torch.Tensor", grad: "torch.Tensor",
             states: dict[str, "torch.Tensor"], step: int) -> None:
        from worker.adapters import bundled_ops

        bundled_ops.step(case.optimizer, param, grad, states, step=step, hyper=dict(case.hyper))

    def bind_states(self, case: "CaseSpec", param: "torch.Tensor", grad: "torch.Tensor",
             states: dict[str, "torch.Tensor"]) -> Callable[[int], None]:
        """`step` on these exact tensors, checked once; the fast runner calls it every step."""
        from worker.adapters import bundled_ops

        return bundled_ops.bind_step(case.optimizer, param, grad, states, hyper=dict(case.hyper))


FAMILIES: dict[str, object] = {"32bit": ThirtyTwoBitAdapter(), "8bit_blockwise": EightBitBlockwiseAdapter()}


class BundledAdapter(ProjectAdapter):
    name = "bundled"

    def __init__(self) -> None:
        self._library: str | None = None

    def load(self, library: str) -> None:
        from worker.adapters import bundled_ops

        try:
            bundled_ops.load_build(library)
        except FileNotFoundError as error:
            raise AdapterError(str(error)) from error
        self._library = library

    def families(self) -> Mapping[str, object]:
        return FAMILIES

    def describe(self) -> dict[str, str]:
        return {"adapter": self.name, "library": str(self._library)}
