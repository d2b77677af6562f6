"""Compile checks of the catalogue's CUDA mutants with nvcc, on a machine without a GPU.

A mutant of a CUDA source must still compile, or the H200 run (bench/gpu/sensitivity_cuda.sh)
would report a build failure instead of a catch. One nvcc compile per CUDA translation unit the
patch changes: a csrc/cuda/*.cu file itself, and both 32-bit units for cuda/apply_cuda.cuh. The
shared headers (optimizer_math.h, quant_map.h) are compiled by every CPU build of the catalogue
run, in plain C++ with no device-only construct; `--with-shared-headers` also nvcc-compiles their
mutants (through cuda/blockwise8.cu, which instantiates all six rules and the 8-bit path), at a
minute or more per mutant on this machine.

The flags are tests/worker/build/test_cuda_compiles.py's (sm_90, this torch's headers, the CPU wheel's missing
CMake macro header switched off); the recorded results live in catalogue/cuda_compile_checks.json.

    python -m worker.sensitivity.cuda_compile [--only ID ...]   # writes the record
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from worker.sensitivity.catalogue import DEFAULT_CATALOGUE, Mutant, load_catalogue, mutant_tree, select

RECORD = DEFAULT_CATALOGUE / "cuda_compile_checks.json"
BUNDLED_CSRC = Path(__file__).resolve().parents[2] / "csrc"
_SHARED_HEADER_UNIT = "cuda/blockwise8.cu"
_APPLY_UNITS = ("cuda/two_state.cu", "cuda/one_state.cu")


def nvcc_units(mutant: Mutant, *, shared_headers: bool = False) -> list[str]:
    """The CUDA translation units (relative to csrc) that compile-check `mutant`; [] when none."""
    units: list[str] = []
    for path in mutant.touched_files:
        if path.endswith(".cu"):
            units.append(path)
        elif path == "cuda/apply_cuda.cuh":
            units.extend(_APPLY_UNITS)
        elif path == "multi_tensor.h":  # the multi-tensor ops' host logic; its one CUDA unit
            units.append("cuda/multi_tensor.cu")
        elif shared_headers and path in ("optimizer_math.h", "quant_map.h"):
            units.append(_SHARED_HEADER_UNIT)
    return sorted(set(units))


def nvcc_command(source: Path, output: Path) -> list[str]:
    import torch
    from torch.utils import cpp_extension

    include_dirs = cpp_extension.include_paths()
    flags = [
        shutil.which("nvcc") or "nvcc", "-c", str(source), "-o", str(output), "-std=c++20",
        "-gencode", "arch=compute_90,code=sm_90", "-Xcompiler", "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        "-Werror", "cross-execution-space-call", "--fmad=false",
        *cpp_extension.COMMON_NVCC_FLAGS, *(f"-I{directory}" for directory in include_dirs),
    ]
    if not (Path(include_dirs[0]) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():
        flags.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    return flags


def compile_check(mutant: Mutant, source: Path = BUNDLED_CSRC, *, units: list[str] | None = None) -> dict:
    """Compile `mutant`'s CUDA units (all of nvcc_units, or `units`): {"ok", "units", "seconds", "error"}."""
    units = nvcc_units(mutant) if units is None else units
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="optdrift-nvcc-") as work:
        tree = mutant_tree(mutant, source, Path(work) / "csrc")
        for unit in units:
            done = subprocess.run(nvcc_command(tree / unit, Path(work) / "unit.o"),
                                  capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                return {"ok": False, "units": units, "seconds": round(time.monotonic() - started, 1),
                        "error": f"{unit}: {done.stderr[-3000:]}"}
    return {"ok": True, "units": units, "seconds": round(time.monotonic() - started, 1), "error": None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="classes or ids (default: every mutant of a CUDA source)")
    parser.add_argument("--with-shared-headers", action="store_true",
                        help="also the mutants of optimizer_math.h and quant_map.h (slow)")
    args = parser.parse_args(argv)
    if shutil.which("nvcc") is None:
        print("error: nvcc is not on PATH; install the CUDA toolkit to compile-check the CUDA mutants", file=sys.stderr)
        return 2
    record = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    failed = 0
    for mutant in select(load_catalogue(), args.only):
        units = nvcc_units(mutant, shared_headers=args.with_shared_headers)
        if not units:
            continue
        result = compile_check(mutant, units=units)
        # The patch's hash says which version of the patch the record is about.
        record[mutant.id] = {**result, "patch_sha256": mutant.patch_sha256}
        failed += not result["ok"]
        print(f"{mutant.id}: {'ok' if result['ok'] else 'FAILED'} ({', '.join(result['units'])}, {result['seconds']} s)",
              flush=True)
        RECORD.write_text(json.dumps(dict(sorted(record.items())), indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
