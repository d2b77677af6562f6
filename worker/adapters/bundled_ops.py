"""Python face of one build of the bundled optimizer kernels (csrc/).

`load_build(path)` loads a compiled library into this process (once: the op namespace `optdrift`
is process-global, so a second, different build needs its own process) and registers a fake
(meta) implementation of every op, so fake tensors, torch.compile and `torch.library.opcheck` see
the ops' in-place effects. The typed wrappers below call `torch.ops.optdrift.*`; `step()` drives any
optimizer generically from the names in `OPTIMIZER_STATES` and a hyperparameter dict.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from service.core.optimizers import EXPLICIT_HYPER, OPTIMIZERS, names_where

NAMESPACE = "optdrift"

# Each optimizer's state tensors (float32, shaped like the parameter, zero-initialised) in the
# order the op's schema takes them, so an engine can allocate and pass them generically
# (service.core.optimizers' table).
OPTIMIZER_STATES: dict[str, tuple[str, ...]] = {name: row.state_names for name, row in OPTIMIZERS.items()}

_SUPPORTED_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_load_lock = threading.Lock()
_loaded_path: Path | None = None
_loaded_sha256: str | None = None


class BuildAlreadyLoadedError(RuntimeError):
    """A different build of the kernels is already loaded into this process."""


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _ops_registered() -> bool:
    # Resolving an op that no library defined raises AttributeError.
    return hasattr(getattr(torch.ops, NAMESPACE), "adam_step")


def load_build(library_path: str | Path) -> Path:
    """Load one build's shared library into this process; idempotent for the same build.

    Loading a second, different build raises `BuildAlreadyLoadedError`: both would register the
    same `optdrift::*` ops, so two builds must be compared from two processes (one kernel host
    each). A byte-identical copy at another path counts as the same build.
    """
    global _loaded_path, _loaded_sha256
    path = Path(library_path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"kernel library {path} does not exist; build csrc first")
    with _load_lock:
        sha256 = _file_sha256(path)
        if _loaded_path is not None:
            if sha256 == _loaded_sha256:
                return _loaded_path
            raise BuildAlreadyLoadedError(
                f"this process already holds the kernel build {_loaded_path} (sha256 "
                f"{_loaded_sha256[:16]}); {path} (sha256 {sha256[:16]}) is a different build of "
                f"the same '{NAMESPACE}' ops and cannot be loaded beside it. Load it in a "
                "separate process (one kernel host per build)."
            )
        if _ops_registered():
            raise BuildAlreadyLoadedError(
                f"'{NAMESPACE}' ops are already registered in this process by a library that was "
                f"not loaded through load_build; cannot also load {path}. Use a fresh process."
            )
        torch.ops.load_library(str(path))
        _register_fakes()
        _loaded_path, _loaded_sha256 = path, sha256
        return path


# ---------------------------------------------------------------- fake (meta) implementations


def _check_tensors_fake(op: str, param, grad, states: Mapping[str, torch.Tensor]) -> None:
    """The tensor checks of csrc/checks.h, for fake/meta tensors that never reach C++."""
    if param.dtype not in _SUPPORTED_PARAM_DTYPES:
        raise RuntimeError(
            f"{op}: argument 'param' has dtype {param.dtype}; supported parameter dtypes are "
            "float32, float16 and bfloat16"
        )
    if grad.dtype != param.dtype:
        raise RuntimeError(
            f"{op}: argument 'grad' has dtype {grad.dtype} but 'param' is {param.dtype}; pass "
            "the gradient in the parameter's dtype"
        )
    named = [("grad", grad, False), *((name, t, True) for name, t in states.items())]
    for name, tensor, is_state in named:
        kind = "state argument" if is_state else "argument"
        if is_state and tensor.dtype != torch.float32:
            raise RuntimeError(
                f"{op}: {kind} '{name}' has dtype {tensor.dtype}; optimizer states are float32"
            )
        if tensor.device != param.device:
            raise RuntimeError(
                f"{op}: {kind} '{name}' is on {tensor.device} but 'param' is on {param.device}; "
                "put all tensors on one device"
            )
        if tensor.numel() != param.numel():
            raise RuntimeError(
                f"{op}: {kind} '{name}' has {tensor.numel()} elements but 'param' has "
                f"{param.numel()}"
            )
    for name, tensor in [("param", param), ("grad", grad), *states.items()]:
        if not tensor.is_contiguous():
            raise RuntimeError(f"{op}: argument '{name}' must be contiguous")


def _arguments(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict:
    """An op call's arguments by schema name, however the caller passed them."""
    return {**dict(zip(names, args)), **kwargs}


