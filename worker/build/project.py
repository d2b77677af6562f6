"""Build a project's source tree the way its configuration says (service.domain.project_config).

* `torch-extension`: the bundled csrc recipe, worker.build.build_extension on build.source_dir.
* `command`: the configured commands, run one after another in a private copy of the tree, with
  the CUDA architectures in the environment; the build's output is `build.library` (a file or a
  folder, relative to the tree), or the literal "installed" for a project loaded from the installed
  package (then the commands, if any, only check the tree, and the library is what is installed).

A command build is cached like an extension build: the key is the sha256 of every file of the
tree (path and bytes, `.git` excluded), the commands, the environment overrides, the CUDA
architectures and the recipe version; the cache entry is the built copy of the tree, renamed into
place only when complete, under an flock that a killed build cannot leave behind (worker.build).
Commands are split with shlex and run without a shell, in their own process group, killed as a
whole at the timeout. Environment given to each command:
    OPTDRIFT_CUDA_ARCHS   "9.0;8.6" ("" for a CPU-only build)
    CUDAARCHS             "90;86"   (CMake's default for CMAKE_CUDA_ARCHITECTURES)
    TORCH_CUDA_ARCH_LIST  "9.0;8.6" (torch.utils.cpp_extension)
    OPTDRIFT_SOURCE_DIR   the folder the commands run in
    OPTDRIFT_PYTHON       the worker's interpreter (its folder is also first on PATH)
plus build.env from the configuration.
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

from service.domain.project_config import ProjectConfig
from worker import sandbox
from worker.sandbox import log_tail
from worker.build.cache import INSTALLED, MAX_KEPT_LOG_BYTES, BuildResult, LabelledHash, cached_build, default_cache_dir
from worker.build.extension import build_extension, compiler_message, detect_cuda_archs

COMMAND_RECIPE_VERSION = "1"


def build_project(source_dir: Path, config: ProjectConfig, *, cache_dir: Path | None = None,
                  cuda_archs: list[str] | None = None, trusted: bool = True,
                  max_timeout_s: float | None = None) -> BuildResult:
    """Build `source_dir` (an extracted commit) per `config.build`; never raises for a failed build.

    `trusted`: whether the build may write to the shared compiler cache (worker.build).
    `max_timeout_s`: the operator's cap; the tree's build.timeout_s may ask for less, never more."""
    source_dir = Path(source_dir).resolve()
    if max_timeout_s is not None and config.build.timeout_s > max_timeout_s:
        config = config.model_copy(update={"build": config.build.model_copy(update={"timeout_s": max_timeout_s})})
    build = config.build
    if build.kind == "torch-extension":
        return build_extension(source_dir / build.source_dir, cache_dir=cache_dir, cuda_archs=cuda_archs,
                               timeout_s=build.timeout_s, trusted=trusted)
    return build_command(source_dir, config, cache_dir=cache_dir, cuda_archs=cuda_archs)


def tree_files(tree: Path) -> list[Path]:
    return sorted((p for p in tree.rglob("*") if p.is_file() and ".git" not in p.relative_to(tree).parts),
                  key=lambda p: p.relative_to(tree).as_posix())


def command_digest(tree: Path, config: ProjectConfig, cuda_archs: list[str]) -> str:
    h = LabelledHash()
    feed = h.feed
    feed("recipe", COMMAND_RECIPE_VERSION)
    feed("build", json.dumps(config.build.model_dump(mode="json"), sort_keys=True))
    feed("archs", ";".join(cuda_archs))
    for path in tree_files(tree):
        feed("path", path.relative_to(tree).as_posix())
        feed("content", path.read_bytes())
    return h.hexdigest()


def _environment(config: ProjectConfig, archs: list[str], workdir: Path, scratch: Path) -> dict[str, str]:
    # The sandbox's allowlisted environment (no database URL, broker URL or token), a scratch HOME.
    env = sandbox.sandbox_env(scratch=scratch)
    env.update({"OPTDRIFT_CUDA_ARCHS": ";".join(archs), "CUDAARCHS": ";".join(a.replace(".", "") for a in archs),
                "TORCH_CUDA_ARCH_LIST": ";".join(archs), "OPTDRIFT_SOURCE_DIR": str(workdir),
                # The worker's own interpreter (the one with torch) first: `python3` in a build
                # command must not be whatever Python comes first on the worker's PATH.
                "OPTDRIFT_PYTHON": sys.executable,
                "PATH": os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))})
    env.update(config.build.env)
    return env


def _run_commands(workdir: Path, config: ProjectConfig, archs: list[str], log_path: Path) -> str | None:
    """Run the commands in `workdir`; None on success, else what went wrong (for BuildResult.error)."""
    deadline = time.monotonic() + config.build.timeout_s
    scratch = sandbox.Scratch(prefix="optdrift-command-build-scratch-")
    env = _environment(config, archs, workdir, scratch.path)
    with open(log_path, "ab") as log, scratch:
        for command in config.build.commands:
            log.write(f"$ {command}\n".encode())
            log.flush()
            argv = shlex.split(command)
            try:
                # Submitted build commands run like csrc builds: own process group, limits, no network.
                child = sandbox.popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, limits=sandbox.BUILD_LIMITS, guard_group=True,
                                      writable=[workdir])
            except OSError as error:
                return f"build command {command!r} could not start: {error}"
            try:
                code = child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                return (f"the build took longer than build.timeout_s = {config.build.timeout_s:g} s and was "
                        f"stopped during {command!r}")
            if code != 0:
                log_tail.keep_tail(log_path, MAX_KEPT_LOG_BYTES)
                tail = compiler_message(log_path.read_text(errors="replace"))
                return f"build command {command!r} exited with status {code}:\n{tail}"
    log_tail.keep_tail(log_path, MAX_KEPT_LOG_BYTES)
    return None


def build_command(source_dir: Path, config: ProjectConfig, *, cache_dir: Path | None = None,
                  cuda_archs: list[str] | None = None) -> BuildResult:
    cache_dir = Path(cache_dir or default_cache_dir()).resolve() / "command"
    archs = detect_cuda_archs() if cuda_archs is None else list(cuda_archs)
    digest = command_digest(source_dir, config, archs)

    def make(staging: Path) -> BuildResult:
        workdir = staging / "tree"
        shutil.copytree(source_dir, workdir, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        log_path = staging / "build.log"
        log_path.write_bytes(b"")
        base = BuildResult(ok=False, digest=digest, log_path=str(log_path), cuda_archs=archs)
        error = _run_commands(workdir, config, archs, log_path)
        library = config.build.library
        if error is None and library != INSTALLED and not (workdir / library).exists():
            error = (f"the build commands succeeded but build.library {library!r} does not exist in the tree; "
                     "check the path in optdrift.toml")
        if error is not None:
            return base.model_copy(update={"error": error})
        return base.model_copy(update={"ok": True, "library_path": INSTALLED if library == INSTALLED
                                       else str(workdir / library)})

    return cached_build(cache_dir, digest, make, lock_timeout_s=config.build.timeout_s + 60)
