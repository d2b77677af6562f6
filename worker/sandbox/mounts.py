"""What a sandboxed child sees: the bubblewrap command line for one build or kernel host.

The child gets a fresh mount namespace built from nothing (bwrap starts from an empty tmpfs root):

- read-only: the system folders a compiler and Python need (/usr and the /bin, /lib... links or
  folders, /opt for toolchains installed there), a handful of /etc files the loader and the
  compilers read (never /etc itself: /etc/shadow, ssh host keys), the Python installation and the
  virtual environment, the optdrift `worker` package and of `service` only its pure core
  (service/__init__.py and service/core/: no API, database, settings or command), not the
  repository around them, /sys, and whatever the operator names in OPTDRIFT_SANDBOX_RO_PATHS;
- read-write: only the folders the caller names (a build's staging folder, the scratch HOME);
- its own /proc (a new PID namespace: no other process is visible), a minimal /dev (null, zero,
  random, tty...; the GPU's device nodes are bound in for a kernel host on CUDA), a small private
  /tmp;
- no /home, /root, /run, /var: no OPTDRIFT_HOME, no database file, no token file, no PostgreSQL
  or Docker socket.

A path that would show a secret (it is, or holds, OPTDRIFT_HOME, the database file, a token file,
the source store or the build cache root) is never bound, whichever list asked for it; a folder the
worker made inside one of them for this child (a build's staging folder) is.

Identity. As root, bwrap runs privileged (it can bind a Python under /root) and the command starts
through `setpriv`, which drops to uid/gid 65534 with no capabilities and an empty bounding set, so
the child is an ordinary unprivileged user outside the namespace too (root would be exempt from
RLIMIT_NPROC and pass owner checks on root's files). As any other user, bwrap makes a user
namespace and maps 65534 inside to that user outside.
"""

from __future__ import annotations

import glob
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

SANDBOX_UID = 65534  # "nobody": owns nothing on the host
SANDBOX_GID = 65534
SANDBOX_USER = "optdrift-sandbox"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt")
# What a compiler, the dynamic loader and Python read from /etc. Not /etc itself.
ETC_FILES = ("/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d",
             "/etc/localtime", "/etc/nsswitch.conf", "/etc/hosts", "/etc/gcc", "/etc/ssl/certs",
             "/etc/ccache.conf")
TMP_BYTES = 512 * 1024**2  # the private /tmp (memory-backed); real scratch is the bound HOME/TMPDIR
GPU_DEVICE_GLOBS = ("/dev/nvidia*", "/dev/nvidia-caps", "/dev/dri")


@dataclass
class MountPlan:
    """The folders a child sees; `args()` turns it into bwrap options."""

    read_only: list[Path] = field(default_factory=list)
    writable: list[Path] = field(default_factory=list)
    devices: list[Path] = field(default_factory=list)
    secrets: list[Path] = field(default_factory=list)  # never shown, whatever asks for them
    skipped: list[str] = field(default_factory=list)  # why a requested path was not bound

    def _shows_secret(self, path: Path) -> Path | None:
        for secret in self.secrets:
            # The secret itself or a folder holding it. A folder *inside* OPTDRIFT_HOME that the
            # worker made for this child (a build's staging folder) shows nothing else.
            if path == secret or secret.is_relative_to(path):
                return secret
        return None

    def _admit(self, path: Path, seen: set[Path]) -> bool:
        if path in seen or not path.exists():
            return False
        secret = self._shows_secret(path)
        if secret is not None:
            self.skipped.append(f"{path} (it would show {secret})")
            return False
        seen.add(path)
        return True

    def _parents(self, path: Path, seen: set[Path], made: set[Path]) -> list[str]:
        """Make the folders above a bind traversable (0755): bwrap makes them 0700 on its own, and
        the sandbox user could then not reach a Python under /root."""
        out: list[str] = []
        for parent in reversed(path.parents[:-1]):
            if parent in made or any(parent.is_relative_to(done) for done in seen):
                continue
            made.add(parent)
            out += ["--perms", "0755", "--dir", str(parent)]
        return out

    def args(self) -> list[str]:
        out: list[str] = []
        seen: set[Path] = set()
        made: set[Path] = {Path("/tmp"), Path("/dev"), Path("/proc"), Path("/sys")}
        for name in SYSTEM_DIRS:
            path = Path(name)
            if path.is_symlink():  # merged /usr: /lib -> usr/lib
                out += ["--symlink", os.readlink(path), name]
                seen.add(path)
            elif self._admit(path, seen):
                out += ["--ro-bind", name, name]
        for name in ETC_FILES:
            if self._admit(Path(name), seen):
                out += [*self._parents(Path(name), seen, made), "--ro-bind", name, name]
        for target, source in identity_files().items():
            out += [*self._parents(Path(target), seen, made), "--ro-bind", str(source), target]
        out += ["--ro-bind-try", "/sys", "/sys", "--proc", "/proc", "--dev", "/dev",
                "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/tmp",
                "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/dev/shm"]
        # Longest paths last, so a folder bound inside another bound folder is not covered by it.
        for path in sorted(set(self.read_only), key=lambda p: len(p.parts)):
            if not any(path.is_relative_to(done) for done in seen) and self._admit(path, seen):
                out += [*self._parents(path, seen, made), "--ro-bind", str(path), str(path)]
        for path in sorted(set(self.writable), key=lambda p: len(p.parts)):
            if self._shows_secret(path) is not None:
                self.skipped.append(f"{path} (writable, but it would show a secret)")
                continue
            out += [*self._parents(path, seen, made), "--bind", str(path), str(path)]
        for device in self.devices:
            if device.exists():
                out += ["--dev-bind", str(device), str(device)]
        return out


