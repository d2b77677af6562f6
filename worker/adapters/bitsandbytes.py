"""bitsandbytes through its public functional API (checked against 0.50.2).

    bitsandbytes.functional.optimizer_update_32bit(name, g, p, state1, beta1, eps, step, lr,
        state2, beta2, beta3, alpha, weight_decay, gnorm_scale, unorm_vec, max_unorm, skip_zeros)
    bitsandbytes.functional.optimizer_update_8bit_blockwise(name, g, p, state1, state2, beta1,
        beta2, beta3, alpha, eps, step, lr, qmap1, qmap2, absmax1, absmax2, weight_decay,
        gnorm_scale, skip_zeros)

Both update p and the states in place and dispatch on the tensors' device (its CPU backend in
pure torch, its CUDA library on a GPU).

Mapping of a case (worker.battery's hyperparameters) onto bitsandbytes, the way its own
optimizer classes (bitsandbytes.optim.*) call these functions:
  optimizer  bnb name   state1                         state2     beta1      beta2   beta3  alpha
  adam       "adam"     m                              v          beta1      beta2   -      -
  ademamix   "ademamix" [m_fast; m_slow] stacked (2,n) v          beta1      beta2   beta3  alpha
  lion       "lion"     m                              -          beta1      beta2   -      -
  momentum   "momentum" momentum buffer                -          momentum   -       -      -
  rmsprop    "rmsprop"  square average                 -          alpha      -       -      -
  adagrad    "adagrad"  sum of squares                 -          -          -       -      -
Unused betas are passed as 0.0, as bnb's classes do; lr, eps, weight_decay, gnorm_scale,
skip_zeros are passed through. bnb's "adam" applies *decoupled* decay (p *= 1 - lr wd), so with
weight_decay > 0 it is torch.optim.AdamW, which is exactly the engine's reference for "adam".
8-bit blockwise states are uint8 codes (zero bytes at start, as bnb's optimizers allocate them)
with one float32 absmax per block of 256 ((2, blocks) for AdEMAMix's stacked state1); state1 is
quantized with the signed dynamic map for every optimizer and state2 with the unsigned one, as
bnb's Optimizer1State/Optimizer2State do (so rmsprop/adagrad's state1 uses the signed map here,
unlike the bundled kernels).

The group lifecycle (a layout case: several tensors in param groups under one optimizer,
docs/PROJECTS.md "The group lifecycle") does not loop over the functional API: it makes ONE of
bnb's own optimizer classes over every tensor, as its users do, and steps it with its own
`step()` (`Optimizer8bit.step()`: per-parameter state made lazily, a per-parameter step counter,
param-group hyperparameters read per parameter through `get_config`):
  optimizer  32bit        8bit_blockwise   param-group keys (bnb's own names)
  adam       AdamW        AdamW8bit        lr, betas=(beta1, beta2), eps, weight_decay
  ademamix   AdEMAMix     AdEMAMix8bit     lr, betas=(beta1, beta2, beta3), alpha, eps, weight_decay
  lion       Lion         Lion8bit         lr, betas=(beta1, beta2), weight_decay
  momentum   SGD          SGD8bit          lr, betas=(momentum, dampening 0), weight_decay
  rmsprop    RMSprop      RMSprop8bit      lr, betas=(alpha, momentum 0), eps, weight_decay
  adagrad    Adagrad      Adagrad8bit      lr, eps, weight_decay
(bnb's SGD and RMSprop keep momentum / alpha in "betas": a group's "momentum" key would be ignored.)
Everything else is the class's default, `min_8bit_size=4096` included: an 8-bit optimizer keeps
fp32 states for its tensors under 4096 elements, as its users get; the tensors it quantizes are
declared (`declared_state`), so a layout whose large tensors fell back reads not_applicable. The
classes take no gnorm_scale (they clip by percentile) nor skip_zeros: such layout cases are
unsupported. What is digested is `optimizer.state[p]` of every tensor (state1/state2, absmax,
qmap, the step counter) and the groups' numbers (worker/adapters/param_groups.py).

`load(library)`: "installed" imports the installed package; a folder is a bitsandbytes source tree
(or a folder holding the `bitsandbytes` package, e.g. a built checkout) put first on sys.path;
either way the adapter checks that the imported module really comes from there.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from service.core.results import CaseSpec
from worker.adapters import param_groups
from worker.adapters.base import AdapterError, HandedOverStates, ProjectAdapter, StateDeclaration

BLOCK_SIZE = 256
BNB_NAMES = {"adam": "adam", "ademamix": "ademamix", "lion": "lion", "momentum": "momentum",
             "rmsprop": "rmsprop", "adagrad": "adagrad"}
TWO_STATE = frozenset({"adam", "ademamix"})
# bnb's CUDA library has no bf16 entry point for these 32-bit optimizers (its str2optimizer32bit
# lists fp32 and fp16 only); the CPU backend is plain torch and takes any dtype.
CUDA_32BIT_WITHOUT_BF16 = frozenset({"momentum", "rmsprop", "adagrad"})
# The group lifecycle's optimizer classes (bitsandbytes.optim), by optimizer: (32bit, 8bit_blockwise).
OPTIMIZER_CLASSES = {"adam": ("AdamW", "AdamW8bit"), "ademamix": ("AdEMAMix", "AdEMAMix8bit"),
                     "lion": ("Lion", "Lion8bit"), "momentum": ("SGD", "SGD8bit"),
                     "rmsprop": ("RMSprop", "RMSprop8bit"), "adagrad": ("Adagrad", "Adagrad8bit")}
# Optimizer8bit's default: smaller tensors keep fp32 states in an 8-bit optimizer.
MIN_8BIT_SIZE = 4096


def _scalars(case: CaseSpec) -> dict[str, float]:
    """bnb's beta1/beta2/beta3/alpha/eps for the case (see the table above)."""
    return _scalars_of(case.optimizer, case.hyper)


