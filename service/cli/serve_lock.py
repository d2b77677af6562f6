"""One `optdrift serve` per OPTDRIFT_HOME: an exclusive lock on OPTDRIFT_HOME/serve.lock, held for
as long as serve runs.

Two serves on one home would share its database and tokens, and the second would take over the
`api-url` file a worker started apart reads to find the API (and delete it when it stops, leaving
that worker without an address). `fcntl.flock` belongs to the open file: the kernel releases it when
the process ends, however it ends, so a serve that crashed leaves no stale lock behind. The file's
text (pid and URL of the holder) is only there for the refusal message; the lock is what counts.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = "serve.lock"


class ServeAlreadyRunning(RuntimeError):
    pass


class ServeLock:
    def __init__(self, home: Path, public_url: str):
        self.path = home / LOCK_NAME
        self.public_url = public_url
        self._fd: int | None = None

    def acquire(self) -> ServeLock:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # O_CLOEXEC (Python's default): the worker serve starts must not inherit, and so keep, the lock
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").split()
            os.close(fd)
            pid = holder[0] if holder else "unknown"
            url = holder[1] if len(holder) > 1 else "an address it has not written yet"
            raise ServeAlreadyRunning(
                f"another `optdrift serve` is running on OPTDRIFT_HOME {self.path.parent} (pid {pid}, "
                f"serving {url}); stop it, or start this one with another OPTDRIFT_HOME") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {self.public_url}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file releases the lock
            self._fd = None
