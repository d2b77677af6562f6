"""The timing job: the kernels' own speed of a finished run, stored with the run.

A task of its own after the run's trajectory verdict is stored (follow_ups.send_timing), on the
environment's co-run queue, so timing never delays a verdict nor sits in front of a run. It
fetches the run's source into a workspace, builds it (a digest-cache hit: the run built it) and
times it (worker/speed/record.py). A failure is logged and noted on the run
(environment_detail["kernel_speed"]); it never changes the run (speed is judged apart). Like the
co-run it yields: while runs wait for this environment it is queued again for later.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from service import run_store
from service.broker.queueing import TIMING_TASK_NAME
from service.run_store import DONE
from service.settings import Settings
from worker import pipeline
from worker.jobs import follow_ups
from worker.jobs.workspace import Workspace
from worker.speed.record import ANSWER_SLACK_S, TimingYielded, budget_s, measure, plan

log = logging.getLogger(__name__)


def time_and_store(*, run_id: int, job, built, policy, settings: Settings,  # noqa: ANN001
                   should_yield: Callable[[], bool] | None = None) -> str | None:
    """Time and store; returns the note the run records (environment_detail["kernel_speed"]), or
    None when timing is off for this run. TimingYielded passes through (measure)."""
    seconds = budget_s(settings)
    if seconds <= 0 or not job.config.kernel_speed:
        return None
    started = time.monotonic()
    # The build's compile cache, as its run's host had it (read-only for a verify run): a
    # torch.compile-based library loads what the run compiled (worker.engine.compile_cache).
    cache = pipeline.compile_cache_for(built.digest, policy)
    try:
        answer = measure(job, built, policy, timing_plan=plan(settings, seconds), should_yield=should_yield,
                         compile_cache=cache)
        count = run_store.store_timings(run_id, answer)
    except TimingYielded:
        raise
    except Exception as error:  # noqa: BLE001 - speed is judged apart: the run stands without it
        log.warning("run %s: timing the kernels failed: %s", run_id, error)
        return f"failed: {error}"[:500]
    finally:
        if cache is not None:
            cache.release()
    errors = sum(1 for t in answer["timings"] if t.get("error"))
    note = f"{count} kernel timings on {answer.get('device')} in {time.monotonic() - started:.1f} s"
    if answer.get("not_timed"):
        note += f"; {answer['not_timed']} not timed (budget {seconds:g} s, OPTDRIFT_SPEED_BUDGET_S)"
    if errors:
        note += f"; {errors} failed"
    return note


def time_run(*, run_id: int, settings: Settings, should_yield: Callable[[], bool] | None = None) -> str:
    """Fetch, build (cached), time, store, note. Returns what happened; raises TimingYielded when
    `should_yield()` said a run waits (the task queues the timing again)."""
    run = run_store.run_facts(run_id)
    if run is None or run.status != DONE:
        return "skipped"
    with Workspace(settings, prefix=f"optdrift-speed-{run_id}-") as workspace:
        try:
            source = workspace.fetch(run.source_digest)
            job = workspace.prepare(source, project=run_store.project_facts(run.project_id), battery=run.battery)
            policy = workspace.policy(
                untrusted=run.kind == "verify", environment=run.environment, warm=True,
                deadline=time.monotonic() + budget_s(settings) + ANSWER_SLACK_S + settings.max_build_s)
            built = workspace.build(job, policy)
            if not built.ok:
                raise RuntimeError(f"the build failed this time: {built.error}")
        except Exception as error:  # noqa: BLE001 - noted on the run; the run stands
            log.warning("run %s: preparing the kernel timing failed: %s", run_id, error)
            note = f"failed: {error}"[:500]
        else:
            note = time_and_store(run_id=run_id, job=job, built=built, policy=policy, settings=settings,
                                  should_yield=should_yield)
    if note is None:
        return "off"
    run_store.note_on_run(run_id, "kernel_speed", note)
    return note


def time_or_yield(run_id: int, settings: Settings) -> str:
    """The timing task's body. Checked before, and while the host times (it is stopped within
    worker/speed/record.py YIELD_POLL_S): a run submitted right after a verdict must not wait
    behind the timing of the previous one, nor a flagged run's co-run (follow_ups.timing_waits_for)."""
    def waiting() -> int:
        return run_store.queued_count(environment=settings.worker_environment)

    reason = follow_ups.timing_waits_for(waiting())
    if reason is None:
        try:
            return time_run(run_id=run_id, settings=settings, should_yield=lambda: waiting() > 0)
        except TimingYielded:
            reason = f"{waiting()} run(s) waiting"
    follow_ups.send_later(TIMING_TASK_NAME, run_id, environment=settings.worker_environment,
                          countdown=settings.corun_retry_s)
    log.info("run %s: kernel timing yields (%s); queued again", run_id, reason)
    return "yielded"
