"""The sandbox every build and kernel host runs in: submitted source is compiled and executed here.

With bubblewrap (`bwrap`, Debian's `bubblewrap`, the sandbox Flatpak uses) a child gets
(worker/sandbox/mounts.py has the mount plan):
- a fresh mount namespace: only the toolchain, Python/torch, the optdrift packages and the folders
  the caller names are visible (system folders read-only; the build folder and a scratch HOME
  writable); no OPTDRIFT_HOME, database file, token file, /run or /var sockets;
- new PID, network, IPC and UTS namespaces: nothing it starts survives it (`setsid`, double
  forks), other processes' /proc is invisible, there is no network at all;
- uid/gid 65534 without capabilities (as root: through setpriv, so it is unprivileged outside too);
- death with its parent (bwrap --die-with-parent), its own session and process group;
- resource limits: CPU seconds, size of any file it writes, processes of the sandbox user, address
  space (builds), no core dumps;
- an environment built from an allowlist (`sandbox_env`) and a scratch HOME/TMPDIR (`Scratch`).

Where bubblewrap cannot run here (not installed, user namespaces refused), `status()` says why;
the worker logs it at start and refuses verify runs unless the operator set
OPTDRIFT_ALLOW_UNSANDBOXED=true (worker/jobs/run.py). Children then get the weaker measures this module
had before bubblewrap: own process group, limits, a network namespace where the kernel allows one,
the allowlisted environment, and worker.sandbox.group_guard for builds.

It shares the kernel and the GPU with the worker (see docs/SECURITY.md): not a VM.
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

from worker.sandbox import boxfiles, launcher, mounts
from worker.sandbox import privilege

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
    # test-only fault injection of the kernel host (worker/engine/host/faults.py); carries no secret
    "OPTDRIFT_TEST_HOST_FAULT",
)


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: int | None = 3600
    file_size_bytes: int | None = 4 * 1024**3
    # RLIMIT_NPROC counts every process and thread of the user. Under bubblewrap that user is the
    # sandbox's own (uid 65534), so a fork bomb stops here; without it, the worker's user (root is
    # exempt), so keep it well above what that user runs besides.
    max_processes: int | None = 4096
    # RLIMIT_AS per process. None for a CUDA kernel host: the driver reserves far more virtual
    # address space than it uses.
    address_space_bytes: int | None = None
    isolate_network: bool = True


BUILD_LIMITS = SandboxLimits(cpu_seconds=1800, file_size_bytes=4 * 1024**3, max_processes=4096,
                             address_space_bytes=24 * 1024**3)
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


# Resolved once, here in the parent. A child between fork and exec (the preexec functions below)
# must not call dlopen or dlsym: another thread of the parent may have held the loader's lock at
# the fork (a thread importing an extension module while `optdrift sensitivity --build-jobs`
# threads start builds, or a worker's heartbeat thread), and the child would wait on it forever.
_LIBC = ctypes.CDLL(None, use_errno=True)
_PRCTL, _UNSHARE = _LIBC.prctl, _LIBC.unshare


def _unshare_network() -> None:
    """In the child, before exec. Raises OSError if the kernel refuses."""
    if os.geteuid() == 0:
        if _UNSHARE(CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
        return
    uid, gid = os.getuid(), os.getgid()
    if _UNSHARE(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER|CLONE_NEWNET)")
    # Map our own uid/gid into the namespace so file ownership looks the same as outside.
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


def _set_limits(limits: SandboxLimits) -> None:
    for name, value in ((resource.RLIMIT_CPU, limits.cpu_seconds),
                        (resource.RLIMIT_FSIZE, limits.file_size_bytes),
                        (resource.RLIMIT_NPROC, limits.max_processes),
                        (resource.RLIMIT_AS, limits.address_space_bytes)):
        if value is not None:
            _soft, hard = resource.getrlimit(name)
            capped = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(name, (capped, capped))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _make_preexec(limits: SandboxLimits, isolate: bool, *, tether: bool = False):  # noqa: ANN202
    """`tether`: the child is the tether of a worker that dropped root (worker.sandbox.privilege): it
    gets effective uid 0 back to fork bwrap as root, keeping the worker's real uid so that the
    worker's signals reach it. Without bubblewrap (no tether) a dropped worker's child never gets
    root back: it runs a build as the worker's user, not as root."""
    def preexec() -> None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)
        # bwrap makes the folders above each bind with the caller's umask: a worker started with
        # 077 would leave them untraversable by the sandbox user.
        os.umask(0o022)
        if isolate:
            _unshare_network()
        _set_limits(limits)
        if tether:
            privilege.raise_effective_in_child()

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


class SandboxUnavailable(RuntimeError):
    """bubblewrap cannot run here; the message says why and what to do."""


