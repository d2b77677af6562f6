"""Run lifecycle: the run row is the source of truth; every transition is a conditional UPDATE so
two workers (or a worker and the reaper) can never both own a run."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.db.models import (
    ACTIVE_STATUSES, BUILDING, CANCELLED, DONE, ERROR, FAILED, FINAL_STATUSES, QUEUED, RUNNING, Run,
)
from service.domain import redaction
from service.domain.errors import ConflictError, NotFoundError


def _now() -> datetime:
    return datetime.now(timezone.utc)


def get(*, session: Session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFoundError(f"no run with id {run_id}")
    return run


def lookup(*, session: Session, run_id: int) -> Run | None:
    """The run's row as the database has it now (a session held for a job may hold an older copy:
    another worker, the reaper or a cancel wrote it since); None when there is none."""
    return session.get(Run, run_id, populate_existing=True)


def claim(*, session: Session, run_id: int, worker: str) -> bool:
    """queued -> building for this worker; False if someone else has it or it is finished."""
    now = _now()
    result = session.execute(
        update(Run)
        .where(Run.id == run_id, Run.status == QUEUED, Run.cancel_requested.is_(False))
        .values(status=BUILDING, worker=worker, attempt=Run.attempt + 1, started_at=now,
                heartbeat_at=now, error=None, cases_done=0)
    )
    session.commit()
    return result.rowcount == 1


# Whatever a worker sends (its own bounds live in worker/sandbox/log_tail.py): a run's error and build log
# are served to anyone who can read the run.
MAX_ERROR_CHARS = 32 * 1024
MAX_BUILD_LOG_CHARS = 256 * 1024


def _scrubbed(values: dict) -> dict:
    """What a worker stores about its run, with known secrets replaced (service.domain.redaction):
    errors, build logs and run detail are served to anyone who can read the run."""
    for key, limit in (("error", MAX_ERROR_CHARS), ("build_log", MAX_BUILD_LOG_CHARS)):
        if isinstance(values.get(key), str):
            values[key] = redaction.clip(redaction.scrub(values[key]), limit)
    if "environment_detail" in values:
        values["environment_detail"] = redaction.scrub_json(values["environment_detail"])
    return values


def set_status(*, session: Session, run_id: int, worker: str, status: str, **values) -> bool:  # noqa: ANN003
    """Move a run this worker owns to `status`; False if it no longer owns it (reaped)."""
    values = _scrubbed(values)
    now = _now()
    if status in FINAL_STATUSES:
        values.setdefault("finished_at", now)
    result = session.execute(
        update(Run)
        .where(Run.id == run_id, Run.worker == worker, Run.status.in_(ACTIVE_STATUSES))
        .values(status=status, heartbeat_at=now, **values)
    )
    session.commit()
    return result.rowcount == 1


def heartbeat(*, session: Session, run_id: int, worker: str, **values) -> bool:  # noqa: ANN003
    values = _scrubbed(values)
    result = session.execute(
        update(Run)
        .where(Run.id == run_id, Run.worker == worker, Run.status.in_(ACTIVE_STATUSES))
        .values(heartbeat_at=_now(), **values)
    )
    # Whatever the caller wrote with it (a batch of trajectories) commits only while the run is
    # still this worker's: a run taken away keeps what its new owner writes, nothing of ours.
    owned = result.rowcount == 1
    if owned:
        session.commit()
    else:
        session.rollback()
    return owned


def cancel_requested(*, session: Session, run_id: int) -> bool:
    return bool(session.scalar(select(Run.cancel_requested).where(Run.id == run_id)))


def request_cancel(*, session: Session, run_id: int) -> Run:
    """A queued run is cancelled at once; a running one at its worker's next phase boundary."""
    run = get(session=session, run_id=run_id)
    if run.status in FINAL_STATUSES:
        raise ConflictError(f"run {run_id} is already {run.status}; nothing to cancel")
    session.execute(update(Run).where(Run.id == run_id).values(cancel_requested=True))
    session.execute(
        update(Run).where(Run.id == run_id, Run.status == QUEUED)
        .values(status=CANCELLED, finished_at=_now(), error="cancelled before it started")
    )
    session.commit()
    session.refresh(run)
    return run


