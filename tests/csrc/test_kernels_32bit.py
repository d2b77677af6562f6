"""Every bundled 32-bit op against a float64 reference of its update rule, 50 steps.

Points (see ARCHITECTURE "Battery"): typical (lr 1e-3, wd 1e-2), discriminating (lr 1e-1, wd 1e-1,
where a decay-after-update ordering is ~1e-3 per step away while the kernel's own error is ~1e-7),
and the wd=0 control at the same lr (where both orderings coincide). Parameters fp32/fp16/bf16,
sizes 1, 4097 (odd tail) and 65536; every case on CPU and, where present, on CUDA.

How the comparison works, and its tolerance (u = 2^-24, FP32_EPS = 2u):
  Every step, the float64 reference starts from the kernel's parameter (states: the reference
  keeps its own float64 states, fed that same parameter) and the kernel's new parameter must be
  the float64 result rounded to the parameter dtype, give or take the float32 error of that one
  step. A free-running comparison would measure the optimizer's sensitivity rather than the
  kernel: at lr = wd = 0.1 RMSprop's coupled decay amplifies a perturbation ~4x over 50 steps, and
  fp16/bf16 rounding is chaotic (Lion's +-lr step at lr=1e-3 is within 5% of half an fp16 ulp near
  |p| = 2.4, a tie that recurs every step, so one float32-vs-float64 difference sends the two
  trajectories to different grid points for good).
  Float32 error of one step, per element: p_new = fl(fl(p d) - fl(update)) costs
  u (|p_old| + |p_new|) on the parameter (both terms, as they may cancel); the update's relative
  error is ~3u per step of state recursion (the float32 states carry the roundings of all t
  steps so far) plus ~10u for the coefficients and the final sqrt / multiply / add / divide,
  <= 4u (t + 3). So the step budget is
      FP32_EPS * (|p_old| + |p_new| + 2 (t + 3) |update|_terms),
  where |update|_terms is the update evaluated on the absolute values of its terms (the
  references return it), because the rounding errors scale with the terms, not with a result
  that may cancel.
  Rounding is monotonic, so the kernel's value must lie between the roundings of
  p_new -/+ budget: exact almost everywhere for fp16/bf16 (a wrong rounding mode or a one-ulp
  bias fails), within ~1e-6 for fp32. The decay-after-update ordering is off by
  lr wd |update| = 1e-3 |update / lr| per step at the discriminating point, ~1000x the budget; at
  the typical point the gap (1e-8 per step) is inside it, which is why that point alone cannot tell
  the orderings apart (PR 2040).
  * float32 states, compared after 50 steps with the reference's (which saw the same gradients
    and parameters): each step adds <= 3 roundings of values <= the element's peak |state|, so
    4 FP32_EPS * steps * peak covers them with margin.
  * Lion: sign(c) is discontinuous at 0; where the float64 |c| is below 1e-5 of its terms (> 80x
    the float32 rounding of c after 50 steps) the float32 kernel cannot know the sign, so those
    elements are set aside, and the test requires that they are few.
"""

from __future__ import annotations

import math

import pytest
import torch

STEPS = 50
FP32_EPS = torch.finfo(torch.float32).eps
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 4097, 65536]
POINTS = {
    "typical": {"lr": 1e-3, "weight_decay": 1e-2},
    "discriminating": {"lr": 1e-1, "weight_decay": 1e-1},
    "no_decay": {"lr": 1e-1, "weight_decay": 0.0},
}
# Fixed per-optimizer hyperparameters: torch.optim's defaults, the papers' for Lion / AdEMAMix.
BASE_HYPER = {
    "adam": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
    "ademamix": {"beta1": 0.9, "beta2": 0.999, "beta3": 0.9999, "alpha": 5.0, "eps": 1e-8},
    "lion": {"beta1": 0.9, "beta2": 0.99},
    "momentum": {"momentum": 0.9},
    "rmsprop": {"alpha": 0.99, "eps": 1e-8},
    "adagrad": {"eps": 1e-10},
}
LION_AMBIGUOUS_RELATIVE = 1e-5


