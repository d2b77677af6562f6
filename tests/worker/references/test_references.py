"""References against first steps computed by hand (plain Python floats, not the tensor code).

Tolerance: 1e-15 relative. The hand computation and the float64 tensor code evaluate the same
formula in a possibly different order, so they may differ by a few float64 ulps (2.2e-16 each);
any real mistake (a missing bias correction, decay after the update, wrong sign) is >= 1e-4.
"""

import math

import pytest
import torch

from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case
from service.core.results import GradientStreamSpec
from worker.references.optimizers import AdEMAMixReference, LionReference, make_reference


def _case(optimizer, **hyper):
    full = {**OPTIMIZER_HYPER_DEFAULTS[optimizer], **hyper}
    return make_case(optimizer=optimizer, family="32bit", param_dtype="float32", hyper=full,
                     gradient=GradientStreamSpec(), seed=0, size=2, steps=2)


def _close(tensor, expected):
    assert tensor.tolist() == pytest.approx(expected, rel=1e-15, abs=1e-15)


def test_lion_first_two_steps_by_hand():
    ref = LionReference(_case("lion", lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.1),
                        torch.tensor([1.0, -2.0], dtype=torch.float64))
    ref.step(1, torch.tensor([0.5, -0.25], dtype=torch.float64))
    # c = 0.1*g -> sign (+1, -1); p = p*(1 - 0.01) - 0.1*sign; m = 0.01*g
    _close(ref.param, [1.0 * 0.99 - 0.1, -2.0 * 0.99 + 0.1])
    _close(ref.exp_avg, [0.005, -0.0025])
    ref.step(2, torch.tensor([-0.1, 0.0], dtype=torch.float64))
    # c = 0.9*m + 0.1*g = (-0.0055, -0.00225) -> sign (-1, -1). (Interpolating with beta2 instead
    # would give +0.00395 for the first element: this step tells the two betas apart.)
    _close(ref.param, [(0.99 - 0.1) * 0.99 + 0.1, (-1.98 + 0.1) * 0.99 + 0.1])
    _close(ref.exp_avg, [0.99 * 0.005 + 0.01 * -0.1, 0.99 * -0.0025])


def test_lion_sign_of_zero_is_zero_so_only_decay_acts():
    ref = LionReference(_case("lion", lr=0.1, weight_decay=0.5), torch.tensor([3.0], dtype=torch.float64))
    ref.step(1, torch.tensor([0.0], dtype=torch.float64))
    _close(ref.param, [3.0 * (1 - 0.05)])


def test_ademamix_first_two_steps_by_hand():
    lr, b1, b2, b3, alpha, eps, wd = 0.1, 0.9, 0.999, 0.8, 5.0, 1e-8, 0.1
    ref = AdEMAMixReference(_case("ademamix", lr=lr, beta1=b1, beta2=b2, beta3=b3, alpha=alpha, eps=eps,
                                  weight_decay=wd), torch.tensor([1.0, -2.0], dtype=torch.float64))
    p = [1.0, -2.0]
    m1, m2, nu = [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
    for t, g in ((1, [0.5, -0.25]), (2, [-1.0, 0.5])):
        ref.step(t, torch.tensor(g, dtype=torch.float64))
        for i in range(2):
            m1[i] = b1 * m1[i] + (1 - b1) * g[i]
            m2[i] = b3 * m2[i] + (1 - b3) * g[i]
            nu[i] = b2 * nu[i] + (1 - b2) * g[i] * g[i]
            update = (m1[i] / (1 - b1 ** t) + alpha * m2[i]) / (math.sqrt(nu[i] / (1 - b2 ** t)) + eps)
            p[i] = p[i] - lr * (update + wd * p[i])
        _close(ref.param, p)
        _close(ref.exp_avg_slow, m2)
    # Step 1 closed form: update = sign(g)*(1 + alpha*(1-b3)) up to eps.
    assert (1 - lr * wd) * 1.0 - lr * (1 + alpha * (1 - b3)) == pytest.approx(0.99 - 0.2, rel=1e-7)


def test_adamw_reference_decays_before_the_update():
    lr, wd, eps = 0.1, 0.1, 1e-8
    ref = make_reference(_case("adam", lr=lr, weight_decay=wd, eps=eps), torch.tensor([1.0, -2.0], dtype=torch.float64))
    ref.step(1, torch.tensor([0.5, -0.25], dtype=torch.float64))
    # Step 1: m_hat = g, v_hat = g^2 -> p*(1-lr*wd) - lr*g/(|g|+eps). Decay after the update would
    # give (p - lr*g/(|g|+eps))*(1-lr*wd), 1e-3 away.
    _close(ref.param.detach(), [1.0 * 0.99 - lr * 0.5 / (0.5 + eps), -2.0 * 0.99 + lr * 0.25 / (0.25 + eps)])


def test_gnorm_scale_scales_the_gradient_the_reference_sees():
    init = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    g = torch.tensor([0.5, -0.25, 3.0], dtype=torch.float64)
    for optimizer in OPTIMIZER_HYPER_DEFAULTS:
        scaled = make_reference(_case(optimizer, gnorm_scale=0.25, weight_decay=0.01), init)
        plain = make_reference(_case(optimizer, weight_decay=0.01), init)
        for t in (1, 2):
            scaled.step(t, g)
            plain.step(t, g * 0.25)  # power of two: exact
        assert torch.equal(scaled.param.detach(), plain.param.detach()), optimizer


def test_skip_zeros_leaves_zero_gradient_elements_untouched_and_others_as_adamw():
    init = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    skipping = make_reference(_case("adam", lr=0.1, weight_decay=0.1, skip_zeros=True), init)
    plain = make_reference(_case("adam", lr=0.1, weight_decay=0.1), init)
    grads = [torch.tensor([0.5, 0.0, 1.0], dtype=torch.float64), torch.tensor([0.5, 0.0, 0.0], dtype=torch.float64)]
    for t, g in enumerate(grads, start=1):
        skipping.step(t, g)
    assert skipping.param[1].item() == -2.0  # never a nonzero gradient: not even decayed
    plain.step(1, grads[0])
    assert skipping.param[0].item() != plain.param[0].item()  # sanity: step 2 moved element 0
    plain.step(2, grads[1])
    assert skipping.param[0].item() == plain.param[0].item()
    # Element 2 took step 1 only; at step 2 its parameter and states were restored.
    once = make_reference(_case("adam", lr=0.1, weight_decay=0.1), init)
    once.step(1, grads[0])
    assert skipping.param[2].item() == once.param[2].item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZER_HYPER_DEFAULTS))
def test_same_precision_reference_keeps_the_parameter_dtype(optimizer, dtype):
    ref = make_reference(_case(optimizer, lr=0.01, weight_decay=0.01), torch.tensor([1.0, -2.0], dtype=dtype))
    ref.step(1, torch.tensor([0.5, -0.25], dtype=dtype))
    assert ref.param.dtype == dtype and torch.isfinite(ref.param).all()
    assert not torch.equal(ref.param.detach(), torch.tensor([1.0, -2.0], dtype=dtype))