_IDENTITY_FILES: dict[str, Path] = {}


def identity_files() -> dict[str, Path]:
    """/etc/passwd and /etc/group for the box, naming only root and the sandbox user: torch and the
    compilers look the current user up (getpwuid), and the host's files list every account."""
    if not _IDENTITY_FILES or not all(p.exists() for p in _IDENTITY_FILES.values()):
        folder = Path(tempfile.mkdtemp(prefix="optdrift-sandbox-etc-"))
        folder.chmod(0o755)
        contents = {
            "/etc/passwd": f"root:x:0:0:root:/root:/bin/sh\n"
                           f"{SANDBOX_USER}:x:{SANDBOX_UID}:{SANDBOX_GID}:optdrift sandbox:/tmp:/bin/sh\n",
            "/etc/group": f"root:x:0:\n{SANDBOX_USER}:x:{SANDBOX_GID}:\n",
        }
        for target, text in contents.items():
            path = folder / Path(target).name
            path.write_text(text)
            path.chmod(0o644)
            _IDENTITY_FILES[target] = path
    return dict(_IDENTITY_FILES)


def python_paths() -> list[Path]:
    """The Python this worker runs (its installation, the virtual environment, site folders) and the
    optdrift code a `python -m worker....` child needs, resolved: the `worker` package and, of
    `service`, its __init__, the pure core and the core's deprecated aliases (service.core.moved)
    (what the kernel host and the build child import;
    the import contract "What runs in the box" in pyproject.toml). The API, the database models,
    the settings and the command stay out of every box."""
    import service
    import worker
    from service.core.moved import MOVED

    service_package = Path(service.__file__).resolve().parent
    paths = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix),
             Path(sys.executable).resolve().parent.parent,
             Path(worker.__file__).resolve().parent, service_package / "__init__.py", service_package / "core"}
    # The deprecated aliases of moved pure modules (service/results.py -> service.core.results): an
    # adapter written against an earlier release imports them in the kernel host.
    paths |= {service_package / f"{old.split('.')[-1]}.py" for old, (new, _) in MOVED.items()
              if new.startswith("service.core.") and old.count(".") == 1}
    # Every import folder (wheels unpacked into a --target folder included), but never the folder
    # around the optdrift packages (a checkout: its .git, test caches), nor the working folder.
    root = code_root()
    for entry in sys.path:
        if entry and os.path.isabs(entry) and Path(entry).is_dir() and not root.is_relative_to(Path(entry).resolve()):
            paths.add(Path(entry).resolve())
    return sorted(p.resolve() for p in paths)


def code_root() -> Path:
    """The folder holding the `worker` package: the child's PYTHONPATH (only the packages are bound)."""
    import worker

    return Path(worker.__file__).resolve().parent.parent


def toolchain_paths(env: dict[str, str], extra: str = "") -> list[Path]:
    """Folders on the child's PATH and LD_LIBRARY_PATH, CUDA_HOME, and the operator's extras, where
    they lie outside the system folders (a toolchain in a home folder, a driver library folder)."""
    candidates: list[str] = []
    for key in ("PATH", "LD_LIBRARY_PATH", "LIBRARY_PATH", "CPATH"):
        candidates += env.get(key, "").split(os.pathsep)
    candidates += [env.get("CUDA_HOME", ""), env.get("CUDA_PATH", "")]
    candidates += extra.split(os.pathsep)
    return [Path(c).resolve() for c in candidates if c and os.path.isabs(c) and Path(c).exists()]


def gpu_devices() -> list[Path]:
    return [Path(p) for pattern in GPU_DEVICE_GLOBS for p in sorted(glob.glob(pattern))]


def identity_args(*, privileged: bool, setpriv: str | None = None) -> tuple[list[str], list[str]]:
    """(bwrap options, the command prefix) that make the child uid/gid 65534 without capabilities.
    `setpriv`: its absolute path (worker.sandbox.launcher), needed when `privileged`."""
    if privileged:
        if not setpriv or not os.path.isabs(setpriv):
            raise ValueError("the identity drop needs setpriv by absolute path (worker.sandbox.launcher)")
        drop = [setpriv, f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_GID}", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all", "--"]
        return [], drop
    return ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID)], []


def namespace_args() -> list[str]:
    """New PID (nothing outlives the sandbox: when its first process ends the kernel kills the rest,
    `setsid` or double-forked included), network (no interface but a down loopback), IPC and UTS
    namespaces; bwrap dies with the worker and takes the namespace with it; a new session so the
    child cannot push input into the worker's terminal."""
    return ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--hostname", "optdrift-sandbox"]
