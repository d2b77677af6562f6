"""Kernel hosts kept started ahead of the work that needs them (issue 18: submit -> verdict on a
warm commit, and a flagged commit's co-run).

A kernel host's start is mostly `import torch` and the device's context: seconds, longer than a
warm battery itself (bench/warm_battery_profile.py measures it). None of it depends on the build, which is only known once a run is taken. So the worker keeps up to KEEP
spare hosts (`KernelHost.spare`: sandboxed as every host, with an empty read-only folder of its
own) that import torch and make the context and then wait; a run links its build into a spare's
folder and the host loads it (`KernelHost.adopt_build`). One host still runs one build, and a
spare serves one piece of work only.

KEEP is 2: a run takes one and starts the next at once, so a commit submitted right after a
verdict finds its host ready (a spare started only after the previous run would still be
importing torch when the commit comes); a flagged run's co-run takes two (its commit's
build and its baseline's, worker/jobs/corun.py). Each idle spare holds a device context.
That holds only where hosts run under bubblewrap, whose boxes see no other process. Without it
(worker.sandbox's weaker fallback), a run's code could signal or trace a spare of the same user
waiting beside it, the host of a later run: there one spare is kept, started after the run
(`spares_kept()`, `start_beside_runs()`).

A spare also makes, while it waits, the gradient inputs of the cases the worker's last run on its
device brought (`expect`; worker.engine.step_inputs): they do not depend on the build, and a
warm commit's battery is most often the last one's. Cases that do not match make their own.

Used by the worker's main battery (worker.pipeline.run with Policy.warm_host) and its co-run;
anything that fails here falls back to starting a host as before, so a spare can cost time, never
a result.

It is also the one door to a kernel host of a build, spare or not (`open_host`): every worker site
opens its hosts there, so what a host is given (device, adapter and its folders, case timeout,
deadline, compile cache) is decided in one place (tests/worker/engine/test_one_host_door.py).
"""

from __future__ import annotations

import atexit
import logging
import threading
from pathlib import Path

from service.core.results import CaseSpec
from worker import sandbox
from worker.engine.compile_cache import CompileCache
from worker.engine.host import KernelHost, KernelHostError

log = logging.getLogger(__name__)
KEEP = 2
_lock = threading.Lock()
_spares: list[tuple[str, KernelHost]] = []  # (device, the host), oldest first
_expected: dict[str, list[CaseSpec]] = {}  # device -> the cases of its last run: what spares prepare


def expect(cases: list[CaseSpec], *, device: str) -> None:
    """The cases the next run on `device` will likely bring (the last run's): spares started from
    now on make their gradient inputs while they wait (worker.engine.step_inputs)."""
    _expected[device] = list(cases)


def start_beside_runs() -> bool:
    """Whether a spare may wait while a run's code runs: only when every host is boxed (bubblewrap)."""
    return sandbox.available()


def spares_kept() -> int:
    """How many spares wait: KEEP where hosts are boxed, else one (module docstring)."""
    return KEEP if start_beside_runs() else 1


def replenish(*, device: str, slot_root: Path | None = None, keep: int | None = None) -> None:
    """Start spare hosts for `device` until `keep` (default: spares_kept()) are waiting (those of another
    device, or dead, are closed)."""
    keep = spares_kept() if keep is None else keep
    with _lock:
        for held in [entry for entry in _spares if entry[0] != device or not entry[1].running()]:
            _spares.remove(held)
            held[1].close()
        while len(_spares) < keep:
            try:
                _spares.append((device, KernelHost.spare(device=device, slot_root=slot_root,
                                                         prepare=_expected.get(device))))
            except OSError as error:  # no sandbox, no fork: the next run starts its host itself
                log.warning("could not start a spare kernel host: %s", error)
                return


