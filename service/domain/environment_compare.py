"""One commit in two environments: did the toolchain or the machine change the trajectories?

The same source built and run in environment A and in environment B (two worker queues: `cpu`
and `gpu.sm90`, or a CUDA 12 and a CUDA 13 worker of one architecture) is compared case by case
as a commit is compared with its parent: B's trajectories judged against A's (unchanged, or changed
from step N, closer to or farther from the float64 reference). Where the two environments'
fingerprints differ (torch, CUDA, driver, device, CPU instruction set) the answer names what
differs, so a reader sees which change of the environment moved the trajectories.
"""

from __future__ import annotations

from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.results import EnvironmentFingerprint, RunComparison, RunResult
from service.core.verdicts import compare_runs
from service.db.models import DONE, Commit, Project, Run
from service.domain import trajectories
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
    comparison: RunComparison


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


def compare_sides(project: Project, commit: Commit, a: Side, b: Side) -> EnvironmentComparison:
    """B's results judged against A's (both of `commit`, loaded)."""
    if a.run.battery != b.run.battery:
        raise BadInputError(f"the runs used different batteries ({a.run.battery!r} in {a.environment}, "
                            f"{b.run.battery!r} in {b.environment}); name one with `battery`")
    return EnvironmentComparison(
        project=project.name, commit=commit.sha, battery=a.run.battery,
        a=_side(a.environment, a.run, a.result), b=_side(b.environment, b.run, b.result),
        fingerprint_changes=fingerprint_changes(a.result.environment, b.result.environment),
        same_build=a.run.build_digest is not None and a.run.build_digest == b.run.build_digest,
        comparison=compare_runs(b.result, a.result))


def compare(*, session: Session, project: Project, ref: str, environment_a: str, environment_b: str,
            battery: str | None = None) -> EnvironmentComparison:
    """Commit `ref` as environment B ran it, judged against environment A's run of it."""
    if environment_a == environment_b:
        raise BadInputError(f"name two different environments (both are {environment_a!r})")
    commit = find_commit(session=session, project=project, ref=ref)
    a = Side(session, project=project, commit=commit, environment=environment_a, battery=battery)
    b = Side(session, project=project, commit=commit, environment=environment_b, battery=battery or a.run.battery)
    return compare_sides(project, commit, a, b)


def _side(environment: str, run: Run, result: RunResult) -> EnvironmentSide:
    return EnvironmentSide(environment=environment, run_id=run.id, build_digest=run.build_digest,
                           fingerprint=result.environment)
