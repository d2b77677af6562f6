"""Kernel host: a subprocess that loads ONE build and runs cases on request.

Two builds of the same library cannot share a process (one op namespace), and a kernel that
segfaults, hangs or hits a CUDA error must cost one case, not the run. So each build runs in

    python -m worker.engine.host --library PATH --device cpu|cuda|auto [--threads N] [--adapter NAME]

(the adapter, worker.adapters, loads PATH and steps the cases; `bundled` by default)

which speaks JSON lines: the parent writes one request per line on the host's stdin, the host
answers one line on its stdout.

    -> {"op": "run", "case": <CaseSpec>, "params_out": "/tmp/x.f32" | null}
    <- {"result": <CaseResult>, "restart": false}
    -> {"op": "params", "case": <CaseSpec>, "params_out": "/tmp/x.f32"}   (a co-run: kernels only,
       the parameters after each step into params_out; the result's trajectory has digests only)
    -> {"op": "run_many", "cases": [<CaseSpec>, ...]}       (fast mode: worker.engine.fast)
       with "params_out": a file in the scratch: the co-run's kernels-only waves writing every
       step's parameters there (worker.engine.params_file); with "known": {index: [series keys]}
       the reference cache's two passes (worker.engine.kernels_only, worker.engine.reference_cache)
    <- {"index": i, "result": <CaseResult>} per case as its group finishes, then {"done": true},
       or {"stopped": "<error>", "restart": bool} after an error the fast runner could not
       attribute to a case (the parent then runs the unanswered cases one by one)
    -> {"op": "time_kernels", "plan": {...}}   (worker/speed/timing.py: each kernel's step timed)
    <- {"timings": [...], "not_applicable": n, "not_timed": n, "seconds": s, "device": name, "restart": bool}
    -> {"op": "exit"}
On start the host answers {"ready": true, "environment": <EnvironmentFingerprint>, "adapter":
<the adapter's describe()>}, or, when the adapter cannot be imported or cannot load the build,
{"ready": false, "error": <the whole message>} and exits. `--adapter-path DIR` (repeatable) puts
DIR first on sys.path, for an adapter module that lives in the project's tree.

The protocol gets a private copy of the original stdout; fd 1 is pointed at stderr so anything a
kernel or library prints cannot corrupt it. A kernel error (RuntimeError) answers a `broken` case;
after a CUDA error the context is unusable, so the host answers and exits, and the parent starts a
fresh host for the remaining cases. The parent (`KernelHost`) enforces a per-case timeout and
turns a crash, a hang or a startup failure into a `broken` case whose message carries the
host's last stderr lines.

Test-only fault injection (tests/test_engine_host.py, tests/test_faults.py):
OPTDRIFT_TEST_HOST_FAULT="abort:TEXT" calls os.abort(), "segv:TEXT" reads address 0 and
"hang:TEXT" sleeps forever when a case id contains TEXT. A host runs submitted code, so it may
also lie: "garbage:TEXT" answers a line that is not JSON, "flood:TEXT" sends bytes without end of
line, "foreign:TEXT" answers a result for another case. Nothing else reads it.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import math
import os
import select
import shutil
import stat
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from worker import gc_policy, sandbox
from worker.sandbox import log_tail
from service.core.results import CaseResult, CaseSpec, EnvironmentFingerprint

_MODULE_STARTED = time.perf_counter()  # the host's startup phases count from here (host_main)
_REPO_ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger(__name__)
FAULT_ENV = "OPTDRIFT_TEST_HOST_FAULT"


# ----------------------------------------------------------------------------- host side
def _lie(case: CaseSpec, protocol, index: int = 0) -> bool:  # noqa: ANN001
    """Test-only: answer falsely for `case` (asked for as `index`) as hostile code in the host
    could; True if it did."""
    kind, _, text = os.environ.get(FAULT_ENV, "").partition(":")
    if not text or text not in case.case_id or kind not in ("garbage", "flood", "foreign", "series"):
        return False
    if kind == "series":  # a known series claimed by a key nobody gave it
        protocol.write(json.dumps({"index": index, "series": "0" * 32, "duration_s": 0.0}) + "\n")
    elif kind == "garbage":
        protocol.write("this is not a protocol line\n")
    elif kind == "flood":
        for _ in range(80):
            protocol.write("x" * (1 << 20))
        protocol.write("\n")
    else:
        other = case.model_copy(update={"seed": case.seed + 1})
        protocol.write(result_line(CaseResult(case=other, status="broken",
                                              message="a result for a case nobody asked for"), index=0, restart=False))
    protocol.flush()
    return True


def result_line(result: CaseResult, **fields: object) -> str:
    """The protocol line {**fields, "result": result}. pydantic writes the result's JSON itself,
    several times faster than json.dumps of model_dump, which first builds every value as a Python
    object (bench/result_lines.py compares them); json parses both to the same values, every float bit for bit
    (tests/test_host_protocol.py)."""
    head = json.dumps(fields)[:-1]  # '{"index": 3' of '{"index": 3}', or '{' for no fields
    return f'{head}{", " if fields else ""}"result": {result.model_dump_json()}}}\n'


def _inject_fault(case: CaseSpec) -> None:
    fault = os.environ.get(FAULT_ENV, "")
    kind, _, text = fault.partition(":")
    if text and text in case.case_id:
        if kind == "abort":
            os.abort()
        if kind == "segv":  # a real invalid read: the kernel delivers SIGSEGV, as a bad kernel would
            import ctypes

            ctypes.string_at(0)
        if kind == "hang":
            while True:
                time.sleep(3600)


def host_main(argv: list[str] | None = None) -> int:
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
                        help="project adapter (worker.adapters): bundled, bitsandbytes, tinyopt or a module path")
    parser.add_argument("--adapter-path", action="append", default=[],
                        help="a folder to import the adapter module from (first on sys.path); repeatable")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--harness-library",
                        help="optdrift's compiled harness (worker.engine.harness), built by the parent; "
                             "without it the engine runs its Python paths (same results, slower)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads. 1 by default: the engine co-runs two hosts, and "
                             "on small tensors thread hand-offs cost far more than they save "
                             "(measured: a 4097-element sqrt takes 11 ms with 2 threads, 3 us with 1)")
    args = parser.parse_args(argv)
    if not args.library and not args.wait_for_build:
        parser.error("--library is required (or --wait-for-build)")
    # Seconds since this module started importing, at the end of each startup phase: sent with the
    # ready line (the parent adds its own spawn-to-ready time), since a host's start is a large
    # share of a warm run (bench/warm_battery_profile.py reads them).
    startup: dict[str, float] = {}

    def mark(phase: str) -> None:
        startup[phase] = round(time.perf_counter() - _MODULE_STARTED, 4)

    mark("arguments")
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import torch

    mark("import torch")

    from worker.adapters import AdapterError, get_adapter
    from worker.engine.environment import fingerprint, resolve_device
    from worker.engine.cuda_errors import context_lost
    from worker.engine.trajectory import run_case, run_params

    mark("import engine")
    if args.harness_library:
        from worker.engine import harness

        try:
            harness.load(args.harness_library)
        except (OSError, RuntimeError, ImportError) as error:  # the engine's Python paths: same results
            print(f"the harness library did not load ({error}); the engine uses its Python paths", file=sys.stderr)
        else:
            mark("harness load")  # the ready line's phases say whether it loaded
    torch.set_num_threads(max(1, args.threads))
    device = environment = None
    if args.wait_for_build:  # everything that does not depend on the build, then wait for it
        device, environment = _open_device(args.device, torch, resolve_device, fingerprint)
        mark("device")
        if args.prepare_inputs:  # the cases the parent expects: their inputs made while it waits
            _prepare_inputs(Path(args.prepare_inputs), device, mark, ready_waves=args.ready_waves)
        importlib.import_module("worker.engine.kernels_only")  # the engine's modules, before the run needs them
        request = json.loads(sys.stdin.readline() or '{"op": "exit"}')
        if request.get("op") != "load":
            return 0  # the parent closed its spare without using it
        args.library, args.adapter = str(request["library"]), str(request.get("adapter") or "bundled")
        args.adapter_path = [str(folder) for folder in request.get("adapter_path") or []]
        mark("build received")
    sys.path[:0] = [str(Path(folder).resolve()) for folder in args.adapter_path]
    try:
        adapter = get_adapter(args.adapter)
        adapter.load(args.library)
        families = adapter.families()
        description = {str(k): str(v) for k, v in adapter.describe().items()}
        mark("adapter load")
    except Exception as error:  # noqa: BLE001 - the adapter's fault, said whole to the parent
        message = str(error) if isinstance(error, AdapterError) else \
            f"adapter {args.adapter!r} failed to load {args.library}: {type(error).__name__}: {error}"
        protocol.write(json.dumps({"ready": False, "error": message}) + "\n")
        raise
    if device is None:
        device, environment = _open_device(args.device, torch, resolve_device, fingerprint)
        mark("device")
    protocol.write(json.dumps({"ready": True, "environment": environment, "adapter": description,
                               "startup_s": dict(startup)}) + "\n")
    # What the imports made lives as long as the host: kept out of every later full collection,
    # which then walks only what runs allocate (worker/gc_policy.py).
    gc.freeze()

    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "exit":
            return 0
        if request.get("op") == "run_many":
            with gc_policy.full_collections_held():
                finished = _run_many(request, device, protocol, adapter, families)
            gc.collect()  # the parent has every answer: nobody waits for this host now
            if "inputs queued" in startup:  # a spare serves one run: what it prepared and no wave took goes
                from worker.engine import step_inputs

                step_inputs.discard_prepared()
            if not finished:
                return 3
            continue
        if request.get("op") == "time_kernels":  # the kernels' own speed (worker/speed/timing.py)
            from worker.speed import timing

            timed = timing.answer(request, device, adapter, families)
            protocol.write(json.dumps(timed) + "\n")
            if timed.get("restart"):
                return 3
            continue
        case = CaseSpec.model_validate(request["case"])
        restart = False
        _inject_fault(case)
        if _lie(case, protocol):
            continue
        unsupported = adapter.unsupported(case, device)
        try:
            if unsupported:  # a capability, not a fault: set aside, never part of a verdict
                result = CaseResult(case=case, status="not_applicable", message=unsupported)
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
        if restart:
            return 3
    return 0


# A spare's kernels-only waves set up ahead for the cases its parent expects (_prepare_inputs):
# "cases" (those cases as the parent wrote them, JSON), "thread" (setting them up), "waves" (a
# worker.engine.kernels_only.ReadyWaves, once made). Its first run_many takes or drops them.
_READY: dict = {}
# Set up ahead only up to this many parameter elements: the waves hold their arenas, gradients and
# states on the device while the spare waits (the standard battery: 29M elements, ~0.5 GB).
READY_MAX_ELEMENTS = 1 << 26


def _prepare_inputs(expected: Path, device, mark: Callable[[str], None], *, ready_waves: bool = True) -> None:  # noqa: ANN001
    """A spare's idle time: start making the initial parameters and gradient inputs of the cases
    its parent expects (worker.engine.step_inputs.prepare), in threads, while it waits for its
    build, and (`ready_waves`) set up their kernels-only waves (_set_up_ready_waves). Marks "inputs
    prepared" when they are all made (shown in the ready line if that was before it). What
    cannot be prepared is said on stderr and left to the run, which makes its own."""
    from worker.engine import fast, step_inputs

    try:
        raw = json.loads(expected.read_text())
        cases = [CaseSpec.model_validate(c) for c in raw]
        limit = fast.DEFAULT_MAX_WAVE_ELEMENTS.get(device.type, fast.DEFAULT_MAX_WAVE_ELEMENTS["cpu"])
        queued, done = step_inputs.prepare(cases, device, limit)
    except Exception as error:  # noqa: BLE001 - preparing is an optimisation, never a failure
        print(f"inputs not prepared: {type(error).__name__}: {error}", file=sys.stderr)
        return
    mark("inputs queued")
    if done is not None:
        done.add_done_callback(lambda _: mark("inputs prepared"))
    if ready_waves and cases and sum(c.size for c in cases) <= READY_MAX_ELEMENTS:
        thread = threading.Thread(target=_set_up_ready_waves, args=(cases, device, mark),
                                  name="optdrift-ready-waves", daemon=True)
        _READY.update(cases=raw, thread=thread)
        thread.start()


def _set_up_ready_waves(cases: list[CaseSpec], device, mark: Callable[[str], None]) -> None:  # noqa: ANN001
    """The expected cases' kernels-only waves, set up with the bundled families before any build
    is loaded (worker.engine.kernels_only.ReadyWaves), at the lowest priority: a spare waits beside
    a running battery. Marks "waves ready"; a failure is said on stderr and the run sets its
    waves up itself."""
    import torch

    from worker.engine import step_inputs
    from worker.engine.kernels_only import ReadyWaves
    from worker.engine.trajectory import bundled_families

    step_inputs.lowest_priority()
    try:
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        _READY["waves"] = ReadyWaves(cases, device, bundled_families())
    except Exception as error:  # noqa: BLE001 - an optimisation, never a failure
        print(f"waves not set up ahead: {type(error).__name__}: {error}", file=sys.stderr)
        return
    mark("waves ready")


def _take_ready_waves(request: dict, families):  # noqa: ANN001, ANN202
    """The waves set up ahead, when this request brings exactly the cases they were made for and
    the loaded adapter's families are those they were opened with; None otherwise. Either way
    nothing is left for a later request: a spare's waves serve its first run_many only."""
    if not _READY:
        return None
    thread, expected = _READY.pop("thread"), _READY.pop("cases")
    thread.join()  # mostly done long before the build comes; else finishing beats starting over
    ready = _READY.pop("waves", None)
    if ready is not None and (request["cases"] != expected or ready.families is not families):
        ready.close()
        return None
    return ready