def take(library_path: str | Path, *, device: str, adapter: str, adapter_paths: list[Path],
         case_timeout_s: float, deadline: float | None, compile_cache: CompileCache | None = None) -> KernelHost | None:
    """The waiting spare with this build loaded, or None (none waiting, another device, or it
    failed to come up: logged, and the caller starts a host as before). `compile_cache`: the
    build's, which a spare reads only (KernelHost.adopt_build)."""
    host = _take_waiting(device)
    if host is None or not _adopt(host, library_path, adapter=adapter, adapter_paths=adapter_paths,
                                  case_timeout_s=case_timeout_s, deadline=deadline, compile_cache=compile_cache):
        return None
    return host


def _adopt(host: KernelHost, library_path: str | Path, **load) -> bool:  # noqa: ANN003
    """Give `host` its build (KernelHost.adopt_build); a spare that cannot take it is closed (logged)."""
    try:
        host.adopt_build(library_path, **load)
        return True
    except KernelHostError as error:
        log.warning("a spare kernel host could not take %s (%s); starting one", library_path, error)
        host.close()
        return False


def _take_waiting(device: str) -> KernelHost | None:
    """The oldest waiting spare of `device` (the likeliest to be ready), still without a build;
    None when none waits. Spares of another device, or dead, are closed on the way."""
    while True:
        with _lock:
            if not _spares:
                return None
            held_device, host = _spares.pop(0)
        if held_device == device and host.running():
            return host
        host.close()


def spares(count: int, *, device: str, slot_root: Path | None = None) -> list[KernelHost | None]:
    """`count` hosts without a build, importing torch and making the context from now on: the
    waiting spares first, then new ones (None where one could not be started). For work that will
    know its builds only later (the co-run fetches and builds two trees meanwhile); each is given
    its build with `open_host(..., spare=...)`."""
    hosts: list[KernelHost | None] = []
    while len(hosts) < count and (waiting := _take_waiting(device)) is not None:
        hosts.append(waiting)
    while len(hosts) < count:
        try:
            hosts.append(KernelHost.spare(device=device, slot_root=slot_root))
        except OSError as error:  # no sandbox, no fork: the work starts its hosts itself
            log.warning("could not start a spare kernel host: %s", error)
            hosts.append(None)
    return hosts[:count]


def put_back(hosts: list[KernelHost | None], *, device: str, keep: int | None = None) -> None:
    """Spares taken with `spares` but not given a build (the work stopped first: a run came, a
    build failed) wait again for the next taker, up to `keep`; the rest are closed. A host that
    was given a build is closed, never put back: a spare serves one piece of work only."""
    keep = spares_kept() if keep is None else keep
    for host in hosts:
        if host is None:
            continue
        with _lock:
            fresh = host.running() and host.library_path == "" and host.start_attempts == 0
            if fresh and len(_spares) < keep:
                _spares.append((device, host))
                continue
        host.close()


def open_host(library_path: str | Path, *, device: str, adapter: str = "bundled",
              adapter_paths: list[str | Path] | tuple = (), case_timeout_s: float = 300.0,
              deadline: float | None = None, compile_cache: CompileCache | None = None,
              spare: KernelHost | None = None) -> KernelHost:
    """The one way the worker opens a kernel host of a build (tests/worker/engine/test_one_host_door.py):
    `spare` (one started ahead, `spares` or `take`) with this build loaded; when there is none or it
    does not come up (logged), a host of that build that starts on its first request (or with
    `KernelHost.start_together`). `adapter_paths`: the folders the adapter module is imported
    from, shown read-only in its box; `deadline` (time.monotonic()): the run's time budget;
    `compile_cache`: the build's (worker.engine.compile_cache). The defaults are KernelHost's."""
    if spare is not None and _adopt(spare, library_path, adapter=adapter, adapter_paths=adapter_paths,
                                    case_timeout_s=case_timeout_s, deadline=deadline, compile_cache=compile_cache):
        return spare
    return KernelHost(library_path, device=device, case_timeout_s=case_timeout_s, adapter=adapter,
                      adapter_paths=adapter_paths, deadline=deadline, compile_cache=compile_cache)


@atexit.register
def discard() -> None:
    """Close the waiting spares (the worker is stopping, or a test is done with them)."""
    with _lock:
        held = list(_spares)
        _spares.clear()
    for _, host in held:
        host.close()
