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

from service.results import CaseSpec
from worker.adapters.base import AdapterError, ProjectAdapter

_F32P, _I64, _F32 = ctypes.POINTER(ctypes.c_float), ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "tinyopt_adamw_f32": [_F32P, _F32P, _F32P, _F32P, _I64, _I64, _F32, _F32, _F32, _F32, _F32],
    "tinyopt_sgd_momentum_f32": [_F32P, _F32P, _F32P, _I64, _I64, _F32, _F32, _F32],
}
STATES = {"adam": ("exp_avg", "exp_avg_sq"), "momentum": ("momentum_buffer",)}


def _ptr(tensor: torch.Tensor):
    return ctypes.cast(tensor.data_ptr(), _F32P)


class ThirtyTwoBit:
    def __init__(self, library: ctypes.CDLL) -> None:
        self.lib = library

    def init_states(self, case: CaseSpec, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: torch.zeros_like(param, dtype=torch.float32) for name in STATES[case.optimizer]}

    def step(self, case: CaseSpec, param: torch.Tensor, grad: torch.Tensor,
             states: dict[str, torch.Tensor], step: int) -> None:
        h, n = case.hyper, param.numel()
        if case.optimizer == "adam":
            code = self.lib.tinyopt_adamw_f32(_ptr(param), _ptr(grad), _ptr(states["exp_avg"]),
                                              _ptr(states["exp_avg_sq"]), n, step, h["lr"], h["beta1"],
                                              h["beta2"], h["eps"], h["weight_decay"])
        else:
            code = self.lib.tinyopt_sgd_momentum_f32(_ptr(param), _ptr(grad), _ptr(states["momentum_buffer"]),
                                                     n, step, h["lr"], h["momentum"], h["weight_decay"])
        if code != 0:
            raise RuntimeError(f"tinyopt {case.optimizer} returned error code {code} for case {case.case_id}")


class TinyoptAdapter(ProjectAdapter):
    name = "tinyopt"

    def __init__(self) -> None:
        self._families: dict[str, ThirtyTwoBit] = {}
        self._path: Path | None = None

    def load(self, library: str) -> None:
        path = Path(library).resolve()
        if not path.is_file():
            raise AdapterError(f"tinyopt library {path} does not exist; check build.library in optdrift.toml")
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as error:
            raise AdapterError(f"cannot load tinyopt library {path}: {error}") from error
        for symbol, argtypes in _SIGNATURES.items():
            function = getattr(lib, symbol, None)
            if function is None:
                raise AdapterError(f"{path} does not export {symbol}; is it a tinyopt build?")
            function.argtypes, function.restype = argtypes, ctypes.c_int
        self._families, self._path = {"32bit": ThirtyTwoBit(lib)}, path

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