def _scalars_of(name: str, h) -> dict[str, float]:  # noqa: ANN001
    if name in ("adam", "ademamix", "lion"):
        beta1, beta2 = h["beta1"], h["beta2"]
    elif name == "momentum":
        beta1, beta2 = h["momentum"], 0.0
    elif name == "rmsprop":
        beta1, beta2 = h["alpha"], 0.0
    else:
        beta1, beta2 = 0.0, 0.0
    return {"beta1": float(beta1), "beta2": float(beta2), "beta3": float(h.get("beta3", 0.0)),
            "alpha": float(h.get("alpha", 0.0)) if name == "ademamix" else 0.0,
            "eps": float(h.get("eps", 0.0))}


def group_options(optimizer: str, hyper) -> dict:  # noqa: ANN001
    """A param group's hyperparameters under bnb's own keys (the table in the module docstring)."""
    s, lr, wd = _scalars_of(optimizer, hyper), float(hyper["lr"]), float(hyper["weight_decay"])
    if optimizer == "ademamix":
        return {"lr": lr, "betas": (s["beta1"], s["beta2"], s["beta3"]), "alpha": s["alpha"], "eps": s["eps"],
                "weight_decay": wd}
    if optimizer in ("adam", "lion"):
        options = {"lr": lr, "betas": (s["beta1"], s["beta2"]), "weight_decay": wd}
        return options | ({"eps": s["eps"]} if optimizer == "adam" else {})
    if optimizer in ("momentum", "rmsprop"):
        return {"lr": lr, "betas": (s["beta1"], 0.0), "eps": s["eps"], "weight_decay": wd}
    return {"lr": lr, "eps": s["eps"], "weight_decay": wd}


class BnbOptimizerGroups:
    """The group lifecycle of both families: ONE bitsandbytes.optim optimizer over the layout
    case's tensors (param_groups.OptimizerGroupCase), dispatched beside the one-tensor lifecycle
    of HandedOverStates (its CaseStates handles)."""

    optim = None  # bitsandbytes.optim, set by the adapter's load()
    eight_bit = False

    def open_group(self, case: CaseSpec, params, device: torch.device):  # noqa: ANN001, ANN201
        optimizer_class = getattr(self.optim, OPTIMIZER_CLASSES[case.optimizer][int(self.eight_bit)])
        first = group_options(case.optimizer, case.group_hyper(0))
        if case.optimizer == "momentum":  # SGD's constructor takes momentum, not betas (and refuses 0)
            first = {"lr": first["lr"], "momentum": first["betas"][0], "weight_decay": first["weight_decay"]}
        elif case.optimizer == "rmsprop":
            first = {"lr": first["lr"], "alpha": first["betas"][0], "eps": first["eps"],
                     "weight_decay": first["weight_decay"]}
        return param_groups.open_group(case, params, "bitsandbytes",
                                       lambda hyper: group_options(case.optimizer, hyper),
                                       lambda groups: optimizer_class(groups, **first))

    def step_group(self, handle, params, grads, step: int) -> None:  # noqa: ANN001
        param_groups.step_group(handle, params, grads, "bitsandbytes")

    def state_for_digest(self, handle):  # noqa: ANN001, ANN201
        if isinstance(handle, param_groups.OptimizerGroupCase):
            return param_groups.group_state(handle)
        return super().state_for_digest(handle)

    def close(self, handle) -> None:  # noqa: ANN001
        if isinstance(handle, param_groups.OptimizerGroupCase):
            param_groups.close_group(handle)
        else:
            super().close(handle)


