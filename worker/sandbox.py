"""The sandbox every build and kernel host runs in: submitted source is compiled and executed here.

What a child gets (Linux; each measure degrades with a logged reason where the platform refuses):
- its own session and process group (a timeout or cancel kills the whole group: compilers, ninja);
- resource limits: CPU seconds, size of any file it writes, number of processes, no core dumps;
- no network: a fresh network namespace (only a loopback that is down). As root that is
  unshare(CLONE_NEWNET); otherwise a user namespace first (CLONE_NEWUSER | CLONE_NEWNET) mapping
  the caller's own uid. Where neither is allowed (containers without the capability, seccomp),
  the child runs with the host network and `network_isolation()` says why;
- an environment built from an allowlist: no database URL, broker URL, API token or cloud
  credential reaches it (`sandbox_env`);
- a scratch folder as HOME and TMPDIR, deleted afterwards (`Scratch`);
- SIGKILL when the process that started it dies (PR_SET_PDEATHSIG); for builds, whose compilers are
  grandchildren that signal never reaches, worker.group_guard kills the whole group then, so no
  orphan keeps the cores.

It is not a security boundary against a determined kernel-level attacker (see docs/SECURITY.md):
the child shares the filesystem view and the GPU with the worker user.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1

# Variables a compiler or a torch process legitimately needs. Everything else is dropped: the
# worker's environment holds OPTDRIFT_DATABASE_URL (with its password), the broker URL, the
# worker's API token, and whatever cloud credentials the host was given.
ALLOWED_ENV = (
    "PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM",
    "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_LAUNCH_BLOCKING",
    "CUBLAS_WORKSPACE_CONFIG", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES",
    "LD_LIBRARY_PATH", "LIBRARY_PATH", "CPATH", "CC", "CXX", "CUDAHOSTCXX", "NVCC_PREPEND_FLAGS",
    "NVCC_APPEND_FLAGS", "TORCH_CUDA_ARCH_LIST", "MAX_JOBS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    "PYTHONPATH", "VIRTUAL_ENV", "OPTDRIFT_CUDA_ARCHS", "BNB_CUDA_VERSION",
    # test-only fault injection of the kernel host (worker/kernel_host.py); carries no secret
    "OPTDRIFT_TEST_HOST_FAULT",
)


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int | None = 3600
    file_size_bytes: int | None = 4 * 1024**3
    # RLIMIT_NPROC counts every process and thread of the user, so keep it well above what the
    # worker user runs besides (root is exempt from it).
    max_processes: int | None = 4096
    isolate_network: bool = True


BUILD_LIMITS = SandboxLimits(cpu_seconds=1800, file_size_bytes=4 * 1024**3, max_processes=4096)
HOST_LIMITS = SandboxLimits(cpu_seconds=6 * 3600, file_size_bytes=2 * 1024**3, max_processes=4096)


def sandbox_env(*, scratch: Path, extra: dict[str, str] | None = None,
                source: dict[str, str] | None = None) -> dict[str, str]:
    source = dict(os.environ if source is None else source)
    env = {key: source[key] for key in ALLOWED_ENV if key in source}
    env.update({"HOME": str(scratch), "TMPDIR": str(scratch), "XDG_CACHE_HOME": str(scratch / ".cache")})
    env.update(extra or {})
    return env


class Scratch:
    """A private folder (0700) for one child's temporary files; removed, whatever it holds, on exit."""

    def __init__(self, prefix: str = "optdrift-scratch-"):
        self.path = Path(tempfile.mkdtemp(prefix=prefix))

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        self.remove()

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _libc():  # noqa: ANN202
    return ctypes.CDLL(None, use_errno=True)


def _unshare_network() -> None:
    """In the child, before exec. Raises OSError if the kernel refuses."""
    libc = _libc()
    if os.geteuid() == 0:
        if libc.unshare(CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
        return
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER|CLONE_NEWNET)")
    # Map our own uid/gid into the namespace so file ownership looks the same as outside.
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


def _set_limits(limits: SandboxLimits) -> None:
    for name, value in ((resource.RLIMIT_CPU, limits.cpu_seconds),
                        (resource.RLIMIT_FSIZE, limits.file_size_bytes),
                        (resource.RLIMIT_NPROC, limits.max_processes)):
        if value is not None:
            _soft, hard = resource.getrlimit(name)
            capped = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(name, (capped, capped))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _make_preexec(limits: SandboxLimits, isolate: bool):  # noqa: ANN202
    def preexec() -> None:
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if isolate:
            _unshare_network()
        _set_limits(limits)

    return preexec


@lru_cache(maxsize=1)
def network_isolation() -> tuple[bool, str]:
    """(available, reason), probed once by starting a throwaway child in a new namespace."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces are Linux-only (platform {sys.platform})"
    try:
        subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=30,
                       preexec_fn=_make_preexec(SandboxLimits(None, None, None), True))
    except (subprocess.SubprocessError, OSError) as exc:
        return False, f"unshare of the network namespace refused here ({exc})"
    return True, "network namespace"


def popen(args: list[str], *, limits: SandboxLimits, env: dict[str, str], guard_group: bool = False,
          **kwargs) -> subprocess.Popen:  # noqa: ANN003
    """subprocess.Popen in the sandbox (own session/process group, limits, no network).

    `guard_group`: run `args` under worker.group_guard, so that when this process dies the whole
    group goes (PR_SET_PDEATHSIG alone reaches only the direct child: a build's ninja and
    compilers outlived a SIGKILLed worker). `-P`: the guard module comes from the worker's own
    path, never from a submitted tree in the child's working directory."""
    if guard_group:
        args = [sys.executable, "-P", "-m", "worker.group_guard", "--", *args]
    isolate = False
    if limits.isolate_network:
        isolate, reason = network_isolation()
        if not isolate:
            log.warning("sandbox: running %s WITH network access: %s", Path(args[0]).name, reason)
    return subprocess.Popen(args, env=env, start_new_session=True,
                            preexec_fn=_make_preexec(limits, isolate), **kwargs)


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group (compilers, ninja, torch's workers)."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
