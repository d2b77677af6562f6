"""GPU workers: one Celery worker process per GPU, and the presence beat every worker writes.

`optdrift worker --gpus all|0,1` runs `run_gpu_workers`: it lists the GPUs with nvidia-smi (never
CUDA: this supervising process and every Celery parent stay free of CUDA, so forked children can
still use it), then starts one `optdrift worker` process per GPU with

    CUDA_VISIBLE_DEVICES=<index>            the worker's kernel hosts see only that GPU
    OPTDRIFT_WORKER_ENVIRONMENT=gpu.sm<cc>  its queues: one set per environment class (gpu.sm90,
                                            then gpu.sm90.verify, then gpu.sm90.corun)
    OPTDRIFT_WORKER_DEVICE=cuda

and supervises them: a worker that exits is restarted (with a pause, so a worker failing at start
does not spin), and SIGTERM/SIGINT stop them all.

Presence: every Celery worker process (GPU or CPU) imports this module (worker.celery_app's
`include`), and on `worker_ready` starts a thread that writes its row in `worker_presence` every
PRESENCE_INTERVAL_S (service.run_store), so the API can tell that a queued run's class has
no live worker.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass

from celery.signals import worker_ready, worker_shutdown

log = logging.getLogger(__name__)
RESTART_PAUSE_S = 5.0


@dataclass(frozen=True)
class GpuWorkerPlan:
    index: str             # the nvidia-smi index, exported as CUDA_VISIBLE_DEVICES
    name: str              # "NVIDIA H200"
    compute_capability: str  # "9.0"

    @property
    def environment(self) -> str:
        return environment_class(self.compute_capability)


def environment_class(compute_capability: str) -> str:
    """The queue / environment class of a GPU: compute capability "9.0" -> "gpu.sm90"."""
    major, _, minor = compute_capability.strip().partition(".")
    if not major.isdigit() or not (minor or "0").isdigit():
        raise ValueError(f"compute capability {compute_capability!r} is not of the form MAJOR.MINOR")
    return f"gpu.sm{major}{minor or '0'}"


def list_gpus() -> str:
    """nvidia-smi's CSV listing (index, compute capability, name); no CUDA in this process."""
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=index,compute_cap,name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True).stdout
    except FileNotFoundError:
        raise RuntimeError("nvidia-smi was not found: this host has no NVIDIA driver; run "
                           "`optdrift worker` without --gpus for a CPU worker") from None
    except subprocess.CalledProcessError as error:
        raise RuntimeError(f"nvidia-smi failed ({error.returncode}): {error.stderr.strip()}") from None


def plan_workers(listing: str, gpus: str) -> list[GpuWorkerPlan]:
    """One plan per selected GPU. `gpus`: "all" or comma-separated nvidia-smi indices ("0,1")."""
    available = []
    for line in listing.strip().splitlines():
        fields = [f.strip() for f in line.split(",", 2)]
        if len(fields) == 3:
            available.append(GpuWorkerPlan(index=fields[0], compute_capability=fields[1], name=fields[2]))
    if not available:
        raise RuntimeError("nvidia-smi lists no GPU; run `optdrift worker` without --gpus for a CPU worker")
    if gpus.strip() == "all":
        return available
    by_index = {plan.index: plan for plan in available}
    wanted = [g.strip() for g in gpus.split(",") if g.strip()]
    unknown = [g for g in wanted if g not in by_index]
    if unknown or not wanted:
        raise ValueError(f"--gpus {gpus!r}: GPU(s) {unknown or gpus!r} not found; this host has "
                         f"{', '.join(sorted(by_index))} (or say --gpus all)")
    return [by_index[g] for g in dict.fromkeys(wanted)]


def worker_environment_for(plan: GpuWorkerPlan) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": plan.index, "OPTDRIFT_WORKER_ENVIRONMENT": plan.environment,
            "OPTDRIFT_WORKER_DEVICE": "cuda"}