def _fake_32bit(optimizer: str) -> Callable[..., None]:
    """The fake of `<optimizer>_step`, from its table row (schema: param, grad, states, scalars)."""
    row, op = OPTIMIZERS[optimizer], f"{NAMESPACE}::{optimizer}_step"
    names = ("param", "grad", *row.state_names, *row.scalar_order)

    def fake(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        given = _arguments(names, args, kwargs)
        _check_tensors_fake(op, given["param"], given["grad"], {name: given[name] for name in row.state_names})

    return fake


def _register_fakes() -> None:
    """A fake of every op of every optimizer (the 8-bit and multi-tensor makers are further down).
    The ops mutate their inputs and return nothing, so a fake only has to validate. A build of a
    tree from before the multi-tensor ops has none of them to fake."""
    makers = {"step": _fake_32bit, "8bit_blockwise_step": _fake_8bit}
    if has_multi_ops():
        makers["multi_step"] = _fake_multi
    for optimizer in OPTIMIZERS:
        for suffix, make in makers.items():
            torch.library.register_fake(f"{NAMESPACE}::{optimizer}_{suffix}", make(optimizer))


# ------------------------------------------------------------------------- typed wrappers
# One per optimizer, made from its row of service.core.optimizers: `<name>_step(param, grad,
# *states, step=..., lr=..., weight_decay=..., <hyperparameters>)`. Defaults are the table's
# (torch.optim's or the papers'); step, lr and weight_decay are always explicit because the
# battery's cases differ exactly there.


def _ops():
    if _loaded_path is None:
        raise RuntimeError("no kernel build is loaded in this process; call load_build(path) first")
    return torch.ops.optdrift


def _typed_wrapper(optimizer: str) -> Callable[..., None]:
    row, op_name, required = OPTIMIZERS[optimizer], f"{optimizer}_step", inspect.Parameter.empty
    defaults: dict[str, object] = {name: required for name in (("step",) if row.takes_step else ()) + EXPLICIT_HYPER}
    defaults.update((name, value) for name, value in row.hyper.items() if name not in EXPLICIT_HYPER)

    def wrapper(param, grad, *states, **hyper) -> None:  # noqa: ANN001, ANN002, ANN003
        unknown = sorted(set(hyper) - set(defaults))
        missing = [name for name, default in defaults.items() if default is required and name not in hyper]
        if len(states) != len(row.states) or unknown or missing:
            raise TypeError(f"{op_name}() takes param, grad, the states {row.state_names} and the keyword "
                            f"arguments {list(defaults)}; got {len(states)} states, unknown {unknown}, "
                            f"missing {missing}")
        values = {**defaults, **hyper}
        getattr(_ops(), op_name)(param, grad, *states, *(values[name] for name in row.scalar_order))

    wrapper.__name__ = wrapper.__qualname__ = op_name
    wrapper.__doc__ = f"One in-place step of {NAMESPACE}::{op_name} (its row: service.core.optimizers)."
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    wrapper.__signature__ = inspect.Signature(
        [inspect.Parameter(name, positional) for name in ("param", "grad", *row.state_names)]
        + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=value,
                             annotation="int" if name == "step" else "bool" if isinstance(value, bool) else "float")
           for name, value in defaults.items()],
        return_annotation="None")
    return wrapper


_WRAPPERS: dict[str, Callable[..., None]] = {optimizer: _typed_wrapper(optimizer) for optimizer in OPTIMIZERS}
# Each wrapper under its op's name as well (bundled_ops.adam_step, ...), as benchmarks call them.
globals().update({wrapper.__name__: wrapper for wrapper in _WRAPPERS.values()})

# Optimizers whose update depends on the step number (bias correction, first-step buffer).
STEP_DEPENDENT = frozenset(names_where(takes_step=True))


