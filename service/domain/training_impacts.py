"""Training-impact jobs (issue 46): open one for a run against its baseline (automatically after the
co-run of a changed commit, or on request for any pair of finished runs), hand it to a worker
(claim, inputs, progress, finish) and read it (the API, the pages, the CLI, the PR comment).

The configurations trained come from the pair's changed cases (service.core.training.configs_from_cases):
a pair whose trajectories do not differ gets a row that says so (not_needed) and no work.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from pydantic import BaseModel
from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.core.results import CaseSpec
from service.core.training import (
    MODEL_SETS, ModelImpact, TrainingImpact, TrainingProgress, configs_from_cases,
)
from service.core.verdicts import compare_runs
from service.db.models import DONE, Run, Verdict
from service.db.training_models import (  # noqa: F401 - the statuses: run_store reads them here
    TRAINING_DONE, TRAINING_FAILED, TRAINING_NOT_NEEDED, TRAINING_QUEUED, TRAINING_RUNNING, TrainingImpactJob,
)
from service.domain import trajectories
from service.db.token_models import TokenRun
from service.domain.auth import ScopeDenied
from service.domain.errors import BadInputError, NotFoundError


class TrainingInputs(BaseModel):
    """What the worker needs: both runs' ids, their source digests and kinds, the cases that changed."""

    job_id: int
    run_id: int
    baseline_run_id: int
    model_set: str
    changed: list[CaseSpec]


def _done_run(session: Session, run_id: int, what: str) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFoundError(f"{what} {run_id} does not exist")
    if run.status != DONE:
        raise BadInputError(f"{what} {run_id} is {run.status}, not done: a training impact compares two finished runs")
    return run


def changed_cases(session: Session, run: Run, baseline: Run) -> list[CaseSpec]:
    """The cases whose trajectories differ between the two runs (the verdict's rule), as run."""
    result = trajectories.run_result(session=session, run=run)  # every stored trajectory: read once
    comparison = compare_runs(result, trajectories.run_result(session=session, run=baseline))
    changed = {case.case_id for case in comparison.cases if case.verdict == "changed"}
    return [case_result.case for case_result in result.cases if case_result.case.case_id in changed]


def open_job(*, session: Session, run_id: int, baseline_run_id: int | None = None, model_set: str = "quick",
             requested_by: str = "automatic") -> tuple[TrainingImpactJob, bool]:
    """The job of `run_id` against `baseline_run_id` (default: the run's verdict's baseline) with
    `model_set`: the existing row when there is one (a failed one is queued again), else a new
    queued row, or a not_needed one when no trajectory differs. Committed. Also whether this call
    queued it (a new row, or a failed one again): only then does the broker get a message."""
    if model_set not in MODEL_SETS:
        raise BadInputError(f"model_set must be one of {sorted(MODEL_SETS)}, got {model_set!r}")
    run = _done_run(session, run_id, "run")
    if baseline_run_id is None:
        verdict = session.scalar(select(Verdict).where(Verdict.run_id == run_id))
        baseline_run_id = verdict.baseline_run_id if verdict is not None else None
        if baseline_run_id is None:
            raise BadInputError(f"run {run_id} has no baseline: name one (baseline_run_id) to compare it with")
    if baseline_run_id == run_id:
        raise BadInputError("a run's training impact is measured against another run, not itself")
    baseline = _done_run(session, baseline_run_id, "baseline run")
    if baseline.project_id != run.project_id:
        raise BadInputError(f"run {run_id} and baseline run {baseline_run_id} belong to different projects")
    if baseline.environment != run.environment:
        raise BadInputError(f"run {run_id} ran in {run.environment!r} and baseline run {baseline_run_id} in "
                            f"{baseline.environment!r}: both sides train on one worker of one environment")
    row = find(session=session, run_id=run_id, baseline_run_id=baseline_run_id, model_set=model_set)
    if row is not None:
        if row.status != TRAINING_FAILED:
            return row, False
        row.status, row.error, row.worker, row.started_at, row.finished_at = TRAINING_QUEUED, None, None, None, None
        row.runs_done = 0
        session.commit()
        return row, True
    changed = changed_cases(session, run, baseline)
    row = TrainingImpactJob(project_id=run.project_id, run_id=run_id, baseline_run_id=baseline_run_id,
                            model_set=model_set, environment=run.environment, requested_by=requested_by[:100],
                            status=TRAINING_QUEUED if changed else TRAINING_NOT_NEEDED,
                            runs_done=0, runs_total=_runs_total(changed, model_set),
                            error=None if changed else "no trajectory differs between the two runs: nothing to train")
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:  # opened a moment ago by another request, which sends it
        return find(session=session, run_id=run_id, baseline_run_id=baseline_run_id, model_set=model_set), False
    session.commit()
    return row, row.status == TRAINING_QUEUED


def check_verify_request(*, session: Session, token_id: int, run_id: int, baseline_run_id: int | None) -> None:
    """A verify-scoped token may ask for the training impact of a verify run it submitted, against
    that run's baseline; anything else is refused (ScopeDenied: 403) saying what it may ask."""
    owned = session.scalar(select(TokenRun.id).where(TokenRun.token_id == token_id, TokenRun.run_id == run_id))
    if owned is None:
        raise ScopeDenied(f"a verify token asks for the training impact of its own verify runs; run {run_id} "
                          f"is not one of them (a submit token may ask for any run of the project)")
    if baseline_run_id is not None:
        verdict = session.scalar(select(Verdict).where(Verdict.run_id == run_id))
        if verdict is None or verdict.baseline_run_id != baseline_run_id:
            raise ScopeDenied("a verify token compares its run with the run's own baseline; leave baseline_run_id "
                              "out (a submit token may name another run)")


