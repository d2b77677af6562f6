"""One commit in two environments: did the toolchain or the machine change the trajectories?

The same source built and run in environment A and in environment B (two worker queues: `cpu`
and `gpu.sm90`, or a CUDA 12 and a CUDA 13 worker of one architecture) is compared case by case
as a commit is compared with its parent: B's trajectories judged against A's (unchanged, or changed
from step N, closer to or farther from the float64 reference). Where the two environments'
fingerprints differ (torch, CUDA, driver, device, CPU instruction set) the answer names what
differs, so a reader sees which change of the environment moved the trajectories.

For a base environment and its build variant (`cpu`, `cpu+fma`: one worker serves both), the worker
co-runs the two builds on the changed cases (service/domain/environment_attribution.py); once it
has, each changed case carries its per-step max |B − A|, `max_ulps` (in ulps of the case's scale)
and `attribution`: the numerical class, the looks-like call and its label naming the evidence
(service/core/environment_attribution.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.environment_attribution import BuildSide, looks_like
from service.core.results import CaseComparison, EnvironmentFingerprint, RunComparison, RunResult
from service.core.verdicts import compare_runs
from service.db.environment_models import EnvironmentAttribution
from service.db.models import DONE, Commit, Project, Run
from service.domain import environment_attribution, trajectories
from service.domain.errors import BadInputError, ConflictError, NotFoundError
from service.domain.submissions import find_commit

# Fingerprint fields a reader compares, in the order they are named.
_FINGERPRINT_FIELDS = ("device_kind", "device_name", "compute_capability", "cpu_capability", "cpu_isa",
                       "driver_version", "cuda_version", "torch_version", "python_version", "platform")


class EnvironmentSide(BaseModel):
    environment: str
    run_id: int
    build_digest: str | None
    fingerprint: EnvironmentFingerprint | None


class FingerprintChange(BaseModel):
    field: str
    a: str | None
    b: str | None


class CaseEnvironmentAttribution(BaseModel):
    """What one changed case of B against A looks like (service/core/environment_attribution.py)."""

    model_config = ConfigDict(populate_by_name=True)

    numerical_class: str = Field(alias="class", description="worker/attribution's class: rounding-level, semantic, "
                                                            "precision, quantization, or unknown (not analysed)")
    looks_like: str = Field(description="fma-contraction, fast-math, another-compiler, rounding-level, "
                                        "beyond-rounding or not-attributed")
    label: str = Field(description="what a reader reads, naming the flag that differs and the ulps")
    evidence: dict[str, Any] = Field(description="flags_added / flags_removed (B against A), flags (those the "
                                                 "call rests on), compilers, first_divergent_step, first_step_ulps, "
                                                 "peak_ulps")


class EnvironmentCase(CaseComparison):
    max_ulps: float | None = Field(None, description="the largest |B − A| over the steps, in ulps of the case's "
                                                     "scale (the largest |parameter| each element has had)")
    attribution: CaseEnvironmentAttribution | None = None


class EnvironmentRunComparison(RunComparison):
    cases: list[EnvironmentCase] = []


class EnvironmentComparison(BaseModel):
    project: str
    commit: str
    battery: str
    a: EnvironmentSide = Field(description="the environment compared against (the 'baseline')")
    b: EnvironmentSide = Field(description="the environment judged")
    fingerprint_changes: list[FingerprintChange] = Field(
        description="what differs between the two environments' fingerprints (empty: same machine class)")
    same_build: bool = Field(description="both environments built the same digest (the same sources, "
                                         "flags and toolchain): any change is the machine's or the runtime's")
    comparison: EnvironmentRunComparison
    attribution_status: str = Field(
        "none", description="the co-run of the two builds on the changed cases: none (not a base environment and "
                            "its variant, or nothing changed), expected (the worker opens it as the later run "
                            "finishes), queued, running, done, failed")
    attribution_note: str | None = Field(None, description="why none, or what failed")


def fingerprint_changes(a: EnvironmentFingerprint | None, b: EnvironmentFingerprint | None) -> list[FingerprintChange]:
    """The fields of the two fingerprints that differ; none when either is unknown."""
    if a is None or b is None:
        return []
    changes = []
    for name in _FINGERPRINT_FIELDS:
        left, right = getattr(a, name), getattr(b, name)
        if left != right:
            changes.append(FingerprintChange(field=name, a=None if left is None else str(left),
                                             b=None if right is None else str(right)))
    # The references (torch.optim's code, ours), per optimizer whose digest differs: the optimizer's
    # name says which reference moved, the digest's head tells the two apart. Unknown on either side
    # (an older worker): silent.
    if a.references and b.references:
        moved = sorted(name for name in a.references.keys() | b.references.keys()
                       if a.references.get(name) != b.references.get(name))

        def side(references: dict[str, str]) -> str:
            return ", ".join(f"{name} {references.get(name, '-')[:12]}" for name in moved)
        if moved:
            changes.append(FingerprintChange(field="references", a=side(a.references), b=side(b.references)))
    return changes


def _finished_run(session: Session, *, project: Project, commit_id: int, environment: str, battery: str | None,
                  sha: str) -> Run:
    if environment not in project.environments:
        raise BadInputError(f"environment {environment[:60]!r} is not registered for project {project.name!r}; "
                            f"use one of {', '.join(project.environments)}")
    query = select(Run).where(Run.commit_id == commit_id, Run.environment == environment, Run.kind == "commit")
    if battery:
        query = query.where(Run.battery == battery)
    runs = list(session.scalars(query.order_by(Run.id.desc())))
    if not runs:
        raise NotFoundError(f"commit {sha[:12]} has no run in environment {environment!r}"
                            f"{f' with battery {battery!r}' if battery else ''}; submit it there "
                            f"(`optdrift submit --environment {environment}`)")
    done = [run for run in runs if run.status == DONE]
    if not done:
        raise ConflictError(f"commit {sha[:12]}'s run in {environment!r} (run {runs[0].id}) is {runs[0].status}; "
                            "compare once it is done")
    return done[0]


class Side:
    """One environment's finished run of a commit, with its results loaded once."""

    def __init__(self, session: Session, *, project: Project, commit: Commit, environment: str,
                 battery: str | None) -> None:
        self.environment = environment
        self.run = _finished_run(session, project=project, commit_id=commit.id, environment=environment,
                                 battery=battery, sha=commit.sha)
        self.result = trajectories.run_result(session=session, run=self.run)


