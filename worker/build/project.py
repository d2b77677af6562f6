"""Build a project's source tree the way its configuration says (service.core.project_config).

* `torch-extension`: the bundled csrc recipe, worker.build.build_extension on build.source_dir.
* `command`: the configured commands, run one after another in a private copy of the tree, with
  the CUDA architectures in the environment; the build's output is `build.library` (a file or a
  folder, relative to the tree), or the literal "installed" for a project loaded from the installed
  package (then the commands, if any, only check the tree, and the library is what is installed).

A command build is cached like an extension build: the key is the sha256 of every file of the
tree (path and bytes, `.git` excluded), the commands, the environment overrides, the CUDA
architectures, the host CPU's ISA features (worker.build.host_cpu: a tree's CMake may compile with
-march=native, and nothing outside the commands says whether it does) and the recipe version; the cache entry is the built copy of the tree, renamed into
place only when complete, under an flock that a killed build cannot leave behind (worker.build).
An untrusted build (a verify run) is never put there: it builds into a private folder, capped in
size and deleted when its run ends (worker.build.cache).
Commands are split with shlex and run without a shell, in their own process group, killed as a
whole at the timeout. Environment given to each command:
    OPTDRIFT_CUDA_ARCHS   "9.0;8.6" ("" for a CPU-only build)
    CUDAARCHS             "90;86"   (CMake's default for CMAKE_CUDA_ARCHITECTURES)
    TORCH_CUDA_ARCH_LIST  "9.0;8.6" (torch.utils.cpp_extension)
    OPTDRIFT_SOURCE_DIR   the folder the commands run in
    OPTDRIFT_PYTHON       the worker's interpreter (its folder is also first on PATH)
    CMAKE_C_COMPILER_LAUNCHER, CMAKE_CXX_COMPILER_LAUNCHER, CMAKE_CUDA_COMPILER_LAUNCHER
                          the ccache (worker.build.ccache), with its CCACHE_* settings; CMake
                          >= 3.17 takes them as the launcher defaults
plus build.env from the configuration: build knobs only (service.core.project_config
build_env_problem), applied inside the box after the identity drop, never to the launcher. The compiler cache is read-only for an untrusted build (a
verify run): the sandbox shows it read-only and CCACHE_READONLY is set. The build log says whether
ccache was used and its hits and misses (also `BuildResult.compiler_cache`). Build systems other
than CMake get no launcher (CC="ccache cc" breaks those that take CC as one executable); they can
name $CMAKE_CXX_COMPILER_LAUNCHER themselves.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from service.core.environments import BuildVariant
from service.core.compiler_flags import build_flags_problem
from service.core.project_config import ProjectConfig, ProjectConfigError, build_env_problem
from worker import sandbox
from worker.build import progress as build_progress
from worker.sandbox import log_tail
from worker.build.cache import (
    COMMAND_FOLDER, INSTALLED, MAX_KEPT_LOG_BYTES, BuildResult, LabelledHash, OutputTooLarge, cached_build,
    default_cache_dir, verify_build_max_bytes, wait_bounded,
)
from worker.build.ccache import CompilerCacheStats, ccache_env, ccache_version, find_ccache, read_ccache_stats_log
from worker.build.extension import (
    DEFAULT_CFLAGS, DEFAULT_CUDA_CFLAGS, build_extension, compiler_message, detect_cuda_archs,
)
from worker.build.host_cpu import isa_digest

COMMAND_RECIPE_VERSION = "2"  # 2: the host CPU's ISA features in the key; ccache as CMake's launcher
LAUNCHER_VARIABLES = ("CMAKE_C_COMPILER_LAUNCHER", "CMAKE_CXX_COMPILER_LAUNCHER", "CMAKE_CUDA_COMPILER_LAUNCHER")


def build_project(source_dir: Path, config: ProjectConfig, *, cache_dir: Path | None = None,
                  cuda_archs: list[str] | None = None, trusted: bool = True,
                  max_timeout_s: float | None = None, cpu_features: tuple[str, ...] | None = None,
                  variant: BuildVariant | None = None) -> BuildResult:
    """Build `source_dir` (an extracted commit) per `config.build`; never raises for a failed build.

    `trusted`: whether the build may write to the shared build and compiler caches; an untrusted
    one (a verify run) builds into a private folder deleted when its run ends (worker.build.cache).
    `cpu_features`: the host CPU's ISA features for the key of a host-dependent build (None: this
    machine's; tests pass others, worker.build.host_cpu).
    `max_timeout_s`: the operator's cap; the tree's build.timeout_s may ask for less, never more.
    `variant`: a build variant's compiler and flags (service/core/environments.py), after the tree's
    flags; in a command build, as CXX and CFLAGS/CXXFLAGS/CUDAFLAGS in its environment. Part of the
    digest either way."""
    # Checked again here, whatever built `config` and `variant` (model_construct skips validation):
    # a flag off the allow-list never reaches a compiler (service/core/compiler_flags.py).
    if (refused := build_flags_problem(config.build, variant)) is not None:
        return BuildResult(ok=False, digest="", error=refused)
    variant = variant or BuildVariant()
    source_dir = Path(source_dir).resolve()
    if variant.cuda_archs is not None:
        # A variant's architectures replace the machine's only where the machine builds for CUDA: a
        # CPU worker serving the same variant name builds what it always builds.
        if cuda_archs is None:
            cuda_archs = detect_cuda_archs()
        if cuda_archs:
            cuda_archs = list(variant.cuda_archs)
    if max_timeout_s is not None and config.build.timeout_s > max_timeout_s:
        config = config.model_copy(update={"build": config.build.model_copy(update={"timeout_s": max_timeout_s})})
    build = config.build
    if build.kind == "torch-extension":
        defines = build.define_flags()
        return build_extension(source_dir / build.source_dir, cache_dir=cache_dir, cuda_archs=cuda_archs,
                               extra_cflags=(*DEFAULT_CFLAGS, *build.cflags, *defines, *variant.cflags),
                               extra_cuda_cflags=(*DEFAULT_CUDA_CFLAGS, *build.cuda_cflags, *defines,
                                                  *variant.cuda_cflags),
                               timeout_s=build.timeout_s, trusted=trusted, cpu_features=cpu_features,
                               compiler=variant.compiler)
    return build_command(source_dir, config, cache_dir=cache_dir, cuda_archs=cuda_archs, trusted=trusted,
                         cpu_features=cpu_features, variant=variant)


def tree_files(tree: Path) -> list[Path]:
    return sorted((p for p in tree.rglob("*") if p.is_file() and ".git" not in p.relative_to(tree).parts),
                  key=lambda p: p.relative_to(tree).as_posix())


def command_digest(tree: Path, config: ProjectConfig, cuda_archs: list[str],
                   cpu_features: tuple[str, ...] | None = None, variant: BuildVariant | None = None) -> str:
    h = LabelledHash()
    feed = h.feed
    feed("recipe", COMMAND_RECIPE_VERSION)
    if variant is not None and variant != BuildVariant():  # the plain build's digest stays as it was
        feed("variant", json.dumps(variant.model_dump(mode="json"), sort_keys=True))
    feed("build", json.dumps(config.build.model_dump(mode="json"), sort_keys=True))
    feed("archs", ";".join(cuda_archs))
    feed("host_isa", isa_digest(cpu_features))
    for path in tree_files(tree):
        feed("path", path.relative_to(tree).as_posix())
        feed("content", path.read_bytes())
    return h.hexdigest()


def _variant_environment(env: dict[str, str], variant: BuildVariant) -> None:
    """A build variant in a command build's environment: its compiler as CXX, its flags after the
    tree's own (build.env) in CFLAGS/CXXFLAGS (CMake and make read them) and CUDAFLAGS."""
    if variant.compiler:
        env["CXX"] = variant.compiler
    for name, flags in (("CFLAGS", variant.cflags), ("CXXFLAGS", variant.cflags), ("CUDAFLAGS", variant.cuda_cflags)):
        if flags:
            env[name] = " ".join(filter(None, [env.get(name), *flags]))