def _open_device(name: str, torch, resolve_device, fingerprint) -> tuple:  # noqa: ANN001
    """(the device, its fingerprint as JSON), the CUDA context made now rather than in the first case."""
    device = resolve_device(name)
    if device.type == "cuda":
        torch.zeros(1, device=device)
    return device, fingerprint(device).model_dump(mode="json")


def _run_many(request: dict, device, protocol, adapter, families) -> bool:  # noqa: ANN001
    """Fast mode; False when the host must exit (a CUDA error left the context unusable)."""
    import torch

    from worker.engine.cuda_errors import context_lost
    from worker.engine.kernels_only import run_request

    parse_started = time.perf_counter()
    cases = [CaseSpec.model_validate(c) for c in request["cases"]]
    phases: dict[str, float] | None = {} if request.get("profile") else None

    def emit(index: int, result: CaseResult) -> None:
        if phases is None:
            protocol.write(result_line(result, index=index))
            return
        began = time.perf_counter()
        protocol.write(result_line(result, index=index))
        phases["answers"] = phases.get("answers", 0.0) + time.perf_counter() - began

    def emit_known(index: int, key: str, result: CaseResult) -> None:
        # A known series: its key alone, not its digests (~3.5 KB a 100-step case), which the
        # parent holds already and would parse, check and hash again (bench/parent_share.py).
        began = time.perf_counter()
        protocol.write(json.dumps({"index": index, "series": key, "duration_s": result.duration_s}) + "\n")
        if phases is not None:
            phases["answers"] = phases.get("answers", 0.0) + time.perf_counter() - began

    runnable = []
    for index, case in enumerate(cases):
        _inject_fault(case)  # test-only: a crash here must fall back to one case at a time
        if _lie(case, protocol, index):
            continue
        unsupported = adapter.unsupported(case, device)
        if unsupported:  # as the one-case path answers it
            emit(index, CaseResult(case=case, status="not_applicable", message=unsupported))
        else:
            runnable.append(index)
    from worker.engine import step_inputs

    if phases is not None:
        phases["parse"] = time.perf_counter() - parse_started  # the cases read, before `request` starts
    started, taken_before, full_before = time.perf_counter(), step_inputs.taken(), gc_policy.full_collections()
    ready = _take_ready_waves(request, families)
    if phases is not None:
        phases["ready waves join"] = time.perf_counter() - started
    try:
        split = run_request(request, cases, runnable, device, families, emit, phases,
                            emit_known if request.get("known_by_key") else None, ready)
    except Exception as error:  # noqa: BLE001 - reported; the parent falls back to one case at a time
        restart = context_lost(error, device)
        protocol.write(json.dumps({"stopped": f"{type(error).__name__}: {error}", "restart": restart}) + "\n")
        return not restart
    finally:
        if ready is not None:
            ready.close()  # what the run did not take
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if phases is not None:
        phases["request"] = time.perf_counter() - started
        phases["full collections"] = gc_policy.full_collections() - full_before  # 0 while held
    protocol.write(json.dumps({"done": True, "params_s": split, "inputs_taken": step_inputs.taken() - taken_before,
                               "phases": phases}) + "\n")
    return True


