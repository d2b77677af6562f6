"""Time the kernels of a run's build after its battery and store the timings with the run.

Called from the Celery task (worker/tasks.py) in the Celery parent: the timing itself runs in a
kernel host of its own (worker/engine/host.py, op `time_kernels`, sandboxed like the battery), so
this module never touches torch or CUDA. Whether it runs: the worker's `speed_budget_s` (None:
on for CUDA workers, off for CPU workers; 0: off) and the project's `kernel_speed` (optdrift.toml).
A failure here is logged and noted on the run; it never fails the run (speed is judged apart).
"""

from __future__ import annotations

import logging
import time

from service.settings import Settings

log = logging.getLogger(__name__)
DEFAULT_CUDA_BUDGET_S = 120.0
# Beyond the budget: the host's start and the one kernel that was being timed when it ran out.
ANSWER_SLACK_S = 120.0


def budget_s(settings: Settings) -> float:
    if settings.speed_budget_s is not None:
        return max(0.0, settings.speed_budget_s)
    return DEFAULT_CUDA_BUDGET_S if settings.worker_device.startswith("cuda") else 0.0


def plan(settings: Settings, seconds: float) -> dict:
    """The TimingPlan (worker/speed/timing.py) as the request carries it."""
    return {"sizes": list(settings.speed_sizes), "repeats": settings.speed_repeats, "budget_s": seconds}


def measure(job, built, policy, *, timing_plan: dict) -> dict:  # noqa: ANN001
    """The kernel host's `time_kernels` answer for this build; raises RuntimeError with the reason."""
    from worker.engine.host import KernelHost

    with KernelHost(built.library_path, device=policy.device, adapter=job.config.adapter,
                    deadline=policy.deadline,
                    adapter_paths=[job.source_dir / folder for folder in job.config.adapter_path]) as host:
        answer = host.ask({"op": "time_kernels", "plan": timing_plan},
                          timeout_s=timing_plan["budget_s"] + ANSWER_SLACK_S)
        if answer is None:
            raise RuntimeError(f"the kernel host gave no timing answer: {host.stderr_tail(4) or 'no output'}")
    if "error" in answer:
        raise RuntimeError(str(answer["error"]))
    if not isinstance(answer.get("timings"), list):
        raise RuntimeError("the kernel host's timing answer has no list of timings")
    return answer


def time_and_store(*, session, run_id: int, job, built, policy, settings: Settings) -> str | None:  # noqa: ANN001
    """Time and store; returns the note the run records (environment_detail["kernel_speed"]), or
    None when timing is off for this run."""
    from service.domain import kernel_speed

    seconds = budget_s(settings)
    if seconds <= 0 or not job.config.kernel_speed:
        return None
    started = time.monotonic()
    try:
        answer = measure(job, built, policy, timing_plan=plan(settings, seconds))
        count = kernel_speed.store(session=session, run_id=run_id, answer=answer)
        session.commit()
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
