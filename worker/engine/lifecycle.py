"""The engines' side of the adapter lifecycle (worker.adapters.base, docs/PROJECTS.md "The adapter
contract"): open a case through its family adapter, read what is digested, close it, and refuse
an adapter that breaks the contract loudly instead of letting it produce other trajectories.

Two checks make the wrong shortcuts fail rather than drift:
  * handles: every open case has its own handle, and a handle is never handed out again (one
    shared library optimizer for all cases; per-case objects found again by `id(param)` after the
    address was reused), kept per family adapter for the life of the process;
  * digested state: no two open cases' `state_for_digest` tensors share memory (a shared step
    counter or one optimizer's state behind distinct handles).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

from service.core.results import CaseSpec
from worker.adapters.base import (AdapterContractError, FamilyAdapter, HandedOverStates, StateDeclaration,
                                  StateNotAsDeclared)
from worker.engine.digest import is_plain, plain_tensors


def adapter_name(family: object) -> str:
    return f"{type(family).__module__}.{type(family).__qualname__}"


class LegacyFamily(HandedOverStates):
    """An adapter written before the lifecycle (`init_states(case, param)`, `step(case, param,
    grad, states, step)`, optional `bind(case, param, grad, states)`), run as handed-over states."""

    def __init__(self, legacy: object) -> None:
        self.legacy = legacy

    def init_states(self, case, param):  # noqa: ANN001, ANN201
        return self.legacy.init_states(case, param)

    def step_states(self, case, param, grad, states, step) -> None:  # noqa: ANN001
        self.legacy.step(case, param, grad, states, step)

    def bind_states(self, case, param, grad, states):  # noqa: ANN001, ANN201
        bind = getattr(self.legacy, "bind", None)
        return bind(case, param, grad, states) if bind is not None else None


_legacy_wrappers: dict[int, tuple[object, LegacyFamily]] = {}


def family_for(families: Mapping[str, object], case: CaseSpec) -> FamilyAdapter:
    """The family adapter of `case`, an old-style one wrapped (once per object)."""
    if case.family not in families:
        raise ValueError(f"case {case.case_id}: kernel family {case.family!r} has no adapter yet "
                         f"(known: {sorted(families)})")
    family = families[case.family]
    if isinstance(family, FamilyAdapter):
        return family
    if hasattr(family, "init_states") and hasattr(family, "step"):
        held = _legacy_wrappers.get(id(family))
        if held is None or held[0] is not family:
            held = _legacy_wrappers[id(family)] = (family, LegacyFamily(family))
        return held[1]
    raise AdapterContractError(
        f"kernel family {case.family!r}: {adapter_name(family)} is not a FamilyAdapter (open, step, "
        "state_for_digest, close; worker/adapters/base.py) nor an old-style adapter with init_states and step")


def runs_on_fast_engine(family: FamilyAdapter) -> bool:
    return bool(getattr(family, "fast_engine", True))


# ----------------------------------------------------------------------------- handles
_VALUE_TYPES = (int, str, bytes, tuple)


class _Handles:
    """One family adapter's handles, looked up in O(1): objects by id while they are alive (a weak
    reference: a dead object's address may be reused by a new one, legitimately), value handles
    (an int key, a tuple) by value, each with the case it was given to (its CaseSpec: what
    digest_states checks a declared state against) and whether it is open.
    An object that cannot be weakly referenced (a dict) is tracked while open only."""

    def __init__(self) -> None:
        self.objects: dict[int, tuple[Any, CaseSpec, bool]] = {}
        self.values: dict[Any, tuple[CaseSpec, bool]] = {}

    def holder(self, handle: Any) -> tuple[CaseSpec, bool] | None:
        if isinstance(handle, _VALUE_TYPES):
            return self.values.get(handle)
        entry = self.objects.get(id(handle))
        if entry is None:
            return None
        ref, case, is_open = entry
        alive = ref() if isinstance(ref, weakref.ref) else ref
        return (case, is_open) if alive is handle else None

    def record(self, handle: Any, case: CaseSpec, is_open: bool) -> None:
        if isinstance(handle, _VALUE_TYPES):
            self.values[handle] = (case, is_open)
            return
        key = id(handle)
        try:
            ref: Any = weakref.ref(handle, lambda dead: self._forget(key, dead))
        except TypeError:
            if not is_open:
                self.objects.pop(key, None)
                return
            ref = handle
        self.objects[key] = (ref, case, is_open)

    def _forget(self, key: int, dead: weakref.ref) -> None:
        if self.objects.get(key, (None,))[0] is dead:
            del self.objects[key]


_handles: dict[int, tuple[object, _Handles]] = {}


def _registry(family: FamilyAdapter) -> _Handles:
    held = _handles.get(id(family))
    if held is None or held[0] is not family:
        held = _handles[id(family)] = (family, _Handles())
    return held[1]


def open_case(family: FamilyAdapter, case: CaseSpec, param: torch.Tensor, device: torch.device) -> Any:
    """`family.open(...)`, refused when the handle belongs (or belonged) to another case."""
    return _register(family, case, family.open(case, param, device))


def tensor_views(case: CaseSpec, flat: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of a layout case: views of the flat parameter (or gradient) vector, one per
    slot (worker.engine.trajectory keeps the flat vector; the guards between stay untouched)."""
    return [flat[slot.offset:slot.stop] for slot in case.tensor_slots()]


