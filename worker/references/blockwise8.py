"""References for the 8-bit blockwise kernels (csrc/quant_map.h, cpu/blockwise8.cpp).

(a) `reference_step`: the kernels' step (dequantize, update, new absmax, requantize) in float64,
    carrying beside every value a bound on how far the kernel's float32 arithmetic can be from it.
    Used teacher-forced (fed the kernel's own codes, absmax and parameter before the step), it says
    per element whether the kernel's step is that algorithm; `acceptable_codes` turns the bound
    into the range of codes a correct kernel may write.
(b) `closed_form_first_step`: the parameter after one step from a zero state, in closed form.
    A zero state quantizes exactly and the parameter update uses the float32 (not the
    requantized) state, so step 1 is free of quantization error and must match this formula to
    the float32 rounding bound of (a). It is what sees a decay-ordering change in 8-bit kernels.
(c) Long runs are measured against torch.optim in float64 (worker.references.make_reference) and,
    for the direction of a change, against the free-running quantization-aware reference built on
    `rule_step` (worker.references.blockwise_quant: (a)'s rule and requantization, no bounds).

Error bound (running error analysis, first order). Every float32 operation of the kernel returns
the exact result of its float32 inputs times (1 + d), |d| <= u = 2**-24 (IEEE round to nearest;
the build uses no fast-math, so CUDA's '/' and sqrtf are correctly rounded too, and an FMA
contraction only removes a rounding). A value x carries a bound e with |x_kernel - x| <= e,
propagated through each operation exactly as the kernel performs it:
    a + b:  e_a + e_b + u |a + b|
    a * b:  |a| e_b + |b| e_a + u |a b|
    a / b:  (e_a + |a / b| e_b) / |b| + u |a / b|          (|b| > e_b, true for every denominator here)
    sqrt a: e_a / (2 sqrt a) + u sqrt a
Constants (1 - lr wd, lr / (1 - beta1^t), ...) are the kernel's float32 roundings of exact values:
e = u |c|. A dequantized state map[code] * absmax is one float32 product: e = u |s|. The parameter
is then rounded to its dtype: + half an ulp (2**-11 relative for fp16, 2**-8 for bf16) plus half the
smallest subnormal. The bound drops second-order terms (u**2 relative, ~1e-7 of the bound), which
BOUND_SAFETY = 1.01 covers; the float64 evaluation itself errs by ~1e-16 relative. Where an element
could go either way (Lion's sign of a value within its bound of 0), the bound includes both
outcomes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from worker.references.quant_map import BLOCK_SIZE, dequantize, num_blocks

U32 = 2.0 ** -24           # unit roundoff of float32
BOUND_SAFETY = 1.01        # second-order terms of the first-order bound
_DTYPE_HALF_ULP = {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
_DTYPE_HALF_MIN_SUBNORMAL = {torch.float32: 2.0 ** -150, torch.float16: 2.0 ** -25,
                             torch.bfloat16: 2.0 ** -134}

# Per optimizer: its states in schema order and whether each uses the signed map.
STATE_SIGNED: dict[str, tuple[tuple[str, bool], ...]] = {
    "adam": (("exp_avg", True), ("exp_avg_sq", False)),
    "ademamix": (("exp_avg_fast", True), ("exp_avg_slow", True), ("exp_avg_sq", False)),
    "lion": (("exp_avg", True),),
    "momentum": (("momentum_buffer", True),),
    "rmsprop": (("square_avg", False),),
    "adagrad": (("state_sum", False),),
}


class Bounded:
    """A float64 value with a bound on the kernel's float32 error in it (see the module doc)."""

    __slots__ = ("v", "e")

    def __init__(self, v, e=None):
        self.v = v if torch.is_tensor(v) else torch.tensor(float(v), dtype=torch.float64)
        self.e = torch.zeros_like(self.v) if e is None else (e if torch.is_tensor(e) else torch.tensor(float(e), dtype=torch.float64))

    @staticmethod
    def const(c: float) -> "Bounded":
        """A kernel constant: an exact value the kernel rounds to float32 once."""
        return Bounded(c, U32 * abs(c))

    def __add__(self, o: "Bounded") -> "Bounded":
        v = self.v + o.v
        return Bounded(v, self.e + o.e + U32 * v.abs())

    def __neg__(self) -> "Bounded":
        return Bounded(-self.v, self.e)

    def __sub__(self, o: "Bounded") -> "Bounded":
        return self + (-o)

    def __mul__(self, o: "Bounded") -> "Bounded":
        v = self.v * o.v
        return Bounded(v, self.v.abs() * o.e + o.v.abs() * self.e + U32 * v.abs())

    def __truediv__(self, o: "Bounded") -> "Bounded":
        v = self.v / o.v
        return Bounded(v, (self.e + v.abs() * o.e) / o.v.abs() + U32 * v.abs())

    def sqrt(self) -> "Bounded":
        root = self.v.sqrt()
        # At 0 the first-order term is unbounded; sqrt(e) bounds sqrt(x + e) - sqrt(x) there.
        first = torch.where(root > 0, self.e / (2 * root), self.e.sqrt())
        return Bounded(root, first + U32 * root)

    def where(self, mask: torch.Tensor, other: "Bounded") -> "Bounded":
        return Bounded(torch.where(mask, self.v, other.v), torch.where(mask, self.e, other.e))


