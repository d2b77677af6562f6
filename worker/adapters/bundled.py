"""The bundled csrc kernels (torch.ops.optdrift.*), built by worker.build, and their families: the
32-bit ops through worker.adapters.bundled_ops.step (`ThirtyTwoBitAdapter`) and the 8-bit blockwise ops
(worker/adapters/bundled_8bit.py). The engines default to these families.

A layout case (several tensors in param groups under one optimizer) runs the 32-bit family through
the multi-tensor ops, one call per step over every tensor (`ThirtyTwoBitAdapter.open_group`,
docs/KERNELS.md "Multi-tensor entry points"); the 8-bit family steps it per tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from worker.adapters.base import AdapterError, GroupStates, HandedOverStates, ProjectAdapter
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

    # ---- the group lifecycle: ONE multi-tensor op call per step over every tensor of the case
    # (csrc/multi_tensor.h), so the shared state a fused optimizer keeps (per-tensor step
    # counters, per-group beta powers, the chunk list over all tensors) is what the case runs. A
    # build from before the multi-tensor ops steps the tensors one op call each (the default).
    def open_group(self, case: "CaseSpec", params: "Sequence[torch.Tensor]", device: "torch.device") -> Any:
        import torch

        from worker.adapters import bundled_ops

        if not bundled_ops.has_multi_ops():
            return super().open_group(case, params, device)
        slots = case.tensor_slots()
        groups = len(case.layout.groups) if case.layout is not None else 1
        names = bundled_ops.OPTIMIZER_STATES[case.optimizer]
        # Each state laid out as the parameters are (one flat buffer, the same aligned offsets and
        # guard elements), so a kernel that runs one element past a tensor's end stays inside the
        # buffer, as it does in the flat parameter vector.
        flat_size = slots[-1].stop if case.layout is None else case.layout.flat_size
        flats = {name: torch.zeros(flat_size, dtype=torch.float32, device=params[0].device) for name in names}
        states = {f"t{slot.index}.{name}": flats[name][slot.offset:slot.stop] for slot in slots for name in names}
        shared = bundled_ops.new_multi_state(case.optimizer, len(slots), groups)
        return MultiTensorStates(case, {**states, **shared}, tensor_cases=[case.tensor_case(s) for s in slots],
                                 names=[list(names) for _ in slots], group_of=[slot.group for slot in slots],
                                 group_hypers=[case.group_hyper(g) for g in range(groups)])

    def step_group(self, handle: GroupStates, params: "Sequence[torch.Tensor]",
                   grads: "Sequence[torch.Tensor]", step: int) -> None:
        if not isinstance(handle, MultiTensorStates):
            return super().step_group(handle, params, grads, step)
        from worker.adapters import bundled_ops

        optimizer = handle.case.optimizer
        names = bundled_ops.OPTIMIZER_STATES[optimizer]
        states = {name: [handle.states[f"t{i}.{name}"] for i in range(len(params))] for name in names}
        shared = {name: handle.states[name] for name in handle.shared_names()}
        bundled_ops.multi_step(optimizer, list(params), list(grads), states, shared, handle.group_of,
                               handle.group_hypers)

    def state_for_digest(self, handle: GroupStates) -> dict[str, "torch.Tensor"]:
        if not isinstance(handle, MultiTensorStates):
            return super().state_for_digest(handle)
        # The counters and powers live on the CPU, where the op's host code keeps them; digested on
        # the tensors' device, beside the rest of the case.
        device = next(iter(handle.states.values())).device
        shared = set(handle.shared_names())
        return {name: tensor.to(device) if name in shared else tensor for name, tensor in handle.states.items()}

    def adopt_states(self, handle: GroupStates, states: dict[str, "torch.Tensor"]) -> None:
        if not isinstance(handle, MultiTensorStates):
            return super().adopt_states(handle, states)
        adopted = dict(states)
        for name in handle.shared_names():  # the op reads these on the CPU
            handle.states[name].copy_(adopted.pop(name))
        handle.states.update(adopted)


@dataclass(eq=False)
class MultiTensorStates(GroupStates):
    """The handle of a 32-bit layout case on the multi-tensor op: every tensor's states by
    "t<i>.<name>" (views of one flat buffer per state), the op's shared state ("steps", and
    "beta_powers" for Adam / AdEMAMix, on the CPU), each tensor's param group and each group's
    hyperparameters."""

    group_of: list = field(default_factory=list)
    group_hypers: list = field(default_factory=list)

    def shared_names(self) -> list[str]:
        return [name for name in ("steps", "beta_powers") if name in self.states]


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