# ------------------------------------------------------------------ float64 references
# Each takes the float64 parameter, the raw gradient, the states, the 1-based step and the
# hyperparameters, and returns (new parameter, new states, elements whose sign is ambiguous, the
# update's magnitude scale). The scale is the update computed from the absolute values of its
# terms (kept as extra "abs_*" states): float32 rounding errors are relative to the terms, not to
# the result, which can cancel to almost nothing (m = b1 m + (1 - b1) g with opposite signs).


def adam_reference(p, g, s, t, h):
    # AdamW, Loshchilov & Hutter arXiv:1711.05101 Algorithm 2 / torch.optim.AdamW: decay and
    # update both from the previous parameter.
    grad = g * h.get("gnorm_scale", 1.0)
    m = h["beta1"] * s["exp_avg"] + (1 - h["beta1"]) * grad
    m_abs = h["beta1"] * s.get("abs_exp_avg", 0.0) + (1 - h["beta1"]) * grad.abs()
    v = h["beta2"] * s["exp_avg_sq"] + (1 - h["beta2"]) * grad * grad
    step_size = h["lr"] / (1 - h["beta1"] ** t)
    denom = v.sqrt() / math.sqrt(1 - h["beta2"] ** t) + h["eps"]
    new_p = p * (1 - h["lr"] * h["weight_decay"]) - step_size * m / denom
    if h.get("skip_zeros", False):
        untouched = g == 0
        new_p = torch.where(untouched, p, new_p)
        m = torch.where(untouched, s["exp_avg"], m)
        m_abs = torch.where(untouched, s.get("abs_exp_avg", 0.0), m_abs)
        v = torch.where(untouched, s["exp_avg_sq"], v)
    states = {"exp_avg": m, "exp_avg_sq": v, "abs_exp_avg": m_abs}
    return new_p, states, None, step_size * m_abs / denom


def ademamix_reference(p, g, s, t, h):
    # Pagliardini et al. arXiv:2409.03137 Algorithm 1 (fixed alpha, beta3).
    grad = g * h.get("gnorm_scale", 1.0)
    m1 = h["beta1"] * s["exp_avg_fast"] + (1 - h["beta1"]) * grad
    m2 = h["beta3"] * s["exp_avg_slow"] + (1 - h["beta3"]) * grad
    m1_abs = h["beta1"] * s.get("abs_exp_avg_fast", 0.0) + (1 - h["beta1"]) * grad.abs()
    m2_abs = h["beta3"] * s.get("abs_exp_avg_slow", 0.0) + (1 - h["beta3"]) * grad.abs()
    nu = h["beta2"] * s["exp_avg_sq"] + (1 - h["beta2"]) * grad * grad
    bias_correction1 = 1 - h["beta1"] ** t
    denom = (nu / (1 - h["beta2"] ** t)).sqrt() + h["eps"]
    update = (m1 / bias_correction1 + h["alpha"] * m2) / denom
    new_p = p * (1 - h["lr"] * h["weight_decay"]) - h["lr"] * update
    scale = h["lr"] * (m1_abs / bias_correction1 + h["alpha"] * m2_abs) / denom
    states = {"exp_avg_fast": m1, "exp_avg_slow": m2, "exp_avg_sq": nu,
              "abs_exp_avg_fast": m1_abs, "abs_exp_avg_slow": m2_abs}
    return new_p, states, None, scale


