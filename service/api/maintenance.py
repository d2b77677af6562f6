"""The API's background loop: re-queue runs whose worker died (bounded attempts) and send queued
runs the broker never took (it was down at submission)."""

from __future__ import annotations

import logging
import threading

from service.db.session import get_sessionmaker
from service.domain import dispatch, runs
from service.settings import Settings

log = logging.getLogger(__name__)


def run_once(settings: Settings) -> tuple[list[int], list[int], list[int]]:
    with get_sessionmaker()() as session:
        requeued, failed = runs.reap_stale(session=session, stale_after_s=settings.stale_after_s,
                                           max_attempts=settings.max_attempts)
        if failed:
            from service.db.models import Run
            from service.domain import verdict_store
            from service.notify import hooks as notify_hooks

            for run_id in failed:
                verdict_store.evaluate_with_dependants(session=session, run=session.get(Run, run_id))
                notify_hooks.run_changed(run_id, settings=settings, with_dependants=True)  # issue 16
        sent = dispatch.dispatch_pending(session=session, settings=settings)
    return requeued, failed, sent


def start(settings: Settings) -> threading.Event:
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(settings.maintenance_interval_s):
            try:
                requeued, failed, sent = run_once(settings)
                if requeued or failed or sent:
                    log.info("maintenance: requeued %s, failed %s, dispatched %s", requeued, failed, sent)
            except Exception:  # noqa: BLE001  (keep the loop alive through a database blip)
                log.exception("maintenance pass failed; retrying next interval")

    threading.Thread(target=loop, name="optdrift-maintenance", daemon=True).start()
    return stop
