"""Root only where it is needed: a worker started as root keeps it for launching the box, nothing else.

Launching the box needs root: bwrap runs privileged (no user namespace needed) and `setpriv` drops
the child to uid 65534, and the box's writable folders are handed to 65534 first (CAP_CHOWN). The
worker's other work (reading and writing build folders, the database, the network) does not, and a
root worker that follows a link planted in a build folder reads root's secrets (~/.aws/credentials,
the Fernet key) and writes any path.

So a worker started as root (`optdrift worker`, and the worker `optdrift serve` starts) calls
`drop_for_worker()` before anything else runs (before Celery, its pool and its threads start):

- the user named by OPTDRIFT_WORKER_USER (default `optdrift`) must exist; when it does not, the
  worker stays root and says so at start and in /healthz (`identity()`);
- as root, the worker's folders (OPTDRIFT_HOME, the build cache) are made its user's, except the
  secret files only root should read (the admin token, the secrets key, the token file) and the
  compiler caches (the box's for good): the worker token and the Fernet key the worker needs (source
  downloads, notifications) are read into its environment first, so a link planted to those files
  is as useless as one to root's; the embedded broker's folders let the user write what the root
  API makes there later, and the worker gets a temporary folder of its own;
- it refuses (DropRefused) where its user could not reach its Python, code or folders, or could
  replace a program it runs as root;
- then real and effective uid/gid become the user's and the saved uid stays 0 (setresuid(u, u, 0)):
  the process can regain root, but only does so in a child it forks to launch the box
  (`tether_command`, `regain_root_in_child`). Python's os.setresuid goes through glibc, which applies
  it to every thread of the process; it still runs before any thread is started.

Why a tether. A process that runs as root (bwrap) cannot be signalled by the worker's user, and the
worker kills boxes (timeouts, cancels, the watchdog: os.killpg on the Popen's pid). So the worker's
child is a small Python process, real uid the worker's (signals reach it) and effective uid 0, that
forks bwrap as root and waits for it; bwrap's --die-with-parent takes the box down when the tether
dies, whoever kills it (the kernel sends that signal with the dying tether's rights, which is why
the tether keeps its effective uid 0). It dies with the worker in turn (PR_SET_PDEATHSIG). When the box ends, the folders handed to 65534 are taken back (`take_back`), so
the worker reads, trims and deletes what the build wrote as their owner.

A dropped worker cannot be ptraced by its own user's processes: the kernel makes a process whose
uids changed non-dumpable, and its saved uid 0 fails ptrace's same-uid test anyway.
"""

from __future__ import annotations

import logging
import os
import pwd
import stat
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from worker.sandbox import launcher

log = logging.getLogger(__name__)

WORKER_USER_VARIABLE = "OPTDRIFT_WORKER_USER"
DEFAULT_WORKER_USER = "optdrift"
PR_SET_DUMPABLE = 4

# How the worker runs, for its log and /healthz.
DROPPED, ROOT, UNPRIVILEGED = "dropped", "root", "unprivileged"


@dataclass(frozen=True)
class Identity:
    mode: str     # DROPPED: root only to launch the box; ROOT: everything as root; UNPRIVILEGED: never root
    user: str     # who the worker's file handling runs as
    detail: str   # one sentence for the log and /healthz

    @property
    def warning(self) -> str | None:
        return self.detail if self.mode == ROOT else None

    def as_dict(self) -> dict[str, str]:
        return {"mode": self.mode, "user": self.user, "detail": self.detail}


class DropRefused(RuntimeError):
    """The worker user exists but the worker cannot run as it; the message says why and what to do."""


_identity: Identity | None = None
_root_groups: list[int] = []  # root's supplementary groups, given back to the launching child


def worker_user_name() -> str:
    return os.environ.get(WORKER_USER_VARIABLE, "").strip() or DEFAULT_WORKER_USER


def dropped() -> bool:
    """Real and effective uid unprivileged, saved uid 0: this process may launch a box as root."""
    real, effective, saved = os.getresuid()
    return real != 0 and effective != 0 and saved == 0