# The poison-pill rule (docs/security/SANDBOX.md, "No run can wedge a worker"): a worker can die mid-run for reasons not the run's (a
# deploy, the OOM killer on a neighbour), so the first lost worker re-queues the run; the second
# makes it poison: `error`, never handed to another worker. A run whose watchdog fired is `error`
# at once (worker/jobs/watchdog.py), which the reaper never sees. `optdrift retry` starts afresh.
POISON_AFTER_WORKERS_LOST = 2


def reap_stale(
    *, session: Session, stale_after_s: float, max_attempts: int, now: datetime | None = None
) -> tuple[list[int], list[int]]:
    """Runs whose worker stopped heart-beating: back to `queued` (to be dispatched again) while
    attempts remain and the run has not taken down POISON_AFTER_WORKERS_LOST workers, else `error`
    with the reason. Returns (requeued ids, ended ids)."""
    now = now or _now()
    cutoff = now - timedelta(seconds=stale_after_s)
    stale = session.scalars(
        select(Run).where(Run.status.in_(ACTIVE_STATUSES), Run.heartbeat_at < cutoff)
    ).all()
    requeued, failed = [], []
    for run in stale:
        last = run.heartbeat_at.strftime("%Y-%m-%d %H:%M:%S")
        lost = run.workers_lost + 1
        reason = (f"worker {run.worker} stopped reporting (last heartbeat {last} UTC) "
                  f"during attempt {run.attempt}")
        if lost >= POISON_AFTER_WORKERS_LOST:
            values = dict(status=ERROR, finished_at=now,
                          error=f"{reason}; its worker was lost in {lost} attempts, so it is not handed to "
                                "another worker (a run that takes down workers is poison, docs/SECURITY.md); "
                                "`optdrift retry` runs it again")
            target = failed
        elif run.attempt < max_attempts:
            values = dict(status=QUEUED, worker=None, dispatched_at=None, error=f"{reason}; queued again")
            target = requeued
        else:  # a lost worker is optdrift's failure, never the commit's
            values = dict(status=ERROR, finished_at=now,
                          error=f"{reason}; gave up after {run.attempt} attempts")
            target = failed
        result = session.execute(
            update(Run).where(Run.id == run.id, Run.status == run.status,
                              Run.heartbeat_at == run.heartbeat_at).values(workers_lost=lost, **values)
        )
        if result.rowcount == 1:
            target.append(run.id)
    session.commit()
    return requeued, failed


__all__ = ["BUILDING", "CANCELLED", "DONE", "FAILED", "QUEUED", "RUNNING"]


def retry_later(*, session: Session, run_id: int, worker: str, error: str, max_attempts: int,
                backoff_s: float) -> float | None:
    """After an optdrift failure (not the commit's) in attempt N: back to `queued` to be sent again
    in backoff_s * 2**(N-1) seconds while attempts remain (returns that delay), else `error` for
    good (returns None). The run's error says what failed and what happens next."""
    run = session.get(Run, run_id)
    if run.attempt < max_attempts:
        delay = backoff_s * 2 ** max(0, run.attempt - 1)
        ours = session.execute(
            update(Run).where(Run.id == run_id, Run.worker == worker, Run.status.in_(ACTIVE_STATUSES))
            .values(status=QUEUED, worker=None, dispatched_at=None, heartbeat_at=_now(),
                    error=redaction.clip(redaction.scrub(
                        f"optdrift error in attempt {run.attempt} of {max_attempts} (not the commit's): "
                        f"{error}; retrying in {delay:g} s"), MAX_ERROR_CHARS))).rowcount
        session.commit()
        return delay if ours else None
    set_status(session=session, run_id=run_id, worker=worker, status=ERROR,
               error=f"optdrift error (not the commit's): {error}; gave up after {run.attempt} attempts")
    return None


def retry(*, session: Session, run_id: int) -> Run:
    """An `error` run back to `queued` with a fresh count of attempts (`optdrift retry`, or the
    same commit submitted again); the caller dispatches it."""
    run = get(session=session, run_id=run_id)
    if run.status != ERROR:
        raise ConflictError(f"run {run_id} is {run.status}; only a run that ended in `error` (an optdrift "
                            "failure) is retried; submit a new commit to run changed code")
    session.execute(update(Run).where(Run.id == run_id, Run.status == ERROR).values(
        status=QUEUED, attempt=0, workers_lost=0, worker=None, dispatched_at=None, finished_at=None,
        error=f"retried after: {run.error}"))
    session.commit()
    session.refresh(run)
    return run


