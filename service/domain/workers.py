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
    variants: tuple[str, ...] = ()  # the build variants it serves beside its environment

    def serves(self, environment: str) -> bool:
        base, variant = split_environment(environment)
        return base == self.environment and (variant is None or variant in self.variants)


_embedded_worker: EmbeddedWorker | None = None


def embedded_worker_started(*, environment: str, started_at: float | None = None,
                            variants: list[str] | tuple[str, ...] = ()) -> None:
    """Called by `optdrift serve` in the API's process once it has started its own worker."""
    global _embedded_worker
    _embedded_worker = EmbeddedWorker(environment, time.monotonic() if started_at is None else started_at,
                                      tuple(variants))


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


def unserved_reason(*, session: Session, environment: str,
                    stale_after_s: float = PRESENCE_STALE_S) -> str | None:
    """None when a live worker serves `environment`; else the sentence saying no live worker serves
    it and which worker setting does. For a build variant it names the live workers of its machine
    class and the variants they serve: a worker alive for `cpu` does not serve `cpu+fma` (issue 44:
    such a run was said to wait for a worker that "has not reported in", which was alive)."""
    if live_workers(session=session, environment=environment, stale_after_s=stale_after_s):
        return None
    base, variant = split_environment(environment)
    if variant is None:
        return (f"no live worker serves environment {environment}; start a worker with "
                f"OPTDRIFT_WORKER_ENVIRONMENT={environment} (`OPTDRIFT_WORKER_ENVIRONMENT={environment} "
                "optdrift worker`)")
    of_base = live_workers(session=session, environment=base, stale_after_s=stale_after_s)
    served = sorted({name for row in of_base for name in ((row.detail or {}).get("variants") or [])})
    alive = (f" (the {len(of_base)} live {base} worker(s) serve "
             f"{'the variants ' + ', '.join(served) if served else 'no build variant'})") if of_base else ""
    return (f"no live worker serves environment {environment}{alive}; start a worker with "
            f"OPTDRIFT_WORKER_ENVIRONMENT={base} and a variant named {variant} in OPTDRIFT_BUILD_VARIANTS "
            f"(JSON such as '{{\"{variant}\": {{\"cflags\": [...]}}}}', what the variant changes in the build; "
            "docs/ENVIRONMENTS.md)")


def waiting_for(*, session: Session, run: Run, stale_after_s: float = PRESENCE_STALE_S) -> str | None:
    """Why a queued run is not starting, when the reason is known; None otherwise."""
    if run.status != QUEUED:
        return None
    unserved = unserved_reason(session=session, environment=run.environment, stale_after_s=stale_after_s)
    if unserved is None:
        return None
    embedded = _embedded_worker
    # Only a worker that will serve the run's environment is waited for; and it "has not reported
    # in" only while no worker of its class is live (a live one serving `cpu` is that worker, up).
    if embedded is not None and embedded.serves(run.environment) and not live_workers(
            session=session, environment=embedded.environment, stale_after_s=stale_after_s):
        waited = time.monotonic() - embedded.started_at
        if waited < EMBEDDED_WORKER_GRACE_S:
            return (f"the worker `optdrift serve` started for queue {run.environment} is starting "
                    f"({waited:.0f} s so far); the run begins when it is up")
        # the path stays off the API (reads may be public); serve printed it, under OPTDRIFT_HOME
        return (f"no live worker for queue {run.environment}: the worker `optdrift serve` started has not "
                f"reported in for {waited:.0f} s; see its log, logs/worker.log in OPTDRIFT_HOME")
    return unserved


def will_serve(*, session: Session, environment: str, stale_after_s: float = PRESENCE_STALE_S) -> bool:
    """Whether a live worker serves `environment`, or the worker `optdrift serve` started (still in
    its first beat's grace) will."""
    if live_workers(session=session, environment=environment, stale_after_s=stale_after_s):
        return True
    embedded = _embedded_worker
    return (embedded is not None and embedded.serves(environment)
            and time.monotonic() - embedded.started_at < EMBEDDED_WORKER_GRACE_S)