def _environment(config: ProjectConfig, archs: list[str], workdir: Path, scratch: Path) -> dict[str, str]:
    # The sandbox's allowlisted environment (no database URL, broker URL or token), a scratch HOME.
    env = sandbox.sandbox_env(scratch=scratch)
    env.update({"OPTDRIFT_CUDA_ARCHS": ";".join(archs), "CUDAARCHS": ";".join(a.replace(".", "") for a in archs),
                "TORCH_CUDA_ARCH_LIST": ";".join(archs), "OPTDRIFT_SOURCE_DIR": str(workdir),
                # The worker's own interpreter (the one with torch) first: `python3` in a build
                # command must not be whatever Python comes first on the worker's PATH.
                "OPTDRIFT_PYTHON": sys.executable,
                "PATH": os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))})
    # The tree's build knobs, checked again where they are applied (the configuration was validated
    # when it was read; this is the last door before a child sees them, and sees them only inside
    # the box: worker.sandbox applies the environment after the identity drop).
    problems = [problem for name, value in config.build.env.items() if (problem := build_env_problem(name, value))]
    if problems:
        raise ProjectConfigError("build.env: " + "; ".join(problems))
    env.update(config.build.env)
    return env


def _compiler_cache(env: dict[str, str], config: ProjectConfig, staging: Path, scratch: Path, *,
                    trusted: bool, ccache_root: Path) -> tuple[Path | None, str]:
    """Route CMake's compiles through ccache: sets the launchers and CCACHE_* in `env`; returns the
    ccache (None: none) and the line the build log gets. `ccache_root`: the folder whose `ccache`
    is the shared compiler cache (the trusted command builds' folder, wherever `staging` is)."""
    ccache = find_ccache()  # FileNotFoundError: OPTDRIFT_CCACHE names one that does not run
    if ccache is None:
        reason = "OPTDRIFT_CCACHE turns it off" if os.environ.get("OPTDRIFT_CCACHE") else \
            "no ccache on PATH or beside this Python; set OPTDRIFT_CCACHE to one"
        return None, f"compiler cache: none ({reason})"
    # The cache root (staging.parent) is ccache's base_dir: every path in a compile command is
    # hashed relative to the build folder inside the staging copy, the same in every build.
    # The stats log goes to the scratch folder: the sandbox lets the commands write only the tree,
    # the scratch folder and (trusted) the compiler cache.
    env.update(ccache_env(cache_dir=staging.parent, stats_log=scratch / "ccache-stats.log"))
    env["CCACHE_DIR"] = str(ccache_root / "ccache")  # an untrusted build's staging is elsewhere
    if not trusted:
        env.update({"CCACHE_READONLY": "1", "CCACHE_TEMPDIR": str(scratch / "ccache-tmp")})
    for variable in LAUNCHER_VARIABLES:  # build.env may not name them (service.core.project_config)
        env[variable] = str(ccache)
    mode = "read-write" if trusted else "read-only (untrusted build)"
    return ccache, (f"compiler cache: {ccache_version(str(ccache))} ({ccache}), {mode}, as CMake's compiler "
                    f"launcher ({', '.join(LAUNCHER_VARIABLES)}); CCACHE_DIR={env['CCACHE_DIR']}")