def launches_as_root() -> bool:
    """Whether the box is launched privileged (bwrap as root, then setpriv): a root worker, dropped or not."""
    return os.geteuid() == 0 or dropped()


def identity() -> Identity:
    """How this worker runs: what `drop_for_worker` decided, or, where it never ran, what the process is."""
    if _identity is not None:
        return _identity
    if dropped():
        return Identity(DROPPED, _name_of(os.getuid()), "root only to launch the box")
    if os.geteuid() == 0:
        return Identity(ROOT, "root", _no_user_message(worker_user_name()))
    return Identity(UNPRIVILEGED, _name_of(os.geteuid()), "never root; the box is made in a user namespace")


def _name_of(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _no_user_message(name: str) -> str:
    return (f"running as root: file handling, database and network work run with root's rights; create "
            f"the user {name!r} (useradd --system --home-dir /var/lib/optdrift {name}) or name another "
            f"with {WORKER_USER_VARIABLE}, and restart the worker (docs/DEPLOY.md)")


# ----------------------------------------------------------------------------- the drop at start
def drop_for_worker(settings) -> Identity:  # noqa: ANN001  (service.settings.Settings: not imported here)
    """At worker start, before threads: as root with a worker user, make the worker's folders its
    user's and become that user (saved uid 0 kept for launching boxes). Returns how the worker runs;
    raises DropRefused when the user exists but cannot do the worker's work. `settings`: the
    worker's; the caller reads them again afterwards (HOME and the preloaded secrets changed).
    (This module imports nothing of service: the box's code reaches it through worker.sandbox.)"""
    global _identity, _root_groups
    if os.geteuid() != 0:
        _identity = identity()
        return _identity
    name = worker_user_name()
    try:
        user = pwd.getpwnam(name)
    except KeyError:
        _identity = Identity(ROOT, "root", _no_user_message(name))
        log.warning("%s", _identity.detail)
        return _identity
    if user.pw_uid == 0 or user.pw_gid == 0:
        raise DropRefused(f"{WORKER_USER_VARIABLE}={name!r} is root (uid {user.pw_uid}, gid {user.pw_gid}): "
                          f"name an unprivileged user")
    from worker.sandbox.mounts import SANDBOX_GID, SANDBOX_UID

    groups = [g for g in os.getgrouplist(name, user.pw_gid) if g != 0]
    _check_programs_are_roots(user)
    # Pin where the worker's folders are before HOME changes (their defaults follow HOME).
    os.environ.setdefault("OPTDRIFT_HOME", str(settings.home))
    folders = [settings.home, settings.resolved_build_cache_dir]
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    for needed in [*folders, Path(sys.prefix), Path(sys.base_prefix), Path(__file__).resolve().parents[2]]:
        _check_reachable(needed, user, groups, becoming_its=folders)
    root_only = _root_only_files(settings)
    _preload_secrets(settings)
    if settings.uses_filesystem_broker:
        _share_new_files(settings.broker_folder, user.pw_uid)
    if not os.environ.get("TMPDIR"):
        # A temporary folder of the worker's own (becoming the user's with the home below), not /tmp:
        # kombu's filesystem transport moves each message file there to read and delete it, and
        # /tmp's sticky bit refuses the worker the deletion of a file the root API made.
        own_tmp = settings.home / "tmp"
        own_tmp.mkdir(mode=0o700, exist_ok=True)
        os.environ["TMPDIR"] = str(own_tmp)
        tempfile.tempdir = None  # tempfile caches the folder it found first
    # The compiler caches are shared by every trusted build on the host, several at once: they stay
    # the box's (never taken back after one build while another writes them); the worker never
    # writes in them.
    compiler_caches = _compiler_caches(settings.resolved_build_cache_dir)
    for folder in folders:
        _give_tree_to(folder, user.pw_uid, user.pw_gid, keep=root_only, box_owned=set(compiler_caches))
    for compiler_cache in compiler_caches:
        compiler_cache.mkdir(parents=True, exist_ok=True)
        os.chown(compiler_cache.parent, user.pw_uid, user.pw_gid)
        if compiler_cache.lstat().st_uid != SANDBOX_UID:
            chown_trees([compiler_cache], SANDBOX_UID, SANDBOX_GID)
    _root_groups = os.getgroups()
    os.setgroups(groups)
    os.setresgid(user.pw_gid, user.pw_gid, user.pw_gid)
    os.setresuid(user.pw_uid, user.pw_uid, 0)
    # The kernel already made the process non-dumpable (its uids changed); said here so it stays so.
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0)
    os.environ.update({"HOME": user.pw_dir, "USER": name, "LOGNAME": name})
    _identity = Identity(DROPPED, name, f"file handling, database and network work run as {name!r} "
                                        f"(uid {user.pw_uid}); root only to launch the box")
    log.info("worker: %s", _identity.detail)
    return _identity


