"""The parent's side of a kernel host: `KernelHost`, the worker's handle on one host process.

It starts the host in the sandbox (`python -m worker.engine.host.child`, worker.sandbox.popen),
writes requests, and reads and checks every answer (worker.engine.host.protocol): the host runs
submitted code. It enforces a per-case timeout and the run's deadline, and turns a crash, a hang or
a startup failure into a `broken` case whose message carries the host's last stderr lines; after
one it starts a fresh host for the remaining cases. A spare (`KernelHost.spare`, used by
worker.engine.host_reserve) starts before its build is known and adopts it later.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from service.core.results import CaseResult, CaseSpec, EnvironmentFingerprint
from worker import gc_policy, sandbox
from worker.adapters import registry as adapter_registry
from worker.engine import compile_cache as compile_cache_module
from worker.engine.compile_cache import CompileCache
from worker.engine.host.protocol import (
    EXIT_REQUEST,
    MAX_ANSWER_BYTES,
    HostProtocolError,
    KernelHostError,
    case_request,
    checked_index,
    checked_result,
    encode_request,
    known_fields,
    known_series_result,
    load_request,
    parse_answer,
    run_many_request,
    shown_seconds,
)
from worker.engine import states_file
from worker.sandbox import boxfiles, log_tail

_REPO_ROOT = Path(__file__).resolve().parents[3]
CHILD_MODULE = "worker.engine.host.child"
log = logging.getLogger(__name__)

# A host that cannot start twice in a row will not start for the next case either (a deterministic
# import or load failure); the remaining cases get its reason at once instead of a start each.
STARTS_BEFORE_GIVING_UP = 2


def take_params_file(written: Path, destination: Path, *, max_bytes: int) -> str | None:
    """Copy the parameters (or states) the host wrote in its scratch to `destination` and remove
    them there; the reason when the file must not be read. The host runs submitted code: a link
    planted there would point the worker's own reads (the co-run's diffs, attribution) at a file
    outside the box, a FIFO would block the worker's open for ever, and the host may still change
    the file while it is read; so it is taken through worker.sandbox.boxfiles (a plain file with
    one name, at most `max_bytes`, copied into the worker's own folder)."""
    try:
        found = boxfiles.copy_out(written.parent, written.name, destination, max_bytes=max_bytes)
    except boxfiles.BoxFileRefused as refused:
        return f"the kernel host's output file was not read: {refused}"
    if found:
        written.unlink(missing_ok=True)
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
                 adapter_paths: list[str | Path] | tuple = (), compile_cache: CompileCache | None = None):
        """`deadline` (time.monotonic()): the run's time budget; no wait goes past it, and cases
        asked for after it are answered `broken` without being run. `adapter_paths`: folders the
        adapter module is imported from (shown read-only in the sandbox). `compile_cache`: the
        build's inductor/Triton cache (worker.engine.compile_cache), shown read-write or read-only
        as it says; None: the host compiles into its scratch."""
        self.library_path = str(library_path)
        self.adapter = adapter
        self.adapter_paths = [Path(p).resolve() for p in adapter_paths]
        self.compile_cache = compile_cache
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
        module, adapter_folders = self._adapter_for_host()
        cache = self.compile_cache
        return self._spawn(["--library", self.library_path, "--adapter", module,
                            *(arg for folder in adapter_folders for arg in ("--adapter-path", str(folder))),
                            *(cache.host_arguments() if cache else [])],
                           readable=self._library_folders() + adapter_folders
                           + ([cache.folder] if cache and not cache.writable else []),
                           writable=[cache.folder] if cache and cache.writable else [])

    def _adapter_for_host(self) -> tuple[str, list[Path]]:
        """(the adapter module the host imports, the folders it imports it from): for an adapter the
        operator registered (worker.adapters.registry), its module and folder first; then the
        tree's adapter_path folders."""
        try:
            module, registered = adapter_registry.host_form(self.adapter)
        except ValueError as error:  # the operator's registration is malformed: said for every case
            raise KernelHostError(str(error)) from None
        return module, registered + self.adapter_paths

    def _spawn(self, arguments: list[str], readable: list[Path], writable: list[Path] = ()) -> float:
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
            [sys.executable, "-P", "-m", CHILD_MODULE, "--device", self.device, "--threads",
             str(self.threads), *arguments],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env,
            limits=sandbox.HOST_LIMITS, readable=readable, writable=list(writable), gpu=self.device != "cpu",
            cwd=self._scratch.path,
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
            self.startup_s = shown_seconds(phases, limit=12)
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
                    deadline: float | None = None, compile_cache: CompileCache | None = None) -> None:
        """Give this spare its build, as `KernelHost(library_path, ...).start()` would have loaded it:
        the build's folder and the adapter folders are linked (hard links, or copies across file
        systems) into the slot, which the sandbox shows read-only, and the host loads them from
        there. `compile_cache`: linked in too; the spare reads it as an untrusted host does, its own
        compiles stay in its scratch (its box was made before the build was known).
        Raises KernelHostError when the spare is gone or does not come up."""
        if not self._alive() or self._slot is None:
            raise KernelHostError("the spare kernel host is not running")
        self.library_path, self.adapter = str(library_path), adapter
        self.adapter_paths = [Path(p).resolve() for p in adapter_paths]
        self.case_timeout_s, self.deadline = case_timeout_s, deadline
        folders = self._library_folders()
        module, adapter_folders = self._adapter_for_host()
        inside = [self._slot / str(i) for i in range(len(folders) + len(adapter_folders))]
        for source, target in zip(folders + adapter_folders, inside):
            _link_tree(source, target)
        library = self.library_path
        if folders:
            built = Path(self.library_path)
            library = str(inside[0] if built.is_dir() else inside[0] / built.name)
        cache_inside, self.compile_cache = None, compile_cache
        if compile_cache is not None:
            cache_inside = self._slot / "compile-cache"
            _link_tree(compile_cache.folder, cache_inside)
        request = load_request(library, module, [str(p) for p in inside[len(folders):]],
                               compile_cache=str(cache_inside) if cache_inside else None)
        try:
            self._process.stdin.write(encode_request(request))
            self._process.stdin.flush()
        except OSError as error:
            raise KernelHostError(f"the spare kernel host is gone: {error}") from None
        self.start_attempts += 1
        self._await_ready(self._spare_spawned)
        if self.adapter_description:  # say where the build came from, not the slot it was linked into
            for source, target in zip(folders + adapter_folders, inside):
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
                self._process.stdin.write(encode_request(EXIT_REQUEST))
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
        if self._slot is not None and self.compile_cache is not None and self.environment is not None:
            # A trusted spare compiled into its scratch (its box was made before the build was known)
            compile_cache_module.keep_new_entries(self._scratch.path / compile_cache_module.SCRATCH_COPY,
                                                  self.compile_cache, self.environment.class_key)
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

    def submit(self, case: CaseSpec, params_out: str | Path | None = None, *, params_only: bool = False,
               states_out: str | Path | None = None) -> None:
        """Send a case; `collect()` gets its result. Two hosts can work at the same time this way.
        `params_only` (with `params_out`): the kernels alone, no references (a co-run); `states_out`
        (with both): every step's state leaves there as well (worker.engine.states_file)."""
        self._pending_case = case
        self._pending_states_out = Path(states_out) if states_out and params_only and params_out else None
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
        states_inside = self._scratch.path / "states.npys"
        states_inside.unlink(missing_ok=True)
        request = case_request(case, str(inside) if params_out else None, params_only=params_only,
                               states_out=str(states_inside) if self._pending_states_out else None)
        self._pending_started = time.monotonic()
        try:
            self._process.stdin.write(encode_request(request))
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
            refused = take_params_file(self._scratch.path / "params.f32", self._pending_params_out,
                                       max_bytes=case.steps * case.size * 4)
            if refused:
                return CaseResult(case=case, status="broken", message=refused,
                                  duration_s=time.monotonic() - started)
        if self._pending_states_out is not None:
            # A refused state file costs the case its states, not its result: attribution reads the
            # parameters alone (worker.engine.states_file reads what is taken as untrusted anyway).
            if take_params_file(self._scratch.path / "states.npys", self._pending_states_out,
                                max_bytes=states_file.byte_limit(case.size, case.steps)):
                self._pending_states_out.unlink(missing_ok=True)
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
            self._process.stdin.write(encode_request(request))
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
        clock = _ParentClock(profile)
        self.last_parent_marks = clock.seconds
        self._ensure_running()  # a startup failure: the one-by-one pass below reports it per case
        if self._alive():
            held = self._send_run_many(cases, params_file, known, known_result, profile, clock)
            if on_request_sent is not None:
                on_request_sent()
            clock.mark("on_request_sent done")
            self._read_run_many(cases, results, on_result, on_pause, known_result if held else None, clock)
        self._run_unanswered(cases, results, on_result, run_one)
        return results

    def _send_run_many(self, cases: list[CaseSpec], params_file: str | None, known, known_result,  # noqa: ANN001
                       profile: bool, clock: "_ParentClock") -> bool:
        """Write the run_many request; whether it names known series (the reference cache's)."""
        request = run_many_request(cases, params_out=str(self._scratch.path / params_file) if params_file else None,
                                   profile=profile)
        clock.mark("request made")
        held = known(self.environment) if known is not None and self.environment is not None else None
        if held:
            request.update(known_fields(held, by_key=known_result is not None))
        clock.mark("known")
        try:
            self._process.stdin.write(encode_request(request))
            self._process.stdin.flush()
        except OSError:
            pass  # the host died; the first read finds end of file
        clock.mark("request sent")
        return bool(held)

    def _read_run_many(self, cases: list[CaseSpec], results: list, on_result, on_pause, known_result,  # noqa: ANN001
                       clock: "_ParentClock") -> None:
        """The sent run_many's answers into `results` until its done or stopped line. A dead or
        hung host, or an answer that is not valid, ends the reading (the host killed): what it
        answered so far stands, and the rest runs one case at a time (`_run_unanswered`), where a
        host that misbehaves again costs only that case."""
        while True:
            if on_pause is not None and not self._answer_ready():
                on_pause()
            try:
                answer, index, result = self._next_answer(cases, results, known_result)
            except HostProtocolError as error:
                log.warning("kernel host for %s: %s", self.library_path, error)
                self._kill()
                return
            if answer is None:
                self._kill()
                return
            if index is None:
                clock.mark("done line")
                self._take_done_line(answer)
                return
            clock.mark("first answer")
            results[index] = result
            if on_result:
                on_result(index, result)
            clock.mark_latest("last answer")

    def _next_answer(self, cases: list[CaseSpec], results: list, known_result) -> tuple:  # noqa: ANN001
        """(answer, case index, its result) of the next run_many line; (None, None, None) when the
        host died or missed the timeout; (the line, None, None) for its done or stopped line."""
        # The timeout applies between answers: one group of cases at most.
        line = self._read_line(time.monotonic() + self.case_timeout_s)
        if line is None:
            return None, None, None
        answer = parse_answer(line)
        index = checked_index(answer, results)
        if index is None:
            return answer, None, None
        if "series" in answer and "result" not in answer:
            return answer, index, known_series_result(answer, index, known_result)
        return answer, index, checked_result(answer, cases[index])

    def _take_done_line(self, answer: dict) -> None:
        """The done (or stopped) line: a restart the host asks for, and its figures, on the host's
        clock: shown, never trusted (bench/warm_battery_profile.py)."""
        if answer.get("restart"):
            self._kill()
        taken = answer.get("inputs_taken")
        self.last_inputs_taken = taken if isinstance(taken, int) else 0
        self.last_phases = shown_seconds(answer.get("phases"), limit=32)
        self.last_params_s = shown_seconds(answer.get("params_s"), limit=8)  # a co-run's parameter writing

    def _run_unanswered(self, cases: list[CaseSpec], results: list, on_result, run_one) -> None:  # noqa: ANN001
        """The cases the fast runner did not answer, one by one (`run_one(index, case)` or `run`)."""
        for index, case in enumerate(cases):
            if results[index] is None:
                results[index] = run_one(index, case) if run_one is not None else self.run(case)
                if on_result:
                    on_result(index, results[index])


class _ParentClock:
    """run_many(profile=True): the parent's clock, seconds from the call to each mark (request made,
    reference lookup done, request sent, on_request_sent done, first and last answer, the host's
    done line): where the parent's share of a run goes (bench/warm_battery_profile.py)."""

    def __init__(self, on: bool):
        self.on, self.called, self.seconds = on, time.perf_counter(), {}

    def mark(self, name: str) -> None:
        """The first time `name` is reached."""
        if self.on:
            self.seconds.setdefault(name, time.perf_counter() - self.called)

    def mark_latest(self, name: str) -> None:
        """The last time `name` is reached."""
        if self.on:
            self.seconds[name] = time.perf_counter() - self.called