def _run_commands(workdir: Path, config: ProjectConfig, archs: list[str], log_path: Path, *,
                  trusted: bool = True, ccache_root: Path | None = None,
                  variant: BuildVariant | None = None) -> tuple[str | None, CompilerCacheStats | None]:
    """Run the commands in `workdir`: (None on success, else what went wrong, for
    BuildResult.error; ccache's counts, None without ccache)."""
    deadline = time.monotonic() + config.build.timeout_s
    scratch = sandbox.Scratch(prefix="optdrift-command-build-scratch-")
    try:
        env = _environment(config, archs, workdir, scratch.path)
        _variant_environment(env, variant or BuildVariant())
    except ProjectConfigError as error:
        scratch.remove()
        with open(log_path, "a") as log:
            log.write(f"{error}\n")
        return str(error), None
    staging = log_path.parent
    try:
        ccache, cache_line = _compiler_cache(env, config, staging, scratch.path, trusted=trusted,
                                             ccache_root=ccache_root or staging.parent)
    except FileNotFoundError as error:
        scratch.remove()
        with open(log_path, "a") as log:
            log.write(f"{error}\n")
        return str(error), None
    ccache_dir = Path(env["CCACHE_DIR"]) if ccache else None
    if ccache_dir is not None:
        ccache_dir.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log, scratch:
        log.write(f"{cache_line}\n".encode())
        with build_progress.watching(log_path):  # `check`'s progress lines (worker.build.progress)
            error = _run_each(config, workdir, env, log, log_path, deadline, trusted=trusted,
                              ccache_dir=ccache_dir, scratch=scratch.path)
        stats = None
        if ccache is not None:
            stats_log = Path(env["CCACHE_STATSLOG"])  # in the scratch, which the box writes
            stats = read_ccache_stats_log(stats_log.parent, stats_log.name, f"{ccache_version(str(ccache))} ({ccache})")
            log.write(f"compiler cache: {stats.summary()}\n".encode())
    log_tail.keep_tail(log_path, MAX_KEPT_LOG_BYTES)
    return error, stats


