"""The Celery app of the workers. Its configuration is service.broker.queueing.celery_config (one
module, shared with the API's sender), applied lazily when Celery first reads its config — nothing
is read from the environment at import.

Start a worker with `optdrift worker` (one per GPU, CUDA_VISIBLE_DEVICES set), which consumes the
queues of OPTDRIFT_WORKER_ENVIRONMENT (`cpu`, then `cpu.verify`, then `cpu.corun`; `gpu.sm90`, ...).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from celery import Celery

from service.broker.queueing import celery_config, consumed_queues
from service.settings import get_settings

# worker.gpu_workers: the presence beat every worker process writes (signals connected on import).
app = Celery("optdrift", set_as_current=False, include=["worker.tasks", "worker.gpu_workers"])


@app.on_configure.connect
def _configure(sender: Celery, **_kwargs) -> None:  # noqa: ANN003
    sender.conf.update(celery_config(get_settings()))


def worker_argv(*, environment: str, concurrency: int = 1, pool: str = "prefork",
                loglevel: str = "INFO", name: str | None = None, variants: Iterable[str] = ()) -> list[str]:
    """argv for `celery worker` consuming one environment's queues, in their order of precedence:
    commit runs, then verify runs, then co-runs (service.broker.queueing.consumed_queues).
    `name`: this worker's part of the node name, for several workers of one class on one host.
    `variants`: the build variants it also serves (OPTDRIFT_BUILD_VARIANTS)."""
    # One worker per GPU on a host: the GPU index keeps their node names apart; several CPU
    # workers on a host are told apart by their names (presence rows are keyed by node).
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES")
    node = f"optdrift-{environment}" + (f"-gpu{gpu.replace(',', '_')}" if gpu else "") + (f"-{name}" if name else "")
    return [
        "worker", "--queues", ",".join(consumed_queues(environment, variants)), "--concurrency", str(concurrency),
        "--pool", pool,
        "--loglevel", loglevel, "--hostname", f"{node}@%h",
        # No gossip/mingle/broker heartbeats: workers coordinate through the database, and the
        # filesystem broker of the embedded default has no fanout for them.
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]