# ------------------------------------------------------------------ the rules (optimizer_math.h)
# Each mirrors the float32 rule operation for operation, so the bound follows the kernel's
# rounding sequence: (param, grad, states, hyper, step) -> (param, states).

def _adam(p, g_raw, s, h, t):
    b1, b2 = h["beta1"], h["beta2"]
    g = g_raw * Bounded.const(h["gnorm_scale"])
    m = Bounded.const(b1) * s[0] + Bounded.const(1 - b1) * g
    v = Bounded.const(b2) * s[1] + Bounded.const(1 - b2) * (g * g)
    denom = v.sqrt() * Bounded.const(1 / math.sqrt(1 - b2 ** t)) + Bounded.const(h["eps"])
    p_new = p * Bounded.const(1 - h["lr"] * h["weight_decay"]) - Bounded.const(h["lr"] / (1 - b1 ** t)) * (m / denom)
    return p_new, [m, v]


def _ademamix(p, g_raw, s, h, t):
    b1, b2, b3 = h["beta1"], h["beta2"], h["beta3"]
    g = g_raw * Bounded.const(h["gnorm_scale"])
    fast = Bounded.const(b1) * s[0] + Bounded.const(1 - b1) * g
    slow = Bounded.const(b3) * s[1] + Bounded.const(1 - b3) * g
    v = Bounded.const(b2) * s[2] + Bounded.const(1 - b2) * (g * g)
    denom = v.sqrt() * Bounded.const(1 / math.sqrt(1 - b2 ** t)) + Bounded.const(h["eps"])
    mixed = fast * Bounded.const(1 / (1 - b1 ** t)) + Bounded.const(h["alpha"]) * slow
    p_new = p * Bounded.const(1 - h["lr"] * h["weight_decay"]) - Bounded.const(h["lr"]) * (mixed / denom)
    return p_new, [fast, slow, v]


def _lion(p, g_raw, s, h, t):
    b1, b2 = h["beta1"], h["beta2"]
    g = g_raw * Bounded.const(h["gnorm_scale"])
    c = Bounded.const(b1) * s[0] + Bounded.const(1 - b1) * g
    # sign(c); where |c| is within its bound of 0 the kernel may see -1, 0 or +1.
    ambiguous = c.v.abs() <= c.e
    direction = Bounded(torch.sign(c.v), torch.where(ambiguous, torch.full_like(c.v, 2.0), torch.zeros_like(c.v)))
    p_new = p * Bounded.const(1 - h["lr"] * h["weight_decay"]) - Bounded.const(h["lr"]) * direction
    m = Bounded.const(b2) * s[0] + Bounded.const(1 - b2) * g
    return p_new, [m]


def _coupled_grad(p, g_raw, h):
    return g_raw * Bounded.const(h["gnorm_scale"]) + Bounded.const(h["weight_decay"]) * p


def _momentum(p, g_raw, s, h, t):
    g = _coupled_grad(p, g_raw, h)
    buf = g if t == 1 else Bounded.const(h["momentum"]) * s[0] + g
    return p - Bounded.const(h["lr"]) * buf, [buf]


def _rmsprop(p, g_raw, s, h, t):
    a = h["alpha"]
    g = _coupled_grad(p, g_raw, h)
    sq = Bounded.const(a) * s[0] + Bounded.const(1 - a) * (g * g)
    return p - Bounded.const(h["lr"]) * (g / (sq.sqrt() + Bounded.const(h["eps"]))), [sq]


def _adagrad(p, g_raw, s, h, t):
    g = _coupled_grad(p, g_raw, h)
    total = s[0] + g * g
    return p - Bounded.const(h["lr"]) * (g / (total.sqrt() + Bounded.const(h["eps"]))), [total]


RULES = {"adam": _adam, "ademamix": _ademamix, "lion": _lion, "momentum": _momentum,
         "rmsprop": _rmsprop, "adagrad": _adagrad}