# ----------------------------------------------------------------------------- parent side
# A host that cannot start twice in a row will not start for the next case either (a deterministic
# import or load failure); the remaining cases get its reason at once instead of a start each.
STARTS_BEFORE_GIVING_UP = 2


class KernelHostError(RuntimeError):
    pass


class HostProtocolError(KernelHostError):
    """The host answered something that is not a valid answer to what was asked: it runs submitted
    code, so its answers are checked like any untrusted input."""


# One answer carries one case's per-step arrays: a few MB for the longest battery cases.
MAX_ANSWER_BYTES = 64 * 1024**2


def parse_answer(line: bytes) -> dict:
    try:
        answer = json.loads(line)
    except ValueError:
        raise HostProtocolError("the kernel host answered a line that is not JSON") from None
    if not isinstance(answer, dict):
        raise HostProtocolError("the kernel host answered JSON that is not an object")
    return answer


def known_series_result(answer: dict, index: int, known_result) -> CaseResult:  # noqa: ANN001
    """The result of a known-series answer {"index", "series", "duration_s"}: what
    `known_result(index, series key, duration)` makes of it (the reference cache's stored
    trajectory). The answer names only a key; which keys may be named for the case is the
    resolver's to check."""
    series, duration = answer.get("series"), answer.get("duration_s", 0.0)
    if known_result is None:
        raise HostProtocolError("the kernel host answered a known series although none was asked for")
    if not isinstance(series, str) or len(series) > 64:
        raise HostProtocolError("the kernel host's known-series answer has no valid series key")
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not math.isfinite(duration):
        raise HostProtocolError("the kernel host's known-series answer has no valid duration")
    return known_result(index, series, float(duration))