def step(optimizer: str, param: torch.Tensor, grad: torch.Tensor,
         states: Mapping[str, torch.Tensor], *, step: int, hyper: Mapping[str, float | bool]) -> None:
    """One in-place update of `param` and `states` by the named optimizer.

    `states` maps the names in OPTIMIZER_STATES[optimizer] to float32 tensors; `hyper` holds the
    wrapper's keyword arguments (lr, weight_decay, betas, ...). `step` is 1-based and ignored by
    the optimizers that do not use it.
    """
    bind_step(optimizer, param, grad, states, hyper=hyper)(step)


def bind_step(optimizer: str, param: torch.Tensor, grad: torch.Tensor,
              states: Mapping[str, torch.Tensor], *, hyper: Mapping[str, float | bool]) -> Callable[[int], None]:
    """`step` with everything but the step number checked and bound once: the returned function
    makes exactly the op call `step` makes (same op, same arguments), without re-validating
    names and hyperparameters on every call. The fast battery runner calls it ~10^5 times a run."""
    try:
        wrapper = _WRAPPERS[optimizer]
    except KeyError:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; known: {', '.join(sorted(_WRAPPERS))}"
        ) from None
    expected = OPTIMIZER_STATES[optimizer]
    if set(states) != set(expected):
        raise ValueError(
            f"optimizer {optimizer!r} takes states {expected}, got {tuple(states)}"
        )
    kwargs = _checked_hyper(optimizer, hyper)
    tensors = (param, grad, *(states[name] for name in expected))
    # The wrapper's call, made positionally on the op's overload: every scalar in schema order,
    # defaults filled in as the wrapper fills them.
    op = getattr(_ops(), f"{optimizer}_step").default
    full = {name: kwargs.get(name, default) for name, default in _keyword_defaults(optimizer).items()}
    order = [argument.name for argument in op._schema.arguments][len(tensors):]
    assert wrapper is _WRAPPERS[optimizer] and set(order) == set(full), (order, sorted(full))
    if order[0] == "step":
        return BoundOp(op, tensors, [full[name] for name in order[1:]], takes_step=True)
    return BoundOp(op, [*tensors, *(full[name] for name in order)], [], takes_step=False)


class BoundOp:
    """One case's op call with every argument fixed but the step number (which, where the op takes
    one, comes right after the tensors): `bound(step)` makes the call. worker.engine.call_loop makes
    the same call from C++ when the harness library is loaded (tests/worker/engine/test_call_loop.py)."""

    __slots__ = ("op", "head", "tail", "takes_step")

    def __init__(self, op: torch._ops.OpOverload, head: list | tuple, tail: list, *, takes_step: bool) -> None:
        self.op, self.head, self.tail, self.takes_step = op, tuple(head), tuple(tail), takes_step

    def __call__(self, step: int) -> None:
        if self.takes_step:
            self.op(*self.head, step, *self.tail)
        else:
            self.op(*self.head)

    def arguments(self) -> tuple[list, int]:
        """Every argument in schema order with 0 in the step's place, and that place (-1: none)."""
        if self.takes_step:
            return [*self.head, 0, *self.tail], len(self.head)
        return list(self.head), -1


def _checked_hyper(optimizer: str, hyper: Mapping[str, float | bool]) -> dict[str, float | bool]:
    """`hyper` as keyword arguments, refused with every unknown and missing name at once."""
    kwargs = dict(hyper)
    accepted = hyperparameters(optimizer)
    names = set(kwargs) | ({"step"} if optimizer in STEP_DEPENDENT else set())
    unknown = names - set(accepted)
    missing = {name for name, required in accepted.items() if required} - names
    if unknown or missing:
        raise ValueError(
            f"bad hyperparameters for {optimizer!r}: unknown {sorted(unknown)}, missing "
            f"{sorted(missing)}; it takes {sorted(accepted)}"
        )
    return kwargs


def hyperparameters(optimizer: str) -> dict[str, bool]:
    """Keyword arguments of an optimizer's wrapper (step included) -> whether each is required."""
    return {name: default is inspect.Parameter.empty for name, default in _keyword_defaults(optimizer).items()}


@functools.cache
def _keyword_defaults(optimizer: str) -> dict[str, object]:
    """The wrapper's keyword arguments in order -> default (inspect.Parameter.empty: required).
    Read once per optimizer: the fast engine binds ~10^3 cases a run, and inspect.signature costs
    tens of microseconds a call."""
    return {name: parameter.default for name, parameter in inspect.signature(_WRAPPERS[optimizer]).parameters.items()
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY}


