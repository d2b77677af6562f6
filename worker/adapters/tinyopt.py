"""tinyopt (tests/fixtures/cmake_project): a C++ library with a C ABI, loaded with ctypes.

The smallest complete adapter, and the template for a project whose kernels are not torch ops:
load the build's shared library, declare the C signatures, and step a case by passing the
tensors' data pointers. tinyopt has fp32 AdamW ("adam", decoupled decay) and SGD momentum on the
CPU, 32-bit states only; every other case is unsupported.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from pathlib import Path

import torch

from service.core.results import CaseSpec
from worker.adapters import c_abi
from worker.adapters.base import HandedOverStates, ProjectAdapter
from worker.adapters.c_abi import F32, F32P, I64

PROJECT = "tinyopt"
_SIGNATURES = {
    "tinyopt_adamw_f32": [F32P, F32P, F32P, F32P, I64, I64, F32, F32, F32, F32, F32],
    "tinyopt_sgd_momentum_f32": [F32P, F32P, F32P, I64, I64, F32, F32, F32],
}
STATES = {"adam": ("exp_avg", "exp_avg_sq"), "momentum": ("momentum_buffer",)}


def _ptr(tensor: torch.Tensor):  # noqa: ANN202
    return c_abi.float_pointer(tensor, PROJECT)


class ThirtyTwoBit(HandedOverStates):
    def __init__(self, library: ctypes.CDLL) -> None:
        self.lib = library

    def init_states(self, case: CaseSpec, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return c_abi.fp32_states(case, param, STATES)

    def step_states(self, case: CaseSpec, param: torch.Tensor, grad: torch.Tensor,
             states: dict[str, torch.Tensor], step: int) -> None:
        h, n = case.hyper, param.numel()
        if case.optimizer == "adam":
            code = self.lib.tinyopt_adamw_f32(_ptr(param), _ptr(grad), _ptr(states["exp_avg"]),
                                              _ptr(states["exp_avg_sq"]), n, step, h["lr"], h["beta1"],
                                              h["beta2"], h["eps"], h["weight_decay"])
        else:
            code = self.lib.tinyopt_sgd_momentum_f32(_ptr(param), _ptr(grad), _ptr(states["momentum_buffer"]),
                                                     n, step, h["lr"], h["momentum"], h["weight_decay"])
        c_abi.check_code(code, PROJECT, case)


class TinyoptAdapter(ProjectAdapter):
    name = "tinyopt"

    def __init__(self) -> None:
        self._families: dict[str, ThirtyTwoBit] = {}
        self._path: Path | None = None

    def load(self, library: str) -> None:
        lib, self._path = c_abi.load_library(library, PROJECT, _SIGNATURES)
        self._families = {"32bit": ThirtyTwoBit(lib)}

    def families(self) -> Mapping[str, ThirtyTwoBit]:
        return self._families or {"32bit": None}

    def unsupported(self, case: CaseSpec, device: torch.device) -> str | None:
        h = case.hyper
        if case.optimizer not in STATES:
            return f"tinyopt has no {case.optimizer} (it has {sorted(STATES)})"
        if device.type != "cpu" or case.param_dtype != "float32":
            return "tinyopt runs float32 parameters on the CPU only"
        if h.get("gnorm_scale", 1.0) != 1.0 or h.get("skip_zeros", False):
            return "tinyopt takes neither gnorm_scale != 1 nor skip_zeros"
        return super().unsupported(case, device)

    def describe(self) -> dict[str, str]:
        return {"adapter": self.name, "library": str(self._path)}
