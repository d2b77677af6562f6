"""The Celery face of the worker: four thin tasks over the jobs (worker/jobs/), and the worker's
signals (the sandbox's state, the harness built before the first run, builds released after each
task).

- optdrift.execute_run: a run, given only its id (worker/jobs/run.py)
- optdrift.record_baseline_diffs: a judged run's co-run (worker/jobs/corun.py)
- optdrift.time_kernels: a finished run's kernel timing (worker/jobs/timing.py)
- optdrift.attribute_environments: a build variant's changed cases against its base environment's
  build (worker/jobs/environment_attribution.py)
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

from celery.signals import task_postrun, worker_ready

from service.broker.queueing import (
    CORUN_TASK_NAME, ENVIRONMENT_ATTRIBUTION_TASK_NAME, RUN_TASK_NAME, TIMING_TASK_NAME,
)
from service.settings import get_settings
from worker import gc_policy, sandbox
from worker.celery_app import app
from worker.jobs.corun import record_and_tell
from worker.jobs.environment_attribution import attribute_and_store
from worker.jobs.run import execute_run
from worker.jobs.timing import time_or_yield
from worker.sandbox import log_tail

log = logging.getLogger(__name__)


@worker_ready.connect
def _say_whether_sandboxed(**_kwargs) -> None:  # noqa: ANN003
    available, what = sandbox.status()
    if available:
        log.info("sandbox: builds and kernel hosts run under %s", what)
    elif get_settings().allow_unsandboxed:
        log.warning("sandbox UNAVAILABLE (%s); OPTDRIFT_ALLOW_UNSANDBOXED=true: verify runs run without it", what)
    else:
        log.warning("sandbox UNAVAILABLE (%s): verify runs are refused (an operator may set "
                    "OPTDRIFT_ALLOW_UNSANDBOXED=true); commit runs get the weaker measures", what)


@task_postrun.connect
def _release_builds_after_task(**_kwargs) -> None:  # noqa: ANN003
    """A task's runs are over (a run, a co-run, a timing): the untrusted builds it made are deleted
    and the trusted ones it used may be evicted again (worker.build.cache.release_builds). A task
    whose process is killed leaves its untrusted builds to the next one's sweep."""
    from worker.build.cache import release_builds

    release_builds()


@worker_ready.connect
def _build_harness_before_runs(**_kwargs) -> None:  # noqa: ANN003
    """Build optdrift's own harness library (worker.engine.harness) before the first run is taken.
    Otherwise the first run that starts a kernel host on a fresh worker builds it, tens of seconds
    charged to that run's budget (a verify run's is small) for code that is not the run's. It runs
    in a process of its own: the Celery parent, which forks the pool's replacement processes, stays
    without torch. A library that does not build is logged; runs then use the Python paths."""
    settings = get_settings()
    device = settings.worker_device
    started = time.monotonic()
    try:
        built = subprocess.run([sys.executable, "-m", "worker.engine.harness", device], capture_output=True,
                               text=True, timeout=settings.max_build_s)
    except subprocess.TimeoutExpired:
        log.warning("the harness library for %s did not build within %g s (OPTDRIFT_MAX_BUILD_S); the "
                    "first run to start a kernel host builds it", device, settings.max_build_s)
        return
    if built.returncode != 0:
        log.warning("the harness library for %s did not build; runs use the engine's Python paths:\n%s",
                    device, log_tail.clip_lines(built.stderr[-4000:], max_line_chars=400))
    elif built.stdout.strip():
        log.info("harness library for %s ready in %.1f s: %s", device, time.monotonic() - started,
                 built.stdout.strip().splitlines()[-1])


@app.task(name=RUN_TASK_NAME, ignore_result=True)
@gc_policy.collect_after  # a full collection after the task, none during it
def execute_run_task(run_id: int) -> str:
    return execute_run(run_id)


@app.task(name=CORUN_TASK_NAME, ignore_result=True)
@gc_policy.collect_after  # a full collection after the task, none during it
def record_baseline_diffs_task(run_id: int) -> str:
    return record_and_tell(run_id, get_settings())


@app.task(name=TIMING_TASK_NAME, ignore_result=True)
@gc_policy.collect_after  # a full collection after the task, none during it
def time_kernels_task(run_id: int) -> str:
    """The kernels' own speed of a finished run (worker/jobs/timing.py). Like the co-run it never
    holds a run back: while runs wait for this environment it is queued again for later."""
    return time_or_yield(run_id, get_settings())


@app.task(name=ENVIRONMENT_ATTRIBUTION_TASK_NAME, ignore_result=True)
@gc_policy.collect_after  # a full collection after the task, none during it
def attribute_environments_task(attribution_id: int) -> str:
    """A build variant's changed cases against its base environment's build, co-run here
    (worker/jobs/environment_attribution.py); like the co-run, it yields to waiting runs."""
    return attribute_and_store(attribution_id, get_settings())
