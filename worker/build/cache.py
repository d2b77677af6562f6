"""The digest-keyed build cache every build kind shares (worker.build.extension, .project).

A build's key is the digest of everything that decides its bits, and its trust: who may have
decided them. The same key again is a hit that builds nothing.

Trust. A trusted build (a commit run, a baseline, `optdrift check`) goes into the shared cache,
`<root>/<digest>` (extension builds) or `<root>/command/<digest>`, and its manifest says
`"trust": "trusted"`; a trusted lookup takes nothing else (an entry from before trust was recorded
is rebuilt). An untrusted build (a verify run: a contributor's code, which may behave differently
when it sees it is untrusted) never writes there: it builds into a private folder of its own,
`<root>/verify/<digest16>-<random>`, that no other build is ever served from, and that is deleted
when its run ends (`release_builds`, called when a worker's task ends) or, if its process died,
by the next untrusted build (`sweep_verify_builds`: the folder's flock went with its process). An
untrusted build may *read* a trusted entry of the same digest (it is the trusted bits), never
write one, nor touch its last-use mark. It is also capped: more than `verify_build_max_bytes()`
in its folder, measured while it runs (`wait_bounded`) and once more when it ends, and the build
is killed and refused, its output deleted but for its log.

Disk. The trusted entries (and failed builds' logs) together are kept under
`build_cache_max_bytes()` (OPTDRIFT_BUILD_CACHE_MAX_BYTES): after each trusted build is put in
place, the least recently used go first (`evict`); every hit marks its entry used. An entry in use
is never evicted: a process that takes an entry holds a shared flock on the entry's lock until its
run ends (`release_builds`), and eviction takes only entries whose lock it can hold exclusively.
The compiler cache (worker.build.ccache, CCACHE_MAXSIZE) and the reference cache
(worker.engine.reference_cache, MAX_ROWS) have caps of their own.

Concurrency and crashes: a build holds an exclusive `flock` on `<cache>/locks/<digest>.lock`. The
kernel drops a flock when its holder dies, so a killed build can never leave a lock that hangs the
next one (unlike a lock *file*, such as torch's own `FileBaton`, which survives a kill -9). Each
attempt builds into its own staging folder, renamed into place only when complete, so a reader
sees either no build or a whole one. A failed attempt keeps the tail of its log under
`<cache>/failed/` and nothing else.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO

from pydantic import BaseModel

from worker.build.ccache import CompilerCacheStats
from worker.build.toolchain import Toolchain
from worker.sandbox import log_tail, privilege

MANIFEST = "manifest.json"
# What is kept of a build log: its last MiB (submitted code decides how much a build prints).
MAX_KEPT_LOG_BYTES = 1024 * 1024
# A build whose library is the installed package rather than a file (worker.build.project).
INSTALLED = "installed"

TRUSTED = "trusted"  # the manifest's "trust" of an entry a trusted lookup may take
COMMAND_FOLDER = "command"  # <root>/command: the command builds' entries (worker.build.project)
VERIFY_FOLDER = "verify"  # <root>/verify: untrusted builds, one private folder each
LAST_USED = "last-used"  # a file in each trusted entry, touched on every hit (eviction's clock)
FAILED_FOLDER = "failed"

BUILD_CACHE_MAX_BYTES_VARIABLE = "OPTDRIFT_BUILD_CACHE_MAX_BYTES"
DEFAULT_BUILD_CACHE_MAX_BYTES = 20 * 1024 ** 3
VERIFY_BUILD_MAX_BYTES_VARIABLE = "OPTDRIFT_VERIFY_BUILD_MAX_BYTES"
DEFAULT_VERIFY_BUILD_MAX_BYTES = 2 * 1024 ** 3
# What one file or folder costs beyond its bytes (its inode, its directory entry): a build that
# makes a million empty files is not free.
ENTRY_BYTES = 512
# How often a running untrusted build's folder is measured: what it can write past its cap is
# what it writes in this long (each file is also capped by the sandbox's RLIMIT_FSIZE).
OUTPUT_POLL_S = 1.0

_DIGEST_NAME = re.compile(r"[0-9a-f]{64}")


class BuildResult(BaseModel):
    ok: bool
    digest: str
    library_path: str | None = None
    cached: bool = False
    duration_s: float = 0.0
    log_path: str | None = None
    error: str | None = None
    cuda_archs: list[str] = []
    # ccache's counts for the build that made this library (None: built without ccache).
    compiler_cache: CompilerCacheStats | None = None
    # The compilers that made it (worker.build.toolchain; None: a build kind that runs the tree's
    # own commands, whose compilers optdrift does not choose).
    toolchain: Toolchain | None = None


# The build cache has one name, the service's setting; the older name `optdrift check` and the tests
# used still works, with a deprecation message naming the new one.
BUILD_CACHE_VARIABLE = "OPTDRIFT_BUILD_CACHE_DIR"
DEPRECATED_BUILD_CACHE_VARIABLE = "OPTDRIFT_BUILD_CACHE"
_deprecation_said = False


def deprecated_cache_message() -> str | None:
    """What to tell a user who still sets OPTDRIFT_BUILD_CACHE (None when they do not)."""
    old = os.environ.get(DEPRECATED_BUILD_CACHE_VARIABLE)
    if not old:
        return None
    new = os.environ.get(BUILD_CACHE_VARIABLE)
    if new and new != old:
        return (f"{DEPRECATED_BUILD_CACHE_VARIABLE} is deprecated and ignored here: {BUILD_CACHE_VARIABLE}={new} "
                "names the build cache; unset the old one")
    return (f"{DEPRECATED_BUILD_CACHE_VARIABLE} is deprecated: set {BUILD_CACHE_VARIABLE}={old} instead "
            "(the same variable as the service's workers)")


def default_cache_dir() -> Path:
    """Where a build goes when its caller names no cache: the service's build cache for the same
    OPTDRIFT_HOME (service.settings: OPTDRIFT_BUILD_CACHE_DIR, else $OPTDRIFT_HOME/builds), so
    `optdrift check` and a worker share their builds. OPTDRIFT_BUILD_CACHE, the older name, is
    still read when OPTDRIFT_BUILD_CACHE_DIR is not set, with a DeprecationWarning (once)."""
    global _deprecation_said
    message = deprecated_cache_message()
    if message is not None and not _deprecation_said:
        _deprecation_said = True
        warnings.warn(message, DeprecationWarning, stacklevel=2)
    configured = os.environ.get(BUILD_CACHE_VARIABLE) or os.environ.get(DEPRECATED_BUILD_CACHE_VARIABLE)
    if configured:
        return Path(configured)
    # service.settings' rule (Settings.resolved_build_cache_dir with its default home), written
    # out here: what a build box imports must not reach the settings (pyproject's contracts);
    # tests/worker/build/test_one_build_cache.py holds the two equal.
    home = os.environ.get("OPTDRIFT_HOME") or \
        Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "optdrift"
    return Path(home) / "builds"


def _bytes_setting(variable: str, default: int) -> int:
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{variable}={raw!r} is not a positive whole number of bytes; set it to one "
                         f"(e.g. {default}, the default: {default / 1024 ** 3:g} GiB) or unset it")
    return value


def build_cache_max_bytes() -> int:
    """The trusted build cache's total (OPTDRIFT_BUILD_CACHE_MAX_BYTES, default 20 GiB): entries and
    failed builds' logs; the least recently used go first beyond it (`evict`)."""
    return _bytes_setting(BUILD_CACHE_MAX_BYTES_VARIABLE, DEFAULT_BUILD_CACHE_MAX_BYTES)