def secret_paths() -> list[Path]:
    """What no sandbox may show: OPTDRIFT_HOME, the database file, the token files, the source store
    and the build cache root (a child sees its own staging folder inside it, nothing more)."""
    from service.settings import get_settings

    settings = get_settings()
    paths = [settings.home, settings.admin_token_file, settings.worker_token_file,
             settings.resolved_store_dir, settings.resolved_build_cache_dir]
    database = settings.resolved_database_url
    if database.startswith("sqlite"):
        paths.append(Path(database.split(":///", 1)[-1]))
    return [Path(os.path.abspath(p)) for p in paths]


@lru_cache(maxsize=1)
def worker_environment() -> tuple[tuple[str, str], ...]:
    """The allowlisted part of the worker's own environment as it was when first asked (at start):
    the only environment whose search paths become binds (mounts.toolchain_paths)."""
    return tuple((key, os.environ[key]) for key in ALLOWED_ENV if key in os.environ)


def _plan(*, readable: list[Path], writable: list[Path], gpu: bool) -> mounts.MountPlan:
    """What the box shows. Binds come from the worker's configuration alone (its Python, its own
    environment's toolchain folders, OPTDRIFT_SANDBOX_RO_PATHS) and the folders the worker's code
    made for this child: never from the child's environment, which a tree's build.env feeds."""
    from service.settings import get_settings

    toolchain = mounts.toolchain_paths(dict(worker_environment()), get_settings().sandbox_ro_paths)
    return mounts.MountPlan(read_only=mounts.python_paths() + toolchain + [Path(p).resolve() for p in readable],
                            writable=[Path(p).resolve() for p in writable],
                            devices=mounts.gpu_devices() if gpu else [], secrets=secret_paths())


def _give_to_sandbox_user(paths: list[Path]) -> list[Path]:
    """As root the child runs as uid 65534: hand it the folders it may write (whole trees: a build
    writes next to the sources it was given). Returns the folders handed over now: a worker that
    dropped root takes them back when the box is gone (worker.sandbox.privilege.take_back), so it
    handles what the build wrote as their owner. A folder that is the box's already (the shared
    compiler cache) is neither walked nor taken back."""
    handed = [Path(top) for top in paths if os.lstat(top).st_uid != mounts.SANDBOX_UID]
    if privilege.dropped():
        # CAP_CHOWN, in a child that regains root: never in this process, whose threads share its uids.
        privilege.chown_trees(handed, mounts.SANDBOX_UID, mounts.SANDBOX_GID)
        return handed
    for top in handed:
        os.lchown(top, mounts.SANDBOX_UID, mounts.SANDBOX_GID)
        for folder, dirs, files in os.walk(top):
            for name in dirs + files:
                os.lchown(os.path.join(folder, name), mounts.SANDBOX_UID, mounts.SANDBOX_GID)
    return handed


