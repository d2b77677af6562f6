"""Float64 variants of the bundled kernels' algorithms: the semantic changes a kernel edit can make.

Each rule below is the kernel's per-element math (csrc/optimizer_math.h) written once in float64,
with switches for the ways it is commonly got wrong. `Variant` names one setting of the switches;
`CORRECT` (no switches) is the algorithm itself and agrees with the float64 references
(worker/references/optimizers.py) to float64 rounding (tests/worker/attribution/test_attribution_variants.py).
`replay(case, variants)` runs them over the case's exact gradients (worker/engine/gradients.py:
the same open-loop stream the kernel saw; closed loop, the quadratic's gradient at each variant's own
parameters, as the float64 reference does), each from the kernel's starting point.

No quantization: for 8-bit cases a variant is the 32-bit rule, which is exactly the 8-bit kernel's
first step from a zero state (docs/KERNELS_8BIT.md) and only approximately any later step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from service.core.optimizers import OPTIMIZER_NAMES, names_where
from service.core.results import CaseSpec
from worker.engine.gradients import GradientStream, initial_parameters

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Which optimizers a variant can apply to, from service.core.optimizers' table: the bias-corrected
# ones (bias corrections, eps placement), and how each applies weight decay.
ALL = OPTIMIZER_NAMES
TWO_MOMENT = names_where(bias_corrected=True)
DECOUPLED = names_where(decay="decoupled")
COUPLED = names_where(decay="coupled")


@dataclass(frozen=True)
class Variant:
    name: str
    label: str                      # what a maintainer reads: "weight decay applied after the update"
    kind: str                       # the mutation class: decay order, eps placement, ...
    optimizers: tuple[str, ...]
    switches: dict = field(default_factory=dict, hash=False)
    needs: str | None = None        # a hyperparameter that must be on for the variant to differ
    # What a commit that goes from this variant back to the algorithm does, where "reverts: <label>"
    # alone would not say it (coupled -> decoupled decay: which way the coupling moved).
    revert_label: str | None = None

    def applies(self, case: CaseSpec) -> bool:
        if case.optimizer not in self.optimizers:
            return False
        if self.needs == "weight_decay":
            return float(case.hyper.get("weight_decay", 0.0)) > 0.0
        if self.needs == "gnorm_scale":
            return float(case.hyper.get("gnorm_scale", 1.0)) != 1.0
        if self.needs == "skip_zeros":
            return bool(case.hyper.get("skip_zeros", False)) and case.gradient.zero_fraction > 0.0
        return True


CORRECT = Variant("reference", "the reference algorithm", "none", ALL)

CATALOGUE: tuple[Variant, ...] = (
    Variant("decay_after_update", "weight decay applied after the update", "decay order", DECOUPLED,
            {"decay": "after"}, "weight_decay"),
    Variant("decay_coupled", "weight decay coupled into the gradient (L2) instead of decoupled", "decay coupling",
            DECOUPLED, {"decay": "coupled"}, "weight_decay",
            revert_label="weight decay decoupled (AdamW-style) where the baseline coupled it into the gradient (L2)"),
    Variant("decay_decoupled", "weight decay decoupled (AdamW-style) instead of added to the gradient",
            "decay coupling", COUPLED, {"decay": "decoupled"}, "weight_decay",
            revert_label="weight decay coupled into the gradient (L2) where the baseline decoupled it"),
    Variant("decay_missing", "weight decay not applied", "decay coupling", ALL, {"decay": "none"}, "weight_decay"),
    Variant("decay_twice", "weight decay applied twice", "decay coupling", ALL, {"decay": "twice"}, "weight_decay"),
    Variant("decay_without_lr", "weight decay not scaled by lr (p·(1 − wd))", "lr scaling", DECOUPLED,
            {"decay": "without_lr"}, "weight_decay"),
    Variant("eps_inside_sqrt", "eps inside the square root", "eps placement", TWO_MOMENT + ("rmsprop", "adagrad"),
            {"eps": "inside_sqrt"}),
    Variant("eps_before_bias_correction", "eps added before the second-moment bias correction", "eps placement",
            TWO_MOMENT, {"eps": "before_bias_correction"}),
    Variant("eps_inside_sqrt_before_bias_correction",
            "eps inside the square root, before the second-moment bias correction (√(v + eps) / √bc2)",
            "eps placement", TWO_MOMENT, {"eps": "inside_sqrt_before_bias_correction"}),
    Variant("bias_correction1_missing", "first-moment bias correction missing", "bias correction", TWO_MOMENT,
            {"bias1": "off"}),
    Variant("bias_correction2_missing", "second-moment bias correction missing", "bias correction", TWO_MOMENT,
            {"bias2": "off"}),
    Variant("bias_correction_missing", "both bias corrections missing", "bias correction", TWO_MOMENT,
            {"bias1": "off", "bias2": "off"}),
    Variant("bias_correction_off_by_one", "bias corrections one step ahead (beta^(t+1))", "bias correction",
            TWO_MOMENT, {"bias1": "next", "bias2": "next"}),
    Variant("bias_correction1_sqrt", "first-moment bias correction under a square root (wrong power)",
            "bias correction", TWO_MOMENT, {"bias1": "sqrt"}),
    # A precision change, not a semantic one: the same formula, but 1 - beta^t from a float32 power
    # loses digits to cancellation (beta2 = 0.999 at t = 1: 1 - 0.999 keeps ~4 of float32's 7 digits),
    # a change of hundreds of ulps of the step, far beyond a rounding (analysis calls it "precision").
    Variant("bias_correction_float32_powers",
            "the bias corrections from float32 powers of beta (1 − βᵗ loses digits to cancellation)",
            "precision", TWO_MOMENT, {"powers": "float32"}),
    # The same loss, with βᵗ kept as a running float32 product (β·β·…, one rounding per step, as
    # DeepSpeed's CPU Adam keeps it between steps) instead of a float32 pow: each step's product
    # rounding accumulates, so it differs from the float32 pow from step 3 on.
    Variant("bias_correction_float32_running_powers",
            "the bias corrections from running float32 products of beta (βᵗ kept as β·β·…, rounded each step)",
            "precision", TWO_MOMENT, {"powers": "float32_running"}),
    Variant("bias_correction2_no_sqrt", "second-moment bias correction without its square root (wrong power)",
            "bias correction", TWO_MOMENT, {"bias2": "no_sqrt"}),
    Variant("betas_swapped", "beta1 and beta2 swapped", "betas", TWO_MOMENT + ("lion",), {"betas": "swapped"}),
    Variant("betas_swapped_in_moments", "beta1 and beta2 swapped in the moment updates (bias corrections right)",
            "betas", TWO_MOMENT, {"betas": "swapped_in_moments"}),
    Variant("beta_complement", "beta used where 1 − beta belongs in the moment updates", "betas",
            TWO_MOMENT + ("lion", "rmsprop"), {"betas": "complement"}),
    Variant("ademamix_beta3_for_beta1", "AdEMAMix's slow EMA with beta1 (beta3 unused)", "ademamix alpha/beta3",
            ("ademamix",), {"beta3": "beta1"}),
    Variant("ademamix_alpha_missing", "AdEMAMix's slow EMA not mixed in (alpha unused)", "ademamix alpha/beta3",
            ("ademamix",), {"alpha": "off"}),
    Variant("ademamix_slow_bias_corrected", "AdEMAMix's slow EMA bias-corrected too", "ademamix alpha/beta3",
            ("ademamix",), {"slow_bias": "on"}),
    Variant("lr_twice", "lr applied twice (lr² in the update)", "lr scaling", ALL, {"lr": "squared"}),
    Variant("lr_missing", "the update not scaled by lr", "lr scaling", ALL, {"lr": "missing"}),
    Variant("update_sign_flipped", "the update added instead of subtracted", "signs", ALL, {"sign": -1.0}),
    Variant("gnorm_scale_ignored", "gnorm_scale not applied to the gradient", "gnorm_scale", ALL,
            {"gnorm": "ignored"}, "gnorm_scale"),
    Variant("gnorm_scale_twice", "gnorm_scale applied twice", "gnorm_scale", ALL, {"gnorm": "twice"}, "gnorm_scale"),
    Variant("skip_zeros_ignored", "skip_zeros ignored: zero-gradient elements updated", "skip_zeros", ("adam",),
            {"skip_zeros": "ignored"}, "skip_zeros"),
    Variant("skip_zeros_decays", "skip_zeros skips the update but still decays", "skip_zeros", ("adam",),
            {"skip_zeros": "decay_only"}, "skip_zeros"),
    Variant("momentum_dampened", "momentum buffer dampened by (1 − momentum)", "betas", ("momentum",),
            {"dampening": "on"}),
    Variant("momentum_nesterov", "Nesterov momentum", "betas", ("momentum",), {"nesterov": "on"}),
    Variant("lion_momentum_before_sign", "Lion's momentum updated before the sign is taken", "betas", ("lion",),
            {"lion_order": "momentum_first"}),
)

BY_NAME = {v.name: v for v in (CORRECT, *CATALOGUE)}


@dataclass(frozen=True)
class Transition:
    """The baseline follows a catalogued variant and the commit something else: the algorithm (a
    revert) or another setting of the same switches (float32 pow -> a running float32 product).
    The commit's change is then commit − baseline = (commit's rule − baseline's rule) + roundings,
    and both rules are replayed from the same start, so it is matched as a variant is."""

    baseline: Variant
    commit: Variant

    @property
    def name(self) -> str:
        return f"{self.baseline.name}->{self.commit.name}"

    @property
    def reverts(self) -> bool:
        return self.commit is CORRECT

    @property
    def kind(self) -> str:
        if self.reverts:
            return self.baseline.kind
        precision = self.baseline.kind == "precision" and self.commit.kind == "precision"
        return "precision" if precision else self.commit.kind

    @property
    def label(self) -> str:
        if not self.reverts:
            return f"{self.commit.label}, where the baseline had {self.baseline.label}"
        if self.baseline.revert_label:
            return f"{self.baseline.revert_label} (reverts: {self.baseline.label})"
        return f"reverts: {self.baseline.label}"


def transitions(candidates: list[Variant]) -> list[Transition]:
    """From each candidate as the baseline's rule: back to the algorithm, and to each other
    candidate that sets the same switches (the commit replaced the baseline's setting)."""
    out = [Transition(b, CORRECT) for b in candidates]
    out += [Transition(b, c) for b in candidates for c in candidates
            if b is not c and set(b.switches) == set(c.switches)]
    return out


def _running_power(beta: np.float32, steps: int) -> np.float32:
    """beta**steps as a float32 running product: beta, then one float32 multiply per step."""
    power = np.float32(1.0)
    for _ in range(steps):
        power = np.float32(power * beta)
    return power


def applicable(case: CaseSpec) -> list[Variant]:
    """The catalogue's variants that can differ from the algorithm on this case."""
    return [v for v in CATALOGUE if v.applies(case)]


class _Rule:
    """One variant of one optimizer in float64, per element (the kernels' states, zero at start)."""

    def __init__(self, case: CaseSpec, variant: Variant, param: torch.Tensor):
        self.case, self.h, self.s = case, {k: float(v) for k, v in case.hyper.items()}, dict(variant.switches)
        self.param = param.clone()
        self.states: dict[str, torch.Tensor] = {}

    def _state(self, name: str) -> torch.Tensor:
        return self.states.setdefault(name, torch.zeros_like(self.param))

    def _grad(self, raw: torch.Tensor) -> torch.Tensor:
        scale = self.h.get("gnorm_scale", 1.0)
        mode = self.s.get("gnorm", "on")
        return raw if mode == "ignored" else raw * (scale * scale if mode == "twice" else scale)

    def _lr(self) -> float:
        lr = self.h["lr"]
        return {"squared": lr * lr, "missing": 1.0}.get(self.s.get("lr"), lr)

    def _betas(self, first: str, second: str, *, in_moments: bool = True) -> tuple[float, float]:
        """The betas the moment updates (or, in_moments=False, the bias corrections) use."""
        b1, b2 = self.h[first], self.h[second]
        swapped = self.s.get("betas") == "swapped" or (in_moments and self.s.get("betas") == "swapped_in_moments")
        return (b2, b1) if swapped else (b1, b2)

    def _ema(self, state: torch.Tensor, beta: float, value: torch.Tensor) -> torch.Tensor:
        if self.s.get("betas") == "complement":
            return (1.0 - beta) * state + beta * value
        return beta * state + (1.0 - beta) * value

    def _decoupled(self, param: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """p ← p·(1 − lr·wd) − update, with the decay switches of the decoupled optimizers."""
        lr, wd, decay = self.h["lr"], self.h.get("weight_decay", 0.0), self.s.get("decay", "before")
        factor = {"before": 1.0 - lr * wd, "after": 1.0 - lr * wd, "twice": (1.0 - lr * wd) ** 2,
                  "without_lr": 1.0 - wd, "none": 1.0, "coupled": 1.0}[decay]
        if decay == "after":
            return (param - update) * factor
        return param * factor - update

    def _coupled_grad(self, grad: torch.Tensor) -> torch.Tensor:
        wd, decay = self.h.get("weight_decay", 0.0), self.s.get("decay", "coupled")
        if decay in ("decoupled", "none"):
            return grad
        return grad + (2.0 if decay == "twice" else 1.0) * wd * self.param

    def step(self, t: int, raw: torch.Tensor) -> None:
        getattr(self, f"_{self.case.optimizer}")(t, self._grad(raw), raw)

    # -- the kernels' rules (csrc/optimizer_math.h), switches marked
    def _bias(self, beta: float, t: int, which: str) -> float:
        mode = self.s.get(which, "on")
        if mode == "off":
            return 1.0
        power = t + 1 if mode == "next" else t
        if self.s.get("powers") == "float32":  # 1.0f - powf(beta, t), all in float32
            correction = float(np.float32(1.0) - np.power(np.float32(beta), np.float32(power)))
        elif self.s.get("powers") == "float32_running":  # p *= beta each step, then 1.0f - p
            correction = float(np.float32(1.0) - _running_power(np.float32(beta), power))
        else:
            correction = 1.0 - beta ** power
        if which == "bias1":
            return correction ** 0.5 if mode == "sqrt" else correction
        return correction if mode == "no_sqrt" else correction ** 0.5

    def _denominator(self, sq: torch.Tensor, sqrt_bc2: float) -> torch.Tensor:
        eps, mode = self.h["eps"], self.s.get("eps", "outside")
        if mode == "inside_sqrt":
            return torch.sqrt(sq / sqrt_bc2 ** 2 + eps)
        if mode == "before_bias_correction":
            return (torch.sqrt(sq) + eps) / sqrt_bc2
        if mode == "inside_sqrt_before_bias_correction":
            return torch.sqrt(sq + eps) / sqrt_bc2
        return torch.sqrt(sq) / sqrt_bc2 + eps

    def _adam(self, t: int, g: torch.Tensor, raw: torch.Tensor) -> None:
        if self.s.get("decay") == "coupled":
            g = g + self.h["weight_decay"] * self.param
        b1, b2 = self._betas("beta1", "beta2")
        c1, c2 = self._betas("beta1", "beta2", in_moments=False)
        m, v = self._state("exp_avg"), self._state("exp_avg_sq")
        new_m, new_v = self._ema(m, b1, g), self._ema(v, b2, g * g)
        update = self.s.get("sign", 1.0) * self._lr() / self._bias(c1, t, "bias1") * (
            new_m / self._denominator(new_v, self._bias(c2, t, "bias2")))
        new_p = self._decoupled(self.param, update)
        skip = self.s.get("skip_zeros", "on")
        if self.h.get("skip_zeros") and skip != "ignored":
            zero = raw == 0
            new_m, new_v = torch.where(zero, m, new_m), torch.where(zero, v, new_v)
            kept = self._decoupled(self.param, torch.zeros_like(update)) if skip == "decay_only" else self.param
            new_p = torch.where(zero, kept, new_p)
        self.states.update(exp_avg=new_m, exp_avg_sq=new_v)
        self.param = new_p

    def _ademamix(self, t: int, g: torch.Tensor, raw: torch.Tensor) -> None:
        if self.s.get("decay") == "coupled":
            g = g + self.h["weight_decay"] * self.param
        b1, b2 = self._betas("beta1", "beta2")
        b3 = b1 if self.s.get("beta3") == "beta1" else self.h["beta3"]
        alpha = 0.0 if self.s.get("alpha") == "off" else self.h["alpha"]
        fast = self.states["fast"] = self._ema(self._state("fast"), b1, g)
        slow = self.states["slow"] = self._ema(self._state("slow"), b3, g)
        sq = self.states["sq"] = self._ema(self._state("sq"), b2, g * g)
        c1, c2 = self._betas("beta1", "beta2", in_moments=False)
        slow_term = slow / (1.0 - b3 ** t) if self.s.get("slow_bias") == "on" else slow
        mixed = fast / self._bias(c1, t, "bias1") + alpha * slow_term
        update = self.s.get("sign", 1.0) * self._lr() * (mixed / self._denominator(sq, self._bias(c2, t, "bias2")))
        self.param = self._decoupled(self.param, update)

    def _lion(self, t: int, g: torch.Tensor, raw: torch.Tensor) -> None:
        if self.s.get("decay") == "coupled":
            g = g + self.h["weight_decay"] * self.param
        b1, b2 = self._betas("beta1", "beta2")
        m = self._state("exp_avg")
        if self.s.get("lion_order") == "momentum_first":
            m = self.states["exp_avg"] = self._ema(m, b2, g)
        direction = torch.sign(self._ema(m, b1, g))
        self.param = self._decoupled(self.param, self.s.get("sign", 1.0) * self._lr() * direction)
        if self.s.get("lion_order") != "momentum_first":
            self.states["exp_avg"] = self._ema(m, b2, g)

    def _momentum(self, t: int, g: torch.Tensor, raw: torch.Tensor) -> None:
        g, mu = self._coupled_grad(g), self.h["momentum"]
        buffer = self._state("buffer")
        if t == 1:
            buffer = g
        else:
            buffer = mu * buffer + ((1.0 - mu) * g if self.s.get("dampening") == "on" else g)
        self.states["buffer"] = buffer
        direction = g + mu * buffer if self.s.get("nesterov") == "on" else buffer
        self._coupled_finish(self.s.get("sign", 1.0) * self._lr() * direction)

    def _rmsprop(self, t: int, g: torch.Tensor, raw: torch.Tensor) -> None:
        g = self._coupled_grad(g)
        sq = self.states["sq"] = self._ema(self._state("sq"), self.h["alpha"], g * g)
        denom = torch.sqrt(sq + self.h["eps"]) if self.s.get("eps") == "inside_sqrt" else torch.sqrt(sq) + self.h["eps"]
        self._coupled_finish(self.s.get("sign", 1.0) * self._lr() * (g / denom))

    def _adagrad(self, t: int, g: torch.Tensor, raw: torch.Tensor) -> None:
        g = self._coupled_grad(g)
        total = self.states["sum"] = self._state("sum") + g * g
        denom = torch.sqrt(total + self.h["eps"]) if self.s.get("eps") == "inside_sqrt" \
            else torch.sqrt(total) + self.h["eps"]
        self._coupled_finish(self.s.get("sign", 1.0) * self._lr() * (g / denom))

    def _coupled_finish(self, update: torch.Tensor) -> None:
        decoupled = self.s.get("decay") == "decoupled"
        factor = 1.0 - self.h["lr"] * self.h.get("weight_decay", 0.0) if decoupled else 1.0
        self.param = self.param * factor - update


def replay_steps(case: CaseSpec, variants: list[Variant], elements: torch.Tensor | None = None):  # noqa: ANN201
    """Yield (step, {variant name: float64 parameters after it}) over the case's gradients, one step at
    a time (memory: one parameter vector per variant). `elements`: replay only these indices. Every
    rule is elementwise, so a subset replays exactly; the gradient is computed at full size (the
    closed loop's at the variant's parameters scattered into the start vector) and then indexed."""
    dtype = _DTYPES[case.param_dtype]
    start = initial_parameters(case.seed, case.size).to(dtype).to(torch.float64)
    stream = GradientStream(case.gradient, seed=case.seed, size=case.size, device="cpu", grad_dtype=dtype)
    rules = {v.name: _Rule(case, v, start if elements is None else start[elements]) for v in variants}
    open_loop = case.gradient.kind == "open"
    with torch.no_grad():
        for t in range(1, case.steps + 1):
            shared = stream.reference_gradient(t, start) if open_loop else None
            for rule in rules.values():
                if elements is None:
                    rule.step(t, shared if open_loop else stream.reference_gradient(t, rule.param))
                elif open_loop:
                    rule.step(t, shared[elements])
                else:
                    rule.step(t, stream.reference_gradient(t, start.index_put((elements,), rule.param))[elements])
            yield t, {name: rule.param for name, rule in rules.items()}


def replay(case: CaseSpec, variants: list[Variant]) -> dict[str, torch.Tensor]:
    """Each variant's float64 parameters after every step, (steps, size): replay_steps collected."""
    out = {v.name: torch.empty((case.steps, case.size), dtype=torch.float64) for v in variants}
    for t, params in replay_steps(case, variants):
        for name, param in params.items():
            out[name][t - 1] = param
    return out
