"""What a run sends after its verdict, each a task of its own on the environment's co-run queue so
the next run never waits behind it: the co-run (per-step |commit - baseline| of the changed cases,
worker/jobs/corun.py) and after it the training impact (worker/jobs/training.py), a build variant's
attribution against its base environment (worker/jobs/environment_attribution.py) and the kernel
timing (worker/jobs/timing.py), and which goes first.

Tasks are sent by name through the worker's Celery app (worker/tasks.py defines them), so the jobs
never import the tasks that call them.
"""

from __future__ import annotations

import logging
import time

from service import run_store
from service.broker.queueing import (
    CORUN_TASK_NAME, ENVIRONMENT_ATTRIBUTION_TASK_NAME, TIMING_TASK_NAME, TRAINING_TASK_NAME, corun_queue_for,
)
from service.run_store import corun_environment
from service.settings import Settings
from worker.celery_app import app
from worker.speed import record as kernel_speed

log = logging.getLogger(__name__)
# Co-runs this worker process queued and has not started yet (run id -> time.monotonic() when
# queued). Its kernel timings wait for them: a flagged commit's co-run detail is what a person is
# waiting for, the speed table is not. Another worker may take a co-run from the shared queue, so an
# entry counts only CORUN_FIRST_S: a timing is held back that long at most.
_corun_sent: dict[int, float] = {}
CORUN_FIRST_S = 120.0


def send_corun(run_id: int) -> None:
    """The co-run of `run_id`, when its verdict names changed cases against a baseline. The
    verdict is stored already and stands without the magnitudes: a broker failure is logged."""
    environment = corun_environment(run_id)
    if environment is None:
        return
    try:
        app.send_task(CORUN_TASK_NAME, args=[run_id], queue=corun_queue_for(environment))
        _corun_sent[run_id] = time.monotonic()
    except Exception:  # noqa: BLE001  (the verdict stands without the magnitudes)
        log.exception("run %s: could not queue the baseline co-run", run_id)


def send_environment_attributions(run_id: int) -> None:
    """When a commit run is done and a partner run of its commit (its base environment's or one of
    its build variants') is too and their trajectories differ: the pair's attribution, on the
    variant's co-run queue (its workers serve the base environment too). Identical digests send
    nothing. Never fails the run: a pair the broker did not take is marked failed, saying so."""
    try:
        opened = run_store.open_environment_attributions(run_id)
    except Exception:  # noqa: BLE001  (the run and its verdict stand without it)
        log.exception("run %s: could not open its environment attributions", run_id)
        return
    for attribution_id, environment in opened:
        try:
            app.send_task(ENVIRONMENT_ATTRIBUTION_TASK_NAME, args=[attribution_id], queue=corun_queue_for(environment))
        except Exception as error:  # noqa: BLE001
            log.exception("run %s: could not queue environment attribution %s", run_id, attribution_id)
            run_store.finish_environment_attribution(attribution_id, error=f"the broker did not take it: {error}")


def send_training_impact(run_id: int, settings: Settings) -> None:
    """After a changed run's co-run: its optimizer trained on the reference models beside the
    baseline's (worker/jobs/training.py), unless this worker has it off. Never fails the run."""
    model_set = settings.resolved_training_model_set
    if model_set is None:
        return
    try:
        opened = run_store.open_training_impact(run_id, model_set=model_set)
    except Exception:  # noqa: BLE001  (the run and its verdict stand without it)
        log.exception("run %s: could not open its training impact", run_id)
        return
    if opened is None:
        return
    job_id, environment = opened
    try:
        app.send_task(TRAINING_TASK_NAME, args=[job_id], queue=corun_queue_for(environment))
    except Exception as error:  # noqa: BLE001
        log.exception("run %s: could not queue training impact %s", run_id, job_id)
        run_store.finish_training_impact(job_id, error=f"the broker did not take it: {error}")


def corun_started(run_id: int) -> None:
    """The co-run of `run_id` started here: the timings no longer wait for it."""
    _corun_sent.pop(run_id, None)


def send_timing(run_id: int, settings: Settings) -> None:
    """The kernels' own speed of a finished run, where this worker times at all
    (worker/speed/record.py budget_s)."""
    if kernel_speed.budget_s(settings) <= 0:
        return
    try:
        app.send_task(TIMING_TASK_NAME, args=[run_id], queue=corun_queue_for(settings.worker_environment))
    except Exception:  # noqa: BLE001  (the verdict stands without the speed)
        log.exception("run %s: could not queue the kernel timing", run_id)


def send_later(task_name: str, run_id: int, *, environment: str, countdown: float) -> None:
    """A co-run, environment attribution or timing that yielded to waiting runs, queued again to
    start after `countdown` s (raises if the broker does not take it). `run_id`: the task's one
    argument (an environment attribution's is its row's id)."""
    app.send_task(task_name, args=[run_id], queue=corun_queue_for(environment), countdown=countdown)


def timing_waits_for(runs_waiting: int) -> str | None:
    """Why a kernel timing must wait now (runs waiting for this environment, or a co-run this
    process queued less than CORUN_FIRST_S ago that has not started), or None."""
    if runs_waiting:
        return f"{runs_waiting} run(s) waiting"
    now = time.monotonic()
    for run_id, queued in list(_corun_sent.items()):
        if now - queued > CORUN_FIRST_S:
            _corun_sent.pop(run_id, None)
    if _corun_sent:
        return f"the co-run of run(s) {sorted(_corun_sent)} goes first"
    return None
