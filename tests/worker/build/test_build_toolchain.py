"""worker/build/toolchain.py: a build's compilers by name and version, in its digest and its result.

A library built by one compiler must never be handed out for a build by another (a shared cache
across workers, or a build variant with clang beside gcc): their digests differ. The stand-in
"clang" here is a script that answers `--version` as another compiler would and compiles with the
machine's g++; the digest can only tell compilers apart by what they say they are."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from worker.build.extension import build_digest, build_extension
from worker.build.toolchain import ToolchainError, host_compiler_command, identify

CSRC = Path(__file__).resolve().parents[3] / "csrc"


def _stand_in(folder: Path, version: str) -> Path:
    script = folder / "clang-standin"
    script.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then echo "{version}"; exit 0; fi\nexec g++ "$@"\n')
    script.chmod(0o755)
    return script


def test_the_default_compiler_is_named_as_it_names_itself() -> None:
    toolchain = identify()
    # c++ is a link (Debian's alternatives): the real compiler is named, with its version.
    assert os.path.isfile(toolchain.cxx) and not os.path.islink(toolchain.cxx)
    said = subprocess.run([toolchain.cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    assert toolchain.cxx_version == said.strip()
    assert toolchain.nvcc is None and toolchain.nvcc_version is None  # a CPU build asks no nvcc


def test_another_compiler_gives_another_digest_and_the_same_one_the_same(tmp_path: Path) -> None:
    standin = _stand_in(tmp_path, "Debian clang version 14.0.6 (stand-in)")
    clang = identify(str(standin))
    assert clang.cxx_version == "Debian clang version 14.0.6 (stand-in)"
    gcc_digest = build_digest(CSRC, cuda_archs=[], toolchain=identify())
    assert build_digest(CSRC, cuda_archs=[], toolchain=identify()) == gcc_digest
    assert build_digest(CSRC, cuda_archs=[], toolchain=clang) != gcc_digest
    # Another version of the same compiler is another compiler too.
    (tmp_path / "newer").mkdir()
    newer = identify(str(_stand_in(tmp_path / "newer", "Debian clang version 15.0.0 (stand-in)")))
    assert build_digest(CSRC, cuda_archs=[], toolchain=newer) not in (gcc_digest, build_digest(
        CSRC, cuda_archs=[], toolchain=clang))


def test_a_compiler_cache_in_front_is_not_the_compiler() -> None:
    assert host_compiler_command("ccache g++ -m64") == ["g++", "-m64"]
    assert host_compiler_command("/usr/lib/ccache/c++") == ["/usr/lib/ccache/c++"]  # a path, not a prefix


def test_a_missing_compiler_is_a_failed_build_that_says_so(tmp_path: Path) -> None:
    with pytest.raises(ToolchainError, match="not on PATH"):
        identify("no-such-compiler-here")
    built = build_extension(CSRC, cache_dir=tmp_path / "cache", cuda_archs=[], compiler="no-such-compiler-here")
    assert not built.ok and "the build's compiler: the compiler 'no-such-compiler-here' is not on PATH" in built.error


@pytest.mark.slow
def test_a_build_records_the_toolchain_that_made_it(build_cache_dir: Path) -> None:
    built = build_extension(CSRC, cache_dir=build_cache_dir, cuda_archs=[])
    assert built.ok, built.error
    assert built.toolchain == identify()
    assert built.digest == build_digest(CSRC, cuda_archs=[], toolchain=identify())
