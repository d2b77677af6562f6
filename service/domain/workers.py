"""Worker presence: heartbeats written by worker processes, read by the API (no torch, no Celery).

A queued run whose environment class has no worker seen within `stale_after_s` cannot start; the
API says so (`waiting_for`) instead of leaving a person to guess why nothing happens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.core.environments import split as split_environment
from service.db.models import QUEUED, Run
from service.db.worker_presence import WorkerPresence

# A worker beats every PRESENCE_INTERVAL_S; three missed beats and it counts as gone.
PRESENCE_INTERVAL_S = 10.0
PRESENCE_STALE_S = 3 * PRESENCE_INTERVAL_S
# `optdrift serve` (unless --no-worker) starts a worker next to the API it runs in its own process.
# Until that worker's first beat (it imports torch and Celery first), a queued run waits for it,
# not for a person to start one; past this long without a beat the worker is reported as not live.
EMBEDDED_WORKER_GRACE_S = 120.0


@dataclass
class EmbeddedWorker:
    environment: str
    started_at: float  # time.monotonic()


_embedded_worker: EmbeddedWorker | None = None


def embedded_worker_started(*, environment: str, started_at: float | None = None) -> None:
    """Called by `optdrift serve` in the API's process once it has started its own worker."""
    global _embedded_worker
    _embedded_worker = EmbeddedWorker(environment, time.monotonic() if started_at is None else started_at)


def embedded_worker_stopped() -> None:
    global _embedded_worker
    _embedded_worker = None


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
    """Workers seen lately; of `environment`, where named: a build variant's (`cpu+fma`) are the
    workers of its environment that serve the variant (their presence detail lists it)."""
    cutoff = datetime.now(timezone.utc) - timedelta(seconds=stale_after_s)
    query = select(WorkerPresence).where(WorkerPresence.seen_at >= cutoff)
    base, variant = split_environment(environment) if environment is not None else (None, None)
    if base is not None:
        query = query.where(WorkerPresence.environment == base)
    found = list(session.scalars(query.order_by(WorkerPresence.name)))
    if variant is not None:
        found = [row for row in found if variant in ((row.detail or {}).get("variants") or [])]
    return found


def waiting_for(*, session: Session, run: Run, stale_after_s: float = PRESENCE_STALE_S) -> str | None:
    """Why a queued run is not starting, when the reason is known; None otherwise."""
    if run.status != QUEUED:
        return None
    if live_workers(session=session, environment=run.environment, stale_after_s=stale_after_s):
        return None
    embedded = _embedded_worker
    if embedded is not None and embedded.environment == split_environment(run.environment)[0]:
        waited = time.monotonic() - embedded.started_at
        if waited < EMBEDDED_WORKER_GRACE_S:
            return (f"the worker `optdrift serve` started for queue {run.environment} is starting "
                    f"({waited:.0f} s so far); the run begins when it is up")
        # the path stays off the API (reads may be public); serve printed it, under OPTDRIFT_HOME
        return (f"no live worker for queue {run.environment}: the worker `optdrift serve` started has not "
                f"reported in for {waited:.0f} s; see its log, logs/worker.log in OPTDRIFT_HOME")
    return (f"no live worker for queue {run.environment}: start one with "
            f"`OPTDRIFT_WORKER_ENVIRONMENT={run.environment} optdrift worker`")
