"""Run a command inside the caller's sandboxed process group and take the whole group down when the
process that started it dies.

    python -m worker.sandbox.group_guard -- COMMAND [ARG ...]

Why: the sandbox (worker/sandbox/__init__.py) starts each build in its own session and sets
PR_SET_PDEATHSIG, but that signal reaches only the direct child. When a worker is killed with
SIGKILL mid-build, ninja and the compilers below a build child were orphaned and kept compiling
(seen with the end-to-end benchmark). This guard is that direct child: it asks for SIGTERM when
its parent dies, and on SIGTERM kills its own process group (itself, the command, and everything
the command started that stayed in the group, which is all of a build: ninja does not make new
sessions). It passes stdin/stdout/stderr through, and exits as the command did: with its status,
or killed by the same signal, so callers see what they would have seen without it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def _kill_group(signum: int, frame: object) -> None:  # noqa: ARG001
    os.killpg(0, signal.SIGKILL)  # the guard's own group: the command, its children, the guard


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: python -m worker.sandbox.group_guard -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _kill_group)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before the request above took effect
        _kill_group(signal.SIGTERM, None)
    try:
        child = subprocess.Popen(argv[1:])
    except OSError as error:  # as a shell says it: the caller's log gets the reason
        print(f"could not start {argv[1]!r}: {error}", file=sys.stderr)
        return 127
    code = child.wait()  # a SIGTERM arriving here runs _kill_group (PEP 475 resumes the wait otherwise)
    if code < 0:  # killed by a signal: die of the same one, so the caller's returncode says so
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
