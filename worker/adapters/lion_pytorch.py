"""lion-pytorch (PyPI, lucidrains/lion-pytorch): a real library's Lion optimizer, driven as it is used.

Issue 20's acceptance: a library optdrift did not write, through the adapter contract
(worker.adapters.base.FamilyAdapter), with library-owned state. Each case gets its own
`lion_pytorch.Lion` over the engine's parameter tensor; the library allocates and updates its own
`exp_avg`, and `state_for_digest` reads whatever the library keeps in `optimizer.state[param]`
(a future version's step counter too, as a 0-d tensor), so what is digested is what the library
updates — never a copy optdrift made.

The build (tests/fixtures/lion_project/optdrift.toml) puts the package, with its metadata, in a
folder of the build output (`build.library`); `load` imports `lion_pytorch` from there and
nowhere else (an installed copy must not stand in for the tree under test). `library = "installed"`
drives the installed package instead.

lion-pytorch's `weight_decay` with `decoupled_weight_decay=False` (its default, which this adapter
passes) is our Lion reference's (worker/references/optimizers.py): p <- p (1 - lr wd) - lr sign(c),
decay from the old parameter. `decoupled_weight_decay=True` would divide wd by the initial lr
(p <- p (1 - wd) ...), which no battery case means. It takes no gradient scale and keeps no 8-bit
states: such cases are unsupported (not applicable). Any device and parameter dtype torch has.

The group lifecycle (a layout case, docs/PROJECTS.md "The group lifecycle"): ONE `Lion` over every
tensor with param groups {"params", "lr", "betas", "weight_decay"} as `case.layout.groups` says,
stepped by its own `step()`; digested: each tensor's `exp_avg` and the groups' numbers
(worker/adapters/param_groups.py). lion-pytorch keeps `_init_lr` (the constructor's lr, which its
decoupled decay divides by) outside the groups: with decoupled_weight_decay=False, as passed here,
no update reads it.
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
from worker.adapters.base import AdapterContractError, AdapterError, FamilyAdapter, ProjectAdapter
from worker.build.cache import INSTALLED

PACKAGE = "lion_pytorch"
DISTRIBUTION = "lion-pytorch"


@dataclass(eq=False)
class LionCase:
    """One case's library objects: the parameter as the library sees it (a Parameter over the
    engine's tensor, so the library's in-place updates are the engine's) and its optimizer."""

    case: CaseSpec
    param: torch.nn.Parameter
    optimizer: torch.optim.Optimizer


