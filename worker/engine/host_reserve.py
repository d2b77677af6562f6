"""One kernel host kept started ahead of the next run (issue 18: submit -> verdict on a warm commit).

A kernel host's start is mostly `import torch` and the device's context: 4.4 s of a warm run on the
H200, 3.6 s of it the import (bench/warm_battery_profile.py, docs/PERFORMANCE.md). None of it
depends on the build, which is only known once a run is taken. So after each run the worker starts
a spare host (`KernelHost.spare`: sandboxed as every host, with an empty read-only folder of its
own) that imports torch and makes the context while the verdict is computed and the worker waits
for its next task; the next run links its build into the spare's folder and the host loads it
(`KernelHost.adopt_build`). One host still runs one build, and a spare serves one run only.

Used by the worker's main battery (worker.pipeline.run with Policy.warm_host); anything that fails
here falls back to starting a host as before, so a spare can cost time, never a result.
"""

from __future__ import annotations

import atexit
import logging
import threading
from pathlib import Path

from worker.engine.host import KernelHost, KernelHostError

log = logging.getLogger(__name__)
_lock = threading.Lock()
_spare: tuple[str, KernelHost] | None = None  # (device, the host)


def replenish(*, device: str, slot_root: Path | None = None) -> None:
    """Start a spare host for `device` unless one is waiting (a spare of another device is closed)."""
    global _spare
    with _lock:
        if _spare is not None:
            held_device, held = _spare
            if held_device == device and held.running():
                return
            held.close()
            _spare = None
        try:
            _spare = (device, KernelHost.spare(device=device, slot_root=slot_root))
        except OSError as error:  # no sandbox, no fork: the next run starts its host itself
            log.warning("could not start a spare kernel host: %s", error)


def take(library_path: str | Path, *, device: str, adapter: str, adapter_paths: list[Path],
         case_timeout_s: float, deadline: float | None) -> KernelHost | None:
    """The waiting spare with this build loaded, or None (none waiting, another device, or it
    failed to come up: logged, and the caller starts a host as before)."""
    host = _take_waiting(device)
    if host is None:
        return None
    try:
        host.adopt_build(library_path, adapter=adapter, adapter_paths=adapter_paths,
                         case_timeout_s=case_timeout_s, deadline=deadline)
    except KernelHostError as error:
        log.warning("the spare kernel host could not take %s (%s); starting one", library_path, error)
        host.close()
        return None
    return host


def _take_waiting(device: str) -> KernelHost | None:
    """The waiting spare, still without a build; None when none waits (one of another device is closed)."""
    global _spare
    with _lock:
        held, _spare = _spare, None
    if held is None:
        return None
    held_device, host = held
    if held_device != device or not host.running():
        host.close()
        return None
    return host


def spares(count: int, *, device: str, slot_root: Path | None = None) -> list[KernelHost | None]:
    """`count` hosts without a build, importing torch and making the context from now on: the
    waiting spare first, then new ones (None where one could not be started). For work that will
    know its builds only later (the co-run fetches and builds two trees meanwhile); each is given
    its build with `adopted`."""
    hosts: list[KernelHost | None] = [_take_waiting(device)]
    if hosts[0] is None:
        hosts = []
    while len(hosts) < count:
        try:
            hosts.append(KernelHost.spare(device=device, slot_root=slot_root))
        except OSError as error:  # no sandbox, no fork: the work starts its hosts itself
            log.warning("could not start a spare kernel host: %s", error)
            hosts.append(None)
    return hosts[:count]


def adopted(spare: KernelHost | None, library_path: str | Path, *, device: str, adapter: str,
            adapter_paths: list[Path], case_timeout_s: float) -> KernelHost:
    """`spare` with this build loaded; when there is none or it does not come up (logged), a host
    of that build that starts on its first request, as a host started without a spare would."""
    if spare is not None:
        try:
            spare.adopt_build(library_path, adapter=adapter, adapter_paths=adapter_paths,
                              case_timeout_s=case_timeout_s)
            return spare
        except KernelHostError as error:
            log.warning("a spare kernel host could not take %s (%s); starting one", library_path, error)
            spare.close()
    return KernelHost(library_path, device=device, case_timeout_s=case_timeout_s, adapter=adapter,
                      adapter_paths=adapter_paths)


@atexit.register
def discard() -> None:
    """Close the waiting spare (the worker is stopping, or a test is done with it)."""
    global _spare
    with _lock:
        held, _spare = _spare, None
    if held is not None:
        held[1].close()