# worker.build.cache.COMMAND_FOLDER, named here rather than imported: worker.build sits above
# worker.sandbox (tests/worker/sandbox/test_privilege.py checks the two agree).
COMMAND_BUILDS_FOLDER = "command"


def _compiler_caches(build_cache: Path) -> list[Path]:
    """The `ccache` folders of the extension builds and of the command builds (worker.build)."""
    root = Path(os.path.abspath(build_cache))
    return [root / "ccache", root / COMMAND_BUILDS_FOLDER / "ccache"]


def _check_programs_are_roots(user: pwd.struct_passwd) -> None:
    """The programs run as root (the tether's Python, bwrap, setpriv, chown) must not be the worker
    user's to replace: otherwise the user's rights would be root's."""
    found = launcher.launcher()
    for program in (os.path.realpath(sys.executable), found.bwrap, found.setpriv, _chown()):
        if not program:
            continue
        path = Path(program).resolve()
        for part in [path, *path.parents]:
            info = part.stat()
            if info.st_uid == user.pw_uid or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (
                    part.is_dir() and info.st_mode & stat.S_ISVTX):
                raise DropRefused(f"{part} (on the way to {program}, which the worker runs as root) can be "
                                  f"changed by {user.pw_name!r} or by others: make it root's and not "
                                  f"group/other-writable")


def _check_reachable(path: Path, user: pwd.struct_passwd, groups: list[int], *, becoming_its: list[Path]) -> None:
    """Every folder above `path` must be enterable by the user (mode bits; an ACL is trusted), but
    for those the drop makes the user's (`becoming_its`: OPTDRIFT_HOME, the build cache)."""
    for folder in reversed(Path(os.path.abspath(path)).parents):
        if any(folder.is_relative_to(os.path.abspath(own)) for own in becoming_its):
            continue
        info = folder.stat()
        bit = (stat.S_IXUSR if info.st_uid == user.pw_uid else
               stat.S_IXGRP if info.st_gid == user.pw_gid or info.st_gid in groups else stat.S_IXOTH)
        if not info.st_mode & bit and not _acl_lets_in(folder):
            raise DropRefused(f"{path} lies under {folder} (mode {stat.S_IMODE(info.st_mode):04o}, owner uid "
                              f"{info.st_uid}), which the worker user {user.pw_name!r} cannot enter: put the "
                              f"worker's Python, code, OPTDRIFT_HOME and build cache where it can (e.g. "
                              f"OPTDRIFT_HOME=/var/lib/optdrift), or let it in")


def _acl_lets_in(folder: Path) -> bool:
    """A folder with an access ACL: trust the operator's ACL (its named entries are not parsed here)."""
    try:
        os.getxattr(folder, "system.posix_acl_access")
    except OSError:
        return False
    return True


def _root_only_files(settings) -> set[Path]:  # noqa: ANN001
    return {Path(os.path.abspath(p)) for p in
            (settings.admin_token_file, settings.worker_token_file, settings.resolved_secrets_key_file)}