def verify_build_max_bytes() -> int:
    """What one untrusted build may leave in its folder, the copied tree included
    (OPTDRIFT_VERIFY_BUILD_MAX_BYTES, default 2 GiB); more and the build is refused."""
    return _bytes_setting(VERIFY_BUILD_MAX_BYTES_VARIABLE, DEFAULT_VERIFY_BUILD_MAX_BYTES)


class LabelledHash:
    """sha256 over (label, length, bytes) records: no two different sequences of fields can feed
    the same bytes, so a digest names its inputs unambiguously. Shared by every build kind."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def feed(self, label: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else value
        self._hash.update(f"{label}:{len(data)}:".encode())
        self._hash.update(data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


# --- measuring and removing what a build wrote (it may have made folders it cannot be read in) ---

def _scandir(folder: str) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except PermissionError:
        # A build may leave a folder mode 000; it is ours (or root's), so it can be opened.
        os.chmod(folder, stat.S_IRWXU)
        with os.scandir(folder) as entries:
            return list(entries)


def folder_bytes(folder: Path) -> int:
    """Bytes under `folder`: every file's size (a hard-linked file once) plus ENTRY_BYTES for each
    file, folder and link; links are not followed. Files that go while it counts are skipped."""
    total, seen, pending = 0, set(), [str(folder)]
    while pending:
        try:
            entries = _scandir(pending.pop())
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            total += ENTRY_BYTES
            if stat.S_ISDIR(info.st_mode):
                pending.append(entry.path)
            elif stat.S_ISREG(info.st_mode) and (info.st_nlink == 1 or (info.st_dev, info.st_ino) not in seen):
                seen.add((info.st_dev, info.st_ino))
                total += info.st_size
    return total


def measured_bytes(folders: list[Path]) -> int:
    """`folder_bytes` over `folders` as the worker may measure them: a worker that dropped root
    (worker.sandbox.privilege) cannot list a folder the box made mode 0700, so it measures in a
    child that regains root; otherwise here."""
    if privilege.dropped():
        return privilege.measure_as_root(list(folders), ENTRY_BYTES)
    return sum(folder_bytes(folder) for folder in folders)


def remove_tree(path: Path) -> None:
    """`path` and everything under it, folders a build left unreadable or unwritable included."""
    def writable_and_again(function, failed: str, _error) -> None:  # noqa: ANN001
        try:
            os.chmod(os.path.dirname(failed), stat.S_IRWXU)
            if os.path.isdir(failed) and not os.path.islink(failed):
                os.chmod(failed, stat.S_IRWXU)
                shutil.rmtree(failed, ignore_errors=True)
            else:
                function(failed)
        except OSError:
            pass

    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, onerror=writable_and_again)


class OutputTooLarge(Exception):
    def __init__(self, written: int, max_bytes: int) -> None:
        super().__init__(f"the build wrote {written / 1024 ** 2:.1f} MiB (its folder and its scratch HOME/TMPDIR), "
                         f"more than the "
                         f"{max_bytes / 1024 ** 2:.1f} MiB an untrusted build may "
                         f"({VERIFY_BUILD_MAX_BYTES_VARIABLE}), and was stopped")
        self.written, self.max_bytes = written, max_bytes


def wait_bounded(child: subprocess.Popen, timeout_s: float, *, output: Path | list[Path] | None = None,
                 max_bytes: int | None = None) -> int:
    """`child.wait(timeout_s)` (subprocess.TimeoutExpired as it), measuring `output` (a folder, or
    several together: the build's folder and its scratch HOME/TMPDIR) every OUTPUT_POLL_S while the
    child runs when `max_bytes` is given: past it, the child's process group (it leads one) is
    killed and OutputTooLarge raised."""
    if output is None or max_bytes is None:
        return child.wait(timeout=timeout_s)
    folders = output if isinstance(output, list) else [output]
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            return child.wait(timeout=max(0.0, min(OUTPUT_POLL_S, left)))
        except subprocess.TimeoutExpired:
            if left <= OUTPUT_POLL_S:
                raise
        written = measured_bytes(folders)
        if written > max_bytes:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise OutputTooLarge(written, max_bytes)


# --- locks, and what this process holds until its run ends ---

def _lock(lock_path: Path, operation: int, timeout_s: float, *, give_up_when: Callable[[], bool] | None = None
          ) -> IO | None:
    """`lock_path` opened and flocked (`operation`: LOCK_EX or LOCK_SH), waiting up to `timeout_s`;
    None as soon as `give_up_when()` is true while waiting (the lock is no longer needed)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(lock_path, "a+")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(handle, operation | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if give_up_when is not None and give_up_when():
                handle.close()
                return None
            if time.monotonic() > deadline:
                handle.close()
                raise TimeoutError(f"another build of {lock_path.stem} held its lock for {timeout_s:.0f} s") from None
            time.sleep(0.2)


def _try_exclusive(lock_path: Path) -> IO | None:
    try:
        return _lock(lock_path, fcntl.LOCK_EX, 0.0)
    except (TimeoutError, OSError):
        return None


class _Held(threading.local):
    """Per thread (a worker's task runs in one): trusted entries in use, by lock path, and
    untrusted build folders with their locks."""

    def __init__(self) -> None:
        self.entries: dict[str, IO] = {}
        self.verify_builds: dict[str, tuple[Path, IO]] = {}


_held = _Held()


def _hold_shared(lock_path: Path, timeout_s: float) -> None:
    if str(lock_path) not in _held.entries:
        _held.entries[str(lock_path)] = _lock(lock_path, fcntl.LOCK_SH, timeout_s)


def _let_go(lock_path: Path) -> None:
    handle = _held.entries.pop(str(lock_path), None)
    if handle is not None:
        handle.close()


def release_builds() -> list[Path]:
    """The end of a run (a worker task, worker/tasks.py): every untrusted build this thread made
    is deleted, and the trusted entries it used may be evicted again. Returns the folders deleted."""
    removed = []
    for folder, (lock_path, handle) in list(_held.verify_builds.items()):
        remove_tree(Path(folder))
        lock_path.unlink(missing_ok=True)
        handle.close()
        removed.append(Path(folder))
    _held.verify_builds.clear()
    for handle in _held.entries.values():
        handle.close()
    _held.entries.clear()
    return removed


# --- the cache ---

def _cached(build_dir: Path, started: float, *, trust: str = TRUSTED) -> BuildResult | None:
    try:
        manifest = json.loads((build_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("trust") != trust:
        return None
    library = manifest.get("library_path")
    if library != INSTALLED and not (library and Path(library).exists()):
        return None
    return BuildResult(**{**manifest, "cached": True, "duration_s": time.monotonic() - started})


def _mark_used(build_dir: Path) -> None:
    try:
        (build_dir / LAST_USED).touch()
    except OSError:
        pass  # evicted meanwhile: the next lookup builds it again


def _write_manifest(staging: Path, build_dir: Path, result: BuildResult, *, trust: str) -> None:
    library = result.library_path
    final_library = library if library == INSTALLED else str(build_dir / Path(library).relative_to(staging))
    (staging / MANIFEST).write_text(json.dumps({
        **result.model_dump(exclude={"cached", "duration_s"}),
        "library_path": final_library, "log_path": str(build_dir / "build.log"),
        "trust": trust, "bytes": folder_bytes(staging),
    }, indent=2))


def cached_build(cache_dir: Path, digest: str, make: Callable[[Path], BuildResult], *,
                 lock_timeout_s: float, trusted: bool = True, root: Path | None = None) -> BuildResult:
    """The build of `digest` from the cache, or made now by `make(staging)`.

    `make` builds into the empty `staging` folder and returns a BuildResult whose `library_path`
    lies inside it (or is INSTALLED) and whose log is `staging/build.log`; it never raises for a
    failed build. Paths in the stored manifest point into the final folder. `cache_dir`: the build
    kind's folder of the cache whose root is `root` (default: `cache_dir` itself).
    `trusted`: False for a verify run's build (the module docstring: a private folder, deleted by
    `release_builds`, capped by `verify_build_max_bytes`)."""
    root = Path(root or cache_dir)
    if not trusted:
        return _untrusted_build(cache_dir, root, digest, make, lock_timeout_s=lock_timeout_s)
    started = time.monotonic()
    build_dir = cache_dir / digest
    lock_path = cache_dir / "locks" / f"{digest}.lock"
    while True:
        if _cached(build_dir, started) is not None:
            _hold_shared(lock_path, lock_timeout_s)  # waits out an eviction of it, if one is under way
            hit = _cached(build_dir, started)
            if hit is not None:
                _mark_used(build_dir)
                return hit
        _let_go(lock_path)  # a shared hold of our own would block our exclusive lock
        # Whoever builds it first keeps a shared hold while it uses the build (its whole run): once
        # the entry is there, wait for that no longer and take a shared hold of our own (the loop's top).
        handle = _lock(lock_path, fcntl.LOCK_EX, lock_timeout_s,
                       give_up_when=lambda: _cached(build_dir, started) is not None)
        if handle is None:
            continue
        try:
            hit = _cached(build_dir, started)  # someone else may have built it while we waited
            if hit is None:
                made = _make_entry(cache_dir, build_dir, digest, make, started)
                if not made.ok:
                    return made
                hit = made
            _mark_used(build_dir)
            fcntl.flock(handle, fcntl.LOCK_SH)  # in use now: held until the run ends
        except BaseException:
            handle.close()
            raise
        _held.entries[str(lock_path)] = handle
        # Turning the lock into a shared one is not atomic: an eviction might have slipped in.
        if (build_dir / MANIFEST).exists():
            break
        _let_go(lock_path)
    evict(root, build_cache_max_bytes())
    return hit


def _make_entry(cache_dir: Path, build_dir: Path, digest: str, make: Callable[[Path], BuildResult],
                started: float) -> BuildResult:
    """Build `digest` into a staging folder and rename it into place (the caller holds its lock)."""
    # We hold the lock: any staging folder of this digest is an abandoned attempt.
    for stale in cache_dir.glob(f"{digest}.staging-*"):
        remove_tree(stale)
    staging = cache_dir / f"{digest}.staging-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    result = make(staging)
    log = staging / "build.log"
    log_tail.keep_tail(log, MAX_KEPT_LOG_BYTES)
    if not result.ok:
        # Keep the failed attempt's log (its tail) where the result points; drop the rest.
        failed_dir = cache_dir / FAILED_FOLDER / f"{digest}-{uuid.uuid4().hex[:8]}"
        failed_dir.mkdir(parents=True)
        if log.exists():
            shutil.move(str(log), failed_dir / "build.log")
        remove_tree(staging)
        return result.model_copy(update={"log_path": str(failed_dir / "build.log"),
                                         "duration_s": time.monotonic() - started})
    _write_manifest(staging, build_dir, result, trust=TRUSTED)
    if build_dir.exists():
        remove_tree(build_dir)  # a half-written entry, or one from before trust was recorded
    os.rename(staging, build_dir)
    return _cached(build_dir, started).model_copy(update={"cached": False})


def _untrusted_build(cache_dir: Path, root: Path, digest: str, make: Callable[[Path], BuildResult], *,
                     lock_timeout_s: float) -> BuildResult:
    started = time.monotonic()
    trusted_dir = cache_dir / digest
    if _cached(trusted_dir, started) is not None:  # the trusted bits: read, never written or marked
        _hold_shared(cache_dir / "locks" / f"{digest}.lock", lock_timeout_s)
        hit = _cached(trusted_dir, started)
        if hit is not None:
            return hit
    sweep_verify_builds(root)
    name = f"{digest[:16]}-{uuid.uuid4().hex[:12]}"
    verify_root = root / VERIFY_FOLDER
    lock_path = verify_root / "locks" / f"{name}.lock"
    handle = _lock(lock_path, fcntl.LOCK_EX, 0.0)  # a new name: nobody else holds it
    folder = verify_root / name
    folder.mkdir(parents=True)
    _held.verify_builds[str(folder)] = (lock_path, handle)
    result = make(folder)
    log = folder / "build.log"
    log_tail.keep_tail(log, MAX_KEPT_LOG_BYTES)
    cap = verify_build_max_bytes()
    written = folder_bytes(folder)
    if written > cap:
        for entry in folder.iterdir():
            if entry != log:
                remove_tree(entry)
        result = result.model_copy(update={"ok": False, "library_path": None,
                                           "error": str(OutputTooLarge(written, cap))})
    if result.ok:
        _write_manifest(folder, folder, result, trust="untrusted")
    return result.model_copy(update={"cached": False, "log_path": str(log) if log.exists() else result.log_path,
                                     "duration_s": time.monotonic() - started})


def sweep_verify_builds(root: Path) -> list[Path]:
    """Untrusted build folders whose process is gone (it died before its run's end could delete
    them: its flock went with it); those in use keep their lock and stay. Returns those deleted."""
    verify_root = Path(root) / VERIFY_FOLDER
    removed = []
    for lock_path in sorted((verify_root / "locks").glob("*.lock")):
        handle = _try_exclusive(lock_path)
        if handle is None:
            continue
        try:
            folder = verify_root / lock_path.stem
            remove_tree(folder)
            lock_path.unlink(missing_ok=True)
            removed.append(folder)
        finally:
            handle.close()
    return removed


def _entries(root: Path) -> list[tuple[float, int, Path, Path | None]]:
    """(last used, bytes, folder, its lock or None) of the trusted cache's evictable things."""
    found = []
    for kind_dir in (root, root / COMMAND_FOLDER):
        for manifest_path in kind_dir.glob(f"*/{MANIFEST}"):
            entry = manifest_path.parent
            if not _DIGEST_NAME.fullmatch(entry.name):
                continue
            try:
                size = json.loads(manifest_path.read_text()).get("bytes")
                marker = entry / LAST_USED
                used = (marker if marker.exists() else manifest_path).stat().st_mtime
            except (OSError, ValueError):
                continue
            found.append((used, size if isinstance(size, int) else folder_bytes(entry), entry,
                          kind_dir / "locks" / f"{entry.name}.lock"))
        for failed in (kind_dir / FAILED_FOLDER).glob("*"):
            try:
                found.append((failed.stat().st_mtime, folder_bytes(failed), failed, None))
            except OSError:
                continue
    return found


def _sweep_abandoned(root: Path) -> None:
    """Staging folders of builds whose process died (their digest's lock is free) and evicted
    entries whose removal was cut short."""
    for kind_dir in (root, root / COMMAND_FOLDER):
        for leftover in kind_dir.glob("*.evicted-*"):
            remove_tree(leftover)
        for staging in kind_dir.glob("*.staging-*"):
            handle = _try_exclusive(kind_dir / "locks" / f"{staging.name.split('.staging-')[0]}.lock")
            if handle is not None:
                try:
                    remove_tree(staging)
                finally:
                    handle.close()


def evict(root: Path, max_bytes: int) -> list[Path]:
    """Delete the least recently used trusted entries (and failed builds' logs) of the cache at
    `root` until they take at most `max_bytes`; an entry whose lock someone holds (a build, a run
    using it) is skipped. Returns what was deleted."""
    _sweep_abandoned(Path(root))
    entries = _entries(Path(root))
    total = sum(size for _, size, _, _ in entries)
    removed = []
    for _used, size, entry, lock_path in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes:
            break
        handle = _try_exclusive(lock_path) if lock_path is not None else None
        if lock_path is not None and handle is None:
            continue  # in use
        try:
            doomed = entry.with_name(f"{entry.name}.evicted-{uuid.uuid4().hex[:8]}")
            os.rename(entry, doomed)  # a reader sees a whole entry or none
            remove_tree(doomed)
            total -= size
            removed.append(entry)
        except OSError:
            continue
        finally:
            if handle is not None:
                handle.close()
    return removed
