"""The Celery face of the worker: four thin tasks over the jobs (worker/jobs/), and the worker's
signals (the sandbox's state, the harness built before the first run, builds released after each
task).

- optdrift.execute_run: a run, given only its id (worker/jobs/run.py)
- optdrift.record_baseline_diffs: a judged run's co-run (worker/jobs/corun.py)
- optdrift.time_kernels: a finished run's kernel timing (worker/jobs/timing.py)
- optdrift.attribute_environments: a build variant's changed cases against its base environment's
  build (worker/jobs/environment_attribution.py)

Each runs under a watchdog (worker/jobs/watchdog.py; the run job arms its own per phase): no wait
on a box can hold the worker past its deadline, a cancel or a shutdown. Celery's own time limits
cannot do this here: the hard limit exists only in the prefork pool (never in `serve`'s solo
worker), knows no phase, and kills the pool process without settling the run; the soft limit is an
exception a thread blocked in a syscall never sees. A warm shutdown (SIGTERM) waits for the running
task, so the worker's main process relays it (_stop_running_jobs) and the job stops within seconds.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from celery.signals import task_postrun, worker_process_init, worker_ready, worker_shutting_down

from service.broker.queueing import (
    CORUN_TASK_NAME, ENVIRONMENT_ATTRIBUTION_TASK_NAME, RUN_TASK_NAME, TIMING_TASK_NAME, TRAINING_TASK_NAME,
)
from service import run_store
from service.settings import get_settings
from worker import gc_policy, sandbox
from worker.celery_app import app
from worker.jobs.corun import record_and_tell
from worker.jobs.environment_attribution import attribute_and_store
from worker.jobs.run import execute_run
from worker.jobs import follow_ups, watchdog
from worker.jobs.timing import time_or_yield
from worker.jobs.training import train_and_store
from worker.sandbox import log_tail, privilege
from worker.speed.record import ANSWER_SLACK_S, budget_s as timing_budget_s

log = logging.getLogger(__name__)


@worker_ready.connect
def _say_whether_sandboxed(**_kwargs) -> None:  # noqa: ANN003
    who = privilege.identity()  # decided before Celery started (service/cli/main.py `worker`)
    if who.warning:
        log.warning("%s", who.warning)
    else:
        log.info("worker identity: %s", who.detail)
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


# What the worker's main process sends its prefork pool processes when it is told to shut down:
# SIGTERM is reset to its default there (Celery's process_initializer), and SIGUSR1 is Celery's.
STOP_SIGNAL = signal.SIGUSR2


def _pool_processes() -> list[int]:
    """This process's prefork pool processes: its children that run this Python, forked without a
    session of their own (a box leads a group of its own). By the executable, not the command line:
    a pool process may retitle itself (setproctitle)."""
    def executable(pid: int | str) -> str | None:
        try:
            return os.readlink(f"/proc/{pid}/exe")
        except OSError:
            return None

    def command_line(pid: int | str) -> bytes:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                return handle.read(4096)
        except OSError:
            return b""

    def same_program(pid: int) -> bool:
        # A worker that dropped root keeps saved uid 0, and the kernel then refuses it its own
        # children's /proc/<pid>/exe (the ptrace access check); their command line stays readable:
        # a pool process forked without exec shows the parent's, or Celery's title for it.
        found = executable(pid)
        if found is not None:
            return found == own
        line = command_line(pid)
        return bool(line) and (line == own_line or b"PoolWorker" in line or line.startswith(b"[celeryd"))

    own, own_line, group = executable("self"), command_line("self"), os.getpgrp()
    return [pid for pid, pgid in watchdog.children() if pgid == group and same_program(pid)]


@worker_shutting_down.connect
def _stop_running_jobs(sig: str = "SIGTERM", how: str = "Warm", **_kwargs) -> None:  # noqa: ANN003
    """In the worker's main process, from its signal handler (so: set a flag, send signals). A solo
    worker runs its job in this process: its watchdog sees the flag; pool processes are told."""
    reason = f"the worker got {sig}: {how.lower()} shutdown"
    watchdog.request_shutdown(reason)
    for pid in _pool_processes():
        try:
            os.kill(pid, STOP_SIGNAL)
        except ProcessLookupError:
            pass


@worker_process_init.connect
def _listen_for_stop(**_kwargs) -> None:  # noqa: ANN003
    """In each prefork pool process: the main process's relay of a shutdown reaches the watchdog.
    The handler runs in the main thread, even one blocked in open() (the signal interrupts it;
    Python retries the call after the handler)."""
    signal.signal(STOP_SIGNAL, lambda *_: watchdog.request_shutdown("the worker is shutting down (SIGTERM)"))


def _guarded(label: str, limit_s: float, body: Callable[[], str], *, send_again: Callable[[], None]) -> str:
    """A task beside the runs (co-run, timing, attribution) under a watchdog for `limit_s`: past it
    or on a shutdown its boxes are killed (the job logs its failure; the run's verdict stands), and
    a thread still blocked ends the process. Stopped by a shutdown, it is sent again for the next
    worker."""
    with watchdog.Watchdog(label=label, grace_s=get_settings().watchdog_grace_s) as guard, \
            guard.phase(label, limit_s):
        outcome = body()
    if guard.stop is not None and guard.stop.cause == watchdog.SHUTDOWN:
        try:
            send_again()
        except Exception:  # noqa: BLE001  (the verdict stands without it)
            log.exception("%s: stopped by the shutdown and not queued again", label)
        return "stopped"
    return outcome


def _beside_runs_limit_s() -> float:
    """A co-run or an attribution: two builds and at most a run's worth of cases, then the slack."""
    settings = get_settings()
    return 2 * settings.max_build_s + settings.max_run_s + settings.watchdog_slack_s


@app.task(name=RUN_TASK_NAME, ignore_result=True)
@gc_policy.collect_after  # a full collection after the task, none during it
def execute_run_task(run_id: int) -> str:
    return execute_run(run_id)


@app.task(name=CORUN_TASK_NAME, ignore_result=True)
@gc_policy.collect_after  # a full collection after the task, none during it
def record_baseline_diffs_task(run_id: int) -> str:
    settings = get_settings()
    return _guarded(f"co-run of run {run_id}", _beside_runs_limit_s(), lambda: record_and_tell(run_id, settings),
                    send_again=lambda: follow_ups.send_later(CORUN_TASK_NAME, run_id, countdown=0,
                                                             environment=run_store.run_facts(run_id).environment))


@app.task(name=TIMING_TASK_NAME, ignore_result=True)
@gc_policy.collect_after  # a full collection after the task, none during it
def time_kernels_task(run_id: int) -> str:
    """The kernels' own speed of a finished run (worker/jobs/timing.py). Like the co-run it never
    holds a run back: while runs wait for this environment it is queued again for later."""
    settings = get_settings()
    # The timing's own deadline (worker/jobs/timing.py): its budget, the answer's slack, a build.
    limit_s = timing_budget_s(settings) + ANSWER_SLACK_S + settings.max_build_s + settings.watchdog_slack_s
    return _guarded(f"kernel timing of run {run_id}", limit_s, lambda: time_or_yield(run_id, settings),
                    send_again=lambda: follow_ups.send_later(TIMING_TASK_NAME, run_id, countdown=0,
                                                             environment=run_store.run_facts(run_id).environment))


@app.task(name=ENVIRONMENT_ATTRIBUTION_TASK_NAME, ignore_result=True)
@gc_policy.collect_after  # a full collection after the task, none during it
def attribute_environments_task(attribution_id: int) -> str:
    """A build variant's changed cases against its base environment's build, co-run here
    (worker/jobs/environment_attribution.py); like the co-run, it yields to waiting runs."""
    settings = get_settings()
    return _guarded(f"environment attribution {attribution_id}", _beside_runs_limit_s(),
                    lambda: attribute_and_store(attribution_id, settings),
                    send_again=lambda: follow_ups.send_later(
                        ENVIRONMENT_ATTRIBUTION_TASK_NAME, attribution_id, countdown=0,
                        environment=run_store.environment_attribution_queue(attribution_id)))


@app.task(name=TRAINING_TASK_NAME, ignore_result=True)
@gc_policy.collect_after  # a full collection after the task, none during it
def training_impact_task(job_id: int) -> str:
    """A changed run's optimizer trained on the reference models beside its baseline's
    (worker/jobs/training.py); like the co-run it yields to waiting runs before it trains."""
    settings = get_settings()
    return _guarded(f"training impact {job_id}", _beside_runs_limit_s(), lambda: train_and_store(job_id, settings),
                    send_again=lambda: follow_ups.send_later(TRAINING_TASK_NAME, job_id, countdown=0,
                                                             environment=run_store.training_impact_queue(job_id)))