def checked_result(answer: dict, case: CaseSpec) -> CaseResult:
    """The answer's CaseResult, which must be about `case` (the one asked for)."""
    try:
        result = CaseResult.model_validate(answer["result"])
    except (KeyError, ValueError):
        raise HostProtocolError("the kernel host's answer has no valid result") from None
    if result.case != case:
        raise HostProtocolError(f"the kernel host answered for case {result.case.case_id!r}, "
                                f"not the one asked for ({case.case_id!r})")
    return result


def take_params_file(written: Path, destination: Path) -> str | None:
    """Move the parameters the host wrote in its scratch to `destination`; the reason when the file
    must not be read. The host runs submitted code: a link planted there would point the worker's
    own reads (the co-run's diffs, attribution) at a file outside the box, so only a plain file
    with one name is taken."""
    try:
        info = written.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        return ("the kernel host left its parameter file as a link or a special file; "
                "not read (submitted code may only write plain files in its scratch)")
    shutil.move(written, destination)
    return None


def _link_tree(source: Path, target: Path) -> None:
    """`source` (a folder) recreated at `target`: files hard-linked (copied where the file system
    refuses a link), symbolic links kept as links."""
    for folder, subfolders, files in os.walk(source):
        here = target / Path(folder).relative_to(source)
        here.mkdir(parents=True, exist_ok=True)
        os.chmod(here, 0o755)
        for name in files + [d for d in subfolders if (Path(folder) / d).is_symlink()]:
            origin, copy = Path(folder) / name, here / name
            if origin.is_symlink():
                os.symlink(os.readlink(origin), copy)
                continue
            try:
                os.link(origin, copy)
            except OSError:
                shutil.copy2(origin, copy)