def lion_reference(p, g, s, t, h):
    # Chen et al. arXiv:2302.06675 Algorithm 2.
    grad = g * h.get("gnorm_scale", 1.0)
    momentum_term = h["beta1"] * s["exp_avg"]
    gradient_term = (1 - h["beta1"]) * grad
    c = momentum_term + gradient_term
    ambiguous = c.abs() <= LION_AMBIGUOUS_RELATIVE * (momentum_term.abs() + gradient_term.abs())
    new_p = p * (1 - h["lr"] * h["weight_decay"]) - h["lr"] * torch.sign(c)
    m = h["beta2"] * s["exp_avg"] + (1 - h["beta2"]) * grad
    return new_p, {"exp_avg": m}, ambiguous, torch.full_like(p, h["lr"])


def _coupled_gradient(p, g, h):
    # g' = g * gnorm_scale + wd p, and the magnitude of its terms.
    scaled = g * h.get("gnorm_scale", 1.0)
    return scaled + h["weight_decay"] * p, scaled.abs() + h["weight_decay"] * p.abs()


def momentum_reference(p, g, s, t, h):
    # torch.optim.SGD(momentum, dampening=0, nesterov=False), coupled L2 decay.
    grad, grad_abs = _coupled_gradient(p, g, h)
    if t == 1:
        buf, buf_abs = grad.clone(), grad_abs
    else:
        buf = h["momentum"] * s["momentum_buffer"] + grad
        buf_abs = h["momentum"] * s["abs_momentum_buffer"] + grad_abs
    states = {"momentum_buffer": buf, "abs_momentum_buffer": buf_abs}
    return p - h["lr"] * buf, states, None, h["lr"] * buf_abs


def rmsprop_reference(p, g, s, t, h):
    # torch.optim.RMSprop(centered=False, momentum=0), coupled L2 decay.
    grad, grad_abs = _coupled_gradient(p, g, h)
    sq = h["alpha"] * s["square_avg"] + (1 - h["alpha"]) * grad * grad
    denom = sq.sqrt() + h["eps"]
    return p - h["lr"] * grad / denom, {"square_avg": sq}, None, h["lr"] * grad_abs / denom


def adagrad_reference(p, g, s, t, h):
    # torch.optim.Adagrad(lr_decay=0, initial_accumulator_value=0), coupled L2 decay.
    grad, grad_abs = _coupled_gradient(p, g, h)
    total = s["state_sum"] + grad * grad
    denom = total.sqrt() + h["eps"]
    return p - h["lr"] * grad / denom, {"state_sum": total}, None, h["lr"] * grad_abs / denom


REFERENCES = {
    "adam": adam_reference,
    "ademamix": ademamix_reference,
    "lion": lion_reference,
    "momentum": momentum_reference,
    "rmsprop": rmsprop_reference,
    "adagrad": adagrad_reference,
}


# ------------------------------------------------------------------------------- driver


def gradient_stream(size, dtype, generator, *, zero_fraction=0.0, always_zero=None):
    grad = torch.randn(size, generator=generator, dtype=torch.float64)
    if zero_fraction:
        grad[torch.rand(size, generator=generator, dtype=torch.float64) < zero_fraction] = 0.0
    if always_zero is not None:
        grad[always_zero] = 0.0
    return grad.to(dtype)


