"""The bundled optimizers as data (issue 48): one row per optimizer, which every per-optimizer
list in Python reads instead of spelling its own.

A row names the optimizer (the stored value: CaseSpec.optimizer, never renamed), its states in the
order the ops' schemas take them (csrc/ops.cpp) with the 8-bit map each is quantized with, its
hyperparameters in schema order with the defaults a battery case gets when its point leaves them
unset, whether the op takes the step number, the csrc files its 32-bit kernels live in, how it
applies weight decay, and the torch.optim class its float64 reference is (or None: written from the
paper). The readers: the result models' OptimizerName (service.core.results, checked equal to
`OPTIMIZER_NAMES` by tests/service/core/test_optimizers.py), the battery defaults
(worker.battery.OPTIMIZER_HYPER_DEFAULTS), the bundled ops' state lists, schema orders, typed
wrappers and fakes (worker.adapters.bundled_ops), and the attribution variants' applicability
(worker.attribution.variants). The float64 update rules stay code (worker/references/,
worker/attribution/variants.py's `_Rule`): they are the science, not a table.

Pure: no torch here (the service validates batteries with it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

# How the kernels apply weight decay (csrc/ops.cpp's header): decoupled, p <- p*(1 - lr*wd) before
# the update (AdamW, Loshchilov & Hutter); coupled, g <- g + wd*p (L2 in the gradient); none.
DecayKind = Literal["decoupled", "coupled", "none"]
# The csrc files of the 32-bit kernels (csrc/cpu/<group>.cpp, csrc/cpu/<group>_kernels.cpp,
# csrc/cuda/<group>.cu): two_state holds the Adam-like rules (a first and a second moment, both
# bias-corrected), one_state the rest.
KernelGroup = Literal["one_state", "two_state"]
MapKind = Literal["signed", "unsigned"]

# Hyperparameters every wrapper takes with no default: the battery's cases differ exactly there,
# so a caller always says them.
EXPLICIT_HYPER: tuple[str, ...] = ("lr", "weight_decay")


@dataclass(frozen=True)
class OptimizerState:
    name: str  # the schema's argument name (one-tensor op); the multi-tensor op's list is name + "s"
    signed: bool  # 8-bit: quantized with the signed map (first moments) or the unsigned one (second
    # moments, sums): csrc/ops.cpp's 8-bit comment


@dataclass(frozen=True)
class Optimizer:
    name: str  # the stored value (CaseSpec.optimizer); never renamed
    states: tuple[OptimizerState, ...]  # schema order; float32, shaped like the parameter, zero at start
    # The schema's float/bool arguments in schema order -> the default a battery case gets.
    hyper: Mapping[str, float | bool] = field(hash=False)
    takes_step: bool  # the op takes the 1-based step number (bias correction, a first-step buffer)
    kernel_group: KernelGroup
    decay: DecayKind
    torch_optim_class: str | None  # the float64 reference's torch.optim class; None: from the paper

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(state.name for state in self.states)

    @property
    def state_maps(self) -> tuple[MapKind, ...]:
        """The quantization maps the 8-bit op takes, in schema order (signed before unsigned)."""
        signs = {state.signed for state in self.states}
        return tuple(kind for kind, signed in (("signed", True), ("unsigned", False)) if signed in signs)

    @property
    def bias_corrected(self) -> bool:
        """Keeps beta1^t and beta2^t: the multi-tensor op holds them per param group, and the
        bias-correction and eps-placement variants apply."""
        return self.kernel_group == "two_state"

    @property
    def scalar_order(self) -> tuple[str, ...]:
        """The op's non-tensor arguments in schema order: the step (where it takes one), then the
        hyperparameters. The same for the 32-bit, 8-bit and multi-tensor ops."""
        return (("step",) if self.takes_step else ()) + tuple(self.hyper)


def _optimizer(name: str, states: tuple[tuple[str, bool], ...], hyper: dict[str, float | bool], *,
               takes_step: bool, kernel_group: KernelGroup, decay: DecayKind,
               torch_optim_class: str | None) -> Optimizer:
    return Optimizer(name, tuple(OptimizerState(*state) for state in states), MappingProxyType(dict(hyper)),
                     takes_step, kernel_group, decay, torch_optim_class)


# Defaults follow torch.optim (Adam, SGD, RMSprop, Adagrad) or the papers (Lion, AdEMAMix); the
# lr defaults are the battery's own (a point usually sets lr).
OPTIMIZERS: dict[str, Optimizer] = {o.name: o for o in (
    _optimizer("adam", (("exp_avg", True), ("exp_avg_sq", False)),
               {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
                "gnorm_scale": 1.0, "skip_zeros": False},
               takes_step=True, kernel_group="two_state", decay="decoupled", torch_optim_class="AdamW"),
    _optimizer("ademamix", (("exp_avg_fast", True), ("exp_avg_slow", True), ("exp_avg_sq", False)),
               {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "beta3": 0.9999, "alpha": 5.0, "eps": 1e-8,
                "weight_decay": 0.0, "gnorm_scale": 1.0},
               takes_step=True, kernel_group="two_state", decay="decoupled", torch_optim_class=None),
    _optimizer("lion", (("exp_avg", True),),
               {"lr": 1e-4, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0, "gnorm_scale": 1.0},
               takes_step=False, kernel_group="one_state", decay="decoupled", torch_optim_class=None),
    _optimizer("momentum", (("momentum_buffer", True),),
               {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.0, "gnorm_scale": 1.0},
               takes_step=True, kernel_group="one_state", decay="coupled", torch_optim_class="SGD"),
    _optimizer("rmsprop", (("square_avg", False),),
               {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "gnorm_scale": 1.0},
               takes_step=False, kernel_group="one_state", decay="coupled", torch_optim_class="RMSprop"),
    _optimizer("adagrad", (("state_sum", False),),
               {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0, "gnorm_scale": 1.0},
               takes_step=False, kernel_group="one_state", decay="coupled", torch_optim_class="Adagrad"),
)}
OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZERS)


def optimizer(name: str) -> Optimizer:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"no optimizer {name!r} (known: {', '.join(OPTIMIZER_NAMES)})") from None


def names_where(**wanted: object) -> tuple[str, ...]:
    """The optimizers whose fields or properties equal `wanted`, in table order:
    names_where(decay="coupled") -> ("momentum", "rmsprop", "adagrad")."""
    return tuple(name for name, row in OPTIMIZERS.items()
                 if all(getattr(row, key) == value for key, value in wanted.items()))
