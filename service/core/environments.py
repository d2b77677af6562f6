"""Environments and their build variants: the names runs and queues carry, and what a variant
changes in a build.

An environment is a class of machine a worker serves (`cpu`, `gpu.sm90`): its runs wait on that
queue and are compared with runs of the same environment. A *build variant* is the same machine
with another toolchain setting: another host compiler (clang beside gcc), other compiler flags
(`-ffp-contract=off`, `-O2`, `-mfma`), nvcc's `--fmad=true`. It is written `<environment>+<variant>`
(`cpu+clang`, `gpu.sm90+fmad`): a project that registers it gets a run per commit there, a baseline
line of its own, and `optdrift compare --env cpu --env cpu+clang` says what the toolchain moved.

Variants are the operator's (OPTDRIFT_BUILD_VARIANTS, service/settings.py), never a tree's: a
variant names a compiler the worker runs, and every field a tree carries is attacker input. A
worker serves the variants it is configured with, on its own environment's machine.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.core.compiler_flags import refused_flag_message

# No `--` anywhere (a hyphen is followed by another character or ends the name): a variant's
# queue is written `cpu--fma` (service/broker/queueing.py). No look-ahead: pydantic's regex
# engine has none.
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._]|-[A-Za-z0-9._])*-?"
ENVIRONMENT_PATTERN = rf"^{_NAME}(?:\+{_NAME})?$"
VARIANT_NAME = re.compile(rf"^{_NAME}$")
_ARCH = re.compile(r"^[0-9]{1,2}\.[0-9][af]?(\+PTX)?$")


def split(environment: str) -> tuple[str, str | None]:
    """('cpu', 'clang') for 'cpu+clang'; ('cpu', None) for 'cpu'."""
    base, _, variant = environment.partition("+")
    return base, variant or None


class BuildVariant(BaseModel):
    """What a variant changes in a torch-extension build (and, as CXX/CXXFLAGS/CFLAGS in the build's
    environment, in a command build)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    compiler: str | None = Field(None, description="the host C++ compiler (a name on the worker's PATH or an "
                                                   "absolute path), e.g. clang++; None: the worker's own")
    cflags: tuple[str, ...] = Field((), description="added to the host compiler's flags, after the tree's")
    cuda_cflags: tuple[str, ...] = Field((), description="added to nvcc's flags, after the tree's")
    cuda_archs: tuple[str, ...] | None = Field(None, description="the CUDA architectures to build for, in place of "
                                                                 "the worker's (TORCH_CUDA_ARCH_LIST entries: "
                                                                 "'9.0', '8.0+PTX'); on a machine that builds "
                                                                 "for CUDA only. ('8.0+PTX',) on a Hopper card "
                                                                 "runs the PTX through the driver's JIT")

    @field_validator("cuda_archs")
    @classmethod
    def _arch_entries(cls, archs: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if archs is not None:
            if not archs:
                raise ValueError("build variant cuda_archs: at least one architecture, or leave it out")
            for arch in archs:
                if not _ARCH.match(arch):
                    raise ValueError(f"build variant architecture {arch!r}: major.minor with an optional "
                                     "+PTX, as TORCH_CUDA_ARCH_LIST writes it ('9.0', '8.0+PTX')")
        return archs

    @field_validator("cflags", "cuda_cflags")
    @classmethod
    def _allowed_flags(cls, flags: tuple[str, ...], info) -> tuple[str, ...]:  # noqa: ANN001
        # The trees' allow-list of flag shapes (service/core/compiler_flags.py): the operator writes
        # variants, but a typo or a pasted flag here would reach every build of every project on the
        # worker, so a variant may carry no flag a tree may not.
        message = refused_flag_message(flags, f"build variant {info.field_name}",
                                       "host" if info.field_name == "cflags" else "nvcc")
        if message is not None:
            raise ValueError(f"{message} (a variant carries compiler options only, not a file, plugin or "
                             "response file)")
        return flags

    @field_validator("compiler")
    @classmethod
    def _compiler_is_one_word(cls, compiler: str | None) -> str | None:
        if compiler is not None and (not compiler or any(c.isspace() for c in compiler)):
            raise ValueError(f"build variant compiler {compiler!r}: one executable, a name or an absolute path")
        return compiler


def check_variants(variants: dict[str, BuildVariant]) -> dict[str, BuildVariant]:
    for name in variants:
        if not VARIANT_NAME.match(name):
            raise ValueError(f"build variant name {name!r}: letters, digits and . _ - (it is written cpu+{name})")
    return variants