# =============================================================================================
# 8-bit blockwise ops (issue 6): csrc/cpu/blockwise8.cpp, csrc/cuda/blockwise8.cu, schemas at the
# end of csrc/ops.cpp. Each state is a pair (uint8 codes shaped like the parameter, float32 absmax
# per block of 256); the maps come from worker.references.quant_map. Everything 8-bit lives below this line.
# =============================================================================================

from worker.references import quant_map as _quant_map  # noqa: E402  (the 8-bit section is appended)

# State names per optimizer (as OPTIMIZER_STATES) and whether each is quantized with the signed map.
STATE_SIGNED_8BIT: dict[str, tuple[bool, ...]] = {
    name: tuple(state.signed for state in row.states) for name, row in OPTIMIZERS.items()}


def _check_8bit_fake(op: str, param, grad, states: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                     maps: Mapping[str, torch.Tensor]) -> None:
    """The shape/dtype/device checks of csrc/blockwise8_checks.h for fake tensors (map values,
    which need data, are only checked by the real kernels)."""
    _check_tensors_fake(op, param, grad, {})
    blocks = _quant_map.num_blocks(param.numel())
    for name, (codes, absmax) in states.items():
        if codes.dtype != torch.uint8 or codes.numel() != param.numel() or codes.device != param.device:
            raise RuntimeError(f"{op}: state argument '{name}_codes' must be uint8 with one code per "
                               f"parameter element on {param.device}; got {codes.dtype}, "
                               f"{codes.numel()} elements, {codes.device}")
        if absmax.dtype != torch.float32 or absmax.numel() != blocks or absmax.device != param.device:
            raise RuntimeError(f"{op}: argument '{name}_absmax' must be float32 with {blocks} elements "
                               f"(one per block of {_quant_map.BLOCK_SIZE}) on {param.device}; got "
                               f"{absmax.dtype}, {absmax.numel()} elements, {absmax.device}")
    for name, qmap in maps.items():
        if qmap.dtype != torch.float32 or qmap.shape != (_quant_map.MAP_SIZE,) or qmap.device != param.device:
            raise RuntimeError(f"{op}: argument '{name}' must be {_quant_map.MAP_SIZE} float32 values "
                               f"on {param.device}; got {qmap.dtype} {tuple(qmap.shape)} on {qmap.device}")


