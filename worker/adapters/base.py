"""The adapter interface: how the engines drive one kernel project's optimizer ops.

A project adapter is one short module (see `tests/fixtures/adapters/tinyopt.py` for the smallest complete one). It says
how to load a build into the kernel host process and, per state family it implements (a row of
service.core.families.FAMILIES: "32bit", "8bit_blockwise", "4bit_blockwise", "fp8_e4m3", ...), how
to run one case of that family:

    class MyProject(ProjectAdapter):
        name = "myproject"
        def load(self, library: str) -> None: ...            # the build's output (a .so, a folder, "installed")
        def families(self) -> Mapping[str, FamilyAdapter]: ... # {"32bit": ..., "8bit_blockwise": ...}
        def unsupported(self, case, device) -> str | None: ... # why a case cannot run here, or None

The case lifecycle (`FamilyAdapter`, docs/PROJECTS.md "The adapter contract"), the same in both
engines (worker.engine.trajectory.run_case, one case at a time; worker.engine.fast, many cases
open at once with their steps interleaved):

    handle = family.open(case, param, device)     # once per case: the library's optimizer, its state
    try:
        for step in 1..case.steps:
            family.step(handle, param, grad, step)  # in place on param (and the library's state)
            digest([param, *family.state_for_digest(handle)])
    finally:
        family.close(handle)                      # always, also when open's caller or a step failed

* The handle is the adapter's per-case object; the engine keeps it and gives it back, nothing
  else. Every open case has its own handle: an adapter that returns a handle another case still
  has (or had: a handle is never reused) fails the run with an error naming the adapter and both
  cases (`AdapterContractError`) instead of stepping one case with another's optimizer.
* `param` is the same tensor at open and at every step of the case (a library may keep it);
  `grad` is this step's gradient, not necessarily the same tensor each step.
* `state_for_digest(handle)` is what the library really updates between steps, read from the
  library itself: its state tensors and its internal scalars (step counters, bias-correction
  powers) as 0-d tensors, the same number, dtypes and shapes at every step, no two open cases
  sharing memory. The engines digest `[param, *state_for_digest(handle)]` after every step.
  A library-owned state is read as it is: entries may be tensor subclasses (torchao's quantized
  states, DTensor), DTensor-like wrappers, or dicts / lists / tuples of tensors; the engines
  digest their plain inner tensors (worker.engine.digest.plain_tensors), no adapter code needed.
* `declared_state(case)` (optional) says what the case's state must be (dtype of the codes,
  block size, `StateDeclaration`); a state that is not (a silent fp32 fallback) makes the case
  `not_applicable` with the reason (`StateNotAsDeclared`).
* Where the state lives (`states_movable`):
    - True ("handed over"): state_for_digest returns a dict of plain tensors the adapter hands
      to the engine; the fast engine copies them into its state arenas and calls
      `adopt_states(handle, views)`; from then on the adapter steps those views.
      `HandedOverStates` implements the lifecycle over `init_states` / `step_states`.
    - False ("library-owned", the default): the library keeps its state; the fast engine only
      reads state_for_digest after each step (copied into its digest arenas).
* `fast_engine = False` says the family cannot have several cases open and stepped interleaved
  (a global singleton in the library, state whose shape changes): the fast engine runs its cases
  one at a time with run_case.
* `bind(handle, param, grad) -> step_fn` (optional) is `step` on fixed tensors with per-call checks
  done once; the fast engine calls it when the adapter overrides it.

Each rule is tested in tests/worker/adapters/test_adapter_lifecycle.py (docs/PROJECTS.md names the test per
rule), on the library-owned fixture tests/fixtures/ownedopt and every adapter in the tree; to
check an adapter of your own, worker.engine.conformance.check_adapter runs cases through both
engines and names each case they disagree on. An object with the older `init_states` /
`step(case, param, grad, states, step)` methods still runs (worker.engine.lifecycle.LegacyFamily).

This module does not import torch: the registry is read by processes that must not (the Celery
parent, the service).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from service.core.results import CaseSpec


class AdapterError(RuntimeError):
    """A build cannot be loaded by its adapter (missing file, wrong package, wrong version)."""


class AdapterContractError(RuntimeError):
    """A family adapter broke the lifecycle contract (a handle shared by two cases, state two open
    cases share, state whose layout changed): the run cannot trust its trajectories."""


class GroupLifecycleMissing(RuntimeError):
    """A layout case (several tensors under one optimizer) whose family adapter has no group
    lifecycle (`open_group` / `step_group`): the engines report the case `not_applicable` with this
    message; it is never run as separate optimizers, which would not exercise the shared state the
    case is there for."""


@dataclass(frozen=True)
class UnreadableState:
    """State a library updates between steps but gives no way to read (DeepSpeed's CPU Adam keeps
    its step and bias-correction powers in C++ with no getter), declared by the adapter so
    `adapter-check` can say what the digests cannot see and what still catches a change in it:
    `seen_through` names the readable figures a change of it moves (the parameters, a state), and
    `from_step` the first step at which it can (1: every update uses it)."""

    name: str
    why: str
    seen_through: tuple[str, ...]
    from_step: int = 1


class StateNotAsDeclared(RuntimeError):
    """A case's state is not what its adapter declared (`FamilyAdapter.declared_state`): a library
    that silently fell back (fp32 states where 8-bit was claimed, another block size). The engines
    report the case `not_applicable` with this message; it is never run as the family it claims."""


@dataclass(frozen=True)
class StateDeclaration:
    """What a case's quantized state must be, checked by the engines on what state_for_digest
    returns (read as it is: tensor subclasses and containers count as their plain inner tensors,
    worker.engine.digest.plain_tensors) after open and after every step.

    * `family`: the state family the case claims ("8bit_blockwise", "4bit_blockwise", "fp8_e4m3"),
      named in the message when the state is not that;
    * `code_dtype`: the dtype of the codes ("uint8", "int8", "float8_e4m3fn"): every checked
      entry must hold a tensor of it;
    * `block_size`: parameter elements per scale (None: not checked): the entry's other floating
      tensors together hold ceil(case.size / block_size) values;
    * `states`: the state_for_digest entries to check; None: every entry that is not a scalar (a
      step counter)."""

    family: str
    code_dtype: str
    block_size: int | None = None
    states: tuple[str, ...] | None = None


class FamilyAdapter(ABC):
    """One kernel family of a project, driven through the per-case lifecycle (module docstring)."""

    # False: the library owns its state (the engines only read state_for_digest). True: the
    # state is plain tensors the fast engine may move into its arenas (see adopt_states).
    states_movable: ClassVar[bool] = False
    # False: never several cases open at once; the fast engine hands this family to run_case.
    fast_engine: ClassVar[bool] = True

    @abstractmethod
    def open(self, case: "CaseSpec", param: "torch.Tensor", device: "torch.device") -> Any:
        """Set up one case before its first step (the library's optimizer over `param`, its
        state) and return its handle: an object of this case alone, never reused."""

    @abstractmethod
    def step(self, handle: Any, param: "torch.Tensor", grad: "torch.Tensor", step: int) -> None:
        """One optimizer step of the handle's case, in place on `param`; `step` is 1-based."""

    @abstractmethod
    def state_for_digest(self, handle: Any) -> "Sequence[torch.Tensor] | Mapping[str, torch.Tensor]":
        """Every tensor the library updates between steps, read from the library (internal
        scalars such as step counters as 0-d tensors), in a fixed order; digested after each step."""

    def declared_state(self, case: "CaseSpec") -> StateDeclaration | None:
        """What this case's state must be (StateDeclaration), or None: not checked (the default).
        Declare it where the library may silently fall back to another state than the family
        claims: such a case reads `not_applicable` with the reason instead of running."""
        return None

    def quantization_codec(self, case: "CaseSpec") -> Any:
        """A quantized family's `worker.references.blockwise_quant.Codec` for `case` (how the library
        stores its states), or None (the default): with one, the engine runs the quantization-aware
        float64 reference beside the case and records Trajectory.quant_ref_steps / quant_ref_max_abs
        from `dequantized_states`, which the direction of quantized cases is judged on."""
        return None

    def dequantized_states(self, handle: Any) -> "Mapping[str, torch.Tensor]":
        """With a quantization_codec: the case's states as the float values they stand for, by the
        reference's names ("exp_avg", "exp_avg_sq")."""
        raise AdapterContractError(f"{type(self).__qualname__} has a quantization_codec but no dequantized_states")

    def close(self, handle: Any) -> None:
        """Tear the case down (free library objects). Always called once per opened handle, also
        after an error. The default does nothing."""

    def adopt_states(self, handle: Any, states: "dict[str, torch.Tensor]") -> None:
        """states_movable only: the engine moved the tensors of state_for_digest(handle) (same
        names, shapes, dtypes, values) into its arenas; step these from now on."""
        raise AdapterContractError(f"{type(self).__qualname__} declares states_movable but has no adopt_states")

    def bind(self, handle: Any, param: "torch.Tensor", grad: "torch.Tensor") -> Callable[[int], None]:
        """`step` on these fixed tensors as a function of the step number. Override to check the
        arguments once instead of on every call (the fast engine's kernel loop)."""
        return lambda step: self.step(handle, param, grad, step)

    # ---- the group lifecycle: a layout case, one optimizer over several tensors in param groups
    def open_group(self, case: "CaseSpec", params: "Sequence[torch.Tensor]", device: "torch.device") -> Any:
        """Set up a layout case (`case.layout`): ONE library optimizer over every tensor, as its
        users build it. `params[i]` is the tensor of `case.tensor_slots()[i]`; param group g holds
        the slots whose `.group` is g, in order, with hyperparameters `case.group_hyper(g)`. The
        handle follows open()'s rules (its own, never reused); state_for_digest(handle) returns
        every tensor's state (names unique over the case, e.g. "t0.exp_avg") and the library's
        shared scalars (step counters, bias-correction powers) as 0-d tensors; close(handle) ends it.
        The default says the adapter has none (the case reads not_applicable with this reason)."""
        raise GroupLifecycleMissing(
            f"the {type(self).__qualname__} adapter has no group lifecycle (open_group/step_group), so it cannot "
            f"run a case of {len(params)} tensors under one optimizer; implement them (docs/PROJECTS.md, "
            "\"The group lifecycle\") or leave layout cases out of the battery")

    def step_group(self, handle: Any, params: "Sequence[torch.Tensor]", grads: "Sequence[torch.Tensor]",
                   step: int) -> None:
        """One step of the library's optimizer over all its tensors (its own step(), once), in place;
        `grads[i]` is this step's gradient of `params[i]`; `step` is 1-based."""
        raise GroupLifecycleMissing(f"the {type(self).__qualname__} adapter has no step_group")

    def unreadable_state(self, case: "CaseSpec") -> "Sequence[UnreadableState]":
        """State the library updates but does not let anyone read (no getter): declared so
        `adapter-check` reports it and what still sees a change in it. Default: none."""
        return ()


