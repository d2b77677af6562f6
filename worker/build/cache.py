"""The digest-keyed build cache every build kind shares (worker.build.extension, .project).

A build's key is the digest of everything that decides its bits; the same key again is a hit that
builds nothing. Concurrency and crashes: a build holds an exclusive `flock` on
`<cache>/locks/<digest>.lock`. The kernel drops a flock when its holder dies, so a killed build can
never leave a lock that hangs the next one (unlike a lock *file*, such as torch's own `FileBaton`,
which survives a kill -9). Each attempt builds into its own staging folder, renamed into place only
when complete, so a reader sees either no build or a whole one. A failed attempt keeps the tail of
its log under `<cache>/failed/` and nothing else.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pydantic import BaseModel

from worker.build.ccache import CompilerCacheStats
from worker.sandbox import log_tail

MANIFEST = "manifest.json"
# What is kept of a build log: its last MiB (submitted code decides how much a build prints).
MAX_KEPT_LOG_BYTES = 1024 * 1024
# A build whose library is the installed package rather than a file (worker.build.project).
INSTALLED = "installed"


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


def default_cache_dir() -> Path:
    """Where a build goes when its caller names no cache: OPTDRIFT_BUILD_CACHE_DIR (the workers'
    setting), else OPTDRIFT_BUILD_CACHE (the older name the tests and `check` set), else the
    user's cache folder."""
    configured = os.environ.get("OPTDRIFT_BUILD_CACHE_DIR") or os.environ.get("OPTDRIFT_BUILD_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "optdrift" / "builds"


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


@contextmanager
def exclusive_lock(lock_path: Path, timeout_s: float) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another build of {lock_path.stem} held its lock for {timeout_s:.0f} s")
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cached(build_dir: Path, started: float) -> BuildResult | None:
    try:
        manifest = json.loads((build_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    library = manifest.get("library_path")
    if library != INSTALLED and not (library and Path(library).exists()):
        return None
    return BuildResult(**{**manifest, "cached": True, "duration_s": time.monotonic() - started})


def cached_build(cache_dir: Path, digest: str, make: Callable[[Path], BuildResult], *,
                 lock_timeout_s: float) -> BuildResult:
    """The build of `digest` from the cache, or made now by `make(staging)` and put in place.

    `make` builds into the empty `staging` folder and returns a BuildResult whose `library_path`
    lies inside it (or is INSTALLED) and whose log is `staging/build.log`; it never raises for a
    failed build. Paths in the stored manifest point into the final folder."""
    started = time.monotonic()
    build_dir = cache_dir / digest
    hit = _cached(build_dir, started)
    if hit is not None:
        return hit
    with exclusive_lock(cache_dir / "locks" / f"{digest}.lock", timeout_s=lock_timeout_s):
        hit = _cached(build_dir, started)  # someone else may have built it while we waited
        if hit is not None:
            return hit
        # We hold the lock: any staging folder of this digest is an abandoned attempt.
        for stale in cache_dir.glob(f"{digest}.staging-*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = cache_dir / f"{digest}.staging-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        result = make(staging)
        log = staging / "build.log"
        log_tail.keep_tail(log, MAX_KEPT_LOG_BYTES)
        if not result.ok:
            # Keep the failed attempt's log (its tail) where the result points; drop the rest.
            failed_dir = cache_dir / "failed" / f"{digest}-{uuid.uuid4().hex[:8]}"
            failed_dir.mkdir(parents=True)
            if log.exists():
                shutil.move(str(log), failed_dir / "build.log")
            shutil.rmtree(staging, ignore_errors=True)
            return result.model_copy(update={"log_path": str(failed_dir / "build.log"),
                                             "duration_s": time.monotonic() - started})
        library = result.library_path
        final_library = library if library == INSTALLED else str(build_dir / Path(library).relative_to(staging))
        (staging / MANIFEST).write_text(json.dumps({
            **result.model_dump(exclude={"cached", "duration_s"}),
            "library_path": final_library, "log_path": str(build_dir / "build.log"),
        }, indent=2))
        if build_dir.exists():
            shutil.rmtree(build_dir)  # a half-written entry without a manifest
        os.rename(staging, build_dir)
        built = _cached(build_dir, started)
        return built.model_copy(update={"cached": False})