def queued_count(*, session: Session, environment: str, kind: str | None = None,
                 dispatched_after: datetime | None = None, dispatched_before: datetime | None = None) -> int:
    """Runs waiting for a worker of `environment` (a baseline co-run yields to them); only those of
    `kind` ("commit", "verify") when given, and only those handed to the broker after
    `dispatched_after` and by `dispatched_before` when given (a running verify run yields to
    commit runs that came after it started and have waited a moment, worker/jobs/run.py CommitRunsFirst)."""
    from sqlalchemy import func

    query = select(func.count()).select_from(Run).where(
        Run.status == QUEUED, Run.environment == environment, Run.cancel_requested.is_(False))
    if kind is not None:
        query = query.where(Run.kind == kind)
    if dispatched_after is not None:
        query = query.where(Run.dispatched_at > dispatched_after)
    if dispatched_before is not None:
        query = query.where(Run.dispatched_at <= dispatched_before)
    return session.scalar(query) or 0


def requeue_yielded(*, session: Session, run_id: int, worker: str, note: str) -> bool:
    """A run this worker owns gives its worker up (a verify run yielding to commit runs): back to
    `queued` with `note` as what its page says, its trajectories deleted (the next start runs
    every case again) and its attempt not counted (yielding is no failure: claim counted one,
    this takes it back). One transaction, only while the run is still this worker's; False if
    it is not (reaped, cancelled), and then nothing changes."""
    from sqlalchemy import delete

    from service.db.models import Trajectory

    owned = session.execute(
        update(Run).where(Run.id == run_id, Run.worker == worker, Run.status.in_(ACTIVE_STATUSES),
                          Run.cancel_requested.is_(False))
        .values(status=QUEUED, worker=None, dispatched_at=None, started_at=None, heartbeat_at=_now(),
                attempt=Run.attempt - 1, cases_done=0,
                error=redaction.clip(redaction.scrub(note), MAX_ERROR_CHARS))
    ).rowcount == 1
    if not owned:
        session.rollback()
        return False
    session.execute(delete(Trajectory).where(Trajectory.run_id == run_id))
    session.commit()
    return True


# A building run's progress, kept in its environment detail (no column of its own): the worker's
# record of the built tree replaces the whole detail when the build ends, so the key lives exactly
# as long as the build. Numbers only ({"phase", "done", "total", "unit"}), never the log's words.
BUILD_PROGRESS_KEY = "build_progress"


def set_build_progress(*, session: Session, run_id: int, worker: str, done: int | None, total: int | None,
                       unit: str) -> bool:
    """Store the build's progress on a run this worker owns while it builds; False (nothing
    written) once it is not building or not this worker's, or while another transaction holds
    the row. The row is locked while its detail is merged, so a write of the detail racing this
    one (the build's end) is never lost; a row locked elsewhere is skipped, never waited for: a
    progress write must not hold the build's watcher (the next step tries again)."""
    run = session.scalar(select(Run).where(Run.id == run_id, Run.worker == worker, Run.status == BUILDING)
                         .with_for_update(skip_locked=True).execution_options(populate_existing=True))
    if run is None:  # no row matched or it is locked: none is locked here, nothing to undo
        return False
    progress = {"phase": "building", "done": done, "total": total, "unit": unit}
    run.environment_detail = {**(run.environment_detail or {}), BUILD_PROGRESS_KEY: progress}
    session.commit()
    return True


def note_in_detail(*, session: Session, run_id: int, key: str, note: str) -> None:
    """One key of the run's environment detail (a finished run's kernel timing note), the rest as
    it is now (the co-run may have written the run meanwhile)."""
    run = lookup(session=session, run_id=run_id)
    run.environment_detail = {**(run.environment_detail or {}), key: note}
    session.commit()


def build_progress_of(run: Run) -> dict | None:
    """The stored build progress while the run builds (a key left by a build the watchdog killed
    says nothing once the run is over); None otherwise."""
    if run.status != BUILDING:
        return None
    stored = (run.environment_detail or {}).get(BUILD_PROGRESS_KEY)
    return stored if isinstance(stored, dict) else None