def _preload_secrets(settings) -> None:  # noqa: ANN001
    """The worker token (source downloads) and the Fernet key (notifications) into the environment,
    read as root, so their files can stay root's 0600 and no link the worker follows can reach them."""
    if not os.environ.get("OPTDRIFT_WORKER_TOKEN"):
        token = settings.resolved_worker_token()
        if token:
            os.environ["OPTDRIFT_WORKER_TOKEN"] = token
    if not os.environ.get("OPTDRIFT_SECRETS_KEY", "").strip():
        try:
            key = settings.resolved_secrets_key_file.read_text().strip()
        except OSError:
            key = ""  # none yet: notifications say so when they need it (service.notify.sealing)
        if key:
            os.environ["OPTDRIFT_SECRETS_KEY"] = key


def _give_tree_to(top: Path, uid: int, gid: int, *, keep: set[Path], box_owned: set[Path]) -> None:
    """As root, before the drop: what root (an earlier root worker, `serve`) or an earlier box made
    in the worker's folder becomes the user's, links themselves, never their targets. The root-only
    secret files stay root's; `box_owned` folders (the shared compiler cache) are the box's for good."""
    from worker.sandbox.mounts import SANDBOX_UID

    def give(path: str, info: os.stat_result) -> None:
        if info.st_uid in (0, SANDBOX_UID) and Path(path) not in keep:
            os.lchown(path, uid, gid)

    give(str(top), os.lstat(top))
    for folder, dirs, files in os.walk(top):
        for name in list(dirs):
            path = os.path.join(folder, name)
            if Path(path) in box_owned:
                dirs.remove(name)
                continue
            give(path, os.lstat(path))
        for name in files:
            path = os.path.join(folder, name)
            give(path, os.lstat(path))


def _share_new_files(folder: Path, uid: int) -> None:
    """The embedded broker's folders (`optdrift serve` as root): the API, still root, keeps writing
    message and exchange files there after the drop, and kombu opens an exchange file for writing
    when the worker binds its queues. A default ACL makes every file created there later the worker
    user's to read and write (root's mode bits alone would make them read-only to it)."""
    entry, anyone = struct.Struct("<HHI"), 0xFFFFFFFF
    # version 2; owner rwx, the worker user rwx, owning group and others nothing, mask rwx
    acl = struct.pack("<I", 2) + b"".join([entry.pack(0x01, 7, anyone), entry.pack(0x02, 7, uid),
                                           entry.pack(0x04, 0, anyone), entry.pack(0x10, 7, anyone),
                                           entry.pack(0x20, 0, anyone)])
    folder.mkdir(parents=True, exist_ok=True)
    for sub in ("queue", "processed", "control"):  # service.broker.queueing's folders
        (folder / sub).mkdir(exist_ok=True)
    try:
        for here, _dirs, _files in os.walk(folder):
            os.setxattr(here, "system.posix_acl_default", acl)
    except OSError as error:
        log.warning("cannot give the worker user the files the API makes later in %s (%s): with `optdrift "
                    "serve` as root, use Redis (OPTDRIFT_BROKER_URL) or a file system with POSIX ACLs",
                    folder, error)


# ----------------------------------------------------------------------------- root in a child only
def regain_root_in_child() -> None:
    """In a forked child before exec (a preexec function): become root again, fully. Allowed because
    the saved uid is 0; subprocess's `user=` would call setreuid, which a non-root real uid may not use
    to reach 0 here. Never called in the worker itself: its threads share its credentials."""
    os.setresuid(0, 0, 0)
    os.setresgid(0, 0, 0)
    os.setgroups(_root_groups)


def raise_effective_in_child() -> None:
    """In the tether's preexec: effective uid 0 (so it can fork bwrap as root), real uid the worker's
    (so the worker's signals reach it)."""
    os.setresuid(-1, 0, -1)


