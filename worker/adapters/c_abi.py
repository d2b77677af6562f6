"""What every adapter of a library with a plain C ABI does the same way (tinyopt, capiopt): load the
shared library with ctypes and declare its signatures, hand it tensors as float pointers, and turn a
non-zero return code into a kernel error. An adapter keeps what is its own: the signatures, the
states per optimizer, the calls, and what it cannot run.

Such a library steps one tensor per call, so its adapters keep `HandedOverStates`' group
lifecycle (docs/PROJECTS.md "The group lifecycle"): a layout case is the user's loop, one call per
tensor with its group's hyperparameters, sharing nothing between tensors. A C library with a
multi-tensor entry point (one call over arrays of pointers, a step counter of its own) overrides
`open_group` / `step_group` to call it once per step, and declares any state it keeps without a
getter (`unreadable_state`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from service.core.results import CaseSpec
from worker.adapters.base import AdapterError

F32P, I64, F32 = ctypes.POINTER(ctypes.c_float), ctypes.c_int64, ctypes.c_float


def float_pointer(tensor: torch.Tensor, project: str):  # noqa: ANN201
    """The tensor's data as `float *`: the C functions walk n contiguous floats from there."""
    if tensor.dtype != torch.float32 or not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError(f"{project} takes contiguous float32 CPU tensors, got {tensor.dtype} on "
                         f"{tensor.device} (contiguous: {tensor.is_contiguous()})")
    return ctypes.cast(tensor.data_ptr(), F32P)


def load_library(library: str, project: str, signatures: Mapping[str, Sequence]) -> tuple[ctypes.CDLL, Path]:
    """The build's shared library with every function of `signatures` declared (all return int);
    AdapterError saying what is wrong and what to check when it is missing or not this project's."""
    path = Path(library).resolve()
    if not path.is_file():
        raise AdapterError(f"{project} library {path} does not exist; check build.library in optdrift.toml")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:
        raise AdapterError(f"cannot load {project} library {path}: {error}") from error
    for symbol, argtypes in signatures.items():
        function = getattr(lib, symbol, None)
        if function is None:
            raise AdapterError(f"{path} does not export {symbol}; is it a {project} build?")
        function.argtypes, function.restype = list(argtypes), ctypes.c_int
    return lib, path


def fp32_states(case: CaseSpec, param: torch.Tensor, states: Mapping[str, Sequence[str]]) -> dict[str, torch.Tensor]:
    """Zeroed float32 states of the case's optimizer, named as the library's calls take them."""
    return {name: torch.zeros_like(param, dtype=torch.float32) for name in states[case.optimizer]}


def check_code(code: int, project: str, case: CaseSpec) -> None:
    if code != 0:
        raise RuntimeError(f"{project} {case.optimizer} returned error code {code} for case {case.case_id}")
