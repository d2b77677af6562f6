"""The API's side of dispatching: hand queued runs to the broker (service.broker.queueing.send_run)
and mark each one the broker took (`dispatched_at`).

A run is dispatched only after its row is committed; if the broker is down the row stays `queued`
with `dispatched_at` NULL and the maintenance loop sends it when the broker is back.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.broker.queueing import send_run
from service.db.models import QUEUED, Run
from service.settings import Settings

log = logging.getLogger(__name__)


def dispatch_runs(*, session: Session, settings: Settings, run_ids: list[int]) -> list[int]:
    """Send the given queued runs, each on its kind's queue (a re-queued verify run goes back to
    the verify queue); mark each sent one. Returns the ids the broker accepted."""
    sent: list[int] = []
    for run_id in run_ids:
        run = session.get(Run, run_id)
        if run is None or run.status != QUEUED:
            continue
        try:
            send_run(settings=settings, run_id=run_id, environment=run.environment, kind=run.kind)
        except Exception as exc:  # noqa: BLE001  (any broker failure: keep queued, retry later)
            log.warning("broker did not take run %s (%s); it stays queued and will be re-sent",
                        run_id, exc)
            break
        session.execute(
            update(Run).where(Run.id == run_id).values(dispatched_at=datetime.now(timezone.utc))
        )
        session.commit()
        sent.append(run_id)
    return sent


def dispatch_pending(*, session: Session, settings: Settings) -> list[int]:
    """Re-send every queued run the broker never accepted (broker was down, or reaped)."""
    run_ids = session.scalars(
        select(Run.id).where(Run.status == QUEUED, Run.dispatched_at.is_(None)).order_by(Run.id)
    ).all()
    return dispatch_runs(session=session, settings=settings, run_ids=list(run_ids))
