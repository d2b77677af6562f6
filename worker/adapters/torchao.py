"""torchao's low-bit optimizers (PyPI `torchao`, `torchao.optim`), driven as they are used.

torchao's optimizers step through `torch.compile` (inductor on the CPU) with quantized
tensor-subclass states (`OptimState8bit`: uint8 codes, per-block scales and the quantization map).
Each case gets its own optimizer over the engine's parameter tensor; the library allocates and
updates its own state on its first step, and `state_for_digest` reads `optimizer.state[param]` as
it is (tensor subclasses are digested through their inner tensors, worker.engine.digest).

Families (the state families optimizer cases can claim, service.core.results.KernelFamily):
- "32bit": `torchao.optim._AdamW` (fp32 states, the compiled single-parameter step);
- "8bit_blockwise": `torchao.optim.AdamW8bit` (block size 256 in 0.18.0);
- "4bit_blockwise": `torchao.optim.AdamW4bit` (block size 128, two codes a byte), labelled 4-bit;
- "fp8_e4m3": `torchao.optim.AdamWFp8` (float8_e4m3fn values, one scale per 256).
Each optimizer is made with the library's own defaults for everything the case does not set (block
size included), as its users get it: a commit that changes a default block size changes the states'
layout from the first step, and the digests see it. torchao keeps fp32 states where a parameter has
fewer than 4096 elements or its size is not a multiple of the block: each low-bit family declares
its codes (`declared_state`), so such a case reads `not_applicable` with the reason instead of
being run as the family it claims.

The group lifecycle (a layout case, docs/PROJECTS.md "The group lifecycle"): ONE optimizer of the
family's class over every tensor, param groups {"params", "lr", "betas", "eps", "weight_decay"}
as `case.layout.groups` says, stepped by its own `step()` (which compiles and runs its
single-parameter step per tensor, with that tensor's group's lr tensor and hyperparameters).
torchao quantizes only the tensors of 4096 elements or more whose size is a multiple of the block:
a low-bit layout case declares those tensors' codes (the others keep fp32 states, as its users
get), or every tensor's where none qualifies, so a layout torchao runs entirely in fp32 reads
not_applicable. Digested: `optimizer.state[p]` of every tensor (its step counter, a 0-d tensor)
and the groups' numbers, lr tensor included (worker/adapters/param_groups.py).

`adam` cases only, decoupled weight decay (AdamW, as the bundled kernels), no gradient scale and
no zero skipping. The build puts the `torchao` package in a folder of its output
(`build.library`); `load` imports it from there and nowhere else, or from the installed
distribution with `library = "installed"`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from service.core.results import CaseSpec
from worker.adapters import param_groups
from worker.adapters.base import AdapterContractError, AdapterError, FamilyAdapter, ProjectAdapter, StateDeclaration
from worker.build.cache import INSTALLED

PACKAGE = "torchao"
# The families this adapter implements: the torchao class of each, and the dtype of its codes.
OPTIMIZER_BY_FAMILY = {"32bit": "_AdamW", "8bit_blockwise": "AdamW8bit", "4bit_blockwise": "AdamW4bit",
                       "fp8_e4m3": "AdamWFp8"}
CODE_DTYPE = {"8bit_blockwise": "uint8", "4bit_blockwise": "uint8", "fp8_e4m3": "float8_e4m3fn"}
# torchao's _AdamBase._new_buffer: a quantized state only for tensors this large (and a multiple of the block).
MIN_QUANTIZED_SIZE = 4096


def group_options(hyper) -> dict:  # noqa: ANN001
    """A param group's hyperparameters under torchao's keys."""
    return {"lr": float(hyper["lr"]), "betas": (float(hyper["beta1"]), float(hyper["beta2"])),
            "eps": float(hyper["eps"]), "weight_decay": float(hyper["weight_decay"])}


@dataclass(eq=False)
class TorchaoCase:
    case: CaseSpec
    param: torch.nn.Parameter
    optimizer: torch.optim.Optimizer


class TorchaoFamily(FamilyAdapter):
    """One torchao optimizer class, one optimizer per case; its state stays the library's."""

    states_movable = False
    fast_engine = False  # the state appears only at the first step (as lion_pytorch's)

    def __init__(self, family: str, optimizer_class: type[torch.optim.Optimizer]) -> None:
        self.family, self.optimizer_class = family, optimizer_class
        self._codec = None

    def quantization_codec(self, case: CaseSpec):  # noqa: ANN201 - a DynamicMapCodec or None
        """The 8-bit family's codec: torchao's own signed and unsigned dynamic maps (read from the
        loaded package, as its states are made with them) over the optimizer class's default block
        size (the adapter sets no other). torchao rounds an exact midpoint up, the codec toward zero:
        they differ only on exact ties. The 4-bit and FP8 families name none (their direction is not
        judged, and says so); neither does a torchao without the map functions this reads."""
        if self.family != "8bit_blockwise":
            return None
        if self._codec is None:
            from worker.references.blockwise_quant import DynamicMapCodec

            try:
                maps = importlib.import_module(f"{PACKAGE}.optim.subclass_8bit")
                signed = torch.tensor(maps.get_qmap_signed(), dtype=torch.float32)
                unsigned = torch.tensor(maps.get_qmap_unsigned(), dtype=torch.float32)
                block_size = inspect.signature(self.optimizer_class.__init__).parameters["block_size"].default
            except (ImportError, AttributeError, KeyError, TypeError, ValueError):
                return None
            if not isinstance(block_size, int):
                return None
            self._codec = DynamicMapCodec(signed, unsigned, block_size)
        return self._codec

    def dequantized_states(self, handle: TorchaoCase) -> dict[str, torch.Tensor]:
        """map[code] * scale of each 8-bit state, in float64 (exact: torchao's own dequantization
        rounds that product to float32)."""
        state = handle.optimizer.state[handle.param]
        values = {}
        for name in ("exp_avg", "exp_avg_sq"):
            quantized = state[name]
            codes, scale = quantized.codes, quantized.scale.to(torch.float64)
            looked_up = quantized.qmap.to(torch.float64)[codes.long()].reshape(scale.numel(), -1)
            values[name] = (looked_up * scale.reshape(-1, 1)).reshape(codes.shape)
        return values

    def open(self, case: CaseSpec, param: torch.Tensor, device: torch.device) -> TorchaoCase:
        h = case.hyper
        as_parameter = torch.nn.Parameter(param, requires_grad=False)  # same storage as `param`
        optimizer = self.optimizer_class([as_parameter], lr=h["lr"], betas=(h["beta1"], h["beta2"]),
                                         eps=h["eps"], weight_decay=h["weight_decay"])
        return TorchaoCase(case=case, param=as_parameter, optimizer=optimizer)

    def step(self, handle: TorchaoCase, param: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        if param.data_ptr() != handle.param.data_ptr():
            raise AdapterContractError(f"torchao adapter: case {handle.case.case_id} was stepped with another "
                                       "parameter tensor than it was opened with")
        handle.param.grad = grad
        handle.optimizer.step()
        handle.param.grad = None

    def open_group(self, case: CaseSpec, params, device: torch.device) -> param_groups.OptimizerGroupCase:  # noqa: ANN001
        first = group_options(case.group_hyper(0))
        return param_groups.open_group(case, params, "torchao", group_options,
                                       lambda groups: self.optimizer_class(groups, **first))

    def step_group(self, handle: param_groups.OptimizerGroupCase, params, grads, step: int) -> None:  # noqa: ANN001
        param_groups.step_group(handle, params, grads, "torchao")

    def state_for_digest(self, handle: TorchaoCase | param_groups.OptimizerGroupCase) -> dict[str, torch.Tensor]:
        if isinstance(handle, param_groups.OptimizerGroupCase):
            return param_groups.group_state(handle)
        state = handle.optimizer.state.get(handle.param, {})
        return {name: value if torch.is_tensor(value) else torch.tensor(value)
                for name, value in sorted(state.items())}

    def declared_state(self, case: CaseSpec) -> StateDeclaration | None:
        # Codes only: the block count is not checked, since the state's floating tensors are the
        # scales and the 256-value quantization map together. A layout case declares the tensors
        # torchao quantizes (or all, where it quantizes none).
        if self.family not in CODE_DTYPE:
            return None
        if case.layout is None:
            return StateDeclaration(family=self.family, code_dtype=CODE_DTYPE[self.family],
                                    states=("exp_avg", "exp_avg_sq"))
        block = self._default_block_size()
        slots = case.tensor_slots()
        quantized = [slot for slot in slots if slot.size >= MIN_QUANTIZED_SIZE
                     and (block is None or slot.size % block == 0)] or slots
        return StateDeclaration(family=self.family, code_dtype=CODE_DTYPE[self.family], states=tuple(
            f"t{slot.index}.{name}" for slot in quantized for name in ("exp_avg", "exp_avg_sq")))

    def _default_block_size(self) -> int | None:
        """The optimizer class's default block size (None where it has none to read)."""
        try:
            default = inspect.signature(self.optimizer_class.__init__).parameters["block_size"].default
        except (KeyError, TypeError, ValueError):
            return None
        return default if isinstance(default, int) else None

    def close(self, handle: TorchaoCase | param_groups.OptimizerGroupCase) -> None:
        if isinstance(handle, param_groups.OptimizerGroupCase):
            param_groups.close_group(handle)
            return
        handle.optimizer.state.clear()
        handle.optimizer.param_groups.clear()


class TorchaoAdapter(ProjectAdapter):
    name = "torchao"

    def __init__(self) -> None:
        self._module: ModuleType | None = None
        self._families: dict[str, TorchaoFamily] = {}

    def load(self, library: str) -> None:
        if library != INSTALLED:
            folder = Path(library).resolve()
            if not (folder / PACKAGE / "__init__.py").is_file():
                raise AdapterError(f"{folder} holds no {PACKAGE} package ({PACKAGE}/__init__.py); build.library "
                                   "in optdrift.toml must name the build's folder that contains it")
            loaded = sys.modules.get(PACKAGE)
            if loaded is not None and not Path(loaded.__file__ or "/").resolve().is_relative_to(folder):
                raise AdapterError(f"{PACKAGE} was already imported in this process from {loaded.__file__}")
            sys.path.insert(0, str(folder))
        try:
            self._module = importlib.import_module(f"{PACKAGE}.optim")
        except ImportError as error:
            raise AdapterError(f"cannot import {PACKAGE}.optim: {type(error).__name__}: {error}") from error
        if library != INSTALLED and not Path(self._module.__file__).resolve().is_relative_to(Path(library).resolve()):
            raise AdapterError(f"{PACKAGE} was imported from {self._module.__file__}, not from the build's folder")
        for family, class_name in OPTIMIZER_BY_FAMILY.items():
            optimizer_class = getattr(self._module, class_name, None)
            if optimizer_class is None:
                raise AdapterError(f"{self._module.__file__} has no {class_name}")
            self._families[family] = TorchaoFamily(family, optimizer_class)

    def families(self) -> Mapping[str, FamilyAdapter | None]:
        return self._families or dict.fromkeys(OPTIMIZER_BY_FAMILY)

    def unsupported(self, case: CaseSpec, device: torch.device) -> str | None:
        if case.optimizer != "adam":
            return f"torchao's low-bit optimizers are AdamW only here, no {case.optimizer}"
        if case.hyper.get("gnorm_scale", 1.0) != 1.0 or case.hyper.get("skip_zeros", False):
            return "torchao's optimizers take neither a gradient scale (gnorm_scale != 1) nor skip_zeros"
        return super().unsupported(case, device)

    def describe(self) -> dict[str, str]:
        where = str(Path(self._module.__file__).parent.parent) if self._module is not None else "not loaded"
        try:
            version = importlib.metadata.version(PACKAGE)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        return {"adapter": self.name, "module": __name__, "version": f"{PACKAGE} {version}", "library": where}