def run_against_reference(kernels, optimizer, dtype, device, size, hyper, *, seed=0,
                          zero_fraction=0.0, always_zero=None):
    """Steps kernel and reference side by side (see the module docstring); returns the final
    tensors and the first failing step, if any."""
    generator = torch.Generator().manual_seed(seed)
    initial = torch.randn(size, generator=generator, dtype=torch.float64).to(dtype)
    names = kernels.OPTIMIZER_STATES[optimizer]
    param = initial.to(device, copy=True)  # a copy even on CPU: initial must stay initial
    states = {n: torch.zeros(size, dtype=torch.float32, device=device) for n in names}
    ref_states = {n: torch.zeros(size, dtype=torch.float64) for n in names}
    peak_state = {n: torch.zeros(size, dtype=torch.float64) for n in names}
    ambiguous = torch.zeros(size, dtype=torch.bool)
    failures = []
    for t in range(1, STEPS + 1):
        grad = gradient_stream(size, dtype, generator, zero_fraction=zero_fraction,
                               always_zero=always_zero)
        old_p = param.cpu().double()
        kernels.step(optimizer, param, grad.to(device), states, step=t, hyper=hyper)
        new_p, ref_states, step_ambiguous, update_scale = REFERENCES[optimizer](
            old_p, grad.double(), ref_states, t, hyper)
        if step_ambiguous is not None:
            ambiguous |= step_ambiguous
        budget = FP32_EPS * (old_p.abs() + new_p.abs() + 2 * (t + 3) * update_scale)
        lowest = (new_p - budget).to(dtype).double()
        highest = (new_p + budget).to(dtype).double()
        got = param.cpu().double()
        bad = ~((got >= lowest) & (got <= highest)) & ~ambiguous  # NaN is bad
        if bad.any() and not failures:
            i = int(bad.nonzero()[0])
            failures.append(
                f"step {t}: {int(bad.sum())} of {size} elements outside the rounding of the "
                f"float64 result; first at {i}: got {got[i].item()!r}, float64 "
                f"{new_p[i].item()!r}, allowed [{lowest[i].item()!r}, {highest[i].item()!r}]")
        for n in names:
            peak_state[n] = torch.maximum(peak_state[n], ref_states[n].abs())
    return {
        "param": param.cpu().double(), "initial": initial, "ambiguous": ambiguous,
        "failures": failures, "ref_states": ref_states,
        "states": {n: states[n].cpu().double() for n in names},
        "state_tolerance": {n: 4 * FP32_EPS * STEPS * peak_state[n] for n in names},
    }


def assert_within(actual, expected, tolerance, what, mask=None):
    error = (actual - expected).abs()
    bad = ~(error <= tolerance)  # NaN counts as bad
    if mask is not None:
        bad &= mask
    if bad.any():
        index = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements outside tolerance; first at "
            f"{index}: got {actual[index].item()!r}, reference {expected[index].item()!r}, "
            f"|error| {error[index].item():.3e} > tolerance {tolerance[index].item():.3e}; "
            f"max |error| {error.max().item():.3e}"
        )