def compare_sides(project: Project, commit: Commit, a: Side, b: Side,
                  stored: EnvironmentAttribution | None = None) -> EnvironmentComparison:
    """B's results judged against A's (both of `commit`, loaded), with the pair's attribution where
    the worker `stored` it (environment_attribution.find)."""
    if a.run.battery != b.run.battery:
        raise BadInputError(f"the runs used different batteries ({a.run.battery!r} in {a.environment}, "
                            f"{b.run.battery!r} in {b.environment}); name one with `battery`")
    cases = (stored.detail or {}).get("cases", {}) if stored is not None and stored.status == "done" else {}
    diffs = {case_id: case["max_abs_diff_per_step"] for case_id, case in cases.items()
             if case.get("max_abs_diff_per_step")}
    comparison = compare_runs(b.result, a.result, diffs or None)
    status, note = _attribution_state(a, b, comparison, stored)
    return EnvironmentComparison(
        project=project.name, commit=commit.sha, battery=a.run.battery,
        a=_side(a.environment, a.run, a.result), b=_side(b.environment, b.run, b.result),
        fingerprint_changes=fingerprint_changes(a.result.environment, b.result.environment),
        same_build=a.run.build_digest is not None and a.run.build_digest == b.run.build_digest,
        comparison=_with_attribution(comparison, cases, a, b), attribution_status=status, attribution_note=note)


def _attribution_state(a: Side, b: Side, comparison: RunComparison,
                       stored: EnvironmentAttribution | None) -> tuple[str, str | None]:
    if stored is not None:
        return stored.status, stored.error or (stored.detail or {}).get("attribution_error")
    if not environment_attribution.expected(a.environment, b.environment):
        return "none", "attribution co-runs a base environment's build and its build variant's (one worker serves both)"
    if not environment_attribution.changed_case_ids(comparison):
        return "none", "no trajectory differs: nothing to attribute"
    return "expected", "the worker that finished the later of the two runs opens it"


def _with_attribution(comparison: RunComparison, cases: dict[str, dict], a: Side, b: Side) -> EnvironmentRunComparison:
    """The comparison, each changed case with its max_ulps and attribution where stored."""
    build_a = BuildSide.from_detail(a.environment, a.run.environment_detail)
    build_b = BuildSide.from_detail(b.environment, b.run.environment_detail)
    rows = []
    for case in comparison.cases:
        found = (cases.get(case.case_id) or {}).get("attribution") if case.verdict == "changed" else None
        call = looks_like(found, build_a, build_b) if isinstance(found, dict) else None
        peak = found.get("peak_ulps") if isinstance(found, dict) else None
        rows.append(EnvironmentCase(
            **dict(case), max_ulps=float(peak) if isinstance(peak, (int, float)) else None,
            attribution=None if call is None else CaseEnvironmentAttribution(
                numerical_class=call.numerical_class, looks_like=call.kind, label=call.label, evidence=call.evidence)))
    return EnvironmentRunComparison(**{**dict(comparison), "cases": rows})


def compare(*, session: Session, project: Project, ref: str, environment_a: str, environment_b: str,
            battery: str | None = None) -> EnvironmentComparison:
    """Commit `ref` as environment B ran it, judged against environment A's run of it."""
    if environment_a == environment_b:
        raise BadInputError(f"name two different environments (both are {environment_a!r})")
    commit = find_commit(session=session, project=project, ref=ref)
    a = Side(session, project=project, commit=commit, environment=environment_a, battery=battery)
    b = Side(session, project=project, commit=commit, environment=environment_b, battery=battery or a.run.battery)
    return compare_sides(project, commit, a, b,
                         environment_attribution.find(session=session, run_a_id=a.run.id, run_b_id=b.run.id))


def _side(environment: str, run: Run, result: RunResult) -> EnvironmentSide:
    return EnvironmentSide(environment=environment, run_id=run.id, build_digest=run.build_digest,
                           fingerprint=result.environment)