def rule_step(optimizer: str, hyper: dict, step: int, p: Bounded, g: Bounded,
              old: list[Bounded]) -> tuple[Bounded, list[Bounded]]:
    """One step of the kernels' per-element rule (the parameter, then the states before
    requantization) from the dequantized states `old`, elements the kernel leaves untouched kept:
    non-finite gradients (always), zero gradients (adam's skip_zeros). Shared by `reference_step`
    and the free-running quantization-aware reference (worker.references.blockwise_quant)."""
    new_p, new_states = RULES[optimizer](p, g, old, hyper, step)
    updated = torch.isfinite(g.v)
    if optimizer == "adam" and hyper.get("skip_zeros", False):
        updated &= g.v != 0
    return new_p.where(updated, p), [s.where(updated, o) for s, o in zip(new_states, old)]


@dataclass
class StepReference:
    """One step of the reference, with bounds on a correct kernel's deviation from it."""

    param: torch.Tensor              # float64, before rounding to the parameter dtype
    param_bound: torch.Tensor        # |kernel param - param| <= param_bound, per element
    states: list[torch.Tensor]       # float64 states after the update, before requantization
    state_bounds: list[torch.Tensor]
    absmax: list[torch.Tensor]       # float64, per block
    absmax_bounds: list[torch.Tensor]
    codes: list[torch.Tensor]        # nearest codes of the float64 states (ties toward zero)
    codes_low: list[torch.Tensor]    # a correct kernel writes a code in [codes_low, codes_high]
    codes_high: list[torch.Tensor]