def _fake_8bit(optimizer: str) -> Callable[..., None]:
    """The fake of `<optimizer>_8bit_blockwise_step`, from its table row (schema: param, grad, each
    state's codes and absmax, the maps, scalars)."""
    row, op = OPTIMIZERS[optimizer], f"{NAMESPACE}::{optimizer}_8bit_blockwise_step"
    maps = tuple(f"{kind}_map" for kind in row.state_maps)
    names = ("param", "grad", *(f"{state}_{part}" for state in row.state_names for part in ("codes", "absmax")),
             *maps, *row.scalar_order)

    def fake(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        given = _arguments(names, args, kwargs)
        _check_8bit_fake(op, given["param"], given["grad"],
                         {state: (given[f"{state}_codes"], given[f"{state}_absmax"]) for state in row.state_names},
                         {name: given[name] for name in maps})

    return fake




def new_states_8bit(optimizer: str, param: torch.Tensor, signed_map: torch.Tensor,
                    unsigned_map: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Zero 8-bit states for `optimizer`: name -> (codes at the map's 0, absmax zeros)."""
    states = {}
    for name, signed in zip(OPTIMIZER_STATES[optimizer], STATE_SIGNED_8BIT[optimizer]):
        states[name] = _quant_map.new_state(param.numel(), signed_map if signed else unsigned_map,
                                            param.device)
        states[name] = (states[name][0].view(param.shape), states[name][1])
    return states


def step_8bit(optimizer: str, param: torch.Tensor, grad: torch.Tensor,
              states: Mapping[str, tuple[torch.Tensor, torch.Tensor]], *, step: int,
              hyper: Mapping[str, float | bool], signed_map: torch.Tensor,
              unsigned_map: torch.Tensor) -> None:
    """One in-place 8-bit blockwise update (the 8-bit counterpart of `step`).

    `states` maps the names in OPTIMIZER_STATES[optimizer] to (codes, absmax) pairs; `hyper` holds
    the same keyword arguments as the 32-bit wrapper of the optimizer (validated the same way).
    """
    bind_step_8bit(optimizer, param, grad, states, hyper=hyper, signed_map=signed_map,
                   unsigned_map=unsigned_map)(step)


# Scalars in schema order (csrc/ops.cpp), and the maps each 8-bit op takes (the table's; its test
# holds them to the schemas: tests/service/core/test_optimizers.py).
_SCALAR_ORDER_8BIT = {name: row.scalar_order for name, row in OPTIMIZERS.items()}
_MAPS_8BIT = {name: row.state_maps for name, row in OPTIMIZERS.items()}


def bind_step_8bit(optimizer: str, param: torch.Tensor, grad: torch.Tensor,
                   states: Mapping[str, tuple[torch.Tensor, torch.Tensor]], *,
                   hyper: Mapping[str, float | bool], signed_map: torch.Tensor,
                   unsigned_map: torch.Tensor) -> Callable[[int], None]:
    """`step_8bit` checked and bound once, as `bind_step` is for the 32-bit ops."""
    if optimizer not in STATE_SIGNED_8BIT:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(sorted(STATE_SIGNED_8BIT))}")
    expected = OPTIMIZER_STATES[optimizer]
    if set(states) != set(expected):
        raise ValueError(f"optimizer {optimizer!r} takes states {expected}, got {tuple(states)}")
    kwargs = _checked_hyper(optimizer, hyper)
    # Fill the wrapper's defaults so the op call can be positional, schema order.
    full = {name: kwargs.get(name, default) for name, default in _keyword_defaults(optimizer).items()}
    tensors = [param, grad]
    for name in expected:
        tensors += list(states[name])
    tensors += [{"signed": signed_map, "unsigned": unsigned_map}[kind] for kind in _MAPS_8BIT[optimizer]]
    op = getattr(_ops(), f"{optimizer}_8bit_blockwise_step").default
    order = _SCALAR_ORDER_8BIT[optimizer]
    if order[0] == "step":
        return BoundOp(op, tensors, [full[name] for name in order[1:]], takes_step=True)
    return BoundOp(op, [*tensors, *(full[name] for name in order)], [], takes_step=False)


# =============================================================================================
# Multi-tensor ops (issue 45): csrc/multi_tensor.h, csrc/cpu/multi_tensor.cpp,
# csrc/cuda/multi_tensor.cu, schemas at the end of csrc/ops.cpp. ONE op call steps every tensor of
# an optimizer (all its param groups); the op keeps the shared state (per-tensor step counters,
# per-group beta powers) in two CPU tensors the caller allocates once (`new_multi_state`).
# =============================================================================================

# Optimizers whose multi-tensor op keeps per-group beta powers (float32 [groups, 3]).
MULTI_BETA_POWERS = frozenset(names_where(bias_corrected=True))
BETA_POWER_COLUMNS = 3  # per group: the step the row was made for, beta1^t, beta2^t


def multi_state_lists(optimizer: str) -> tuple[str, ...]:
    """The op's state list arguments, in schema order ("exp_avgs", "exp_avg_sqs" for Adam)."""
    return tuple(f"{name}s" for name in OPTIMIZER_STATES[optimizer])


def new_multi_state(optimizer: str, tensors: int, groups: int) -> dict[str, torch.Tensor]:
    """The op's shared state, fresh: "steps" (int64 [tensors], zeros: no step taken) and, for Adam
    and AdEMAMix, "beta_powers" (float32 [groups, 3], zeros: nothing cached). Both on the CPU,
    where the op's host code reads and advances them whatever the tensors' device."""
    state = {"steps": torch.zeros(tensors, dtype=torch.int64)}
    if optimizer in MULTI_BETA_POWERS:
        state["beta_powers"] = torch.zeros(groups, BETA_POWER_COLUMNS, dtype=torch.float32)
    return state


def _multi_hyper_lists(optimizer: str, op: torch._ops.OpOverload,
                       group_hypers: list[Mapping[str, float | bool]]) -> list[list]:
    """Per schema hyperparameter list (float[] / bool[] arguments, in order), one value per group:
    each group's hyper checked as the one-tensor wrappers check theirs, defaults filled in."""
    full = []
    for group, hyper in enumerate(group_hypers):
        try:
            kwargs = _checked_hyper(optimizer, hyper)
        except ValueError as error:
            raise ValueError(f"param group {group}: {error}") from None
        full.append({name: kwargs.get(name, default) for name, default in _keyword_defaults(optimizer).items()})
    names = [argument.name for argument in op._schema.arguments if str(argument.type) in ("List[float]", "List[bool]")]
    return [[group[name] for group in full] for name in names]


def bind_multi_step(optimizer: str, params: list[torch.Tensor], grads: list[torch.Tensor],
                    states: Mapping[str, list[torch.Tensor]], shared: Mapping[str, torch.Tensor],
                    group_of: list[int], group_hypers: list[Mapping[str, float | bool]]) -> Callable[[], None]:
    """One `<optimizer>_multi_step` call over these lists, its arguments checked and fixed once:
    `states` maps the one-tensor state names ("exp_avg") to one tensor per param, `shared` is
    new_multi_state's dict, `group_of[i]` tensor i's param group, `group_hypers[g]` group g's
    hyperparameters (the one-tensor wrapper's keyword arguments). The returned function makes the
    call; the op advances the counters itself, so it takes no step number."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(sorted(OPTIMIZER_STATES))}")
    expected = OPTIMIZER_STATES[optimizer]
    if set(states) != set(expected):
        raise ValueError(f"optimizer {optimizer!r} takes states {expected}, got {tuple(states)}")
    wanted = {"steps", "beta_powers"} if optimizer in MULTI_BETA_POWERS else {"steps"}
    if set(shared) != wanted:
        raise ValueError(f"optimizer {optimizer!r} keeps shared state {sorted(wanted)}, got {sorted(shared)}")
    op = getattr(_ops(), f"{optimizer}_multi_step").default
    hyper_lists = _multi_hyper_lists(optimizer, op, list(group_hypers))
    arguments = [list(params), list(grads), *(list(states[name]) for name in expected), shared["steps"]]
    if optimizer in MULTI_BETA_POWERS:
        arguments.append(shared["beta_powers"])
    arguments += [list(group_of), *hyper_lists]
    return lambda: op(*arguments)


def multi_step(optimizer: str, params: list[torch.Tensor], grads: list[torch.Tensor],
               states: Mapping[str, list[torch.Tensor]], shared: Mapping[str, torch.Tensor],
               group_of: list[int], group_hypers: list[Mapping[str, float | bool]]) -> None:
    """One step of every tensor by the named optimizer's multi-tensor op (see bind_multi_step)."""
    bind_multi_step(optimizer, params, grads, states, shared, group_of, group_hypers)()


def _check_multi_fake(op: str, params, grads, state_lists: Mapping[str, list], group_of) -> None:
    """The list checks of csrc/multi_tensor_checks.cpp for fake tensors, tensor by tensor."""
    for name, values in [("grads", grads), *state_lists.items(), ("group_of", group_of)]:
        if len(values) != len(params):
            raise RuntimeError(f"{op}: '{name}' has {len(values)} entries but 'params' has {len(params)}")
    for index, (param, grad) in enumerate(zip(params, grads)):
        _check_tensors_fake(f"{op} (tensor {index})", param, grad,
                            {name: values[index] for name, values in state_lists.items()})


def has_multi_ops() -> bool:
    """Whether the loaded build has the multi-tensor ops (a build of a tree from before them has not)."""
    # torch.ops directly: load_build registers the fakes before it records the build as loaded.
    return hasattr(getattr(torch.ops, NAMESPACE), "adam_multi_step")


def _fake_multi(optimizer: str) -> Callable[..., None]:
    """The fake of `<optimizer>_multi_step`, from its table row (schema: params, grads, a list per
    state, steps, beta_powers where it keeps them, group_of, a list per hyperparameter)."""
    row, op = OPTIMIZERS[optimizer], f"{NAMESPACE}::{optimizer}_multi_step"
    lists = multi_state_lists(optimizer)
    names = ("params", "grads", *lists, "steps", *(("beta_powers",) if optimizer in MULTI_BETA_POWERS else ()),
             "group_of", *row.hyper)

    def fake(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        given = _arguments(names, args, kwargs)
        _check_multi_fake(op, given["params"], given["grads"], {name: given[name] for name in lists},
                          given["group_of"])

    return fake
