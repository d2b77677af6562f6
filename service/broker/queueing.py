"""The Celery configuration (one module, shared by the worker app and the API's sender), the
queue names and `send_run`, which hands one run id to the broker. No database here: the worker
imports this module (service/domain/dispatch.py, the one caller of `send_run`, marks what it sent,
for the API and, through service/run_store.py, for the worker).

The service never imports `worker`: it sends tasks by name through a producer-only Celery app.
"""

from __future__ import annotations

from functools import lru_cache
from collections.abc import Iterable
from typing import Any

from celery import Celery

from service.settings import Settings

RUN_TASK_NAME = "optdrift.execute_run"


CORUN_TASK_NAME = "optdrift.record_baseline_diffs"


TIMING_TASK_NAME = "optdrift.time_kernels"


# A build variant's changed cases against its base environment's build (worker/jobs/environment_attribution.py),
# on the variant's co-run queue: the workers that serve the variant serve its base environment too.
ENVIRONMENT_ATTRIBUTION_TASK_NAME = "optdrift.attribute_environments"


# A changed run's optimizer trained on reference models beside its baseline's (worker/jobs/training.py),
# on the run's co-run queue: after the co-run, never in front of a run.
TRAINING_TASK_NAME = "optdrift.training_impact"


VERIFY_KIND = "verify"


def queue_for(environment: str) -> str:
    """The environment class's queue of commit runs (CI's): `cpu`, `gpu.sm90`, ...; a build variant's
    `cpu+fma` waits on `cpu--fma` (a queue name is a file name for the filesystem broker, which
    takes letters, digits and . _ - only; environment names never hold `--`)."""
    return environment.replace("+", "--")


def verify_queue_for(environment: str) -> str:
    """The environment's queue of verify runs (a contributor's on-demand runs): off the commit
    runs' queue, so a commit run submitted while verify runs wait starts before them."""
    return f"{queue_for(environment)}.verify"


def corun_queue_for(environment: str) -> str:
    """The environment's queue of baseline co-runs (per-step |commit - baseline| of changed cases):
    off the runs' queue, so a co-run never sits in front of a run; the same workers consume it."""
    return f"{queue_for(environment)}.corun"


def run_queue_for(*, environment: str, kind: str) -> str:
    """The queue a run of `kind` ("commit" or "verify") waits on."""
    return verify_queue_for(environment) if kind == VERIFY_KIND else queue_for(environment)


def consumed_queues(environment: str, variants: Iterable[str] = ()) -> list[str]:
    """The queues a worker of `environment` takes tasks from, most urgent first: it takes from a
    queue only while every queue before it is empty (both brokers honour the order, see
    celery_config), so verify runs yield to commit runs and co-runs to both. `variants`: the build
    variants it also serves (`environment+variant`, service/core/environments.py), each kind of
    queue of every variant after that kind of the plain environment."""
    served = [environment, *(f"{environment}+{variant}" for variant in variants)]
    return ([queue_for(name) for name in served] + [verify_queue_for(name) for name in served]
            + [corun_queue_for(name) for name in served])


def celery_config(settings: Settings) -> dict[str, Any]:
    transport_options: dict[str, Any] = {
        # Redis re-delivers an unacked task after this long: longer than the longest run, or a
        # healthy run would be started twice (the reaper, not Redis, handles dead workers).
        "visibility_timeout": settings.visibility_timeout_s,
        # kombu's Redis transport rotates a worker's queues by default (the queue it last took
        # from goes to the end of its BRPOP), which alternates commit and verify runs. "priority"
        # keeps the worker's order (consumed_queues): BRPOP pops from the first non-empty queue.
        "queue_order_strategy": "priority",
    }
    if settings.uses_filesystem_broker:
        folder = settings.broker_folder
        for sub in ("queue", "processed", "control"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        transport_options = {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "processed_folder": str(folder / "processed"),
            # Without it kombu keeps its exchange table in ./control of whatever folder the
            # process was started from.
            "control_folder": str(folder / "control"),
            "store_processed": False,
            # kombu polls the folder once a second by default: up to a second of every run's
            # submit -> verdict spent queued, a large share of a warm run's total.
            # A listing of an almost empty folder ten times a second costs nothing measurable.
            "polling_interval": 0.1,
        }
    return {
        "broker_url": settings.resolved_broker_url,
        # kombu's filesystem transport with its exchange tables created atomically: two processes
        # binding at once could otherwise read a table the other was creating (service/broker/filesystem.py).
        "broker_transport": "service.broker.filesystem:Transport" if settings.uses_filesystem_broker else None,
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        "broker_connection_timeout": 3,
        # Results live in the application database, never in Celery's backend.
        "task_ignore_result": True,
        "result_backend": None,
        # A task is acknowledged after it finishes, and a worker takes one at a time, so a
        # worker that dies mid-run leaves its task for another worker instead of losing it.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_serializer": "json",
        "accept_content": ["json"],
        "task_default_queue": "cpu",
        "task_create_missing_queues": True,
        "worker_send_task_events": False,
        "worker_hijack_root_logger": False,
    }


@lru_cache(maxsize=4)
def _producer(broker_url: str, settings_json: str) -> Celery:
    from service.settings import Settings as _S

    settings = _S.model_validate_json(settings_json)
    app = Celery("optdrift-api", set_as_current=False)
    app.conf.update(celery_config(settings))
    return app


def producer_app(settings: Settings) -> Celery:
    return _producer(settings.resolved_broker_url, settings.model_dump_json())


def send_run(*, settings: Settings, run_id: int, environment: str, kind: str,
             countdown: float | None = None) -> None:
    """Hand one run id to the broker, on its kind's queue (to start after `countdown` seconds: a
    retry's backoff). Raises if the broker does not take it."""
    producer_app(settings).send_task(
        RUN_TASK_NAME,
        args=[run_id],
        queue=run_queue_for(environment=environment, kind=kind),
        countdown=countdown,
        retry=True,
        # Fail fast when the broker is down: the run is safe in the database and the
        # maintenance loop re-sends it.
        retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 0.5,
                       "interval_max": 0.5},
    )


def send_training_impact(*, settings: Settings, job_id: int, environment: str) -> None:
    """Hand a training-impact job to the broker, on the run's environment's co-run queue. Raises
    if the broker does not take it."""
    producer_app(settings).send_task(TRAINING_TASK_NAME, args=[job_id], queue=corun_queue_for(environment),
                                     retry=True, retry_policy={"max_retries": 1, "interval_start": 0,
                                                               "interval_step": 0.5, "interval_max": 0.5})