def _run_each(config: ProjectConfig, workdir: Path, env: dict[str, str], log, log_path: Path,  # noqa: ANN001
              deadline: float, *, trusted: bool, ccache_dir: Path | None, scratch: Path) -> str | None:
    for command in config.build.commands:
        log.write(f"$ {command}\n".encode())
        log.flush()
        argv = shlex.split(command)
        try:
            # Submitted build commands run like csrc builds: own process group, limits, no network.
            child = sandbox.popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=subprocess.STDOUT, limits=sandbox.BUILD_LIMITS, guard_group=True,
                                  scratch=scratch,
                                  writable=[workdir] + ([ccache_dir] if ccache_dir and trusted else []),
                                  readable=[ccache_dir] if ccache_dir and not trusted else [])
        except OSError as error:
            return f"build command {command!r} could not start: {error}"
        try:
            # An untrusted build's folder and its scratch HOME/TMPDIR are measured while it runs
            # (worker.build.cache): the scratch is on the worker's disk too.
            code = wait_bounded(child, max(0.0, deadline - time.monotonic()), output=[workdir.parent, scratch],
                                max_bytes=None if trusted else verify_build_max_bytes())
        except OutputTooLarge as error:
            return f"{error} during {command!r}"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return (f"the build took longer than build.timeout_s = {config.build.timeout_s:g} s and was "
                    f"stopped during {command!r}")
        if code != 0:
            log_tail.keep_tail(log_path, MAX_KEPT_LOG_BYTES)
            tail = compiler_message(log_path.read_text(errors="replace"))
            return f"build command {command!r} exited with status {code}:\n{tail}"
    return None


def _resolves_inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def build_command(source_dir: Path, config: ProjectConfig, *, cache_dir: Path | None = None,
                  cuda_archs: list[str] | None = None, trusted: bool = True,
                  cpu_features: tuple[str, ...] | None = None, variant: BuildVariant | None = None) -> BuildResult:
    root = Path(cache_dir or default_cache_dir()).resolve()
    cache_dir = root / COMMAND_FOLDER
    archs = detect_cuda_archs() if cuda_archs is None else list(cuda_archs)
    digest = command_digest(source_dir, config, archs, cpu_features, variant)

    def make(staging: Path) -> BuildResult:
        workdir = staging / "tree"
        shutil.copytree(source_dir, workdir, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        log_path = staging / "build.log"
        log_path.write_bytes(b"")
        base = BuildResult(ok=False, digest=digest, log_path=str(log_path), cuda_archs=archs)
        error, stats = _run_commands(workdir, config, archs, log_path, trusted=trusted, ccache_root=cache_dir,
                                     variant=variant)
        base = base.model_copy(update={"compiler_cache": stats})
        library = config.build.library
        if error is None and library != INSTALLED and not (workdir / library).exists():
            error = (f"the build commands succeeded but build.library {library!r} does not exist in the tree; "
                     "check the path in optdrift.toml")
        elif error is None and library != INSTALLED and not _resolves_inside(workdir / library, workdir):
            # The commands may have made it a link: the kernel host is shown this path, so a link out of
            # the tree would become a bind of a host folder.
            error = (f"build.library {library!r} leads out of the tree (a link made by the build); the "
                     "library must be a file or folder inside the tree")
        if error is not None:
            return base.model_copy(update={"error": error})
        return base.model_copy(update={"ok": True, "library_path": INSTALLED if library == INSTALLED
                                       else str(workdir / library)})

    return cached_build(cache_dir, digest, make, lock_timeout_s=config.build.timeout_s + 60, trusted=trusted,
                        root=root)
