"""Which compilers a build uses, by name and version: part of the build's digest and of its result.

Two builds of one tree with the same flags but another host compiler (gcc 12 or clang 14, or gcc
12 and 13) or another nvcc can give other bits: a compiler decides whether `a*b+c` becomes one
fused multiply-add, how it orders a reduction, which vector instructions it uses. So the digest of a
build covers the compilers' identities (what `--version` says, which names the vendor, version and
distribution build), a cache shared by workers with different compilers never hands one's library to
the other, and a run records the toolchain that made its kernels (docs/ENVIRONMENTS.md).

The host compiler is the one torch.utils.cpp_extension calls: `CXX` (the worker's environment or a
build variant's), else `c++` on PATH; nvcc is CUDA_HOME's (or CUDA_PATH's, or the one on PATH).
Nothing here imports torch.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess

from pydantic import BaseModel, ConfigDict

COMPILER_CACHES = ("ccache", "sccache")
VERSION_TIMEOUT_S = 30.0


class Toolchain(BaseModel):
    model_config = ConfigDict(frozen=True)

    cxx: str  # the host compiler as called (after PATH lookup, links resolved)
    cxx_version: str  # the first line of its `--version`
    nvcc: str | None = None  # None: a CPU-only build
    nvcc_version: str | None = None  # nvcc's "release X.Y, VX.Y.Z" line

    def describe(self) -> str:
        """One line for logs and pages: 'g++ 12.2.0 (Debian ...); nvcc release 13.0, V13.0.88'."""
        return self.cxx_version + (f"; nvcc {self.nvcc_version}" if self.nvcc_version else "")


def host_compiler_command(cxx: str | None = None) -> list[str]:
    """The host compiler's command line: `cxx`, else $CXX, else c++; a compiler cache in front of it
    (CXX="ccache c++") is not the compiler."""
    words = shlex.split(cxx or os.environ.get("CXX") or "c++")
    if len(words) > 1 and os.path.basename(words[0]) in COMPILER_CACHES:
        words = words[1:]
    return words


def nvcc_path() -> str | None:
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(variable)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


class ToolchainError(RuntimeError):
    """A compiler that cannot be found or does not answer `--version`."""


def _resolved(command: str) -> str:
    found = shutil.which(command)
    if found is None:
        raise ToolchainError(f"the compiler {command!r} is not on PATH")
    return os.path.realpath(found)


@functools.lru_cache(maxsize=32)
def _version_line(path: str, mtime_ns: int, *, nvcc: bool) -> str:  # noqa: ARG001 - mtime keys the cache
    try:
        answer = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S,
                                stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ToolchainError(f"{path} --version did not answer: {error}") from None
    lines = [line.strip() for line in answer.stdout.splitlines() if line.strip()]
    if answer.returncode != 0 or not lines:
        raise ToolchainError(f"{path} --version failed (exit {answer.returncode})")
    if nvcc:
        release = [line for line in lines if "release" in line]
        return release[-1] if release else lines[-1]
    return lines[0]


def _version(path: str, *, nvcc: bool) -> str:
    return _version_line(path, os.stat(path).st_mtime_ns, nvcc=nvcc)


def identify(cxx: str | None = None, *, cuda: bool = False) -> Toolchain:
    """The toolchain a torch-extension build with host compiler `cxx` (None: $CXX, else c++) uses;
    nvcc too when it builds for CUDA."""
    cxx_path = _resolved(host_compiler_command(cxx)[0])
    nvcc = nvcc_path() if cuda else None
    return Toolchain(cxx=cxx_path, cxx_version=_version(cxx_path, nvcc=False),
                     nvcc=os.path.realpath(nvcc) if nvcc else None,
                     nvcc_version=_version(os.path.realpath(nvcc), nvcc=True) if nvcc else None)