class ThirtyTwoBit(BnbOptimizerGroups, HandedOverStates):
    def __init__(self, functional, optim=None) -> None:  # noqa: ANN001
        self.F, self.optim = functional, optim

    def init_states(self, case: CaseSpec, param: torch.Tensor) -> dict[str, torch.Tensor]:
        n = param.numel()
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.float32, device=param.device)  # noqa: E731
        states = {"state1": zeros(2, n) if case.optimizer == "ademamix" else zeros(n)}
        if case.optimizer in TWO_STATE:
            states["state2"] = zeros(n)
        return states

    def step_states(self, case: CaseSpec, param: torch.Tensor, grad: torch.Tensor,
             states: dict[str, torch.Tensor], step: int) -> None:
        s = _scalars(case)
        self.F.optimizer_update_32bit(
            BNB_NAMES[case.optimizer], grad, param, states["state1"], s["beta1"], s["eps"], step,
            float(case.hyper["lr"]), states.get("state2"), s["beta2"], s["beta3"], s["alpha"],
            float(case.hyper["weight_decay"]), float(case.hyper["gnorm_scale"]),
            skip_zeros=bool(case.hyper.get("skip_zeros", False)))


class EightBitBlockwise(BnbOptimizerGroups, HandedOverStates):
    eight_bit = True

    def __init__(self, functional, optim=None) -> None:  # noqa: ANN001
        self.F, self.optim = functional, optim
        self._maps: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def declared_state(self, case: CaseSpec) -> StateDeclaration | None:
        """A layout case: the tensors bnb's 8-bit optimizer quantizes (MIN_8BIT_SIZE elements or
        more) hold uint8 codes; if no tensor is that large, every tensor is declared, so a layout
        bnb would run entirely in fp32 reads not_applicable. One-tensor cases (the functional API,
        codes made here) declare nothing."""
        if case.layout is None:
            return None
        slots = case.tensor_slots()
        quantized = [slot for slot in slots if slot.size >= MIN_8BIT_SIZE] or slots
        two = case.optimizer in TWO_STATE
        return StateDeclaration(family="8bit_blockwise", code_dtype="uint8", states=tuple(
            f"t{slot.index}.{name}" for slot in quantized for name in (("state1", "state2") if two else ("state1",))))

    def maps(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        if key not in self._maps:
            self._maps[key] = (self.F.create_dynamic_map(signed=True).to(device),
                               self.F.create_dynamic_map(signed=False).to(device))
        return self._maps[key]

    def init_states(self, case: CaseSpec, param: torch.Tensor) -> dict[str, torch.Tensor]:
        n, device = param.numel(), param.device
        blocks = -(-n // BLOCK_SIZE)
        stacked = case.optimizer == "ademamix"
        states = {"state1": torch.zeros((2, n) if stacked else (n,), dtype=torch.uint8, device=device),
                  "absmax1": torch.zeros((2, blocks) if stacked else (blocks,), dtype=torch.float32, device=device)}
        if case.optimizer in TWO_STATE:
            states["state2"] = torch.zeros(n, dtype=torch.uint8, device=device)
            states["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=device)
        return states

    def step_states(self, case: CaseSpec, param: torch.Tensor, grad: torch.Tensor,
             states: dict[str, torch.Tensor], step: int) -> None:
        s = _scalars(case)
        signed_map, unsigned_map = self.maps(param.device)
        two = case.optimizer in TWO_STATE
        self.F.optimizer_update_8bit_blockwise(
            BNB_NAMES[case.optimizer], grad, param, states["state1"], states.get("state2"),
            s["beta1"], s["beta2"], s["beta3"], s["alpha"], s["eps"], step, float(case.hyper["lr"]),
            signed_map, unsigned_map if two else None, states["absmax1"], states.get("absmax2"),
            float(case.hyper["weight_decay"]), float(case.hyper["gnorm_scale"]),
            bool(case.hyper.get("skip_zeros", False)))


class BitsandbytesAdapter(ProjectAdapter):
    name = "bitsandbytes"

    def __init__(self) -> None:
        self.module = None
        self._families: dict[str, object] = {}

    def load(self, library: str) -> None:
        if library != "installed":
            tree = Path(library).resolve()
            if not (tree / "bitsandbytes" / "__init__.py").is_file():
                raise AdapterError(f"{tree} holds no bitsandbytes package (expected {tree}/bitsandbytes/__init__.py); "
                                   "pass a built bitsandbytes source tree or 'installed'")
            sys.path.insert(0, str(tree))
        try:
            module = importlib.import_module("bitsandbytes")
            functional = importlib.import_module("bitsandbytes.functional")
        except ImportError as error:
            raise AdapterError(f"cannot import bitsandbytes ({library}): {error}; install it "
                               "(pip install bitsandbytes==0.50.2) or build its source tree") from error
        origin = Path(module.__file__).resolve()
        if library != "installed" and Path(library).resolve() not in origin.parents:
            raise AdapterError(f"bitsandbytes was imported from {origin}, not from the tree {library}; "
                               "run each build in a fresh kernel host")
        for needed in ("optimizer_update_32bit", "optimizer_update_8bit_blockwise", "create_dynamic_map"):
            if not hasattr(functional, needed):
                raise AdapterError(f"bitsandbytes {getattr(module, '__version__', '?')} at {origin} has no "
                                   f"functional.{needed}; this adapter targets the 0.50 API")
        optim = importlib.import_module("bitsandbytes.optim")
        missing = [name for pair in OPTIMIZER_CLASSES.values() for name in pair if not hasattr(optim, name)]
        if missing:
            raise AdapterError(f"bitsandbytes {getattr(module, '__version__', '?')} at {origin} has no "
                               f"optim.{', optim.'.join(missing)}; this adapter targets the 0.50 API")
        self.module = module
        self._families = {"32bit": ThirtyTwoBit(functional, optim), "8bit_blockwise": EightBitBlockwise(functional, optim)}

    def families(self) -> Mapping[str, object]:
        return self._families

    def unsupported(self, case: CaseSpec, device: torch.device) -> str | None:
        if case.layout is not None:
            hypers = [case.group_hyper(g) for g in range(len(case.layout.groups))]
            if any(h.get("gnorm_scale", 1.0) != 1.0 for h in hypers):
                return ("bitsandbytes' optimizer classes take no gradient scale (they clip by percentile): a layout "
                        "case runs them, so leave gnorm_scale at 1 in its groups")
            if any(h.get("skip_zeros", False) for h in hypers):
                return "bitsandbytes' optimizer classes take no skip_zeros: leave it off in a layout case's groups"
        if (device.type == "cuda" and case.family == "32bit" and case.param_dtype == "bfloat16"
                and case.optimizer in CUDA_32BIT_WITHOUT_BF16):
            return (f"bitsandbytes' CUDA library has no bf16 32-bit {case.optimizer} kernel "
                    "(fp32 and fp16 only); leave bf16 out of this optimizer's cases")
        return super().unsupported(case, device)

    def describe(self) -> dict[str, str]:
        if self.module is None:
            return {"adapter": self.name}
        return {"adapter": self.name, "version": str(getattr(self.module, "__version__", "?")),
                "path": str(Path(self.module.__file__).parent)}


def supported_cases(cases: list[CaseSpec], device_type: str) -> tuple[list[CaseSpec], list[tuple[CaseSpec, str]]]:
    """(cases bnb can run on a `device_type` device, [(case, why not)]) without loading bnb."""
    adapter, device = BitsandbytesAdapter(), torch.device(device_type)
    adapter._families = {"32bit": None, "8bit_blockwise": None}
    keep, dropped = [], []
    for case in cases:
        reason = adapter.unsupported(case, device)
        (dropped.append((case, reason)) if reason else keep.append(case))
    return keep, dropped