def open_group_case(family: FamilyAdapter, case: CaseSpec, params: list[torch.Tensor], device: torch.device) -> Any:
    """`family.open_group(...)` for a layout case, with open_case's handle rules."""
    return _register(family, case, family.open_group(case, params, device))


def _register(family: FamilyAdapter, case: CaseSpec, handle: Any) -> Any:
    registry = _registry(family)
    holder = registry.holder(handle)
    if holder is not None:
        other, is_open = holder
        state = "still open" if is_open else "closed: a handle is never reused"
        raise AdapterContractError(
            f"adapter {adapter_name(family)} returned the same handle for case {case.case_id} as for "
            f"case {other.case_id} ({state}): every case needs its own handle (its own library optimizer and "
            "state), or one case steps another's. Create the per-case objects in open() and keep them "
            "in the handle; never look them up by id(param) or a data pointer (docs/PROJECTS.md)")
    registry.record(handle, case, True)
    return handle


def close_case(family: FamilyAdapter, handle: Any) -> None:
    registry = _registry(family)
    holder = registry.holder(handle)
    if holder is not None:
        registry.record(handle, holder[0], False)
    family.close(handle)


def close_all(opened: list[tuple[FamilyAdapter, Any]]) -> None:
    """Close every handle, even when some close() raises; then raise the first such error."""
    failures = []
    for family, handle in opened:
        try:
            close_case(family, handle)
        except Exception as error:  # noqa: BLE001 - every handle is closed first
            failures.append((family, error))
    if failures:
        family, error = failures[0]
        raise AdapterContractError(f"adapter {adapter_name(family)}: close() failed: "
                                   f"{type(error).__name__}: {error}") from error