def run_gpu_workers(gpus: str, *, worker_args: list[str], listing: str | None = None) -> int:
    """Start and supervise one worker per selected GPU until SIGTERM/SIGINT; returns 0."""
    plans = plan_workers(listing if listing is not None else list_gpus(), gpus)
    stopping = threading.Event()
    processes: dict[str, subprocess.Popen] = {}

    def start(plan: GpuWorkerPlan) -> subprocess.Popen:
        env = {**os.environ, **worker_environment_for(plan)}
        log.info("starting worker for GPU %s (%s, %s)", plan.index, plan.name, plan.environment)
        return subprocess.Popen([sys.executable, "-m", "service.cli", "worker", *worker_args], env=env)

    def stop(*_args) -> None:  # noqa: ANN002
        stopping.set()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for plan in plans:
            processes[plan.index] = start(plan)
        while not stopping.wait(1.0):
            for plan in plans:
                code = processes[plan.index].poll()
                if code is not None:
                    log.warning("worker for GPU %s exited with %s; restarting in %.0f s", plan.index, code,
                                RESTART_PAUSE_S)
                    if stopping.wait(RESTART_PAUSE_S):
                        break
                    processes[plan.index] = start(plan)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.terminate()  # Celery's warm shutdown: the running task finishes or is re-queued
        for process in processes.values():
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


# ----------------------------------------------------------------------------- presence
class PresenceBeat:
    """Writes this worker's presence row every interval until stopped; database errors are
    logged and retried at the next beat."""

    def __init__(self, *, name: str, environment: str, detail: dict, interval_s: float):
        self.name, self.environment, self.detail, self.interval_s = name, environment, detail, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="optdrift-presence", daemon=True)

    def _beat(self) -> None:
        from service import run_store

        run_store.presence_beat(name=self.name, environment=self.environment, detail=self.detail)

    def _loop(self) -> None:
        while True:
            try:
                self._beat()
            except Exception:  # noqa: BLE001
                log.exception("presence beat failed")
            if self._stop.wait(self.interval_s):
                return

    def start(self) -> "PresenceBeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            from service import run_store

            run_store.presence_leave(name=self.name)
        except Exception:  # noqa: BLE001  (it ages out anyway)
            log.exception("could not remove the presence row of %s", self.name)


_presence: PresenceBeat | None = None


@worker_ready.connect
def _start_presence(sender=None, **_kwargs) -> None:  # noqa: ANN001, ANN003
    global _presence
    from service.run_store import PRESENCE_INTERVAL_S
    from service.settings import get_settings

    settings = get_settings()
    node = getattr(sender, "hostname", None) or socket.gethostname()
    detail = {"host": socket.gethostname(), "pid": os.getpid(), "device": settings.worker_device,
              "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
              # the build variants it serves beside its environment (`cpu+fma` runs wait for it too)
              "variants": sorted(settings.build_variants),
              # what /healthz says of this worker's sandbox and of whom its file handling runs as
              "sandbox": sandbox_report()}
    _presence = PresenceBeat(name=f"{node}:{os.getpid()}", environment=settings.worker_environment,
                             detail=detail, interval_s=PRESENCE_INTERVAL_S).start()


def sandbox_report() -> dict:
    """Whether builds and kernel hosts run boxed here, and who the worker's own work runs as
    (worker.sandbox.privilege): a root worker that found no worker user carries its warning."""
    from worker import sandbox
    from worker.sandbox import privilege

    available, what = sandbox.status()
    who = privilege.identity()
    return {"available": available, "what": what, "identity": who.as_dict(),
            **({"warning": who.warning} if who.warning else {})}


@worker_shutdown.connect
def _stop_presence(**_kwargs) -> None:  # noqa: ANN003
    if _presence is not None:
        _presence.stop()


def _main() -> None:  # pragma: no cover - `python -m worker.gpu_workers all`
    logging.basicConfig(level=logging.INFO)
    sys.exit(run_gpu_workers(sys.argv[1] if len(sys.argv) > 1 else "all", worker_args=sys.argv[2:]))


if __name__ == "__main__":
    _main()
