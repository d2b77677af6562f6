"""The kernel host process itself: what runs in the box (`python -m worker.engine.host.child`).

It loads one build through its adapter, says it is ready, then answers the parent's requests on
stdin, one JSON line each (worker/engine/host/__init__.py lists them). The protocol gets a private
copy of the original stdout; fd 1 is pointed at stderr so anything a kernel or library prints
cannot corrupt it. A kernel error (RuntimeError) answers a `broken` case; after a CUDA error the
context is unusable, so the host answers and exits with status 3, and the parent starts a fresh one.

Its imports reach nothing of `service` but `service.core` (the box shows only that; the import
contract "What runs in the kernel host's box" in pyproject.toml): everything it needs comes on its
command line and its requests.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import TextIO

from service.core.results import CaseResult, CaseSpec
from worker import gc_policy
from worker.engine.host import batch, faults, spare
from worker.engine.host.protocol import not_ready_line, plain_json_line, ready_line, result_line

_MODULE_STARTED = time.perf_counter()  # the host's startup phases count from here (main)
EXIT_FOR_RESTART = 3  # the context is unusable (a CUDA error): the parent starts a fresh host


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="run optimizer cases on one kernel build")
    parser.add_argument("--library",
                        help="the build's output the adapter loads (a .so, a built tree, or 'installed')")
    parser.add_argument("--wait-for-build", action="store_true",
                        help="a spare host (worker.engine.host_reserve): import torch and make the "
                             "device's context now, then read the build from the first line on stdin, "
                             '{"op": "load", "library": ..., "adapter": ..., "adapter_path": [...]}')
    parser.add_argument("--no-ready-waves", dest="ready_waves", action="store_false",
                        help="with --prepare-inputs: do not set the expected cases' waves up ahead")
    parser.add_argument("--prepare-inputs", metavar="CASES_JSON",
                        help="with --wait-for-build: the cases the run is expected to bring (a JSON list); "
                             "their gradient inputs are made while the host waits (worker.engine.step_inputs)")
    parser.add_argument("--adapter", default="bundled",
                        help="project adapter (worker.adapters): a registered name or a module path")
    parser.add_argument("--adapter-path", action="append", default=[],
                        help="a folder to import the adapter module from (first on sys.path); repeatable")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--harness-library",
                        help="optdrift's compiled harness (worker.engine.harness), built by the parent; "
                             "without it the engine runs its Python paths (same results, slower)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads. 1 by default: the engine co-runs two hosts, and "
                             "on small tensors thread hand-offs cost far more than they save")
    parser.add_argument("--compile-cache", metavar="FOLDER",
                        help="this build's compile cache as the box shows it (worker.engine.compile_cache)")
    parser.add_argument("--compile-cache-read-only", action="store_true",
                        help="the compile cache is read-only here: compile into a copy in the scratch")
    args = parser.parse_args(argv)
    if not args.library and not args.wait_for_build:
        parser.error("--library is required (or --wait-for-build)")
    return args


class _StartupClock:
    """Seconds since this module started importing, at the end of each startup phase: sent with the
    ready line (the parent adds its own spawn-to-ready time), since a host's start is a large
    share of a warm run (bench/warm_battery_profile.py reads them)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        self.phases[phase] = round(time.perf_counter() - _MODULE_STARTED, 4)


