"""Issue 47: a release that refuses this machine's toolchain in its build files is "not buildable
here", a distinct outcome (exit 8 with a warning), not `broken` (exit 3).

The recognition is conservative (worker/build/refusal.py): the refusal must be the build's first
error. The end-to-end test runs a real CMake configure that refuses as bitsandbytes 0.47.0's
CMakeLists.txt refuses CUDA 13, through `optdrift check` and through the worker's run error.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from service.core import not_buildable
from worker.build.refusal import is_refusal, toolchain_refusal

REPO_ROOT = Path(__file__).resolve().parents[3]

CMAKE_REFUSAL = """\
compiler cache: none (OPTDRIFT_CCACHE=0); every file compiles
$ cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCOMPUTE_BACKEND=cuda -Wno-error=dev
-- The CXX compiler identification is GNU 13.3.0
-- The CUDA compiler identification is NVIDIA 13.0.48
-- Configuring bitsandbytes (Backend: cuda)
CMake Error at CMakeLists.txt:112 (message):
  CUDA Version > 12 is not supported


-- Configuring incomplete, errors occurred!
"""
NVCC_HOST_COMPILER = """\
[1/4] c++ -MMD -MF adam.o.d -DTORCH_EXTENSION_NAME=k -Wno-error=deprecated -c adam.cpp -o adam.o
FAILED: adam.cuda.o
/usr/local/cuda/bin/nvcc --generate-dependencies-with-compile -c adam.cu -o adam.cuda.o -Wno-error=x
In file included from /usr/local/cuda/include/cuda_runtime.h:82,
                 from <command-line>:
/usr/local/cuda/include/crt/host_config.h:143:2: error: #error -- unsupported GNU version! gcc versions later than 13 are not supported! The nvcc flag '-allow-unsupported-compiler' can be used to override this version check
  143 | #error -- unsupported GNU version! gcc versions later than 13 are not supported!
ninja: build stopped: subcommand failed.
"""
SETUP_REFUSAL = """\
running build_ext
Traceback (most recent call last):
  File "setup.py", line 40, in <module>
    raise RuntimeError(f"CUDA version {cuda} is not supported; this release requires CUDA < 13")
RuntimeError: CUDA version 13.0 is not supported; this release requires CUDA < 13
"""
# A build that fails for its own reasons stays a failure, whatever it printed on the way.
COMPILE_ERROR_FIRST = """\
[2/4] /usr/local/cuda/bin/nvcc -c lion.cu -o lion.cuda.o
FAILED: lion.cuda.o
lion.cu(41): error: identifier "beta3" is undefined
1 error detected in the compilation of "lion.cu".
/usr/local/cuda/include/crt/host_config.h:143:2: error: #error -- unsupported GNU version!
"""
REFUSAL_AS_WARNING = """\
CMake Warning at CMakeLists.txt:20 (message):
  CUDA version 13.0 is not supported upstream yet; building anyway
