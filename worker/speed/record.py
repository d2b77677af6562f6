"""Time the kernels of a finished run's build and store the timings with the run.

A task of its own (worker/tasks.py `time_kernels_task`, sent by `_send_timing`) after the run's trajectory verdict is
stored, on the environment's co-run queue, so timing never delays a verdict nor sits in front of a
run. It fetches the run's source, builds it through the pipeline (a digest-cache hit: the run
built it), and times every kernel in a kernel host of its own (worker/engine/host.py, op
`time_kernels`, sandboxed like the battery), so this module never touches torch or CUDA. Whether it
runs: the worker's `speed_budget_s` (None: on for CUDA workers, off for CPU workers; 0: off) and
the project's `kernel_speed` (optdrift.toml). A failure is logged and noted on the run
(environment_detail["kernel_speed"]); it never changes the run (speed is judged apart).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator

from service.settings import Settings

log = logging.getLogger(__name__)
DEFAULT_CUDA_BUDGET_S = 120.0
# Beyond the budget: the host's start and the one kernel that was being timed when it ran out.
ANSWER_SLACK_S = 120.0
# How often a timing asks whether a run is waiting for this worker (a run then waits at most about
# this long behind it: the timing stops, and is queued again).
YIELD_POLL_S = 0.25


class TimingYielded(RuntimeError):
    """The timing stopped for a run waiting for this worker; it is queued again (worker/tasks.py)."""


def budget_s(settings: Settings) -> float:
    if settings.speed_budget_s is not None:
        return max(0.0, settings.speed_budget_s)
    return DEFAULT_CUDA_BUDGET_S if settings.worker_device.startswith("cuda") else 0.0


def plan(settings: Settings, seconds: float) -> dict:
    """The TimingPlan (worker/speed/timing.py) as the request carries it."""
    return {"sizes": list(settings.speed_sizes), "repeats": settings.speed_repeats, "budget_s": seconds}


def measure(job, built, policy, *, timing_plan: dict,  # noqa: ANN001
            should_yield: Callable[[], bool] | None = None) -> dict:
    """The kernel host's `time_kernels` answer for this build; raises RuntimeError with the reason,
    or TimingYielded when `should_yield()` (asked before a host is taken, then every YIELD_POLL_S
    while the host times) said a run is waiting. The host is a spare started ahead where the policy keeps them (host_reserve)."""
    from worker.engine import host_reserve
    from worker.engine.host import KernelHost

    # Asked once more before a host is taken: a run that came while the tree was fetched and built
    # would otherwise lose the spare to the timing, which starts its kernels and is stopped only at
    # the watcher's first check, so the run would wait that long and then for a new spare.
    if should_yield is not None and should_yield():
        raise TimingYielded("a run is waiting for this worker")
    host = host_reserve.take(built.library_path, device=policy.device, adapter=job.config.adapter,
                             adapter_paths=job.adapter_folders, case_timeout_s=policy.case_timeout_s,
                             deadline=policy.deadline) if policy.warm_host else None
    host = host or KernelHost(built.library_path, device=policy.device, adapter=job.config.adapter,
                              deadline=policy.deadline, adapter_paths=job.adapter_folders)
    try:
        with host, _interrupted_when(should_yield, host) as yielded:
            answer = host.ask({"op": "time_kernels", "plan": timing_plan},
                              timeout_s=timing_plan["budget_s"] + ANSWER_SLACK_S)
            if yielded.is_set():
                raise TimingYielded("a run is waiting for this worker")
            if answer is None:
                raise RuntimeError(f"the kernel host gave no timing answer: {host.stderr_tail(4) or 'no output'}")
    finally:
        if policy.warm_host:
            host_reserve.replenish(device=policy.device, slot_root=policy.host_slot_root)
    if "error" in answer:
        raise RuntimeError(str(answer["error"]))
    if not isinstance(answer.get("timings"), list):
        raise RuntimeError("the kernel host's timing answer has no list of timings")
    return answer


@contextlib.contextmanager
def _interrupted_when(should_yield: Callable[[], bool] | None, host) -> Iterator[threading.Event]:  # noqa: ANN001
    """While the block runs, a thread asks `should_yield()` every YIELD_POLL_S and, when it says
    yes, sets the event it yields and kills the host (the block's request then ends at once)."""
    yielded, done = threading.Event(), threading.Event()

    def watch() -> None:
        while not done.wait(YIELD_POLL_S):
            try:
                if should_yield():
                    yielded.set()
                    host.interrupt()
                    return
            except Exception:  # noqa: BLE001 - a failed check only means no yield this time
                log.warning("the kernel timing's check for waiting runs failed", exc_info=True)

    watcher = threading.Thread(target=watch, name="optdrift-speed-yield", daemon=True) if should_yield else None
    if watcher:
        watcher.start()
    try:
        yield yielded
    finally:
        done.set()
        if watcher:
            watcher.join()


def time_and_store(*, session, run_id: int, job, built, policy, settings: Settings,  # noqa: ANN001
                   should_yield: Callable[[], bool] | None = None) -> str | None:
    """Time and store; returns the note the run records (environment_detail["kernel_speed"]), or
    None when timing is off for this run. TimingYielded passes through (measure)."""
    from service.domain import kernel_speed

    seconds = budget_s(settings)
    if seconds <= 0 or not job.config.kernel_speed:
        return None
    started = time.monotonic()
    try:
        answer = measure(job, built, policy, timing_plan=plan(settings, seconds), should_yield=should_yield)
        count = kernel_speed.store(session=session, run_id=run_id, answer=answer)
        session.commit()
    except TimingYielded:
        raise
    except Exception as error:  # noqa: BLE001 - speed is judged apart: the run stands without it
        session.rollback()
        log.warning("run %s: timing the kernels failed: %s", run_id, error)
        return f"failed: {error}"[:500]
    errors = sum(1 for t in answer["timings"] if t.get("error"))
    note = f"{count} kernel timings on {answer.get('device')} in {time.monotonic() - started:.1f} s"
    if answer.get("not_timed"):
        note += f"; {answer['not_timed']} not timed (budget {seconds:g} s, OPTDRIFT_SPEED_BUDGET_S)"
    if errors:
        note += f"; {errors} failed"
    return note


def time_run(*, run_id: int, settings: Settings, should_yield: Callable[[], bool] | None = None) -> str:
    """The task's body: fetch, build (cached), time, store, note. Returns what happened; raises
    TimingYielded when `should_yield()` said a run waits (the task queues the timing again)."""
    import tempfile
    from pathlib import Path

    from service.db.models import DONE, Project, Run
    from service.db.session import get_sessionmaker
    from service.domain.storage import archive_limits
    from worker import pipeline
    from worker.source_fetch import fetch_source

    with get_sessionmaker()() as session, tempfile.TemporaryDirectory(prefix=f"optdrift-speed-{run_id}-") as tmp:
        run = session.get(Run, run_id)
        if run is None or run.status != DONE:
            return "skipped"
        try:
            source = fetch_source(base_url=settings.resolved_public_url, digest=run.source_digest, dest=Path(tmp) / "src",
                                  limits=archive_limits(settings), max_bytes=settings.max_upload_bytes,
                                  token=settings.resolved_worker_token())
            job = pipeline.prepare(source, project=session.get(Project, run.project_id), requested_battery=run.battery)
            untrusted = run.kind == "verify"
            policy = pipeline.Policy(
                device=settings.worker_device, fast_engine=settings.fast_engine,
                cache_dir=settings.resolved_build_cache_dir, trusted=not untrusted,
                cuda_archs=[] if settings.worker_device == "cpu" else None,
                max_build_s=settings.verify_max_build_s if untrusted else settings.max_build_s,
                deadline=time.monotonic() + budget_s(settings) + ANSWER_SLACK_S + settings.max_build_s,
                warm_host=settings.resolved_warm_host,
                host_slot_root=settings.resolved_build_cache_dir / "host-slots")
            built = pipeline.build(job, policy)
            if not built.ok:
                raise RuntimeError(f"the build failed this time: {built.error}")
        except Exception as error:  # noqa: BLE001 - noted on the run; the run stands
            log.warning("run %s: preparing the kernel timing failed: %s", run_id, error)
            note = f"failed: {error}"[:500]
        else:
            note = time_and_store(session=session, run_id=run_id, job=job, built=built, policy=policy,
                                  settings=settings, should_yield=should_yield)
        if note is None:
            return "off"
        session.refresh(run)  # the co-run may have written the run since it was read
        run.environment_detail = {**(run.environment_detail or {}), "kernel_speed": note}
        session.commit()
        return note