def _take_protocol_stream() -> TextIO:
    """A private copy of stdout for the protocol; fd 1 (and sys.stdout) then go to stderr."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol


def _load_harness(path: str, clock: _StartupClock) -> None:
    from worker.engine import harness

    try:
        harness.load(path)
    except (OSError, RuntimeError, ImportError) as error:  # the engine's Python paths: same results
        print(f"the harness library did not load ({error}); the engine uses its Python paths", file=sys.stderr)
    else:
        clock.mark("harness load")  # the ready line's phases say whether it loaded


def _open_device(name: str) -> tuple:
    """(the device, its fingerprint as JSON), the CUDA context made now rather than in the first case."""
    import torch

    from worker.engine.environment import fingerprint, resolve_device

    device = resolve_device(name)
    if device.type == "cuda":
        torch.zeros(1, device=device)
    return device, fingerprint(device).model_dump(mode="json")


def _await_build(args: argparse.Namespace) -> bool:
    """A spare's wait: the first line on stdin names its build (into `args`); False when the parent
    closed the spare without using it."""
    importlib.import_module("worker.engine.kernels_only")  # the engine's modules, before the run needs them
    request = json.loads(sys.stdin.readline() or json.dumps({"op": "exit"}))
    if request.get("op") != "load":
        return False
    args.library, args.adapter = str(request["library"]), str(request.get("adapter") or "bundled")
    args.adapter_path = [str(folder) for folder in request.get("adapter_path") or []]
    if request.get("compile_cache"):  # linked into the read-only slot: read, never written back
        args.compile_cache, args.compile_cache_read_only = str(request["compile_cache"]), True
    return True


def _use_compile_cache(args: argparse.Namespace, environment: dict) -> None:
    """Inductor and Triton pointed at the build's compile cache (worker.engine.compile_cache), before
    the adapter is loaded: no compile may go to the scratch default first."""
    if args.compile_cache:
        from worker.engine import compile_cache

        compile_cache.use_in_host(args.compile_cache, writable=not args.compile_cache_read_only,
                                  class_key=str(environment["class_key"]),
                                  scratch=os.environ.get("TMPDIR") or "/tmp")


def _load_adapter(args: argparse.Namespace, protocol: TextIO):  # noqa: ANN202
    """(the adapter with the build loaded, its families, its description); on any failure the
    not-ready line carries the whole message to the parent, and the error propagates (the host exits)."""
    from worker.adapters import AdapterError, get_adapter

    sys.path[:0] = [str(Path(folder).resolve()) for folder in args.adapter_path]
    try:
        adapter = get_adapter(args.adapter)
        adapter.load(args.library)
        families = adapter.families()
        description = {str(k): str(v) for k, v in adapter.describe().items()}
    except Exception as error:  # noqa: BLE001 - the adapter's fault, said whole to the parent
        message = str(error) if isinstance(error, AdapterError) else \
            f"adapter {args.adapter!r} failed to load {args.library}: {type(error).__name__}: {error}"
        protocol.write(not_ready_line(message))
        raise
    return adapter, families, description


def _answer_case(request: dict, device, protocol: TextIO, adapter, families) -> bool:  # noqa: ANN001
    """One case ("run" or "params"); False when the host must exit (a CUDA error)."""
    import torch

    from worker.engine.cuda_errors import context_lost
    from worker.engine.trajectory import run_case, run_params

    case = CaseSpec.model_validate(request["case"])
    restart = False
    faults.inject(case)
    if faults.lie(case, protocol):
        return True
    unsupported = adapter.unsupported(case, device)
    try:
        if unsupported:  # a capability, not a fault: set aside, never part of a verdict
            result = CaseResult(case=case, status="not_applicable", message=unsupported)
        elif request.get("op") == "params" and request.get("states_out"):  # attribution: the states too
            with open(request["params_out"], "wb") as params_out, open(request["states_out"], "wb") as states_out:
                result = run_params(case, device, params_out, families=families, states_out=states_out)
        elif request.get("op") == "params":  # a co-run: kernels and parameters only
            with open(request["params_out"], "wb") as params_out:
                result = run_params(case, device, params_out, families=families)
        elif request.get("params_out"):
            with open(request["params_out"], "wb") as params_out:
                result = run_case(case, device, params_out, families=families)
        else:
            result = run_case(case, device, families=families)
    except Exception as error:  # noqa: BLE001 - any kernel error is this case's verdict
        restart = context_lost(error, device)
        result = CaseResult(case=case, status="broken", message=f"{type(error).__name__}: {error}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    protocol.write(result_line(result, restart=restart))
    return not restart


def _answer_run_many(request: dict, device, protocol: TextIO, adapter, families, *, spare_host: bool) -> bool:  # noqa: ANN001
    with gc_policy.full_collections_held():
        finished = batch.answer(request, device, protocol, adapter, families)
    gc.collect()  # the parent has every answer: nobody waits for this host now
    if spare_host:  # a spare serves one run: what it prepared and no wave took goes
        from worker.engine import step_inputs

        step_inputs.discard_prepared()
    return finished


def _answer_time_kernels(request: dict, device, protocol: TextIO, adapter, families) -> bool:  # noqa: ANN001
    from worker.speed import timing  # the kernels' own speed (worker/speed/timing.py)

    timed = timing.answer(request, device, adapter, families)
    protocol.write(plain_json_line(timed))
    return not timed.get("restart")


def _answer_train(request: dict, device, protocol: TextIO, families) -> bool:  # noqa: ANN001
    """One training run (worker/training/loop.py): {"training": <TrainingRunAnswer>} or
    {"training_error": <message>}; False when the host must exit (a CUDA error)."""
    import torch

    from service.core.training import TrainingRunSpec
    from worker.engine.cuda_errors import context_lost
    from worker.training.loop import train

    spec = TrainingRunSpec.model_validate(request["run"])
    restart = False
    try:
        answer = {"training": train(spec, families, device).model_dump(mode="json")}
    except Exception as error:  # noqa: BLE001 - the run's answer; the job says which run
        restart = context_lost(error, device)
        answer = {"training_error": f"{type(error).__name__}: {error}"}
    if device.type == "cuda" and not restart:
        torch.cuda.synchronize(device)
    protocol.write(plain_json_line({**answer, "restart": restart}))
    return not restart


def _serve(protocol: TextIO, device, adapter, families, *, spare_host: bool) -> int:  # noqa: ANN001
    """Answer requests until the parent says exit or closes stdin; the exit status."""
    for line in sys.stdin:
        request = json.loads(line)
        op = request.get("op")
        if op == "exit":
            return 0
        if op == "run_many":
            going_on = _answer_run_many(request, device, protocol, adapter, families, spare_host=spare_host)
        elif op == "time_kernels":
            going_on = _answer_time_kernels(request, device, protocol, adapter, families)
        elif op == "train":
            going_on = _answer_train(request, device, protocol, families)
        else:
            going_on = _answer_case(request, device, protocol, adapter, families)
        if not going_on:
            return EXIT_FOR_RESTART
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    clock = _StartupClock()
    clock.mark("arguments")
    protocol = _take_protocol_stream()
    import torch

    clock.mark("import torch")
    import worker.adapters  # noqa: F401 - the engine's modules, timed as one startup phase
    import worker.engine.cuda_errors  # noqa: F401
    import worker.engine.environment  # noqa: F401
    import worker.engine.trajectory  # noqa: F401
    from worker.references.digest import reference_digests

    clock.mark("import engine")
    if args.harness_library:
        _load_harness(args.harness_library, clock)
    torch.set_num_threads(max(1, args.threads))
    device = environment = None
    if args.wait_for_build:  # everything that does not depend on the build, then wait for it
        device, environment = _open_device(args.device)
        clock.mark("device")
        if args.prepare_inputs:  # the cases the parent expects: their inputs made while it waits
            spare.prepare_inputs(Path(args.prepare_inputs), device, clock.mark, ready_waves=args.ready_waves)
        if not _await_build(args):
            return 0  # the parent closed its spare without using it
        clock.mark("build received")
    if args.compile_cache and device is None:  # its folder is named by this host's environment
        device, environment = _open_device(args.device)
        clock.mark("device")
    if args.compile_cache:
        _use_compile_cache(args, environment)
        clock.mark("compile cache")
    adapter, families, description = _load_adapter(args, protocol)
    clock.mark("adapter load")
    if device is None:
        device, environment = _open_device(args.device)
        clock.mark("device")
    # The references as loaded now, after the adapter (whatever it imported or replaced is what the
    # cases are measured against): worker/references/digest.py.
    environment = {**environment, "references": reference_digests()}
    protocol.write(ready_line(environment, description, clock.phases))
    # What the imports made lives as long as the host: kept out of every later full collection,
    # which then walks only what runs allocate (worker/gc_policy.py).
    gc.freeze()
    return _serve(protocol, device, adapter, families, spare_host="inputs queued" in clock.phases)


if __name__ == "__main__":
    sys.exit(main())
