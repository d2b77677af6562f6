"""Time the kernels of a build: whether a worker times at all, the plan, and the kernel host's answer.

The timing job (worker/jobs/timing.py, a task of its own after the run's trajectory verdict is
stored, on the environment's co-run queue) fetches and builds the run's tree and calls `measure`,
which times every kernel in a kernel host of its own (worker/engine/host, op `time_kernels`,
sandboxed like the battery), so this module never touches torch or CUDA. Whether it runs: the
worker's `speed_budget_s` (None: on for CUDA workers, off for CPU workers; 0: off; `budget_s`) and
the project's `kernel_speed` (optdrift.toml).
"""

from __future__ import annotations

import contextlib
import logging
import threading
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
    """The timing stopped for a run waiting for this worker; it is queued again (worker/jobs/timing.py)."""


def budget_s(settings: Settings) -> float:
    if settings.speed_budget_s is not None:
        return max(0.0, settings.speed_budget_s)
    return DEFAULT_CUDA_BUDGET_S if settings.worker_device.startswith("cuda") else 0.0


def plan(settings: Settings, seconds: float) -> dict:
    """The TimingPlan (worker/speed/timing.py) as the request carries it."""
    return {"sizes": list(settings.speed_sizes), "repeats": settings.speed_repeats, "budget_s": seconds}


def measure(job, built, policy, *, timing_plan: dict,  # noqa: ANN001
            should_yield: Callable[[], bool] | None = None, compile_cache=None) -> dict:  # noqa: ANN001
    """The kernel host's `time_kernels` answer for this build; raises RuntimeError with the reason,
    or TimingYielded when `should_yield()` (asked before a host is taken, then every YIELD_POLL_S
    while the host times) said a run is waiting. The host is a spare started ahead where the policy keeps them (host_reserve).
    `compile_cache`: the build's (worker.engine.compile_cache), so the timed host loads what the run
    compiled instead of timing against a cold compile; the caller releases it."""
    from worker.engine import host_reserve

    # Asked once more before a host is taken: a run that came while the tree was fetched and built
    # would otherwise lose the spare to the timing, which starts its kernels and is stopped only at
    # the watcher's first check, so the run would wait that long and then for a new spare.
    if should_yield is not None and should_yield():
        raise TimingYielded("a run is waiting for this worker")
    host = host_reserve.take(built.library_path, device=policy.device, adapter=job.config.adapter,
                             adapter_paths=job.adapter_folders, case_timeout_s=policy.case_timeout_s,
                             deadline=policy.deadline, compile_cache=compile_cache) if policy.warm_host else None
    host = host or host_reserve.open_host(built.library_path, device=policy.device, adapter=job.config.adapter,
                                          deadline=policy.deadline, adapter_paths=job.adapter_folders,
                                          compile_cache=compile_cache)
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