# The tether (see the module docstring), run as `python -I -S -c TETHER WORKER_PID GROUPS PROGRAM ARG...`
# with real uid the worker's and effective uid 0. Self-contained: nothing of the worker is imported as root.
TETHER = """
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone with the worker
if os.getppid() != int(sys.argv[1]):
    os._exit(128 + signal.SIGKILL)  # the worker died before the request took effect
child = os.fork()
if child == 0:
    try:
        os.setresuid(0, 0, 0)
        os.setresgid(0, 0, 0)
        os.setgroups([int(g) for g in sys.argv[2].split(",") if g])
        os.execv(sys.argv[3], sys.argv[3:])  # --die-with-parent: bwrap and its box go with the tether
    finally:
        os._exit(127)
# The tether keeps effective uid 0 until it ends: the kernel checks the parent-death signal like a
# kill(2) from the dying tether, and one from the worker's uid could not reach bwrap (root). Its real
# uid stays the worker's, for the worker's signals; it runs nothing but this wait.
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda number, frame: os._exit(128 + number))  # bwrap dies with us
_, status = os.waitpid(child, 0)
if os.WIFSIGNALED(status):
    signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
os._exit(os.waitstatus_to_exitcode(status))
"""


def tether_command(command: list[str]) -> list[str]:
    """`command` (bwrap ...) run by the tether; start it with preexec `raise_effective_in_child`."""
    return [os.path.realpath(sys.executable), "-I", "-S", "-c", TETHER, str(os.getpid()),
            ",".join(map(str, _root_groups)), *command]


def _chown() -> str | None:
    return launcher._system_program("chown")  # noqa: SLF001  (the launcher's lookup: system folders only)


def chown_trees(paths: list[Path], uid: int, gid: int) -> None:
    """`chown -R -P -h uid:gid -- paths` in a child that regains root: links are changed themselves and
    never followed, so a link the box planted names nothing outside the folder. Raises OSError."""
    if not paths:
        return
    chown = _chown()
    if chown is None:
        raise OSError("chown (coreutils) was not found in the system folders; the box's folders cannot be handed over")
    done = subprocess.run([chown, "-R", "-P", "-h", f"{uid}:{gid}", "--", *map(str, paths)],
                          env=dict(launcher.LAUNCHER_ENV), preexec_fn=regain_root_in_child,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise OSError(f"chown of {', '.join(map(str, paths))} to {uid}:{gid} failed: "
                      f"{done.stderr.strip()[-2000:] or done.returncode}")


def measure_as_root(paths: list[Path], entry_bytes: int) -> int:
    """Bytes under `paths` as worker.build.cache.folder_bytes counts them (every file's apparent size,
    a hard-linked file once, plus `entry_bytes` for each file, folder and link), measured by `du` in a
    child that regains root: the box may leave folders mode 0700 that the worker's own user cannot
    list, and a measure that skipped them would let a build write past its cap unseen. Raises OSError."""
    du = launcher._system_program("du")  # noqa: SLF001  (system folders only)
    if du is None:
        raise OSError("du (coreutils) was not found in the system folders; the box's folders cannot be measured")
    existing = [str(p) for p in paths if os.path.lexists(p)]
    if not existing:
        return 0
    totals = []
    for unit in (["-B1", "--apparent-size"], ["--inodes"]):
        done = subprocess.run([du, "-s", "-c", "-P", "-x", *unit, "--", *existing], env=dict(launcher.LAUNCHER_ENV),
                              preexec_fn=regain_root_in_child, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=120)
        last = done.stdout.strip().splitlines()[-1:] or [""]
        try:
            totals.append(int(last[0].split()[0]))
        except (ValueError, IndexError):
            raise OSError(f"du could not measure {', '.join(existing)}: {done.stderr.strip()[-500:]}") from None
    size, entries = totals
    return size + entries * entry_bytes


def take_back(paths: list[Path]) -> None:
    """The box is gone: what it wrote becomes the worker's again (its user, not root). Logged, never
    raised: a folder left to 65534 is one the worker cannot trim or delete, not a broken run."""
    existing = [p for p in paths if os.path.lexists(p)]
    try:
        chown_trees(existing, os.getuid(), os.getgid())
    except (OSError, subprocess.SubprocessError) as error:
        log.warning("sandbox: could not take back %s from the box: %s", ", ".join(map(str, existing)), error)