def block_max(x: torch.Tensor, numel: int, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Per block of `block_size` elements of flat `x` (the last one may be partial): its max."""
    padded = torch.zeros(num_blocks(numel, block_size) * block_size, dtype=x.dtype, device=x.device)
    padded[:numel] = x
    return padded.view(-1, block_size).amax(dim=1)


def per_element(per_block: torch.Tensor, numel: int, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """A per-block value repeated over the block's elements, flat, `numel` long."""
    return per_block.repeat_interleave(block_size)[:numel]


def nearest_codes(x: torch.Tensor, qmap64: torch.Tensor, *, ties: str) -> torch.Tensor:
    """Nearest map index of each x. ties: 'down' (lower code), 'up', or 'zero' (smaller magnitude)."""
    midpoints = (qmap64[:-1] + qmap64[1:]) / 2
    down = torch.searchsorted(midpoints, x, right=False)   # count of midpoints < x: ties go down
    if ties == "down":
        return down
    up = torch.searchsorted(midpoints, x, right=True)      # count of midpoints <= x: ties go up
    if ties == "up":
        return up
    return torch.where(x >= 0, down, up)


def reference_step(optimizer: str, hyper: dict, step: int, param: torch.Tensor, grad: torch.Tensor,
                   codes: list[torch.Tensor], absmax: list[torch.Tensor], signed_map: torch.Tensor,
                   unsigned_map: torch.Tensor) -> StepReference:
    """One step from the given quantized states (the kernel's, when teacher-forced), in float64.

    `param`/`grad` in the parameter dtype (what the kernel reads); the parameter dtype sets the
    final rounding term of the parameter bound.
    """
    numel = param.numel()
    dtype = param.dtype
    p = Bounded(param.reshape(-1).to(torch.float64))
    g = Bounded(grad.reshape(-1).to(torch.float64))
    maps64 = [(signed_map if signed else unsigned_map).to(torch.float64).cpu().to(param.device)
              for _, signed in STATE_SIGNED[optimizer]]
    old = []
    for code, block_absmax, qmap64 in zip(codes, absmax, maps64):
        value = dequantize(code.reshape(-1), block_absmax, qmap64)
        old.append(Bounded(value, U32 * value.abs()))

    new_p, new_states = rule_step(optimizer, hyper, step, p, g, old)

    param_bound = new_p.e * BOUND_SAFETY + _DTYPE_HALF_ULP[dtype] * (new_p.v.abs() + new_p.e) \
        + _DTYPE_HALF_MIN_SUBNORMAL[dtype]
    result = StepReference(param=new_p.v, param_bound=param_bound, states=[], state_bounds=[],
                           absmax=[], absmax_bounds=[], codes=[], codes_low=[], codes_high=[])
    for state, qmap64 in zip(new_states, maps64):
        bound = state.e * BOUND_SAFETY
        block_absmax = block_max(state.v.abs(), numel)
        absmax_bound = block_max(bound, numel)       # max is 1-Lipschitz in each element
        a = per_element(block_absmax, numel)
        a_bound = per_element(absmax_bound, numel)
        safe_a = torch.where(a > 0, a, torch.ones_like(a))
        x = torch.where(a > 0, state.v / safe_a, torch.zeros_like(a))
        # x_kernel = s32 / a32 rounded once: |x_kernel - x| <= (e_s + |x| e_a) / (a - e_a) + u|x|.
        x_bound = torch.where(a > 0, (bound + x.abs() * a_bound) / (safe_a - a_bound).clamp_min(1e-300)
                              + U32 * x.abs(), torch.zeros_like(a))
        result.states.append(state.v)
        result.state_bounds.append(bound)
        result.absmax.append(block_absmax)
        result.absmax_bounds.append(absmax_bound)
        result.codes.append(nearest_codes(x, qmap64, ties="zero"))
        result.codes_low.append(nearest_codes(x - x_bound, qmap64, ties="down"))
        result.codes_high.append(nearest_codes(x + x_bound, qmap64, ties="up"))
    return result


@dataclass
class StepCheck:
    param_excess: float          # max(|kernel - ref| - bound) over elements; <= 0 means within bound
    param_max_abs: float         # max |kernel - ref|
    absmax_excess: float
    bad_codes: int               # codes outside [codes_low, codes_high]

    @property
    def ok(self) -> bool:
        return self.param_excess <= 0 and self.absmax_excess <= 0 and self.bad_codes == 0


def check_step(ref: StepReference, param: torch.Tensor, codes: list[torch.Tensor],
               absmax: list[torch.Tensor]) -> StepCheck:
    """Compare a kernel's state after a step with the teacher-forced reference of that step."""
    delta = (param.reshape(-1).to(torch.float64) - ref.param).abs()
    absmax_excess = max(float(((a.to(torch.float64) - ra).abs() - rb).max())
                        for a, ra, rb in zip(absmax, ref.absmax, ref.absmax_bounds))
    bad = sum(int(((c.reshape(-1).long() < lo) | (c.reshape(-1).long() > hi)).sum())
              for c, lo, hi in zip(codes, ref.codes_low, ref.codes_high))
    return StepCheck(param_excess=float((delta - ref.param_bound).max()), param_max_abs=float(delta.max()),
                     absmax_excess=absmax_excess, bad_codes=bad)


def closed_form_first_step(optimizer: str, hyper: dict, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The parameter after step 1 from a zero state, in float64 exact arithmetic.

    With all states 0 the bias corrections cancel: Adam's m/(1-b1) = g and sqrt(v/(1-b2)) = |g|, so
        adam:      p (1 - lr wd) - lr g / (|g| + eps)
        ademamix:  p (1 - lr wd) - lr (g + alpha (1 - b3) g) / (|g| + eps)     (slow EMA not corrected)
        lion:      p (1 - lr wd) - lr sign(g)                                   (c = (1 - b1) g)
        momentum:  p - lr g'                  with g' = g + wd p (coupled L2; buffer = g' on step 1)
        rmsprop:   p - lr g' / (sqrt(1 - alpha) |g'| + eps)
        adagrad:   p - lr g' / (|g'| + eps)
    where g = gnorm_scale * grad. Elements with a non-finite gradient keep p (the kernels' rule).
    """
    h = hyper
    p = param.reshape(-1).to(torch.float64)
    g = grad.reshape(-1).to(torch.float64) * h["gnorm_scale"]
    lr, wd = h["lr"], h["weight_decay"]
    if optimizer == "adam":
        new = p * (1 - lr * wd) - lr * g / (g.abs() + h["eps"])
        if h.get("skip_zeros", False):
            new = torch.where(g == 0, p, new)
    elif optimizer == "ademamix":
        new = p * (1 - lr * wd) - lr * (g + h["alpha"] * (1 - h["beta3"]) * g) / (g.abs() + h["eps"])
    elif optimizer == "lion":
        new = p * (1 - lr * wd) - lr * torch.sign(g)
    else:
        coupled = g + wd * p
        if optimizer == "momentum":
            new = p - lr * coupled
        elif optimizer == "rmsprop":
            new = p - lr * coupled / (math.sqrt(1 - h["alpha"]) * coupled.abs() + h["eps"])
        elif optimizer == "adagrad":
            new = p - lr * coupled / (coupled.abs() + h["eps"])
        else:
            raise ValueError(f"unknown optimizer {optimizer!r}")
    return torch.where(torch.isfinite(g), new, p)


def decay_after_update_first_step(optimizer: str, hyper: dict, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Step 1 of the pre-PR-2040 ordering, p' = (p - lr u)(1 - lr wd), for adam/ademamix: the
    change the one-step test exists to see. It differs from the closed form by lr wd |lr u|."""
    if optimizer not in ("adam", "ademamix"):
        raise ValueError("the decay-ordering change concerns adam and ademamix")
    lr, wd = hyper["lr"], hyper["weight_decay"]
    p = param.reshape(-1).to(torch.float64)
    correct = closed_form_first_step(optimizer, hyper, param, grad)
    update = p * (1 - lr * wd) - correct          # lr * u
    return (p - update) * (1 - lr * wd)
