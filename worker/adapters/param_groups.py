"""The group lifecycle of a library whose optimizer is a `torch.optim.Optimizer` subclass
(bitsandbytes' `bnb.optim.*`, torchao's `AdamW8bit`..., lion-pytorch's `Lion`): ONE instance over
every tensor of a layout case, its param groups as `case.layout.groups` says, stepped through its
own `step()` once per step (worker/adapters/base.py `FamilyAdapter.open_group`, docs/PROJECTS.md
"The group lifecycle").

An adapter says how a group's hyperparameters read in the library's terms (`group_options`: the
keys the library's own param-group dicts hold, e.g. bnb's SGD keeps momentum in "betas") and how
to make the optimizer from those groups; the rest is here:

* each tensor the engine hands over (a view of one flat vector) becomes a `torch.nn.Parameter`
  over the same memory, so the library's in-place updates land in the engine's view; checked at
  open (same data pointer), and at every step (the engine's tensors are the ones opened);
* before `step()` every Parameter's `.grad` is this step's gradient view; after it, None again;
* `state_for_digest` reads the library: `optimizer.state[p]` of every tensor as "t<i>.<name>"
  (a Python number, e.g. bnb's step counter, as a 0-d tensor) and every param group's numbers as
  "g<j>.<key>" (a per-group step counter, the hyperparameters the library holds, torchao's lr
  tensor): a library that changes a group's hyperparameter or counter changes the digest.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from service.core.results import CaseSpec
from worker.adapters.base import AdapterContractError


@dataclass(eq=False)
class OptimizerGroupCase:
    """A layout case's library objects: one Parameter per tensor (over the engine's view) and the
    ONE optimizer over all of them."""

    case: CaseSpec
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer


def as_parameters(params: Sequence[torch.Tensor], adapter: str) -> list[torch.nn.Parameter]:
    """A Parameter over each tensor's own memory (a view of the flat vector stays that view)."""
    wrapped = [torch.nn.Parameter(tensor, requires_grad=False) for tensor in params]
    for index, (tensor, parameter) in enumerate(zip(params, wrapped)):
        if parameter.data_ptr() != tensor.data_ptr() or parameter.shape != tensor.shape:
            raise AdapterContractError(f"{adapter} adapter: tensor {index}'s Parameter is not over the engine's "
                                       "view; the library's updates would not land in the case's parameters")
    return wrapped


def param_groups(case: CaseSpec, params: Sequence[torch.nn.Parameter],
                 group_options: Callable[[Mapping[str, float | bool]], dict[str, Any]]) -> list[dict[str, Any]]:
    """The library's param groups: group g holds the tensors whose slot is in g, in order, with
    `group_options(case.group_hyper(g))`."""
    groups: list[dict[str, Any]] = []
    for slot, param in zip(case.tensor_slots(), params):
        while len(groups) <= slot.group:
            groups.append({"params": [], **group_options(case.group_hyper(len(groups)))})
        groups[slot.group]["params"].append(param)
    return groups


def open_group(case: CaseSpec, params: Sequence[torch.Tensor], adapter: str,
               group_options: Callable[[Mapping[str, float | bool]], dict[str, Any]],
               make: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]) -> OptimizerGroupCase:
    """ONE optimizer over every tensor of the layout case, as `make(param_groups)` builds it."""
    wrapped = as_parameters(params, adapter)
    optimizer = make(param_groups(case, wrapped, group_options))
    if len(optimizer.param_groups) != len(case.layout.groups):
        raise AdapterContractError(f"{adapter} adapter: the optimizer has {len(optimizer.param_groups)} param "
                                   f"groups, case {case.case_id} {len(case.layout.groups)}")
    return OptimizerGroupCase(case=case, params=wrapped, optimizer=optimizer)


def step_group(handle: OptimizerGroupCase, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               adapter: str) -> None:
    """One `optimizer.step()` over all tensors, each with its gradient view set as its `.grad`."""
    for index, (mine, given) in enumerate(zip(handle.params, params, strict=True)):
        if mine.data_ptr() != given.data_ptr():
            raise AdapterContractError(f"{adapter} adapter: case {handle.case.case_id}'s tensor {index} was "
                                       "stepped with another tensor than it was opened with")
    for param, grad in zip(handle.params, grads, strict=True):
        param.grad = grad
    try:
        handle.optimizer.step()
    finally:
        for param in handle.params:
            param.grad = None


def _number_tensor(value: Any) -> torch.Tensor | None:
    """A number (or a tuple of numbers) as a tensor, a float as float64 (exact); a tensor as it
    is; None for anything else (a flag of None, a name)."""
    if torch.is_tensor(value):
        return value
    if isinstance(value, bool) or isinstance(value, numbers.Integral):
        return torch.tensor(value)
    if isinstance(value, numbers.Real):
        return torch.tensor(float(value), dtype=torch.float64)
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, numbers.Real) for v in value):
        return torch.tensor([float(v) for v in value], dtype=torch.float64)
    return None


def group_state(handle: OptimizerGroupCase) -> dict[str, Any]:
    """Every tensor's library state ("t<i>.<name>", sorted by name; numbers as 0-d tensors, tensor
    subclasses and containers as they are) and every param group's numbers ("g<j>.<key>"), read
    from the optimizer. Empty before the library's first step (its state is made lazily, as
    torch.optim's is): nothing is read then, so a declared state is checked from step 1 on."""
    read: dict[str, Any] = {}
    for index, param in enumerate(handle.params):
        for name, value in sorted(handle.optimizer.state.get(param, {}).items()):
            if isinstance(value, (dict, list, tuple)) and _number_tensor(value) is None:
                read[f"t{index}.{name}"] = value  # a container of tensors: digested as its leaves
                continue
            number = _number_tensor(value)
            if number is not None:
                read[f"t{index}.{name}"] = number
    if not read:
        return read
    for index, group in enumerate(handle.optimizer.param_groups):
        for key, value in sorted(group.items()):
            number = _number_tensor(value) if key != "params" else None
            if number is not None:
                read[f"g{index}.{key}"] = number
    return read


def close_group(handle: OptimizerGroupCase) -> None:
    handle.optimizer.state.clear()
    handle.optimizer.param_groups.clear()
    handle.params.clear()
