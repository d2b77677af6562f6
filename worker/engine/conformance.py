"""Does a family table keep the adapter contract? Run the same cases through both engines and
compare every per-step digest (docs/PROJECTS.md, "The adapter contract").

The one-case engine (run_case) opens one case at a time; the fast engine opens a whole wave at
once and interleaves their steps. An adapter whose cases leak into each other (one library
optimizer behind per-case wrappers, objects found again by address) gives other digests in one
of the two, so a mismatch is a contract failure of the adapter, named with the cases that show it.
Use a few cases that differ in their hyperparameters (betas) and sizes, so a shared object shows.

`check_group_lifecycle` does the same for a family's group lifecycle (docs/PROJECTS.md "The group
lifecycle"): one layout case per family (group_check_case), reported as present, missing (not a
failure: such cases read not_applicable) or not run, with the family's unreadable state.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from service.core.results import CaseResult, CaseSpec
from worker.adapters.base import AdapterContractError
from worker.engine.fast import run_cases_fast
from worker.engine.trajectory import FamilyAdapter, run_case


@dataclass(frozen=True)
class EngineMismatch:
    case_id: str
    one_case: str   # "step N: od2:..." / "broken: ..."
    fast: str


def _first_difference(one: CaseResult, fast: CaseResult) -> tuple[str, str] | None:
    if one.status != "ok" or fast.status != "ok":
        if one.status == fast.status and one.message == fast.message:
            return None
        return f"{one.status}: {one.message}", f"{fast.status}: {fast.message}"
    for step, (a, b) in enumerate(zip(one.trajectory.digests, fast.trajectory.digests), start=1):
        if a != b:
            return f"step {step}: {a}", f"step {step}: {b}"
    if len(one.trajectory.digests) != len(fast.trajectory.digests):
        return f"{len(one.trajectory.digests)} steps", f"{len(fast.trajectory.digests)} steps"
    return None


def _one_case(case: CaseSpec, device: torch.device, families: Mapping[str, FamilyAdapter]) -> CaseResult:
    try:
        return run_case(case, device, families=families)
    except Exception as error:  # noqa: BLE001 - compared as the kernel host would report it
        return CaseResult(case=case, status="broken", message=f"{type(error).__name__}: {error}")


def engine_results(cases: list[CaseSpec], device: torch.device | str,
                   families: Mapping[str, FamilyAdapter]) -> list[tuple[CaseResult, CaseResult]]:
    """(run_case's result, the fast engine's result) of every case."""
    device = torch.device(device)
    one_case = [_one_case(case, device, families) for case in cases]
    return list(zip(one_case, run_cases_fast(cases, device, families=families)))


def mismatches(pairs: list[tuple[CaseResult, CaseResult]]) -> list[EngineMismatch]:
    """Every case whose two results differ (status, message or a digest)."""
    found = []
    for one, fast in pairs:
        difference = _first_difference(one, fast)
        if difference is not None:
            found.append(EngineMismatch(one.case.case_id, *difference))
    return found


def compare_engines(cases: list[CaseSpec], device: torch.device | str,
                    families: Mapping[str, FamilyAdapter]) -> list[EngineMismatch]:
    return mismatches(engine_results(cases, device, families))


def check_adapter(adapter_name: str, cases: list[CaseSpec], device: torch.device | str,
                  families: Mapping[str, FamilyAdapter]) -> None:
    """Raise AdapterContractError naming the adapter and each case the two engines disagree on."""
    found = compare_engines(cases, device, families)
    if found:
        shown = "; ".join(f"{m.case_id}: one-case {m.one_case} vs fast {m.fast}" for m in found[:5])
        raise AdapterContractError(
            f"adapter {adapter_name}: the one-case and fast engines disagree on {len(found)} of "
            f"{len(cases)} cases ({shown}). Its cases leak into each other: keep every library "
            "object and state of a case in the handle open() returns (docs/PROJECTS.md)")


# ----------------------------------------------------------------------------- the group lifecycle
# The layout adapter-check runs per family (docs/PROJECTS.md "The group lifecycle"): one optimizer
# over tensors of 1 element, an odd size past one 256-block, 4096 (a block multiple, where 8-bit
# libraries start quantizing) and 1031 (odd, not a block multiple) in two param groups, the second
# without weight decay (the group a user makes for biases and norms).
GROUP_CHECK_SIZES = ((1, 257, 4096), (1031,))
# Steps: at least 3, where a change in how running beta powers are carried first shows (steps 1
# and 2 round alike), at most 8, to keep the check quick.
GROUP_CHECK_STEPS = (3, 8)


def group_check_case(like: CaseSpec) -> CaseSpec:
    """The layout case of `like`'s optimizer, family, dtype, gradient stream and hyperparameters:
    GROUP_CHECK_SIZES in two groups, the first with `like`'s weight decay (0.1 where that is 0, so
    the groups differ), the second with weight decay 0."""
    from service.core.results import ParamLayout, TensorGroupSpec
    from worker.battery import make_case

    first = {**like.hyper, "weight_decay": like.hyper.get("weight_decay") or 0.1}
    layout = ParamLayout(groups=[TensorGroupSpec(sizes=list(GROUP_CHECK_SIZES[0]), hyper=first),
                                 TensorGroupSpec(sizes=list(GROUP_CHECK_SIZES[1]), hyper={**first, "weight_decay": 0.0})])
    low, high = GROUP_CHECK_STEPS
    return make_case(optimizer=like.optimizer, family=like.family, param_dtype=like.param_dtype, hyper=first,
                     gradient=like.gradient, seed=like.seed, size=layout.flat_size,
                     steps=max(low, min(like.steps, high)), layout=layout)


@dataclass(frozen=True)
class GroupLifecycleReport:
    """What adapter-check found for one family's group lifecycle.

    `status`: "yes" (the layout case ran, a run on each engine gave the same digests), "missing" (the
    family has none: GroupLifecycleMissing, the case reads not_applicable), or "not run" (the
    case is unsupported here or its state is not as declared; `detail` says why). `how` says
    whose group lifecycle ran. `unreadable` is the family's UnreadableState declarations, each
    with the `seen_through` names that no digested figure of the case matches (an empty tuple:
    every name is digested)."""

    family: str
    case: CaseSpec | None
    status: str
    detail: str
    how: str = ""
    unreadable: tuple[tuple[Any, tuple[str, ...]], ...] = ()


def _group_how(family: FamilyAdapter) -> str:
    from worker.adapters.base import HandedOverStates

    if type(family).open_group is HandedOverStates.open_group:
        return ("the handed-over default: one step_states call per tensor with its group's hyperparameters "
                "(no state shared between tensors)")
    owner = next(klass for klass in type(family).__mro__ if "open_group" in vars(klass))
    return f"the adapter's own ({owner.__qualname__}.open_group / step_group)"


def _probe(family: FamilyAdapter, case: CaseSpec, device: torch.device) -> list[str]:
    """The names of what the engines digest for `case` after its first step ("parameters" and every
    state leaf, lifecycle.digest_states), read through one fresh group lifecycle. Raises what the
    lifecycle raises: GroupLifecycleMissing where the family has none."""
    from worker.engine import lifecycle
    from worker.engine.gradients import GradientStream, initial_parameters
    from worker.engine.trajectory import TORCH_DTYPES

    dtype = TORCH_DTYPES[case.param_dtype]
    param = initial_parameters(case.seed, case.size).to(dtype).to(device)
    stream = GradientStream(case.gradient, seed=case.seed, size=case.size, device=device, grad_dtype=dtype)
    views = lifecycle.tensor_views(case, param)
    handle = lifecycle.open_group_case(family, case, views, device)
    try:
        family.step_group(handle, views, lifecycle.tensor_views(case, stream.kernel_gradient(1, param)), 1)
        return ["parameters", *(name for name, _ in lifecycle.digest_states(family, handle))]
    finally:
        lifecycle.close_all([(family, handle)])


def _unmatched(seen_through: tuple[str, ...], names: list[str]) -> tuple[str, ...]:
    """The `seen_through` entries no digested name matches (a pattern, fnmatch; "t*.exp_avg" also
    matches the leaves "t2.exp_avg.codes" of a quantized state)."""
    return tuple(pattern for pattern in seen_through
                 if not any(fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*")
                            for name in names))


def check_group_lifecycle(adapter_name: str, family_name: str, candidates: list[CaseSpec],
                          device: torch.device | str, families: Mapping[str, FamilyAdapter],
                          unsupported: Callable[[CaseSpec, torch.device], str | None]) -> GroupLifecycleReport:
    """Run the layout case (group_check_case) of the first of `candidates` (one family's runnable
    cases) the project supports as a layout through both engines. AdapterContractError when the
    engines disagree or the case broke: the adapter's group lifecycle broke the contract."""
    from worker.adapters.base import GroupLifecycleMissing
    from worker.engine import lifecycle

    device = torch.device(device)
    if not candidates:
        return GroupLifecycleReport(family_name, None, "not run", "no case of this family in the battery")
    reasons = []
    for like in candidates:
        case = group_check_case(like)
        why = unsupported(case, device)
        if why is None:
            break
        reasons.append(why)
    else:
        return GroupLifecycleReport(family_name, None, "not run", f"unsupported as a layout case: {reasons[0]}")
    family = lifecycle.family_for(families, case)
    try:
        names = _probe(family, case, device)
    except GroupLifecycleMissing as error:
        return GroupLifecycleReport(family_name, case, "missing", str(error))
    except Exception:  # noqa: BLE001 - the engines below run it again and report it as they would
        names = []
    (one, fast), = engine_results([case], device, families)
    difference = _first_difference(one, fast)
    if difference is not None:
        raise AdapterContractError(
            f"adapter {adapter_name}: family {family_name}'s group lifecycle gives other digests on a second "
            f"run of layout case {case.case_id} (one-case {difference[0]} vs fast {difference[1]}): its optimizer "
            "or state outlives close(), or is shared between cases (docs/PROJECTS.md \"The group lifecycle\")")
    if one.status == "broken":
        raise AdapterContractError(f"adapter {adapter_name}: family {family_name}'s group lifecycle broke on layout "
                                   f"case {case.case_id}: {one.message}")
    if one.status != "ok":
        return GroupLifecycleReport(family_name, case, "not run", one.message or one.status, _group_how(family))
    declared = tuple(family.unreadable_state(case))
    return GroupLifecycleReport(
        family_name, case, "yes", f"a run on each engine gives the same digests over {case.steps} steps", _group_how(family),
        tuple((entry, _unmatched(tuple(entry.seen_through), names)) for entry in declared))
