"""A build variant's changed cases, attributed (issue 36): when a commit's run in a variant
environment (`cpu+fma`) and its run in the base environment (`cpu`) are both done and their
trajectories differ, the worker that serves both co-runs the two builds on the changed cases
(worker/jobs/environment_attribution.py) and stores per case the per-step max |B − A| and the
numerical attribution (worker/attribution). This module opens those jobs (`open_for`, when a run
finishes), hands them to the worker (claim, inputs, store) and reads them for the comparison
(service/domain/environment_compare.py), where the looks-like label is made
(service/core/environment_attribution.py).

A is always the base environment's run, B the variant's; a comparison asked the other way round
reads the same row.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.core.environments import split
from service.core.results import RunComparison
from service.core.verdicts import compare_runs
from service.db.environment_models import (
    ATTRIBUTION_DONE, ATTRIBUTION_FAILED, ATTRIBUTION_QUEUED, ATTRIBUTION_RUNNING, EnvironmentAttribution,
)
from service.db.models import DONE, Project, Run
from service.domain import trajectories


def changed_case_ids(comparison: RunComparison) -> set[str]:
    """The cases whose trajectories differ (not broken, not nondeterministic): what is co-run."""
    return {case.case_id for case in comparison.cases if case.verdict == "changed"}


def _partners(project: Project, environment: str) -> list[str]:
    """The registered environments `environment` pairs with: a variant's base, or a base's variants."""
    base, variant = split(environment)
    if variant is not None:
        return [base] if base in project.environments else []
    return [name for name in project.environments if split(name)[0] == environment and split(name)[1]]


def _done_commit_run(session: Session, *, commit_id: int, battery: str, environment: str) -> Run | None:
    return session.scalar(select(Run).where(Run.commit_id == commit_id, Run.battery == battery,
                                            Run.environment == environment, Run.kind == "commit",
                                            Run.status == DONE))


def find(*, session: Session, run_a_id: int, run_b_id: int) -> EnvironmentAttribution | None:
    """The attribution of the two runs, whichever of them is the base environment's."""
    return session.scalar(select(EnvironmentAttribution).where(or_(
        (EnvironmentAttribution.run_a_id == run_a_id) & (EnvironmentAttribution.run_b_id == run_b_id),
        (EnvironmentAttribution.run_a_id == run_b_id) & (EnvironmentAttribution.run_b_id == run_a_id))))


def expected(environment_a: str, environment_b: str) -> bool:
    """Whether a finished pair of these environments gets an attribution when it differs: a base
    environment and one of its build variants (one worker serves both)."""
    (base_a, variant_a), (base_b, variant_b) = split(environment_a), split(environment_b)
    return base_a == base_b and (variant_a is None) != (variant_b is None)


def open_for(*, session: Session, run: Run) -> list[EnvironmentAttribution]:
    """When `run` (a commit run) is done: a queued attribution for each finished partner run of its
    commit (its base environment's, or its variants') whose trajectories differ from it. Identical
    digests open none. Committed here; a pair already opened (the partner's worker was as fast) is
    left as it is. Returns the rows opened."""
    if run.kind != "commit" or run.status != DONE or run.commit_id is None:
        return []
    project = session.get(Project, run.project_id)
    opened = []
    for partner in _partners(project, run.environment):
        other = _done_commit_run(session, commit_id=run.commit_id, battery=run.battery, environment=partner)
        if other is None or find(session=session, run_a_id=run.id, run_b_id=other.id) is not None:
            continue
        a, b = (run, other) if split(run.environment)[1] is None else (other, run)
        changed = changed_case_ids(compare_runs(trajectories.run_result(session=session, run=b),
                                                trajectories.run_result(session=session, run=a)))
        if not changed:
            continue
        row = EnvironmentAttribution(project_id=project.id, run_a_id=a.id, run_b_id=b.id, environment_a=a.environment,
                                     environment_b=b.environment, status=ATTRIBUTION_QUEUED,
                                     changed_cases=len(changed))
        try:
            with session.begin_nested():
                session.add(row)
        except IntegrityError:  # the other run's worker opened it a moment ago
            continue
        opened.append(row)
    session.commit()
    return opened


def lookup(*, session: Session, attribution_id: int) -> EnvironmentAttribution | None:
    return session.get(EnvironmentAttribution, attribution_id)


def claim(*, session: Session, attribution_id: int, worker: str, stale_after_s: float | None = None) -> bool:
    """queued -> running for `worker`; False when another worker has it or it is over. A row left
    running longer than `stale_after_s` (its worker died: the broker hands the task out again) may
    be claimed again."""
    now = datetime.now(timezone.utc)
    claimable = EnvironmentAttribution.status == ATTRIBUTION_QUEUED
    if stale_after_s is not None:
        claimable = or_(claimable, (EnvironmentAttribution.status == ATTRIBUTION_RUNNING)
                        & (EnvironmentAttribution.started_at < now - timedelta(seconds=stale_after_s)))
    claimed = session.execute(
        update(EnvironmentAttribution).where(EnvironmentAttribution.id == attribution_id, claimable)
        .values(status=ATTRIBUTION_RUNNING, worker=worker, started_at=now))
    session.commit()
    return claimed.rowcount == 1


def finish(*, session: Session, attribution_id: int, detail: dict | None = None, error: str | None = None) -> None:
    """done with `detail`, or failed with `error`."""
    row = session.get(EnvironmentAttribution, attribution_id)
    row.status = ATTRIBUTION_FAILED if error else ATTRIBUTION_DONE
    row.detail, row.error, row.finished_at = detail, error, datetime.now(timezone.utc)
    session.commit()


def requeue(*, session: Session, attribution_id: int) -> None:
    """Back to queued (the job yielded to waiting runs and is sent again)."""
    session.execute(update(EnvironmentAttribution).where(EnvironmentAttribution.id == attribution_id)
                    .values(status=ATTRIBUTION_QUEUED, worker=None, started_at=None))
    session.commit()
