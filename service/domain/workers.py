"""Worker presence: heartbeats written by worker processes, read by the API (no torch, no Celery).

A queued run whose environment class has no worker seen within `stale_after_s` cannot start; the
API says so (`waiting_for`) instead of leaving a person to guess why nothing happens.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.db.models import QUEUED, Run
from service.db.worker_presence import WorkerPresence

# A worker beats every PRESENCE_INTERVAL_S; three missed beats and it counts as gone.
PRESENCE_INTERVAL_S = 10.0
PRESENCE_STALE_S = 3 * PRESENCE_INTERVAL_S


def beat(*, session: Session, name: str, environment: str, detail: dict[str, Any] | None = None) -> None:
    """Insert or refresh this worker's row."""
    now = datetime.now(timezone.utc)
    row = session.get(WorkerPresence, name)
    if row is None:
        session.add(WorkerPresence(name=name, environment=environment, detail=detail, started_at=now, seen_at=now))
    else:
        row.environment, row.detail, row.seen_at = environment, detail, now
    session.commit()


def leave(*, session: Session, name: str) -> None:
    """A worker shutting down cleanly removes its row at once."""
    session.execute(delete(WorkerPresence).where(WorkerPresence.name == name))
    session.commit()


def live_workers(*, session: Session, environment: str | None = None,
                 stale_after_s: float = PRESENCE_STALE_S) -> list[WorkerPresence]:
    cutoff = datetime.now(timezone.utc) - timedelta(seconds=stale_after_s)
    query = select(WorkerPresence).where(WorkerPresence.seen_at >= cutoff)
    if environment is not None:
        query = query.where(WorkerPresence.environment == environment)
    return list(session.scalars(query.order_by(WorkerPresence.name)))


def waiting_for(*, session: Session, run: Run, stale_after_s: float = PRESENCE_STALE_S) -> str | None:
    """Why a queued run is not starting, when the reason is known; None otherwise."""
    if run.status != QUEUED:
        return None
    if not live_workers(session=session, environment=run.environment, stale_after_s=stale_after_s):
        return (f"no live worker for queue {run.environment}: start one with "
                f"`OPTDRIFT_WORKER_ENVIRONMENT={run.environment} optdrift worker`")
    return None