def _runs_total(changed: list[CaseSpec], model_set: str) -> int:
    spec = MODEL_SETS[model_set]
    return len(configs_from_cases(changed, spec.max_configs)) * len(spec.models) * spec.seeds * 3


def find(*, session: Session, run_id: int, baseline_run_id: int, model_set: str) -> TrainingImpactJob | None:
    return session.scalar(select(TrainingImpactJob).where(
        TrainingImpactJob.run_id == run_id, TrainingImpactJob.baseline_run_id == baseline_run_id,
        TrainingImpactJob.model_set == model_set))


def latest_for_run(*, session: Session, run_id: int) -> TrainingImpactJob | None:
    """The run's most recent job (the automatic one unless someone asked for another since)."""
    return session.scalar(select(TrainingImpactJob).where(TrainingImpactJob.run_id == run_id)
                          .order_by(TrainingImpactJob.id.desc()).limit(1))


def for_runs(*, session: Session, run_ids: list[int]) -> dict[int, TrainingImpactJob]:
    """Each run's most recent job, for a page of runs (one query)."""
    if not run_ids:
        return {}
    rows = session.scalars(select(TrainingImpactJob).where(TrainingImpactJob.run_id.in_(run_ids))
                           .order_by(TrainingImpactJob.id)).all()
    return {row.run_id: row for row in rows}


def lookup(*, session: Session, job_id: int) -> TrainingImpactJob | None:
    return session.get(TrainingImpactJob, job_id)


def get(*, session: Session, job_id: int) -> TrainingImpactJob:
    row = lookup(session=session, job_id=job_id)
    if row is None:
        raise NotFoundError(f"training impact {job_id} does not exist")
    return row


def view(row: TrainingImpactJob, *, curves: bool = True) -> TrainingImpact:
    """The row as the API serves it; `curves=False` leaves the per-step losses out (lists, badges)."""
    results = [ModelImpact.model_validate(result) for result in (row.results or [])]
    if not curves:
        results = [result.model_copy(update={"curves": None}) for result in results]
    return TrainingImpact(id=row.id, run_id=row.run_id, baseline_run_id=row.baseline_run_id, status=row.status,
                          model_set=row.model_set, device=row.device,
                          progress=TrainingProgress(runs_done=row.runs_done, runs_total=row.runs_total, phase=row.phase),
                          results=results, error=row.error, seconds=row.seconds)


# ---- the worker's side (through service.run_store)
def claim(*, session: Session, job_id: int, worker: str, stale_after_s: float | None = None) -> bool:
    """queued -> running for `worker`; False when another worker has it or it is over. A row left
    running longer than `stale_after_s` (its worker died) may be claimed again."""
    now = datetime.now(timezone.utc)
    claimable = TrainingImpactJob.status == TRAINING_QUEUED
    if stale_after_s is not None:
        claimable = or_(claimable, (TrainingImpactJob.status == TRAINING_RUNNING)
                        & (TrainingImpactJob.started_at < now - timedelta(seconds=stale_after_s)))
    claimed = session.execute(update(TrainingImpactJob).where(TrainingImpactJob.id == job_id, claimable)
                              .values(status=TRAINING_RUNNING, worker=worker, started_at=now, runs_done=0))
    session.commit()
    return claimed.rowcount == 1


def inputs(*, session: Session, job_id: int) -> TrainingInputs | None:
    row = session.get(TrainingImpactJob, job_id)
    if row is None:
        return None
    run, baseline = session.get(Run, row.run_id), session.get(Run, row.baseline_run_id)
    if run is None or baseline is None or run.status != DONE or baseline.status != DONE:
        return None
    return TrainingInputs(job_id=job_id, run_id=run.id, baseline_run_id=baseline.id, model_set=row.model_set,
                          changed=changed_cases(session, run, baseline))


def progress(*, session: Session, job_id: int, done: int, total: int, phase: str | None) -> None:
    session.execute(update(TrainingImpactJob).where(TrainingImpactJob.id == job_id)
                    .values(runs_done=done, runs_total=total, phase=phase))
    session.commit()


def finish(*, session: Session, job_id: int, results: list[dict] | None = None, error: str | None = None,
           device: str | None = None, seconds: float | None = None) -> None:
    """done with `results` (ModelImpact JSON), or failed with `error`."""
    row = session.get(TrainingImpactJob, job_id)
    row.status = TRAINING_FAILED if error else TRAINING_DONE
    row.results, row.error, row.device, row.seconds = results, error, device, seconds
    row.phase, row.finished_at = None, datetime.now(timezone.utc)
    session.commit()


def requeue(*, session: Session, job_id: int) -> None:
    """Back to queued (the job yielded to waiting runs and is sent again)."""
    session.execute(update(TrainingImpactJob).where(TrainingImpactJob.id == job_id)
                    .values(status=TRAINING_QUEUED, worker=None, started_at=None, phase=None))
    session.commit()
