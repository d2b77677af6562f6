"""Dispatching, written once: hand a queued run to the broker (service.broker.queueing.send_run,
which picks its queue) and mark when the broker hands it out (`dispatched_at`). The API sends the
runs it queued (dispatch_runs, and dispatch_pending from its maintenance loop); the worker, through
service.run_store, a run it queued again (send_again).

A run is dispatched only after its row is committed; if the broker is down the row stays `queued`
with `dispatched_at` NULL and the maintenance loop sends it when the broker is back.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.broker.queueing import send_run
from service.db.models import QUEUED, Run
from service.domain import runs
from service.settings import Settings

log = logging.getLogger(__name__)


def dispatch_run(*, session: Session, settings: Settings, run: Run, delay: float = 0.0) -> bool:
    """Send one run on its kind's queue (service.broker.queueing.send_run: a verify run on the verify
    queue), to start after `delay` s (a retry's backoff), and mark when the broker hands it out;
    committed. False, and nothing marked, when the broker does not take it: the run stays queued with
    no dispatch time and the maintenance loop sends it (dispatch_pending)."""
    try:
        send_run(settings=settings, run_id=run.id, environment=run.environment, kind=run.kind,
                 countdown=delay or None)
    except Exception as exc:  # noqa: BLE001  (any broker failure: keep queued, retry later)
        log.warning("broker did not take run %s (%s); it stays queued and will be re-sent", run.id, exc)
        return False
    # When the broker hands it out: a retry's countdown included, so a running verify run does not
    # yield to a commit run that no worker may take yet (worker/jobs/run.py CommitRunsFirst).
    handed_out = datetime.now(timezone.utc) + timedelta(seconds=delay)
    session.execute(update(Run).where(Run.id == run.id).values(dispatched_at=handed_out))
    session.commit()
    return True


def dispatch_runs(*, session: Session, settings: Settings, run_ids: list[int]) -> list[int]:
    """Send the given queued runs, each on its kind's queue (a re-queued verify run goes back to
    the verify queue); mark each sent one. Returns the ids the broker accepted; stops at the first
    it does not take (the rest stay queued for the maintenance loop)."""
    sent: list[int] = []
    for run_id in run_ids:
        run = session.get(Run, run_id)
        if run is None or run.status != QUEUED:
            continue
        if not dispatch_run(session=session, settings=settings, run=run):
            break
        sent.append(run_id)
    return sent


def send_again(*, session: Session, settings: Settings, run_id: int, delay: float) -> bool:
    """A run a worker queued again (a retry after its backoff, a verify run that yielded), sent
    from the worker's session: its row as the database has it now (dispatch_run)."""
    return dispatch_run(session=session, settings=settings, run=runs.lookup(session=session, run_id=run_id),
                        delay=delay)


def dispatch_pending(*, session: Session, settings: Settings) -> list[int]:
    """Re-send every queued run the broker never accepted (broker was down, or reaped)."""
    run_ids = session.scalars(
        select(Run.id).where(Run.status == QUEUED, Run.dispatched_at.is_(None)).order_by(Run.id)
    ).all()
    return dispatch_runs(session=session, settings=settings, run_ids=list(run_ids))