def assert_result(result, dtype, label):
    keep = ~result["ambiguous"]
    # A handful of sign-ambiguous Lion elements is expected (about 1e-7 of element-steps).
    assert int(result["ambiguous"].sum()) <= max(1, result["ambiguous"].numel() // 1000), label
    assert not result["failures"], f"{label}: {result['failures'][0]}"
    for name in result["states"]:
        assert_within(result["states"][name], result["ref_states"][name],
                      result["state_tolerance"][name], f"{label} state {name}", keep)


@pytest.fixture(autouse=True)
def single_intra_op_thread():
    # The float64 references are many small tensor ops; on a loaded 2-core machine torch's
    # intra-op threads spin against each other (a 64k abs() goes from 30 us to 500 us). The
    # kernel's result does not depend on the thread count (test_thread_count_invariance).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# --------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize("optimizer", list(REFERENCES))
def test_matches_float64_reference(kernels, optimizer, point, dtype, size, device):
    hyper = {**BASE_HYPER[optimizer], **POINTS[point]}
    result = run_against_reference(kernels, optimizer, dtype, device, size, hyper)
    assert_result(result, dtype, f"{optimizer}/{point}/{dtype}/{size}/{device}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", list(REFERENCES))
def test_gnorm_scale(kernels, optimizer, device):
    # 0.3 is not a power of two, so the scaling really rounds; the fp32 state comparison sees a
    # missing scale even where the parameter update is scale invariant (Adam, Lion).
    hyper = {**BASE_HYPER[optimizer], **POINTS["discriminating"], "gnorm_scale": 0.3}
    result = run_against_reference(kernels, optimizer, torch.float32, device, 4097, hyper)
    assert_result(result, torch.float32, f"{optimizer}/gnorm_scale/{device}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("skip_zeros", [True, False])
def test_adam_skip_zeros(kernels, skip_zeros, dtype, device):
    size = 4097
    always_zero = torch.arange(size) % 7 == 0  # never see a gradient at all
    hyper = {**BASE_HYPER["adam"], **POINTS["discriminating"], "skip_zeros": skip_zeros}
    result = run_against_reference(kernels, "adam", dtype, device, size, hyper,
                                   zero_fraction=0.3, always_zero=always_zero)
    assert_result(result, dtype, f"adam/skip_zeros={skip_zeros}/{dtype}/{device}")
    kept_param = result["param"][always_zero]
    initial = result["initial"][always_zero].double()
    if skip_zeros:  # completely untouched: bit for bit, states still zero
        assert torch.equal(kept_param, initial)
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.count_nonzero(result["states"][name][always_zero]) == 0
    else:  # without skip_zeros the decay still shrinks them: (1 - 0.01)^50 ~ 0.6
        assert torch.all(kept_param.abs() < 0.7 * initial.abs() + 1e-3)


def test_thread_count_invariance(kernels):
    """at::parallel_for's split must not change a single bit of the CPU result."""
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        generator = torch.Generator().manual_seed(3)
        param = torch.randn(1 << 17, generator=generator)
        grad = torch.randn(1 << 17, generator=generator)
        states = {n: torch.zeros_like(param) for n in kernels.OPTIMIZER_STATES["adam"]}
        for t in range(1, 4):
            kernels.step("adam", param, grad, states, step=t,
                         hyper={**BASE_HYPER["adam"], **POINTS["discriminating"]})
        results.append(param)
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("optimizer", ["adam", "momentum", "rmsprop", "adagrad"])
def test_references_match_torch_optim(optimizer):
    """The float64 references above are torch.optim's algorithms (where it has them)."""
    hyper = {**BASE_HYPER[optimizer], **POINTS["discriminating"]}
    generator = torch.Generator().manual_seed(1)
    size = 257
    start = torch.randn(size, generator=generator, dtype=torch.float64)
    torch_param = torch.nn.Parameter(start.clone())
    lr, wd = hyper["lr"], hyper["weight_decay"]
    torch_optimizer = {
        "adam": lambda: torch.optim.AdamW([torch_param], lr=lr, weight_decay=wd,
                                          betas=(hyper["beta1"], hyper["beta2"]),
                                          eps=hyper["eps"]),
        "momentum": lambda: torch.optim.SGD([torch_param], lr=lr, weight_decay=wd,
                                            momentum=hyper["momentum"]),
        "rmsprop": lambda: torch.optim.RMSprop([torch_param], lr=lr, weight_decay=wd,
                                               alpha=hyper["alpha"], eps=hyper["eps"]),
        "adagrad": lambda: torch.optim.Adagrad([torch_param], lr=lr, weight_decay=wd,
                                               eps=hyper["eps"]),
    }[optimizer]()
    ref_p = start.clone()
    ref_states = {n: torch.zeros(size, dtype=torch.float64) for n in REFERENCE_STATES[optimizer]}
    for t in range(1, STEPS + 1):
        grad = torch.randn(size, generator=generator, dtype=torch.float64)
        torch_param.grad = grad.clone()
        torch_optimizer.step()
        ref_p, ref_states, _, _ = REFERENCES[optimizer](ref_p, grad, ref_states, t, hyper)
    # Same algorithm, operations in a different order: float64 rounding only (~1e-16 per op).
    torch.testing.assert_close(ref_p, torch_param.detach(), rtol=0, atol=1e-12)


REFERENCE_STATES = {
    "adam": ("exp_avg", "exp_avg_sq"),
    "momentum": ("momentum_buffer",),
    "rmsprop": ("square_avg",),
    "adagrad": ("state_sum",),
}