class KernelHost:
    """The parent's handle on one host process; restarts it after a crash, hang or CUDA error."""

    # run_many takes `known_result`: a known series is answered by its key alone (reference_cache)
    answers_known_by_key = True

    def __init__(self, library_path: str | Path, *, device: str = "auto", case_timeout_s: float = 300.0,
                 startup_timeout_s: float = 120.0, env: dict[str, str] | None = None, threads: int = 1,
                 adapter: str = "bundled", deadline: float | None = None,
                 adapter_paths: list[str | Path] | tuple = ()):
        """`deadline` (time.monotonic()): the run's time budget; no wait goes past it, and cases
        asked for after it are answered `broken` without being run. `adapter_paths`: folders the
        adapter module is imported from (shown read-only in the sandbox)."""
        self.library_path = str(library_path)
        self.adapter = adapter
        self.adapter_paths = [Path(p).resolve() for p in adapter_paths]
        # The adapter's describe() from the ready line: what was loaded (version, path).
        self.adapter_description: dict[str, str] | None = None
        self.device = device
        self.case_timeout_s = case_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.startup_s: dict[str, float] = {}  # the last start's phases (host clock) and spawn to ready
        self.env = env
        self.threads = threads
        self.deadline = deadline
        self.environment: EnvironmentFingerprint | None = None
        self.restarts = 0
        # Starts that failed in a row (an adapter that cannot be imported, a library that will not
        # load): after STARTS_BEFORE_GIVING_UP the host is not started again for every case.
        self.start_attempts, self._failed_starts, self._start_error = 0, 0, ""
        self._process: subprocess.Popen | None = None
        self._buffer = bytearray()
        self._stderr = tempfile.NamedTemporaryFile(prefix="optdrift-host-", suffix=".log", delete=False)
        self._scratch = sandbox.Scratch(prefix="optdrift-host-scratch-")
        self._slot: Path | None = None  # a spare's folder for its build (spare(), adopt_build())
        self.last_params_s: dict[str, float] = {}  # the last run_many's parameter writing (host clock)
        self.last_inputs_taken = 0  # steps of gradient inputs it had prepared and the last run_many took
        self.last_phases: dict[str, float] = {}  # run_many(profile=True): the host's seconds per wave phase
        # run_many(profile=True): the parent's clock, seconds from the call to each mark (request
        # made, reference lookup done, request sent, on_request_sent done, first and last answer,
        # the host's done line): where the parent's share of a run goes (bench/warm_battery_profile.py).
        self.last_parent_marks: dict[str, float] = {}
        self._spare_spawned = 0.0

    def __enter__(self) -> "KernelHost":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- process management
    def start(self) -> None:
        self._await_ready(self._spawn_for_build())

    @staticmethod
    def start_together(hosts: list["KernelHost"]) -> None:
        """Start `hosts` at once from this thread: every process is spawned before any is waited
        for, so their torch imports and CUDA contexts overlap (two hosts of an attribution start in
        about the time of one). Call it from the thread that will use them: a host dies with the
        thread that started it (the sandbox's parent-death signal). A host that does not start is
        left stopped, as if never started: its first request starts it again and reports why."""
        spawned = [(host, host._spawn_for_build()) for host in hosts if not host._alive()]
        for host, at in spawned:
            try:
                host._await_ready(at)
            except (KernelHostError, HostProtocolError) as error:
                log.warning("%s; it is started again by its first request", error)
                host._kill()
                host._process = None

    def _spawn_for_build(self) -> float:
        # Submitted code runs here, in the sandbox (worker/sandbox/__init__.py): it sees the build's output
        # read-only, the GPU's device nodes, a scratch HOME/TMPDIR removed by close(), and talks
        # to this process only over its pipes. Its own process group: a kill takes its children too.
        return self._spawn(["--library", self.library_path, "--adapter", self.adapter,
                            *(arg for folder in self.adapter_paths for arg in ("--adapter-path", str(folder)))],
                           readable=self._library_folders() + self.adapter_paths)

    def _spawn(self, arguments: list[str], readable: list[Path]) -> float:
        env = sandbox.sandbox_env(scratch=self._scratch.path,
                                  source=os.environ if self.env is None else self.env)
        from worker.engine import harness  # imports torch: only where a host is started

        harness_library = harness.library_for(self.device)  # optdrift's own code; a cache hit after the first
        if harness_library is not None:
            arguments = ["--harness-library", str(harness_library), *arguments]
            readable = [*readable, harness_library.parent]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
        self._buffer = bytearray()
        spawned = time.perf_counter()
        self._process = sandbox.popen(
            [sys.executable, "-P", "-m", "worker.engine.host", "--device", self.device, "--threads",
             str(self.threads), *arguments],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env,
            limits=sandbox.HOST_LIMITS, readable=readable, gpu=self.device != "cpu", cwd=self._scratch.path,
            scratch=self._scratch.path,
        )
        return spawned

    def _await_ready(self, spawned: float) -> None:
        try:
            line = self._read_line(time.monotonic() + self.startup_timeout_s)
        except HostProtocolError:
            line = None
        if line is None:
            self._kill()
            raise KernelHostError(f"kernel host for {self.library_path} did not start: {self._death_note()}")
        try:
            answer = parse_answer(line)
            if answer.get("ready") is False and isinstance(answer.get("error"), str):
                self._kill()
                raise KernelHostError(f"kernel host for {self.library_path} did not start: "
                                      f"{log_tail.clip_lines(answer['error'], max_line_chars=4000)}")
            self.environment = EnvironmentFingerprint.model_validate(answer["environment"])
            described = answer.get("adapter")
            self.adapter_description = ({str(k): str(v) for k, v in described.items()}
                                        if isinstance(described, dict) else None)
            phases = answer.get("startup_s")  # the host's own clock: shown, never trusted for anything
            self.startup_s = {str(k)[:40]: float(v) for k, v in list(phases.items())[:12]
                              if isinstance(v, (int, float))} if isinstance(phases, dict) else {}
            self.startup_s["spawn to ready"] = round(time.perf_counter() - spawned, 4)
            log.info("kernel host for %s started in %.2f s (%s)", self.library_path,
                     self.startup_s["spawn to ready"], ", ".join(f"{k} {v:.2f}" for k, v in self.startup_s.items()))
        except (KeyError, ValueError) as error:
            self._kill()
            raise HostProtocolError(f"kernel host for {self.library_path} did not start: its first answer "
                                    f"is not a valid ready line ({type(error).__name__})") from None

    # -- a spare host: started before its build is known (worker.engine.host_reserve)
    @classmethod
    def spare(cls, *, device: str, threads: int = 1, slot_root: Path | None = None,
              prepare: list[CaseSpec] | None = None, ready_waves: bool = True) -> "KernelHost":
        """A host that imports torch and makes the device's context now, and waits for `adopt_build`.
        Its sandbox shows, besides what every host sees, one empty folder of its own (the slot),
        read-only; the build is linked into it when it is known. `prepare`: the cases its run is
        expected to bring; it makes their gradient inputs while it waits (worker.engine.step_inputs)
        and (`ready_waves`) sets their kernels-only waves up (worker.engine.kernels_only.ReadyWaves)."""
        host = cls("", device=device, threads=threads)
        if slot_root is not None:
            Path(slot_root).mkdir(parents=True, exist_ok=True, mode=0o700)
        host._slot = Path(tempfile.mkdtemp(prefix="optdrift-host-slot-", dir=slot_root))
        os.chmod(host._slot, 0o755)  # the sandbox user reads it
        arguments = ["--wait-for-build"]
        if prepare:  # a file in its slot, not a pipe: the host reads it only once its context is made
            expected = host._slot / "expected-cases.json"
            expected.write_text(json.dumps([c.model_dump(mode="json") for c in prepare]))
            os.chmod(expected, 0o644)
            arguments += ["--prepare-inputs", str(expected)] + ([] if ready_waves else ["--no-ready-waves"])
        host._spare_spawned = host._spawn(arguments, readable=[host._slot])
        return host

    def adopt_build(self, library_path: str | Path, *, adapter: str = "bundled",
                    adapter_paths: list[str | Path] | tuple = (), case_timeout_s: float = 300.0,
                    deadline: float | None = None) -> None:
        """Give this spare its build, as `KernelHost(library_path, ...).start()` would have loaded it:
        the build's folder and the adapter folders are linked (hard links, or copies across file
        systems) into the slot, which the sandbox shows read-only, and the host loads them from
        there. Raises KernelHostError when the spare is gone or does not come up."""
        if not self._alive() or self._slot is None:
            raise KernelHostError("the spare kernel host is not running")
        self.library_path, self.adapter = str(library_path), adapter
        self.adapter_paths = [Path(p).resolve() for p in adapter_paths]
        self.case_timeout_s, self.deadline = case_timeout_s, deadline
        folders = self._library_folders()
        inside = [self._slot / str(i) for i in range(len(folders) + len(self.adapter_paths))]
        for source, target in zip(folders + self.adapter_paths, inside):
            _link_tree(source, target)
        library = self.library_path
        if folders:
            built = Path(self.library_path)
            library = str(inside[0] if built.is_dir() else inside[0] / built.name)
        request = {"op": "load", "library": library, "adapter": adapter,
                   "adapter_path": [str(p) for p in inside[len(folders):]]}
        try:
            self._process.stdin.write((json.dumps(request) + "\n").encode())
            self._process.stdin.flush()
        except OSError as error:
            raise KernelHostError(f"the spare kernel host is gone: {error}") from None
        self.start_attempts += 1
        self._await_ready(self._spare_spawned)
        if self.adapter_description:  # say where the build came from, not the slot it was linked into
            for source, target in zip(folders + self.adapter_paths, inside):
                self.adapter_description = {k: v.replace(str(target), str(source))
                                            for k, v in self.adapter_description.items()}

    def _library_folders(self) -> list[Path]:
        """What the host must read of the build: the folder of a built file, or a built tree."""
        library = Path(self.library_path)
        if self.library_path in ("installed", "") or not library.exists():
            return []  # nothing to show: the adapter reports the missing build from inside the box
        return [library if library.is_dir() else library.parent]

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def running(self) -> bool:
        """Whether the host process is alive (a spare still waiting, or a host between cases)."""
        return self._alive()

    def _kill(self) -> None:
        if self._process is None:
            return
        if self._process.poll() is None:
            try:
                os.killpg(self._process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._process.wait()
        for pipe in (self._process.stdin, self._process.stdout):
            try:
                pipe.close()
            except OSError:
                pass

    def interrupt(self) -> None:
        """Kill the host process from another thread: the request the owning thread waits on then
        ends as a dead host's (its read sees end of file); the owner cleans up as after a crash."""
        process = self._process
        if process is not None and process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _ask_exit(self) -> None:
        if self._alive():
            try:
                self._process.stdin.write(b'{"op": "exit"}\n')
                self._process.stdin.flush()
            except OSError:
                pass

    @staticmethod
    def close_together(hosts: list["KernelHost"]) -> None:
        """Close `hosts`, their exits overlapped: a CUDA host's exit (its context and memory torn
        down) takes about a second, which one after the other the co-run paid twice."""
        for host in hosts:
            host._ask_exit()
        for host in hosts:
            host.close()

    def close(self) -> None:
        self._ask_exit()
        if self._process is not None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._kill()
        self._process = None
        self._stderr.close()
        os.unlink(self._stderr.name)
        self._scratch.remove()
        if self._slot is not None:
            shutil.rmtree(self._slot, ignore_errors=True)

    def stderr_tail(self, lines: int = 8) -> str:
        """The host's last stderr lines, bounded whatever the kernel printed (worker.sandbox.log_tail)."""
        self._stderr.flush()
        text = log_tail.tail_text(self._stderr.name, 64 * 1024)
        return log_tail.clip_lines("\n".join(text.strip().splitlines()[-lines:]))

    def _death_note(self) -> str:
        code = self._process.poll() if self._process else None
        killed_by = sandbox.signal_of(code)
        if killed_by is not None:
            how = f"killed by {killed_by.name}"
        elif code is not None:
            how = f"exited with status {code}"
        else:
            how = "no answer"
        tail = self.stderr_tail()
        return how + (f"; last stderr lines:\n{tail}" if tail else "")

    def _answer_ready(self) -> bool:
        """Whether a whole answer, or the start of one, can be read without waiting."""
        if self._buffer.find(b"\n") >= 0:
            return True
        ready, _, _ = select.select([self._process.stdout.fileno()], [], [], 0)
        return bool(ready)

    def _read_line(self, deadline: float) -> bytes | None:
        """One protocol line, or None on EOF (host died) or at the deadline (host hangs)."""
        if self.deadline is not None:
            deadline = min(deadline, self.deadline)
        fd = self._process.stdout.fileno()
        newline = self._buffer.find(b"\n")
        while newline < 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                self._process.wait()
                return None
            searched = len(self._buffer)
            self._buffer += chunk
            newline = self._buffer.find(b"\n", searched)
            if newline < 0 and len(self._buffer) > MAX_ANSWER_BYTES:
                raise HostProtocolError(f"the kernel host sent a line over {MAX_ANSWER_BYTES} bytes")
        line = bytes(self._buffer[:newline])
        del self._buffer[:newline + 1]
        return line

    # -- requests
    def _ensure_running(self) -> str | None:
        """(Re)start the host process if it is not alive; the reason when it cannot start."""
        if self._alive():
            return None
        if self._failed_starts >= STARTS_BEFORE_GIVING_UP:
            return (f"{self._start_error} (not started again: it failed to start "
                    f"{self._failed_starts} times in a row)")
        if self._process is not None:  # it died: a crash in the previous case
            self._kill()
            self.restarts += 1
        self.start_attempts += 1
        try:
            self.start()
        except KernelHostError as error:
            self._failed_starts, self._start_error = self._failed_starts + 1, str(error)
            return str(error)
        self._failed_starts = 0
        return None

    def submit(self, case: CaseSpec, params_out: str | Path | None = None, *, params_only: bool = False) -> None:
        """Send a case; `collect()` gets its result. Two hosts can work at the same time this way.
        `params_only` (with `params_out`): the kernels alone, no references (a co-run)."""
        self._pending_case = case
        self._pending_failure: CaseResult | None = None
        if self.out_of_time():
            self._pending_failure = CaseResult(case=case, status="broken",
                                               message="not run: the run's time budget ran out")
            return
        startup_error = self._ensure_running()
        if startup_error is not None:
            self._pending_failure = CaseResult(case=case, status="broken", message=startup_error)
            return
        # The host can write only inside its scratch: it writes the parameters there, and collect()
        # moves them to where the caller asked.
        self._pending_params_out = Path(params_out) if params_out else None
        inside = self._scratch.path / "params.f32"
        inside.unlink(missing_ok=True)
        request = {"op": "params" if params_only and params_out else "run", "case": case.model_dump(mode="json"),
                   "params_out": str(inside) if params_out else None}
        self._pending_started = time.monotonic()
        try:
            self._process.stdin.write((json.dumps(request) + "\n").encode())
            self._process.stdin.flush()
        except OSError:
            pass  # the host died; collect() finds EOF and reports it

    def collect(self) -> CaseResult:
        """The submitted case's result; a crash, hang or startup failure gives a `broken` result."""
        case = self._pending_case
        if self._pending_failure is not None:
            return self._pending_failure
        started = self._pending_started
        try:
            line = self._read_line(started + self.case_timeout_s)
            if line is not None:
                answer = parse_answer(line)
                result = checked_result(answer, case)
        except HostProtocolError as error:
            self._kill()
            return CaseResult(case=case, status="broken", message=str(error),
                              duration_s=time.monotonic() - started)
        if line is None:
            timed_out = self._process.poll() is None
            self._kill()
            if timed_out and self.out_of_time():
                message = "stopped: the run's time budget ran out during this case"
            elif timed_out:
                message = f"timed out after {self.case_timeout_s:g} s"
            else:
                message = f"kernel host crashed: {self._death_note()}"
            return CaseResult(case=case, status="broken", message=message,
                              duration_s=time.monotonic() - started)
        if answer.get("restart"):
            self._kill()
        if self._pending_params_out is not None:
            refused = take_params_file(self._scratch.path / "params.f32", self._pending_params_out)
            if refused:
                return CaseResult(case=case, status="broken", message=refused,
                                  duration_s=time.monotonic() - started)
        return result

    def run(self, case: CaseSpec, params_out: str | Path | None = None) -> CaseResult:
        self.submit(case, params_out)
        return self.collect()

    def ask(self, request: dict, timeout_s: float) -> dict | None:
        """One request of another kind (worker/speed's `time_kernels`) and its one answer, checked
        only to be a JSON object; None when the host cannot start, dies or misses `timeout_s`."""
        if self.out_of_time() or self._ensure_running() is not None:
            return None
        try:
            self._process.stdin.write((json.dumps(request) + "\n").encode())
            self._process.stdin.flush()
            line = self._read_line(time.monotonic() + timeout_s)
            answer = parse_answer(line) if line is not None else None
        except (OSError, HostProtocolError):
            answer = None
        if answer is None or answer.get("restart"):
            self._kill()
        return answer

    @property
    def scratch_path(self) -> Path:
        """The host's scratch folder (the one place it may write; a co-run's parameter files)."""
        return self._scratch.path

    @gc_policy.full_collections_held()  # no full collection while the answers come (worker/gc_policy.py)
    def run_many(self, cases: list[CaseSpec], on_result=None, *, params_file: str | None = None,  # noqa: ANN001
                 known=None, run_one=None, on_pause=None, on_request_sent=None,  # noqa: ANN001
                 known_result=None, profile: bool = False) -> list[CaseResult]:  # noqa: ANN001
        """All `cases` through the host's fast runner (worker.engine.fast), the same results as
        `run` one by one. `on_result(index, result)` as results arrive (out of order). Cases the
        fast runner did not answer (crash, hang, CUDA error) are then run one by one with `run`
        (or `run_one(index, case)`), so a faulty case is reported broken on its own.
        `params_file`: a file name in `scratch_path` for the co-run's kernels-only run (its layout:
        worker.engine.params_file). `known(environment) -> {index: [series keys]}`: the reference
        cache's known digest series (worker.engine.reference_cache.run_many); with
        `known_result(index, series key, duration_s) -> CaseResult` the host answers a case whose
        digests form one of them with the key alone, and this makes its result. `on_pause()` when
        the host has no further answer ready (its answers come in bursts, one per wave): where a
        caller storing results in batches writes what it holds. `on_request_sent()` once the
        request is on its way, before the first answer is read: work the caller can do while
        the host runs. `profile`: the host times its wave
        phases (`last_phases`, on the host's clock: shown, never trusted)."""
        results: list[CaseResult | None] = [None] * len(cases)
        called = time.perf_counter()
        marks: dict[str, float] = {}

        def mark(name: str) -> None:
            if profile:
                marks.setdefault(name, time.perf_counter() - called)
        self.last_parent_marks = marks
        self._ensure_running()  # a startup failure: the one-by-one pass below reports it per case
        if self._alive():
            request = {"op": "run_many", "cases": [c.model_dump(mode="json") for c in cases]}
            if params_file:
                request["params_out"] = str(self._scratch.path / params_file)
            if profile:
                request["profile"] = True
            mark("request made")
            held = known(self.environment) if known is not None and self.environment is not None else None
            if held:
                request["known"] = {str(index): keys for index, keys in held.items()}
                if known_result is not None:
                    request["known_by_key"] = True
            mark("known")
            try:
                self._process.stdin.write((json.dumps(request) + "\n").encode())
                self._process.stdin.flush()
            except OSError:
                pass
            mark("request sent")
            if on_request_sent is not None:
                on_request_sent()
            mark("on_request_sent done")
            while True:
                if on_pause is not None and not self._answer_ready():
                    on_pause()
                # The timeout applies between answers: one group of cases at most.
                try:
                    line = self._read_line(time.monotonic() + self.case_timeout_s)
                    answer = parse_answer(line) if line is not None else None
                    index = answer.get("index") if answer is not None else None
                    if index is not None:
                        if (isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(cases)
                                or results[index] is not None):
                            raise HostProtocolError(f"the kernel host answered for case index {index!r}, "
                                                    "which was not asked for or was answered already")
                        if "series" in answer and "result" not in answer:
                            result = known_series_result(answer, index, known_result if held else None)
                        else:
                            result = checked_result(answer, cases[index])
                except HostProtocolError as error:
                    # What it answered so far stands; the rest runs one case at a time below,
                    # where a host that misbehaves again costs only that case.
                    log.warning("kernel host for %s: %s", self.library_path, error)
                    self._kill()
                    break
                if answer is None:
                    self._kill()
                    break
                if index is not None:
                    mark("first answer")
                    results[index] = result
                    if on_result:
                        on_result(answer["index"], result)
                    if profile:
                        marks["last answer"] = time.perf_counter() - called
                    continue
                mark("done line")
                if answer.get("restart"):
                    self._kill()
                # A co-run request's parameter writing, on the host's clock: shown, never trusted.
                split = answer.get("params_s")
                taken = answer.get("inputs_taken")  # likewise shown only (bench/warm_battery_profile.py)
                self.last_inputs_taken = taken if isinstance(taken, int) else 0
                phases = answer.get("phases")
                self.last_phases = ({str(k)[:40]: float(v) for k, v in list(phases.items())[:32]
                                     if isinstance(v, (int, float))} if isinstance(phases, dict) else {})
                self.last_params_s = ({str(k)[:40]: float(v) for k, v in list(split.items())[:8]
                                       if isinstance(v, (int, float))} if isinstance(split, dict) else {})
                break
        for index, case in enumerate(cases):
            if results[index] is None:
                results[index] = run_one(index, case) if run_one is not None else self.run(case)
                if on_result:
                    on_result(index, results[index])
        return results


if __name__ == "__main__":
    sys.exit(host_main())