@dataclass(eq=False)
class CaseStates:
    """The handle of a `HandedOverStates` family: the case and its state tensors by name."""

    case: "CaseSpec"
    states: "dict[str, torch.Tensor]" = field(default_factory=dict)


class HandedOverStates(FamilyAdapter):
    """A family whose state is plain tensors made up front and handed to the engine (the bundled
    kernels, bitsandbytes' functional API, a C ABI library): implement `init_states` and
    `step_states` (and optionally `bind_states`); the lifecycle is done here."""

    states_movable = True

    @abstractmethod
    def init_states(self, case: "CaseSpec", param: "torch.Tensor") -> "dict[str, torch.Tensor]":
        """Zeroed (or initial) state tensors of the case, by name."""

    @abstractmethod
    def step_states(self, case: "CaseSpec", param: "torch.Tensor", grad: "torch.Tensor",
                    states: "dict[str, torch.Tensor]", step: int) -> None:
        """One step, in place on `param` and `states`."""

    def bind_states(self, case: "CaseSpec", param: "torch.Tensor", grad: "torch.Tensor",
                    states: "dict[str, torch.Tensor]") -> Callable[[int], None] | None:
        """`step_states` on fixed tensors, checked once; None: call step_states every step."""
        return None

    def open(self, case: "CaseSpec", param: "torch.Tensor", device: "torch.device") -> CaseStates:
        return CaseStates(case, self.init_states(case, param))

    def step(self, handle: CaseStates, param: "torch.Tensor", grad: "torch.Tensor", step: int) -> None:
        self.step_states(handle.case, param, grad, handle.states, step)

    def state_for_digest(self, handle: CaseStates) -> "dict[str, torch.Tensor]":
        return handle.states

    def adopt_states(self, handle: CaseStates, states: "dict[str, torch.Tensor]") -> None:
        handle.states = dict(states)

    def close(self, handle: CaseStates) -> None:
        handle.states = {}

    def bind(self, handle: CaseStates, param: "torch.Tensor", grad: "torch.Tensor") -> Callable[[int], None]:
        bound = self.bind_states(handle.case, param, grad, handle.states)
        return bound if bound is not None else super().bind(handle, param, grad)

    # The group lifecycle of a functional API: the user's loop over the tensors, one step_states
    # call per tensor with its group's hyperparameters (a library with real shared state across
    # tensors, such as a multi-tensor kernel, overrides open_group / step_group).
    def open_group(self, case: "CaseSpec", params: "Sequence[torch.Tensor]", device: "torch.device") -> "GroupStates":
        slots = case.tensor_slots()
        tensor_cases = [case.tensor_case(slot) for slot in slots]
        states: dict[str, "torch.Tensor"] = {}
        names: list[list[str]] = []
        for slot, tensor_case, param in zip(slots, tensor_cases, params):
            made = self.init_states(tensor_case, param)
            names.append(list(made))
            states.update({f"t{slot.index}.{name}": tensor for name, tensor in made.items()})
        return GroupStates(case, states, tensor_cases=tensor_cases, names=names)

    def step_group(self, handle: "GroupStates", params: "Sequence[torch.Tensor]",
                   grads: "Sequence[torch.Tensor]", step: int) -> None:
        for index, (tensor_case, param, grad) in enumerate(zip(handle.tensor_cases, params, grads)):
            own = {name: handle.states[f"t{index}.{name}"] for name in handle.names[index]}
            self.step_states(tensor_case, param, grad, own, step)