class LionFamily(FamilyAdapter):
    """lion_pytorch.Lion, one optimizer per case; its state stays the library's."""

    states_movable = False  # the library allocates exp_avg itself, on its first step
    # Like torch.optim's optimizers, Lion creates its state lazily in its first step(): at open()
    # there is nothing to digest yet, and the fast engine lays out its digest arenas from
    # state_for_digest right after open(). Making the state at open() ourselves would hide the
    # library's own initialisation from the digest; so the one-case engine runs these cases
    # (worker.engine.fast would otherwise find the layout changed at step 1 and re-run each alone).
    fast_engine = False

    def __init__(self, lion_class: type[torch.optim.Optimizer]) -> None:
        self.lion_class = lion_class
        # Pass decoupled_weight_decay=False where this version has it: the reference's convention.
        self._options = ({"decoupled_weight_decay": False}
                         if "decoupled_weight_decay" in inspect.signature(lion_class).parameters else {})

    def open(self, case: CaseSpec, param: torch.Tensor, device: torch.device) -> LionCase:
        h = case.hyper
        as_parameter = torch.nn.Parameter(param, requires_grad=False)  # same storage as `param`
        optimizer = self.lion_class([as_parameter], lr=h["lr"], betas=(h["beta1"], h["beta2"]),
                                    weight_decay=h["weight_decay"], **self._options)
        return LionCase(case=case, param=as_parameter, optimizer=optimizer)

    def step(self, handle: LionCase, param: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        if param.data_ptr() != handle.param.data_ptr():
            raise AdapterContractError(
                f"lion_pytorch adapter: case {handle.case.case_id} was stepped with another parameter tensor "
                "than it was opened with; its optimizer updates the tensor it was given at open")
        handle.param.grad = grad  # what the library reads
        handle.optimizer.step()
        handle.param.grad = None

    def open_group(self, case: CaseSpec, params, device: torch.device) -> param_groups.OptimizerGroupCase:  # noqa: ANN001
        first = _group_options(case.group_hyper(0))
        return param_groups.open_group(case, params, "lion_pytorch", _group_options,
                                       lambda groups: self.lion_class(groups, **first, **self._options))

    def step_group(self, handle: param_groups.OptimizerGroupCase, params, grads, step: int) -> None:  # noqa: ANN001
        param_groups.step_group(handle, params, grads, "lion_pytorch")

    def state_for_digest(self, handle: LionCase | param_groups.OptimizerGroupCase) -> dict[str, torch.Tensor]:
        """Everything the library keeps for the parameter, by name in a fixed order; numbers (a
        step counter) as 0-d tensors. Empty before the library's first step."""
        if isinstance(handle, param_groups.OptimizerGroupCase):
            return param_groups.group_state(handle)
        state = handle.optimizer.state.get(handle.param, {})
        return {name: value if torch.is_tensor(value) else torch.tensor(value)
                for name, value in sorted(state.items())}

    def close(self, handle: LionCase | param_groups.OptimizerGroupCase) -> None:
        if isinstance(handle, param_groups.OptimizerGroupCase):
            param_groups.close_group(handle)
            return
        handle.optimizer.state.clear()
        handle.optimizer.param_groups.clear()


def _group_options(hyper) -> dict:  # noqa: ANN001
    """A param group's hyperparameters under lion-pytorch's keys."""
    return {"lr": float(hyper["lr"]), "betas": (float(hyper["beta1"]), float(hyper["beta2"])),
            "weight_decay": float(hyper["weight_decay"])}


class LionPytorchAdapter(ProjectAdapter):
    name = "lion_pytorch"

    def __init__(self) -> None:
        self._module: ModuleType | None = None
        self._family: LionFamily | None = None
        self._version = "unknown"

    def load(self, library: str) -> None:
        if library == INSTALLED:
            self._module = _import_lion()
            self._version = _version(None)
        else:
            folder = Path(library).resolve()
            if not (folder / PACKAGE / "__init__.py").is_file():
                raise AdapterError(f"{folder} holds no {PACKAGE} package ({PACKAGE}/__init__.py); build.library "
                                   "in optdrift.toml must name the build's folder that contains it")
            loaded = sys.modules.get(PACKAGE)
            if loaded is not None and not _inside(loaded, folder):
                raise AdapterError(f"{PACKAGE} was already imported in this process from {loaded.__file__}; "
                                   f"the kernel host must import the build's copy in {folder}")
            sys.path.insert(0, str(folder))
            self._module = _import_lion()
            if not _inside(self._module, folder):
                raise AdapterError(f"{PACKAGE} was imported from {self._module.__file__}, not from the build's "
                                   f"folder {folder}")
            self._version = _version(folder)
        lion_class = getattr(self._module, "Lion", None)
        if not (inspect.isclass(lion_class) and issubclass(lion_class, torch.optim.Optimizer)):
            raise AdapterError(f"{self._module.__file__} has no Lion optimizer class (lion_pytorch.Lion); "
                               f"this adapter drives lion-pytorch's Lion(params, lr, betas, weight_decay)")
        self._family = LionFamily(lion_class)

    def families(self) -> Mapping[str, FamilyAdapter | None]:
        return {"32bit": self._family}

    def unsupported(self, case: CaseSpec, device: torch.device) -> str | None:
        if case.optimizer != "lion":
            return f"lion-pytorch has only Lion, no {case.optimizer}"
        if case.family != "32bit":
            return f"lion-pytorch keeps its state at the parameter's precision: no {case.family} states"
        if case.hyper.get("gnorm_scale", 1.0) != 1.0:
            return "lion-pytorch takes no gradient scale (gnorm_scale != 1); leave gnorm_scale at 1"
        return super().unsupported(case, device)

    def describe(self) -> dict[str, str]:
        where = str(Path(self._module.__file__).parent) if self._module is not None else "not loaded"
        return {"adapter": self.name, "module": __name__, "version": f"{DISTRIBUTION} {self._version}",
                "library": where}


def _import_lion() -> ModuleType:
    try:
        return importlib.import_module(PACKAGE)
    except ImportError as error:
        raise AdapterError(f"cannot import {PACKAGE}: {type(error).__name__}: {error}") from error


def _inside(module: ModuleType, folder: Path) -> bool:
    return module.__file__ is not None and Path(module.__file__).resolve().is_relative_to(folder)


def _version(folder: Path | None) -> str:
    """The version the package's metadata says: the build folder's (its egg-info or dist-info),
    or the installed distribution's."""
    if folder is None:
        try:
            return importlib.metadata.version(DISTRIBUTION)
        except importlib.metadata.PackageNotFoundError:
            return "unknown (no installed metadata)"
    for distribution in importlib.metadata.distributions(path=[str(folder)]):
        if distribution.metadata["Name"] and \
                distribution.metadata["Name"].replace("_", "-").lower() == DISTRIBUTION:
            return distribution.version
    return "unknown (no metadata in the build)"
