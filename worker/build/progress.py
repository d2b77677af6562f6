"""What a build is doing while it runs, read from its log as it grows (issue 47: `check` was silent
for the 47 s of a build, 93 % of a DeepSpeed check).

A caller that wants to know listens around its build (`listening`): `optdrift check` prints each
step, the run job stores one at most every second on the run (service.run_store.build_progress; the
run page and GET /api/v1/runs/{id} show it). The build code watches its log while its child runs
(`watching`, in worker.build.extension and .project). Without a listener nothing is read. The log is the child's output, which submitted code writes:
it is opened through worker.sandbox.boxfiles (a regular file with one link, not a link or a FIFO)
and read from that descriptor as it grows, at most MAX_READ_BYTES each poll.

What a line tells (`LogProgress`):
    ninja's `[12/40] c++ ... -c adam.cpp ...`       12 of 40 steps, compiling adam.cpp
    CMake's Makefiles `[ 45%] Building CXX object`  45 of 100
    a compiler invocation without either prefix      counted (n compiled so far, total unknown)
    `$ cmake --build build` (a command build's log)  the command now running
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from worker.sandbox import boxfiles

POLL_S = 0.5
MAX_READ_BYTES = 1 << 20  # a poll's share of a fast-growing log; the rest is read at the next one
MAX_LINE_CHARS = 4096  # a longer line is read in pieces: only its start can hold a step prefix


@dataclass(frozen=True)
class BuildStep:
    done: int
    total: int | None  # None: compile lines counted, the total unknown
    what: str  # "adam.cpp", "Building CXX object src/adam.cpp.o", "$ cmake --build build"
    # "units" (ninja's steps, compile lines) or "percent" (CMake's Makefiles): follows from the
    # line's kind, so it does not tell two steps apart.
    unit: str = field(default="units", compare=False)

    def words(self) -> str:
        """'[12/40] compiling adam.cpp', '3 compiled, compiling c.cpp', '$ cmake --build build'."""
        if self.total:
            return f"[{self.done}/{self.total}] {self.what}"
        return f"{self.done} compiled, {self.what}" if self.done else self.what

    def counts(self) -> dict[str, int | str | None]:
        """What a run stores of the step: numbers only, never the log's words (submitted code
        writes the log). {"done": 12, "total": 40, "unit": "units"}; a command line alone: done None."""
        return {"done": self.done if self.done or self.total else None, "total": self.total, "unit": self.unit}


_NINJA = re.compile(r"^\[(\d+)/(\d+)\]\s*(.*)")
_MAKE = re.compile(r"^\[\s*(\d+)%\]\s*(.*)")
_COMPILER = re.compile(r"^\S*(?:c\+\+|g\+\+|gcc|cc|clang\+\+|clang|nvcc|ccache)(?:-[\d.]+)?\s.*\s-c\s")
_SOURCE = re.compile(r"\s-c\s+(\S+)")
_LIBRARY = re.compile(r"\s-o\s+(\S+\.(?:so|dylib|a)['\"]?)(?:\s|$)")
_COMMAND = re.compile(r"^\$ (.+)")


def _what(rest: str) -> str:
    """The file a compile line compiles, the library a link line makes, else the line's start."""
    if source := _SOURCE.search(rest):
        return f"compiling {Path(source.group(1).strip(chr(39) + chr(34))).name}"
    if library := _LIBRARY.search(rest):
        return f"linking {Path(library.group(1).strip(chr(39) + chr(34))).name}"
    return rest.strip()[:80]


class LogProgress:
    """A build log's lines in, the latest step out."""

    def __init__(self) -> None:
        self.partial = ""
        self.compiled = 0
        self.step: BuildStep | None = None

    def feed(self, text: str) -> BuildStep | None:
        """Take more of the log; the step it reached (None while none is known)."""
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()[-MAX_LINE_CHARS:]
        for line in lines:
            self._line(line.rstrip("\r")[:MAX_LINE_CHARS])
        return self.step

    def _line(self, line: str) -> None:
        if match := _NINJA.match(line):
            self.step = BuildStep(int(match.group(1)), int(match.group(2)), _what(match.group(3)))
        elif match := _MAKE.match(line):
            self.step = BuildStep(int(match.group(1)), 100, match.group(2).strip()[:80], unit="percent")
        elif _COMPILER.match(line):
            self.compiled += 1
            self.step = BuildStep(self.compiled, None, _what(line))
        elif match := _COMMAND.match(line):
            self.step = BuildStep(0, None, f"$ {match.group(1)[:80]}")


Listener = Callable[[BuildStep], None]
_listener: contextvars.ContextVar[tuple[Listener, float] | None] = contextvars.ContextVar(
    "build_progress_listener", default=None)


class Pacer:
    """The newest step, handed on at most once every `every_s` seconds. A step held back is handed
    on at the first poll after the interval (the watcher polls every POLL_S whether or not the log
    grew), so a listener lags the log by at most every_s + POLL_S and never stays on a stale step."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.said: BuildStep | None = None
        self.said_at: float | None = None

    def due(self, step: BuildStep | None, now: float) -> BuildStep | None:
        """`step` when it is new and the interval has passed since the last one handed on; else None."""
        if step is None or step == self.said:
            return None
        if self.said_at is not None and now - self.said_at < self.every_s:
            return None
        self.said, self.said_at = step, now
        return step


@contextlib.contextmanager
def listening(on_step: Listener, *, every_s: float = 0.0) -> Iterator[None]:
    """Builds made in this context (this thread) report their steps to `on_step`, called from a
    watcher thread each time the step changes, at most once every `every_s` seconds (Pacer)."""
    token = _listener.set((on_step, every_s))
    try:
        yield
    finally:
        _listener.reset(token)


@contextlib.contextmanager
def watching(log_path: Path) -> Iterator[None]:
    """While the block runs (a build child writing `log_path`), tell the listener, if any, each new step."""
    listener = _listener.get()
    if listener is None:
        yield
        return
    on_step, every_s = listener
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(Path(log_path), on_step, stop, Pacer(every_s)),
                               name="build-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join(timeout=5.0)


def _watch(log_path: Path, on_step: Listener, stop: threading.Event, pacer: Pacer) -> None:
    progress, fd = LogProgress(), None
    try:
        while True:
            stopping = stop.wait(POLL_S)
            if fd is None:
                try:
                    fd = boxfiles.open_file(log_path.parent, log_path.name)
                except boxfiles.BoxFileRefused:
                    return  # not a plain file: nothing of it is read
            if fd is not None:
                data = os.read(fd, MAX_READ_BYTES)
                step = pacer.due(progress.feed(data.decode("utf-8", errors="replace")), time.monotonic())
                if step is not None:
                    on_step(step)
            if stopping:
                return
    except Exception:  # noqa: BLE001 - progress is a courtesy: never the build's failure
        return
    finally:
        if fd is not None:
            os.close(fd)