class _TakenBackPopen(subprocess.Popen):
    """A dropped worker's box (its tether): once its exit is seen (wait, poll, communicate), the
    folders handed to the box are the worker's user's again."""

    def __init__(self, *args, taken_back: list[Path], **kwargs) -> None:  # noqa: ANN002, ANN003
        self._taken_back = list(taken_back)
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            privilege.take_back(self._taken_back)
            raise

    def _handle_exitstatus(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super()._handle_exitstatus(*args, **kwargs)
        folders, self._taken_back = self._taken_back, []
        if folders:
            privilege.take_back(folders)


def bwrap_command(args: list[str], *, env: dict[str, str], readable: list[Path] = (),
                  writable: list[Path] = (), gpu: bool = False, cwd: Path | None = None) -> list[str]:
    """The full command line that runs `args` in the sandbox with `env` as its whole environment
    (bwrap must exist). Start it with launcher.LAUNCHER_ENV: bwrap and the identity drop never see
    `env`; `env -i` applies it as the last step, inside every namespace, as the sandbox user."""
    found = launcher.launcher()
    privileged = privilege.launches_as_root()
    problem = found.problem(privileged=privileged)
    if problem is not None:
        raise SandboxUnavailable(problem)
    user_args, drop = mounts.identity_args(privileged=privileged, setpriv=found.setpriv)
    plan = _plan(readable=list(readable), writable=list(writable), gpu=gpu)
    mount_args = plan.args()
    for reason in plan.skipped:
        log.warning("sandbox: not showing %s", reason)
    chdir = str(Path(cwd).resolve()) if cwd else (str(Path(writable[0]).resolve()) if writable else "/tmp")
    return [found.bwrap, *mounts.namespace_args(), *user_args, *mount_args, "--chdir", chdir,
            "--clearenv", *(arg for key, value in launcher.LAUNCHER_ENV.items() for arg in ("--setenv", key, value)),
            "--", *drop, *launcher.child_command(args, env)]


@lru_cache(maxsize=1)
def status() -> tuple[bool, str]:
    """(available, what): whether builds and kernel hosts run under bubblewrap here, probed once by
    starting a Python in a box as a real child would be started."""
    if not sys.platform.startswith("linux"):
        return False, f"bubblewrap is Linux-only (platform {sys.platform})"
    found = launcher.launcher()
    problem = found.problem(privileged=privilege.launches_as_root())
    if problem is not None:
        return False, problem
    executable = found.bwrap
    env = sandbox_env(scratch=Path("/tmp"))
    env["PYTHONPATH"] = str(mounts.code_root())
    command = bwrap_command([sys.executable, "-P", "-c", "import worker, os; print(os.getuid())"], env=env)
    tether = privilege.dropped()  # as popen starts a box (worker.sandbox.privilege)
    try:
        out = subprocess.run(privilege.tether_command(command) if tether else command,
                             env=dict(launcher.LAUNCHER_ENV), capture_output=True, text=True, timeout=60,
                             preexec_fn=privilege.raise_effective_in_child if tether else None)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"bubblewrap did not start: {exc}"
    if out.returncode != 0 or out.stdout.strip() != str(mounts.SANDBOX_UID):
        detail = (out.stderr.strip().splitlines() or ["no message"])[-1]
        return False, f"bubblewrap could not make a sandbox here ({detail}); user namespaces may be refused"
    return True, f"bubblewrap {executable}"


def available() -> bool:
    return status()[0]


def signal_of(returncode: int | None) -> signal.Signals | None:
    """The signal that ended a sandboxed child, if one did. bwrap reports a child killed by signal N
    as exit status 128 + N (subprocess reports an unsandboxed one as -N)."""
    if returncode is None:
        return None
    number = -returncode if returncode < 0 else (returncode - 128 if available() and returncode > 128 else 0)
    try:
        return signal.Signals(number) if number else None
    except ValueError:
        return None


def popen(args: list[str], *, limits: SandboxLimits, env: dict[str, str], readable: list[Path] = (),
          writable: list[Path] = (), gpu: bool = False, cwd: Path | None = None, guard_group: bool = False,
          scratch: Path | None = None, **kwargs) -> subprocess.Popen:  # noqa: ANN003
    """subprocess.Popen in the sandbox: `args` sees the toolchain, Python and `readable` read-only,
    `writable` and `scratch` (the child's HOME/TMPDIR, a `Scratch`) read-write (handed to the
    sandbox user), the GPU's device nodes if `gpu`, nothing else of the file system; its first
    folder (or `cwd`) is the working folder. `env` is only ever the child's environment: no value
    in it becomes a bind or reaches the programs that build the box.

    Without bubblewrap (`status()`), the weaker measures of the module docstring; then
    `guard_group` runs `args` under worker.sandbox.group_guard, so that when this process dies the whole
    group goes (PR_SET_PDEATHSIG alone reaches only the direct child). `-P`: the guard module comes
    from the worker's own path, never from a submitted tree in the child's working directory."""
    # Whatever the child may write is the box's from now on: the worker takes files from there only
    # through worker.sandbox.boxfiles (its audit test checks every other open against this list).
    for folder in [*writable, *([scratch] if scratch is not None else [])]:
        boxfiles.register_box_folder(Path(folder))
    if available():
        env = dict(env)
        env.update({"USER": mounts.SANDBOX_USER, "LOGNAME": mounts.SANDBOX_USER})
        if scratch is not None:
            writable = [*writable, Path(scratch)]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(mounts.code_root()), env.get("PYTHONPATH")]))
        command = bwrap_command(args, env=env, readable=readable, writable=writable, gpu=gpu, cwd=cwd)
        handed = _give_to_sandbox_user([Path(p) for p in writable]) if privilege.launches_as_root() else []
        if privilege.dropped():
            return _TakenBackPopen(privilege.tether_command(command), taken_back=handed,
                                   env=dict(launcher.LAUNCHER_ENV), start_new_session=True,
                                   preexec_fn=_make_preexec(limits, False, tether=True), **kwargs)
        return subprocess.Popen(command, env=dict(launcher.LAUNCHER_ENV), start_new_session=True,
                                preexec_fn=_make_preexec(limits, False), **kwargs)
    name = Path(args[0]).name
    # As in the box: the worker's own programs (the group guard) start with the launcher's fixed
    # environment, and `env -i` gives the child its environment last.
    args, launch_env = launcher.child_command(args, env), dict(launcher.LAUNCHER_ENV)
    if guard_group:
        args = [sys.executable, "-P", "-m", "worker.sandbox.group_guard", "--", *args]
        launch_env["PYTHONPATH"] = str(mounts.code_root())
    isolate = False
    if limits.isolate_network:
        isolate, reason = network_isolation()
        if not isolate:
            log.warning("sandbox: running %s WITH network access: %s", name, reason)
    return subprocess.Popen(args, env=launch_env, start_new_session=True, cwd=cwd,
                            preexec_fn=_make_preexec(limits, isolate), **kwargs)
