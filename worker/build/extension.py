"""The bundled kernels' build kind (`torch-extension`): a source tree compiled with
torch.utils.cpp_extension + ninja into the digest-keyed cache (worker.build.cache).

The digest covers everything that decides the compiled bits: the kernel sources (path and content
of every .cpp/.cu/.h/.cuh/.hpp file), the compile flags, the torch and CUDA versions and the target
architectures. The compile runs in a child process (`python -m worker.build.child`) in the sandbox
with a wall-clock timeout; its whole output goes to the build log. A compiler error comes back as a
`BuildResult` with `ok=False` and the compiler's message, never a traceback.

For ccache hits across builds (worker.build.ccache), the build compiles a private copy of the
sources at `<staging>/out/src` (only the files the digest covers, so nothing outside the digest can
reach the compiler), and ccache's base_dir is the cache root: every path it hashes is then relative
to the staging folder, the same for every commit tree and every build. The build log and
`BuildResult.compiler_cache` say whether ccache was used and which files it hit or missed.

What the box may write and what the worker writes are apart: the box is shown `<staging>/out`
(sources, ninja's files, objects, the library, ccache's stats log) and nothing else of the staging
folder; the build log (the child's stdout, a descriptor the worker opened) and the manifest live in
`<staging>` itself, where no box has a bind. What the worker takes from `out` (the stats log, the
check that the library is a plain file) goes through worker.sandbox.boxfiles.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from worker import sandbox
from worker.build.cache import (
    MAX_KEPT_LOG_BYTES, BuildResult, LabelledHash, OutputTooLarge, cached_build, default_cache_dir,
    verify_build_max_bytes, wait_bounded,
)
from worker.build.host_cpu import depends_on_host, isa_digest
from worker.build.toolchain import Toolchain, ToolchainError, identify
from worker.build.ccache import (
    EXTENSION_NAME_MACRO, ccache_env, ccache_version, find_ccache, read_ccache_stats_log,
)
from worker.build import progress as build_progress
from worker.sandbox import boxfiles, log_tail

# Bump when the way a build is made changes, so old cache entries are not reused.
BUILD_RECIPE_VERSION = "3"  # 2: libstdc++ linked dynamically, --fmad=false; 3: the box writes only <staging>/out
SOURCE_SUFFIXES = (".cpp", ".cc", ".cu", ".h", ".hpp", ".cuh")
DEFAULT_CFLAGS = ("-O3",)
# No --use_fast_math, and no FMA contraction (--fmad=false): the CUDA kernels compute exactly the
# float32 operations the source writes, rounded one by one, as the CPU build does (x86-64 gcc
# without -mfma does not contract). With contraction, nvcc fuses differently depending on how an
# expression is written, so a reordering that is exact in real arithmetic (decay before/after the
# update at wd=0) changed the last bit on the H200 but not on the CPU. The kernels are
# memory-bound: FMA buys them no speed.
DEFAULT_CUDA_CFLAGS = ("-O3", "-lineinfo", "--fmad=false")
LIBRARY_PREFIX = "optdrift_kernels_"
BOX_FOLDER = "out"  # <staging>/out: the only part of a staging folder an extension build's box may write


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


def torch_versions() -> tuple[str, str | None]:
    """(torch.__version__, torch.version.cuda) of the installed torch, read from its version.py
    when torch is not imported in this process yet. A build's digest needs only these, and
    importing torch for them cost a parent that never runs a kernel (`optdrift check`, a Celery
    worker's first spare kernel host) a whole torch import before it could start its hosts, which
    then import torch themselves. torch's own version.py holds plain
    assignments; the values are those torch imports as torch.__version__ and torch.version.cuda
    (tests/worker/build/test_build.py::test_a_digest_is_the_same_whether_or_not_torch_is_imported
    compares the digests made both ways)."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "version"):
        spec = importlib.util.find_spec("torch")  # locates the package without running it
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        version_file = Path(folders[0]) / "version.py" if folders else None
        if version_file is not None and version_file.is_file():
            namespace: dict = {}
            exec(compile(version_file.read_text(), str(version_file), "exec"), namespace)  # noqa: S102 - torch's own file
            if isinstance(namespace.get("__version__"), str):
                cuda = namespace.get("cuda")
                return namespace["__version__"], cuda if isinstance(cuda, str) else None
        import torch
    return str(torch.__version__), torch.version.cuda


def detect_cuda_archs() -> list[str]:
    """Compute capabilities to build for, e.g. ["9.0"]; [] means a CPU-only build.

    `OPTDRIFT_CUDA_ARCHS` ("9.0;8.6", or "" for CPU-only) overrides detection. Detection asks
    nvidia-smi rather than torch.cuda so that the calling process (a Celery parent) never
    initialises CUDA.
    """
    configured = os.environ.get("OPTDRIFT_CUDA_ARCHS")
    if configured is not None:
        return [a for a in re.split(r"[;,\s]+", configured) if a]
    if torch_versions()[1] is None or shutil.which("nvidia-smi") is None:
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


def build_digest(
    source_dir: Path,
    *,
    cuda_archs: list[str],
    extra_cflags: tuple[str, ...] = DEFAULT_CFLAGS,
    extra_cuda_cflags: tuple[str, ...] = DEFAULT_CUDA_CFLAGS,
    cpu_features: tuple[str, ...] | None = None,
    toolchain: Toolchain | None = None,
) -> str:
    """`cpu_features`: the host's ISA features (worker.build.host_cpu; None: this machine's), in the
    digest only when the flags make code for the compiling CPU (-march=native ...): such a library
    is not reused on a CPU that would have built it differently. Tests pass other feature sets.
    `toolchain`: the compilers (worker.build.toolchain; None: this machine's default ones)."""
    torch_version, torch_cuda = torch_versions()
    toolchain = toolchain or identify(cuda=bool(cuda_archs))
    h = LabelledHash()
    feed = h.feed
    feed("recipe", BUILD_RECIPE_VERSION)
    feed("cxx", toolchain.cxx_version)
    feed("nvcc", (toolchain.nvcc_version or "none") if cuda_archs else "none")
    feed("torch", torch_version)
    feed("cuda", str(torch_cuda) if cuda_archs else "none")
    feed("python", f"{sys.implementation.cache_tag}")
    feed("archs", ";".join(cuda_archs))
    feed("cflags", "\0".join(extra_cflags))
    feed("cuda_cflags", "\0".join(extra_cuda_cflags) if cuda_archs else "")
    if depends_on_host([*extra_cflags, *(extra_cuda_cflags if cuda_archs else ())]):
        feed("host_isa", isa_digest(cpu_features))
    for path in kernel_source_files(source_dir):
        feed("path", path.relative_to(source_dir).as_posix())
        feed("content", path.read_bytes())
    return h.hexdigest()


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
    cpu_features: tuple[str, ...] | None = None,
    compiler: str | None = None,
) -> BuildResult:
    """Compile `source_dir` (every .cpp, plus every .cu when building for CUDA) into the cache.

    `compiler`: the host compiler (a build variant's, e.g. clang++; None: the worker's $CXX, else
    c++). Which one, and its version, is part of the digest (worker.build.toolchain).

    `trusted`: whether this build may write to the shared build and compiler caches. An untrusted
    build (a verify run: a contributor's code) reads them and adds nothing, so it cannot plant an
    object that a later trusted build would take as a hit: it builds into a private folder, capped
    in size and deleted when its run ends (worker.build.cache)."""
    source_dir = Path(source_dir).resolve()
    if not source_dir.is_dir():
        raise FileNotFoundError(f"kernel source folder {source_dir} does not exist")
    cache_dir = Path(cache_dir or default_cache_dir()).resolve()
    archs = detect_cuda_archs() if cuda_archs is None else list(cuda_archs)
    try:
        toolchain = identify(compiler, cuda=bool(archs))
    except ToolchainError as error:
        return BuildResult(ok=False, digest="", error=f"the build's compiler: {error}", cuda_archs=archs)
    digest = build_digest(source_dir, cuda_archs=archs, extra_cflags=tuple(extra_cflags),
                          extra_cuda_cflags=tuple(extra_cuda_cflags), cpu_features=cpu_features, toolchain=toolchain)
    built = cached_build(cache_dir, digest, lambda staging: _compile(
        source_dir, staging, digest, archs, extra_cflags, extra_cuda_cflags, timeout_s, trusted=trusted,
        ccache_root=cache_dir, compiler=compiler), lock_timeout_s=timeout_s + 60, trusted=trusted)
    return built.model_copy(update={"toolchain": toolchain})


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
    ccache_root: Path,
    compiler: str | None = None,
) -> BuildResult:
    # Compile a private copy of exactly the digested files, at a path that is the same relative
    # to the staging folder in every build (see the module docstring: ccache hits across trees).
    box_root = staging / BOX_FOLDER
    box_root.mkdir()
    copy_root = box_root / "src"
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
        build_directory=str(box_root),
        cuda_archs=archs,
        extra_cflags=list(extra_cflags),
        extra_cuda_cflags=list(extra_cuda_cflags),
        ccache=str(ccache) if ccache else None,
    )
    stats_log = box_root / "ccache-stats.log"
    scratch = sandbox.Scratch(prefix="optdrift-build-scratch-")
    extra_env = {"TORCH_CUDA_ARCH_LIST": ";".join(archs)} if archs else {}
    if compiler:  # a build variant's host compiler, in place of the worker's $CXX
        extra_env["CXX"] = compiler
    if ccache:
        names_extension = any(EXTENSION_NAME_MACRO.encode() in p.read_bytes() for p in copied)
        extra_env.update(ccache_env(cache_dir=staging.parent, stats_log=stats_log,
                                    sources_name_extension=names_extension))
        # The shared compiler cache is the trusted builds' one, wherever this build's staging is.
        extra_env["CCACHE_DIR"] = str(ccache_root / "ccache")
        if not trusted:
            extra_env.update({"CCACHE_READONLY": "1", "CCACHE_TEMPDIR": str(scratch.path / "ccache-tmp")})
    # Submitted code is compiled here: allowlisted environment (no secrets), limits, no network.
    env = sandbox.sandbox_env(scratch=scratch.path, extra=extra_env)
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    base = BuildResult(ok=False, digest=digest, log_path=str(log_path), cuda_archs=archs)
    with open(log_path, "wb") as log, scratch:
        log.write(f"compile flags: host {shlex.join(extra_cflags)}"
                  f"{f'; nvcc {shlex.join(extra_cuda_cflags)}' if archs else ''}\n".encode())
        if depends_on_host([*extra_cflags, *(extra_cuda_cflags if archs else ())]):
            log.write(f"native flags: the library is built for this CPU ({isa_digest()}), "
                      "which is part of its digest\n".encode())
        log.flush()  # before the child writes to the same file
        if not ccache:
            reason = "OPTDRIFT_CCACHE turns it off" if os.environ.get("OPTDRIFT_CCACHE") else \
                "no ccache on PATH or beside this Python; set OPTDRIFT_CCACHE to one"
            log.write(f"compiler cache: none ({reason}); every file compiles\n".encode())
            log.flush()
        # In the sandbox the child sees its staging folder (the copied sources, the output) and,
        # read-only unless this build is trusted, the compiler cache; nothing else of the cache.
        ccache_dir = ccache_root / "ccache"
        if ccache:
            ccache_dir.mkdir(exist_ok=True)
        child = sandbox.popen(
            [sys.executable, "-P", "-m", "worker.build.child", spec.model_dump_json()],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            cwd=box_root if sandbox.available() else Path(__file__).resolve().parents[2],
            limits=sandbox.BUILD_LIMITS, guard_group=True, scratch=scratch.path,
            writable=[box_root] + ([ccache_dir] if ccache and trusted else []),
            # The ccache executable's own folder too: an operator's OPTDRIFT_CCACHE may live outside
            # the system folders the box shows (e.g. a ccache unpacked under the worker's home).
            readable=([ccache_dir] if ccache and not trusted else []) + ([Path(ccache).resolve().parent] if ccache else []),
        )
        try:
            # An untrusted build's folder and its scratch HOME/TMPDIR are measured while it runs
            # (worker.build.cache): the scratch is on the worker's disk too.
            with build_progress.watching(log_path):  # `check`'s progress lines (worker.build.progress)
                returncode = wait_bounded(child, timeout_s, output=[staging, scratch.path],
                                          max_bytes=None if trusted else verify_build_max_bytes())
        except OutputTooLarge as error:
            return base.model_copy(update={"error": str(error)})
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return base.model_copy(update={"error": f"the build took longer than {timeout_s:.0f} s and was stopped"})
    if ccache:
        stats = read_ccache_stats_log(box_root, stats_log.name, f"{ccache_version(str(ccache))} ({ccache})")
        base = base.model_copy(update={"compiler_cache": stats})
        with open(log_path, "a") as log:
            log.write(f"compiler cache: {stats.summary()}\n")
    log_tail.keep_tail(log_path, MAX_KEPT_LOG_BYTES)
    log_text = log_path.read_text(errors="replace")
    if returncode != 0:
        return base.model_copy(update={"error": compiler_message(log_text)})
    library = box_root / f"{name}.so"
    try:
        handle = boxfiles.open_file(box_root, library.name)
    except boxfiles.BoxFileRefused as refused:
        return base.model_copy(update={"error": f"the built library: {refused}"})
    if handle is None:
        return base.model_copy(update={"error": compiler_message(log_text)})
    os.close(handle)
    return base.model_copy(update={"ok": True, "library_path": str(library)})
