"""A job beside the runs yields to them: the baseline co-run (corun.py), a build variant's
environment attribution (environment_attribution.py) and the training impact (training.py) ask
between cases (or before their hosts start) whether runs wait for this worker's environment; if so
they stop (CorunYielded) and are queued again on the co-run queue, to start after
settings.corun_retry_s, written once here (`queued_again`). A run never waits behind them."""

from __future__ import annotations

import logging
from collections.abc import Callable

from service import run_store
from service.settings import Settings
from worker.jobs import follow_ups

log = logging.getLogger(__name__)

YIELDED = "yielded"


class CorunYielded(RuntimeError):
    """A job beside the runs stopped between cases for runs waiting for this worker (it is queued again)."""


def yield_to_runs(settings: Settings) -> None:
    """Raise CorunYielded while runs wait for this worker's environment: a job beside the runs
    (a co-run, an environment attribution, a training impact) stops and is queued again."""
    waiting = run_store.queued_count(environment=settings.worker_environment)
    if waiting:
        raise CorunYielded(f"{waiting} run(s) waiting for {settings.worker_environment}")


def queued_again(waiting: CorunYielded, *, label: str, task_name: str, job_id: int, settings: Settings,
                 queue: Callable[[], str], requeue: Callable[[], None] | None = None) -> str:
    """The job that yielded (`waiting`, its reason), queued again: its row back to `queued` first
    (`requeue`, for a job with a row of its own: an environment attribution, a training impact),
    then its task (`task_name` with its one argument `job_id`) sent to start after
    settings.corun_retry_s on the co-run queue of `queue()`'s environment. Returns YIELDED, the task's
    answer; raises when the broker does not take it."""
    log.info("%s yields (%s); queued again", label, waiting)
    if requeue is not None:
        requeue()
    follow_ups.send_later(task_name, job_id, environment=queue(), countdown=settings.corun_retry_s)
    return YIELDED
