"""The watchdog: no wait on a box or its files can hold a worker for ever (issue 43).

A job's thread can block where Python cannot interrupt it: an open() of a FIFO a box planted, a
read of a pipe whose writer never closes, a syscall that never returns. Every timeout inside the job
works only while that thread runs; the watchdog is a thread of its own. Armed around a job's phases
(build, host, blame; a co-run or a timing as a whole), each with the deadline the phase's own limit
implies plus OPTDRIFT_WATCHDOG_SLACK_S, it stops the job when

- the phase's deadline passes (the job's own timeout did not work): DEADLINE;
- a cancel of the run is asked for (polled every CANCEL_POLL_S): CANCEL;
- the worker is asked to shut down (SIGTERM, relayed by worker/tasks.py): SHUTDOWN.

Stopping kills the process groups of this process's children (every box leads one: bubblewrap's
--new-session, or start_new_session=True), which ends every wait on a box's process, and gives the
job's thread OPTDRIFT_WATCHDOG_GRACE_S to unwind: it sees `stop` at its next check (JobStopped) and
settles its run itself. A thread still blocked after the grace is wedged: the watchdog settles the
run (on_wedged: `error` with the reason, never handed to another worker; `cancelled` for a cancel)
and ends this process with EXIT_WEDGED. The prefork parent starts a fresh pool process (a solo
worker's supervisor restarts the worker), and the task's message, re-delivered, finds its run
final and is skipped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEADLINE, CANCEL, SHUTDOWN = "deadline", "cancel", "shutdown"
# sysexits' EX_SOFTWARE: what a supervisor's log shows for a process the watchdog ended.
EXIT_WEDGED = 70
TICK_S = 0.1
CANCEL_POLL_S = 1.0
# The wedged run's record (one UPDATE) gets this long: a database that does not answer either
# must not keep the wedged process alive (the reaper then finds the run, docs/security/SANDBOX.md).
RECORD_WEDGED_S = 10.0


@dataclass(frozen=True)
class Stop:
    """Why a job was stopped: `cause` (DEADLINE, CANCEL, SHUTDOWN) and the sentence its run keeps."""

    cause: str
    reason: str


class JobStopped(RuntimeError):
    """Raised in the job's thread at its next check once the watchdog stopped it."""

    def __init__(self, stop: Stop) -> None:
        super().__init__(stop.reason)
        self.stop = stop


# ----------------------------------------------------------------------------- the worker shutting down
_shutdown = threading.Event()
_shutdown_reason: list[str] = []


def request_shutdown(reason: str) -> None:
    """The worker is shutting down (a signal handler calls this: it only sets a flag). The job
    running in this process, if any, is stopped at the watchdog's next tick."""
    _shutdown_reason[:] = [reason]
    _shutdown.set()


def shutdown_requested() -> str | None:
    return _shutdown_reason[0] if _shutdown.is_set() and _shutdown_reason else None


# ----------------------------------------------------------------------------- the boxes
def children() -> list[tuple[int, int]]:
    """(pid, process group) of each living child of this process, read from /proc (every box this
    process started is one: the job's thread, which holds their Popen objects, may be the blocked one)."""
    own, found = os.getpid(), []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so split after its last ')'
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == own and fields[0] != b"Z":
            found.append((int(entry.name), int(fields[2])))
    return found


