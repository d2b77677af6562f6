"""capiopt (tests/fixtures/capi_project): a C++ library with a plain C ABI, loaded with ctypes.

The second external fixture project (issue 14's acceptance), named in its optdrift.toml by module
path (`adapter = "worker.adapters.capi"`), as a project outside this tree names its own adapter.
capiopt has fp32 AdamW ("adam") and Lion kernels on the CPU, 32-bit states only. Everything else
— bf16/fp16 parameters, the 8-bit blockwise family, other optimizers, a GPU — it declares
unsupported, which the engine sets aside as not applicable.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from pathlib import Path

import torch

from service.core.results import CaseSpec
from worker.adapters import c_abi
from worker.adapters.base import AdapterError, HandedOverStates, ProjectAdapter
from worker.adapters.c_abi import F32, F32P, I64

PROJECT = "capiopt"
ABI_VERSION = 1
_SIGNATURES = {
    "capiopt_abi_version": [],
    # param, grad, exp_avg, exp_avg_sq, n, step, lr, beta1, beta2, eps, weight_decay
    "capiopt_adamw_f32": [F32P, F32P, F32P, F32P, I64, I64, F32, F32, F32, F32, F32],
    # param, grad, exp_avg, n, lr, beta1, beta2, weight_decay
    "capiopt_lion_f32": [F32P, F32P, F32P, I64, F32, F32, F32, F32],
}
# Every tensor capiopt keeps between steps, per optimizer (the engine digests them all).
STATES = {"adam": ("exp_avg", "exp_avg_sq"), "lion": ("exp_avg",)}


def _ptr(tensor: torch.Tensor):  # noqa: ANN202
    return c_abi.float_pointer(tensor, PROJECT)


class ThirtyTwoBit(HandedOverStates):
    """fp32 parameters and states, one C call per step."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.lib = library

    def init_states(self, case: CaseSpec, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return c_abi.fp32_states(case, param, STATES)

    def step_states(self, case: CaseSpec, param: torch.Tensor, grad: torch.Tensor,
             states: dict[str, torch.Tensor], step: int) -> None:
        h, n = case.hyper, param.numel()
        if case.optimizer == "adam":
            code = self.lib.capiopt_adamw_f32(_ptr(param), _ptr(grad), _ptr(states["exp_avg"]),
                                              _ptr(states["exp_avg_sq"]), n, step, h["lr"], h["beta1"],
                                              h["beta2"], h["eps"], h["weight_decay"])
        else:
            code = self.lib.capiopt_lion_f32(_ptr(param), _ptr(grad), _ptr(states["exp_avg"]), n, h["lr"],
                                             h["beta1"], h["beta2"], h["weight_decay"])
        c_abi.check_code(code, PROJECT, case)


class CapiAdapter(ProjectAdapter):
    name = "capiopt"

    def __init__(self) -> None:
        self._families: dict[str, ThirtyTwoBit] = {}
        self._path: Path | None = None

    def load(self, library: str) -> None:
        lib, path = c_abi.load_library(library, PROJECT, _SIGNATURES)
        version = lib.capiopt_abi_version()
        if version != ABI_VERSION:
            raise AdapterError(f"{path} has capiopt ABI version {version}; this adapter drives version "
                               f"{ABI_VERSION} (update worker/adapters/capi.py with the C signatures)")
        self._families, self._path = {"32bit": ThirtyTwoBit(lib)}, path

    def families(self) -> Mapping[str, ThirtyTwoBit]:
        return self._families or {"32bit": None}

    def unsupported(self, case: CaseSpec, device: torch.device) -> str | None:
        if case.optimizer not in STATES:
            return f"capiopt has no {case.optimizer} kernel (it has {sorted(STATES)})"
        if case.family != "32bit":
            return f"capiopt has no {case.family} kernels (32-bit states only)"
        if case.param_dtype != "float32":
            return f"capiopt has no {case.param_dtype} kernels (float32 parameters only)"
        if device.type != "cpu":
            return f"capiopt runs on the CPU only, not {device.type}"
        h = case.hyper
        if h.get("gnorm_scale", 1.0) != 1.0 or h.get("skip_zeros", False):
            return "capiopt takes neither gnorm_scale != 1 nor skip_zeros"
        return super().unsupported(case, device)

    def describe(self) -> dict[str, str]:
        return {"adapter": self.name, "library": str(self._path), "abi_version": str(ABI_VERSION)}
