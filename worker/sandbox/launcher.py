"""The programs that build the box, found once from the worker's own environment.

Everything up to the sandbox user's first instruction is the worker's alone: the launcher
(`bwrap`), the identity drop (`setpriv`, as root) and the program that finally applies the child's
environment (`env -i`) are absolute paths resolved here, from the worker's PATH and OPTDRIFT_BWRAP,
never from a child's environment. They start with LAUNCHER_ENV, a fixed environment that names no
library, no locale folder and no search path a tree could have set (LD_PRELOAD, PATH=., GCONV_PATH
... would otherwise act in bwrap itself, outside every namespace, or in setpriv as root before the
drop).

The child's own environment (the allowlisted `sandbox_env`, a tree's validated build.env on top) is
applied last, by `env -i` after the drop: no program that runs with privilege, and no program
outside the namespaces, ever sees it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from functools import lru_cache

# The system folders the launcher's programs are looked up in when OPTDRIFT_BWRAP does not name one:
# never the worker's PATH as a whole (a virtual environment or a home folder could come first).
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What bwrap, setpriv and `env` themselves run with: nothing a tree sets, nothing of the worker's.
LAUNCHER_ENV: dict[str, str] = {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8"}


@dataclass(frozen=True)
class Launcher:
    """Absolute paths of the box's programs (None: not found here; `problem` says what is missing)."""

    bwrap: str | None
    setpriv: str | None
    env: str | None

    def problem(self, *, privileged: bool) -> str | None:
        if self.bwrap is None:
            return "bubblewrap is not installed (Debian: apt-get install bubblewrap; or set OPTDRIFT_BWRAP)"
        if self.env is None:
            return f"`env` (coreutils) is not in {SYSTEM_PATH}: it applies the child's environment after the drop"
        if privileged and self.setpriv is None:
            return "running as root, and setpriv (util-linux) is missing to drop to the sandbox user"
        return None


def _system_program(name: str) -> str | None:
    # Absolute, not resolved through links: a multi-call binary (busybox) picks its applet by name.
    found = shutil.which(name, path=SYSTEM_PATH)
    return os.path.abspath(found) if found else None


@lru_cache(maxsize=4)
def _resolve(bwrap_setting: str | None) -> Launcher:
    if bwrap_setting:
        # The operator's choice: an absolute path, or a name looked up in the system folders.
        path = bwrap_setting if os.path.isabs(bwrap_setting) else shutil.which(bwrap_setting, path=SYSTEM_PATH)
        bwrap = os.path.abspath(path) if path and os.path.isfile(path) and os.access(path, os.X_OK) else None
    else:
        bwrap = _system_program("bwrap")
    return Launcher(bwrap=bwrap, setpriv=_system_program("setpriv"), env=_system_program("env"))


def launcher() -> Launcher:
    """The launcher for this worker: resolved once per OPTDRIFT_BWRAP value (the worker's own setting;
    tests turn bubblewrap off by pointing it at nothing)."""
    return _resolve(os.environ.get("OPTDRIFT_BWRAP") or None)


def child_command(args: list[str], env: dict[str, str]) -> list[str]:
    """`args` with `env` applied as its whole environment by `env -i`, after everything privileged."""
    program = launcher().env
    if program is None:
        raise FileNotFoundError(launcher().problem(privileged=False))
    for name in env:
        if not name or "=" in name or "\0" in name:
            raise ValueError(f"environment variable name {name!r} cannot be passed to a sandboxed child")
    return [program, "-i", "--", *(f"{name}={value}" for name, value in sorted(env.items())), *args]
