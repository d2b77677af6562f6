"""Does a family table keep the adapter contract? Run the same cases through both engines and
compare every per-step digest (docs/PROJECTS.md, "The adapter contract").

The one-case engine (run_case) opens one case at a time; the fast engine opens a whole wave at
once and interleaves their steps. An adapter whose cases leak into each other (one library
optimizer behind per-case wrappers, objects found again by address) gives other digests in one
of the two, so a mismatch is a contract failure of the adapter, named with the cases that show it.
Use a few cases that differ in their hyperparameters (betas) and sizes, so a shared object shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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