src/adam.cpp:12:5: error: 'foo' was not declared in this scope
"""


@pytest.mark.parametrize(("log", "line"), [
    (CMAKE_REFUSAL, "CUDA Version > 12 is not supported"),
    (NVCC_HOST_COMPILER, "/usr/local/cuda/include/crt/host_config.h:143:2: error: #error -- unsupported GNU "
                         "version! gcc versions later than 13 are not supported! The nvcc flag "
                         "'-allow-unsupported-compiler' can be used to override this version check"),
    (SETUP_REFUSAL, "RuntimeError: CUDA version 13.0 is not supported; this release requires CUDA < 13"),
])
def test_a_refusal_of_the_toolchain_is_found(log: str, line: str) -> None:
    assert toolchain_refusal(log) == line


@pytest.mark.parametrize("log", [COMPILE_ERROR_FIRST, REFUSAL_AS_WARNING, "", "[1/1] c++ -c a.cpp\n",
                                 "error: linker command failed with exit code 1\n"])
def test_other_failures_are_not_refusals(log: str) -> None:
    assert toolchain_refusal(log) is None


@pytest.mark.parametrize("line", ["Unsupported CUDA version 13.0", "CUDA version 13.0 not supported",
                                  "this release requires CUDA < 13", "#error CUDA 13 is not supported",
                                  "error: unsupported GNU version", "torch 2.9 is not yet supported"])
def test_the_documented_shapes(line: str) -> None:
    assert is_refusal(line)


@pytest.mark.parametrize("line", ["warning: unsupported compiler flag -fno-plt ignored",
                                  "error: 'x' was not declared", "the CUDA stream is supported"])
def test_what_is_not_a_refusal(line: str) -> None:
    assert not is_refusal(line)


CMAKELISTS = """\
cmake_minimum_required(VERSION 3.18)
project(refuses LANGUAGES CXX)
# As bitsandbytes 0.47.0 refuses CUDA 13: the release's build files say what they do not support.
set(FOUND_CUDA_VERSION "13.0")
if(FOUND_CUDA_VERSION VERSION_GREATER_EQUAL "13.0")
  message(FATAL_ERROR "CUDA Version > 12 is not supported")
endif()
"""


@pytest.fixture
def refusing_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "release-0.47.0"
    shutil.copytree(REPO_ROOT / "tests" / "fixtures" / "capi_project", tree,
                    ignore=shutil.ignore_patterns("commits", "build"))
    (tree / "CMakeLists.txt").write_text(CMAKELISTS)
    return tree


def test_check_says_not_buildable_and_exits_8(refusing_tree: Path, tmp_path: Path, build_cache_dir: Path,  # noqa: ANN001
                                              capsys) -> None:  # noqa: ANN001
    from service.cli.check import EXIT_NOT_BUILDABLE, run_check

    out = tmp_path / "check.json"
    code = run_check(refusing_tree, None, device="cpu", cache_dir=build_cache_dir, json_out=out)
    captured = capsys.readouterr()
    assert code == EXIT_NOT_BUILDABLE == 8, captured
    assert "warning: " in captured.err and "not buildable in this environment (cpu: torch " in captured.err
    assert captured.err.rstrip().endswith("CUDA Version > 12 is not supported"), captured.err
    assert "broken" not in captured.out + captured.err
    document = json.loads(out.read_text())
    assert document["not_buildable"][0].endswith(": CUDA Version > 12 is not supported")


def test_a_baseline_that_refuses_says_so_too(refusing_tree: Path, build_cache_dir: Path, capsys) -> None:  # noqa: ANN001
    from service.cli.check import EXIT_NOT_BUILDABLE, run_check

    code = run_check(REPO_ROOT / "tests" / "fixtures" / "capi_project", refusing_tree, device="cpu",
                     cache_dir=build_cache_dir)
    assert code == EXIT_NOT_BUILDABLE
    assert f"--baseline {refusing_tree}: not buildable in" in capsys.readouterr().err


def test_the_worker_fails_the_run_with_the_sentence_and_the_cli_exits_8(refusing_tree: Path,  # noqa: ANN001
                                                                         build_cache_dir: Path) -> None:
    """The worker's run error (worker/jobs/run.py) is the sentence; `submit --wait` reads it as 8."""
    from service.cli.main import run_exit_code
    from worker import pipeline
    from worker.build.refusal import refusal_of

    job = pipeline.prepare(refusing_tree)
    built = pipeline.build(job, pipeline.Policy(device="cpu", cache_dir=build_cache_dir, cuda_archs=[]))
    assert not built.ok
    error = not_buildable.sentence("gpu.sm90", refusal_of(built))
    assert error == "not buildable in gpu.sm90: CUDA Version > 12 is not supported"
    assert run_exit_code({"status": "failed", "error": error, "verdict": None}) == 8
    assert run_exit_code({"status": "failed", "error": "build failed: adam.cu(3): error: x", "verdict": None}) == 3