def kill_children() -> int:
    """SIGKILL every child's process group (a child in this process's own group: only the child).
    Returns how many were signalled."""
    own_group, killed = os.getpgrp(), 0
    for pid, group in children():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group != own_group:
                os.killpg(group, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed


# ----------------------------------------------------------------------------- the watchdog
class Watchdog:
    """One job's watchdog (a context manager around the whole job; `phase` arms a deadline).

    `cancelled`: asks the database whether a cancel was requested (None: not cancellable).
    `on_wedged(stop)`: records the job's end when its thread stays blocked after the grace.
    `exit_process`: os._exit in a worker; a test passes its own."""

    def __init__(self, *, label: str, grace_s: float, cancelled: Callable[[], bool] | None = None,
                 on_wedged: Callable[[Stop], None] | None = None,
                 exit_process: Callable[[int], None] = os._exit) -> None:
        self.label, self.grace_s = label, grace_s
        self.cancelled, self.on_wedged, self.exit_process = cancelled, on_wedged, exit_process
        self.stop: Stop | None = None
        self.wedged = False
        self._phase: tuple[str, float, float] | None = None  # name, monotonic deadline, its limit
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"watchdog-{label}", daemon=True)

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ended.set()
        # While it records a wedged job the thread is about to end the process: never wait on it.
        if not self.wedged:
            self._thread.join(timeout=5)

    @contextlib.contextmanager
    def phase(self, name: str, limit_s: float) -> Iterator[None]:
        """Arm a deadline `limit_s` from now for the phase `name`; disarmed after it."""
        self._phase = (name, time.monotonic() + limit_s, limit_s)
        try:
            yield
        finally:
            self._phase = None

    def check(self) -> None:
        """In the job's thread, at each point where it would record an outcome: raise JobStopped
        once the watchdog stopped the job (a build it killed is not the commit's failure)."""
        if self.stop is not None:
            raise JobStopped(self.stop)

    # ------------------------------------------------------------------ its own thread
    def _watch(self) -> None:
        next_cancel_poll = time.monotonic() + CANCEL_POLL_S
        while not self._ended.wait(TICK_S):
            stop = self._due()
            if stop is None and self.cancelled is not None and time.monotonic() >= next_cancel_poll:
                next_cancel_poll = time.monotonic() + CANCEL_POLL_S
                try:
                    if self.cancelled():
                        stop = Stop(CANCEL, "cancelled on request")
                except Exception:  # noqa: BLE001  (a database blip: ask again next poll)
                    log.exception("%s: the cancel poll failed", self.label)
            if stop is not None:
                self._stop_job(stop)
                return

    def _due(self) -> Stop | None:
        shutdown = shutdown_requested()
        if shutdown:
            return Stop(SHUTDOWN, shutdown)
        armed = self._phase
        if armed is not None and time.monotonic() > armed[1]:
            name, _, limit_s = armed
            return Stop(DEADLINE, f"its {name} phase passed the watchdog's deadline of {limit_s:g} s (the phase's "
                                  "own limit + OPTDRIFT_WATCHDOG_SLACK_S): a wait on its box or its files did not end")
        return None

    def _stop_job(self, stop: Stop) -> None:
        self.stop = stop
        killed = kill_children()
        log.warning("%s: stopped (%s): %s; %d box process group(s) killed", self.label, stop.cause, stop.reason, killed)
        give_up_at = time.monotonic() + self.grace_s
        while not self._ended.wait(TICK_S):
            # A box started after the first kill (a kernel host restarted for the next case) dies too.
            kill_children()
            if time.monotonic() > give_up_at:
                break
        else:
            return  # the job's thread unwound and settled its run
        self.wedged = True
        log.error("%s: its thread is still blocked %g s after its boxes were killed (%s); recording the run and "
                  "ending this worker process (exit %d)", self.label, self.grace_s, stop.reason, EXIT_WEDGED)
        if self.on_wedged is not None:
            recorder = threading.Thread(target=self._record_wedged, args=(stop,), name=f"wedged-{self.label}",
                                        daemon=True)
            recorder.start()
            recorder.join(timeout=RECORD_WEDGED_S)
        for handler in logging.getLogger().handlers:  # the line above reaches the log before the exit
            with contextlib.suppress(Exception):
                handler.flush()
        self.exit_process(EXIT_WEDGED)

    def _record_wedged(self, stop: Stop) -> None:
        try:
            self.on_wedged(stop)
        except Exception:  # noqa: BLE001  (the reaper finds the run once its heartbeat is stale)
            log.exception("%s: recording the wedged run failed", self.label)