@dataclass(eq=False)
class GroupStates(CaseStates):
    """The handle of a handed-over family's layout case: every tensor's states by "t<i>.<name>",
    the per-tensor cases (size, group hyperparameters) and each tensor's state names."""

    tensor_cases: list = field(default_factory=list)
    names: list = field(default_factory=list)


class ProjectAdapter(ABC):
    name: ClassVar[str]

    @abstractmethod
    def load(self, library: str) -> None:
        """Load one build into this process (the kernel host). Called once, before any case."""

    @abstractmethod
    def families(self) -> Mapping[str, FamilyAdapter]:
        """Kernel family name -> the `FamilyAdapter` that runs its cases (open, step, state_for_digest, close)."""

    def unsupported(self, case: "CaseSpec", device: "torch.device") -> str | None:
        """Why this project cannot run `case` on `device` (a kernel the library does not have),
        or None. Such a case is set aside as `not_applicable` with this text: counted and listed,
        never broken, never part of a verdict."""
        if case.family not in self.families():
            return (f"the {self.name} adapter has no kernel family {case.family!r} "
                    f"(it has {sorted(self.families())}); remove it from the project's battery")
        return None

    def describe(self) -> dict[str, str]:
        """What was loaded, as short strings: the adapter, its module and, when an override says
        so, the library's version and the path it was loaded from. Called once in the kernel host
        after `load()`; the host's ready line carries it, every run stores it
        (`environment_detail["adapter"]`) and the run page shows it, so a result says which
        library version produced it. Override to add `version` and `library`."""
        return {"adapter": self.name, "module": type(self).__module__}