# ----------------------------------------------------------------------------- digested state
def digest_states(family: FamilyAdapter, handle: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, plain tensor) of state_for_digest(handle), in its order, read as it is: an entry that
    is a tensor subclass, a DTensor-like wrapper or a container counts as its plain leaves
    ("exp_avg.codes", ...; worker.engine.digest.plain_tensors); names are positions for a list.
    A plain entry is itself, so plain states read (and digest) as they always did. When the
    handle's case has a declared state (FamilyAdapter.declared_state), it is checked here, so
    both engines refuse a state that is not the declared one (StateNotAsDeclared)."""
    states = family.state_for_digest(handle)
    entries = list(states.items()) if isinstance(states, Mapping) else [(str(i), t) for i, t in enumerate(states)]
    items = []
    for name, value in entries:
        try:
            items.extend(plain_tensors(value, str(name)))
        except TypeError as error:
            raise AdapterContractError(f"adapter {adapter_name(family)}: state_for_digest entry {name!r}: "
                                       f"{error}") from None
    if family.states_movable and not all(is_plain(value) for _, value in entries):
        raise AdapterContractError(f"adapter {adapter_name(family)} hands its states over (states_movable) but "
                                   "state_for_digest holds tensor subclasses or containers: handed-over states "
                                   "are plain tensors (or leave states_movable False: library-owned)")
    holder = _registry(family).holder(handle)
    declare = getattr(family, "declared_state", None)
    declaration = declare(holder[0]) if holder is not None and declare is not None else None
    if declaration is not None and entries:
        check_declared_state(declaration, holder[0], entries, adapter_name(family))
    return items


def check_declared_state_now(family: FamilyAdapter, handle: Any) -> None:
    """Where the handle's case has a declared state, read and check it now (digest_states does);
    otherwise nothing is read, so an adapter whose state appears only at its first step is not
    asked for it before then."""
    holder = _registry(family).holder(handle)
    declare = getattr(family, "declared_state", None)
    if holder is not None and declare is not None and declare(holder[0]) is not None:
        digest_states(family, handle)


def check_declared_state(declaration: StateDeclaration, case: CaseSpec, entries: list[tuple[str, Any]],
                         adapter: str) -> None:
    """Raise StateNotAsDeclared unless every checked entry holds codes of the declared dtype and,
    with a block size, ceil(size / block_size) scales (its other floating-point values)."""
    wanted = declaration.states
    claim = f"{adapter} declares {declaration.family} state for case {case.case_id}"
    present = {str(name) for name, _ in entries}
    for name in wanted or ():
        if name not in present:
            raise StateNotAsDeclared(f"{claim}, but it has no state {name!r} (it has {sorted(present)})")
    for name, value in entries:
        leaves = [tensor for _, tensor in plain_tensors(value, str(name))]
        if wanted is None and all(t.dim() == 0 for t in leaves) or wanted is not None and str(name) not in wanted:
            continue
        layout = ", ".join(f"{str(t.dtype).removeprefix('torch.')}[{t.numel()}]" for t in leaves)
        if not any(str(t.dtype).removeprefix("torch.") == declaration.code_dtype for t in leaves):
            raise StateNotAsDeclared(
                f"{claim}, but state {name!r} is {layout}, with no {declaration.code_dtype} codes: the library "
                f"fell back to another state (n={case.size}); not run as {declaration.family}")
        if declaration.block_size:
            scales = sum(t.numel() for t in leaves if t.is_floating_point())
            expected = -(-case.size // declaration.block_size)
            if scales != expected:
                raise StateNotAsDeclared(
                    f"{claim} with blocks of {declaration.block_size} ({expected} scales for n={case.size}), but "
                    f"state {name!r} is {layout}: {scales} scale values; not run as {declaration.family}")


def check_unshared(family_of_case: Mapping[int, FamilyAdapter], states_of_case: Mapping[int, list],
                   cases: list[CaseSpec]) -> None:
    """No two open cases' digested tensors share memory: shared state means one case's step
    moves another's (one library optimizer behind distinct handles, a shared step counter)."""
    extents = sorted((start, end, index, name) for index, items in states_of_case.items()
                     for name, tensor in items for start, end in [_extent(tensor)] if end > start)
    reach, holder = 0, None  # the furthest end so far, and whose interval reaches it
    for start, end, index, name in extents:
        if holder is not None and start < reach and holder[0] != index:
            other, other_name = holder
            raise AdapterContractError(
                f"adapter {adapter_name(family_of_case[index])}: state {name!r} of case "
                f"{cases[index].case_id} shares memory with state {other_name!r} of case "
                f"{cases[other].case_id}, both open: each case's optimizer must own its state "
                "(one library optimizer object per case, made in open())")
        if end > reach:
            reach, holder = end, (index, name)


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """[first byte, past the last byte) the tensor's elements span (0, 0 when empty)."""
    if tensor.numel() == 0:
        return 0, 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return start, start + (last + 1) * tensor.element_size()
