"""bitsandbytes 0.50.2 (installed from the package index) through worker.adapters.bitsandbytes, on
the CPU: its CPU backend runs the same functional API the CUDA library serves on a GPU.

The AdamW tolerance is derived, not chosen: a first-order running-error bound (the `Bounded`
arithmetic of worker/references/blockwise8.py: every float32 operation is exact times (1 + d),
|d| <= 2**-24) carried through AdamW in the order bnb's 32-bit "adam" evaluates it, element by
element and step by step, from the same open-loop float32 gradients torch.optim.AdamW (float64)
gets. Open loop, so the gradients are identical and the bound covers the optimizer's arithmetic
alone. The bound is tight enough to tell the two decay orderings of PR 2040 apart at the
discriminating point, which the last assertion of the bound test proves.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from service.core.results import GradientStreamSpec  # noqa: E402
from worker.adapters import get_adapter  # noqa: E402
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, load_battery, make_case  # noqa: E402
from worker.engine.corun import run_battery  # noqa: E402
from worker.engine.gradients import GradientStream, initial_parameters  # noqa: E402
from worker.engine.host import KernelHost  # noqa: E402
from worker.references.blockwise8 import BOUND_SAFETY, Bounded  # noqa: E402

# The float64 reference and the float64 evaluation of the bound's exact values differ only in
# float64 rounding (~1e-16 relative on values below 10): 1e-12 absolute covers it with room.
FLOAT64_SLACK = 1e-12


def test_bitsandbytes_is_the_version_the_adapter_targets():
    assert bnb.__version__ == "0.50.2"


def _adam_case(lr: float, wd: float, *, steps: int = 20, size: int = 4097, seed: int = 0):
    hyper = {**OPTIMIZER_HYPER_DEFAULTS["adam"], "lr": lr, "weight_decay": wd}
    return make_case(optimizer="adam", family="32bit", param_dtype="float32", hyper=hyper,
                     gradient=GradientStreamSpec(kind="open"), seed=seed, size=size, steps=steps)


def _bnb_order_bound(p, g, m, v, h, t):
    """One AdamW step in the order bnb's 32-bit 'adam' computes it, with its error bound."""
    b1, b2, lr, wd = h["beta1"], h["beta2"], h["lr"], h["weight_decay"]
    m = Bounded.const(b1) * m + Bounded.const(1 - b1) * g
    v = Bounded.const(b2) * v + Bounded.const(1 - b2) * (g * g)
    correction1, correction2 = 1 - b1 ** t, math.sqrt(1 - b2 ** t)
    if wd > 0:
        p = p * Bounded.const(1 - lr * wd)
    update = m / (v.sqrt() + Bounded.const(h["eps"] * correction2))
    p = p + Bounded.const(-lr * correction2 / correction1) * update
    return p, m, v


@pytest.mark.parametrize("lr,wd", [(0.1, 0.1), (1e-3, 1e-2), (0.1, 0.0)])
def test_adamw_trajectory_stays_within_the_derived_float32_bound_of_torch_adamw(lr, wd):
    case = _adam_case(lr, wd)
    adapter = get_adapter("bitsandbytes")
    adapter.load("installed")
    family = adapter.families()["32bit"]
    param = initial_parameters(case.seed, case.size)
    states = family.init_states(case, param)
    stream = GradientStream(case.gradient, seed=case.seed, size=case.size, device="cpu", grad_dtype=torch.float32)

    reference = torch.nn.Parameter(param.to(torch.float64), requires_grad=False)
    adamw = torch.optim.AdamW([reference], lr=lr, betas=(case.hyper["beta1"], case.hyper["beta2"]),
                              eps=case.hyper["eps"], weight_decay=wd, foreach=False)
    zero = torch.zeros(case.size, dtype=torch.float64)
    bound_p, bound_m, bound_v = Bounded(param.to(torch.float64)), Bounded(zero.clone()), Bounded(zero.clone())
    # The other ordering (decay applied to p + update), exact, for the discrimination check.
    decay_after = param.to(torch.float64)
    m64, v64 = zero.clone(), zero.clone()

    for step in range(1, case.steps + 1):
        grad = stream.kernel_gradient(step, param)
        family.step_states(case, param, grad, states, step)
        g64 = grad.to(torch.float64)
        reference.grad = g64.clone()
        adamw.step()
        bound_p, bound_m, bound_v = _bnb_order_bound(bound_p, Bounded(g64), bound_m, bound_v, case.hyper, step)

        assert torch.allclose(bound_p.v, reference.detach(), rtol=0, atol=FLOAT64_SLACK)
        excess = (param.to(torch.float64) - reference.detach()).abs() - (BOUND_SAFETY * bound_p.e + FLOAT64_SLACK)
        assert excess.max() <= 0, f"step {step}: bnb is {excess.max():.3e} outside the float32 bound"

        m64 = case.hyper["beta1"] * m64 + (1 - case.hyper["beta1"]) * g64
        v64 = case.hyper["beta2"] * v64 + (1 - case.hyper["beta2"]) * g64 * g64
        m_hat, v_hat = m64 / (1 - case.hyper["beta1"] ** step), v64 / (1 - case.hyper["beta2"] ** step)
        decay_after = (decay_after - lr * m_hat / (v_hat.sqrt() + case.hyper["eps"])) * (1 - lr * wd)

    gap = (decay_after - reference.detach()).abs()
    if lr * lr * wd >= 1e-3:
        # At the discriminating point the other ordering leaves the bound on many elements: a bnb
        # whose CPU path decayed after the update would fail this test.
        assert (gap > BOUND_SAFETY * bound_p.e + FLOAT64_SLACK).sum() > case.size // 10
        assert gap.max() > 100 * bound_p.e.max()


def test_quick_battery_runs_through_the_bitsandbytes_adapter():
    battery = load_battery("quick")
    run = run_battery(battery, "installed", device="cpu", adapter="bitsandbytes")
    assert len(run.cases) == len(battery.expand())
    broken = [(c.case.case_id, c.message) for c in run.cases if c.status != "ok"]
    assert not broken
    by_id = {c.case.case_id: c for c in run.cases}
    for result in run.cases:
        assert sum(result.trajectory.nonfinite_count) == 0, result.case.case_id
        assert len(result.trajectory.digests) == result.case.steps
        if result.case.family == "32bit" and result.case.param_dtype == "float32" \
                and not result.case.hyper.get("skip_zeros"):
            # fp32 runs of bnb's CPU backend follow the float64 references (torch.optim, the papers)
            # to float32 rounding over 20 steps: far below the ~1e-3 an ordering change makes.
            assert result.trajectory.ref64_max_abs[-1] < 1e-4, result.case.case_id
    # What optdrift reports about bnb 0.50.2's CPU backend: its 32-bit Adam ignores skip_zeros
    # (exactly-zero gradients still decay and move the parameter), so the skip_zeros case leaves
    # the reference, which holds those elements still.
    skip = next(c for case_id, c in by_id.items() if "skip_zeros=True" in case_id and ".32bit." in case_id)
    assert skip.trajectory.ref64_max_abs[-1] > 1e-2


def test_ademamix_state1_is_stacked_fast_then_slow():
    adapter = get_adapter("bitsandbytes")
    adapter.load("installed")
    hyper = {**OPTIMIZER_HYPER_DEFAULTS["ademamix"], "lr": 0.1, "weight_decay": 0.1}
    for family_name in ("32bit", "8bit_blockwise"):
        case = make_case(optimizer="ademamix", family=family_name, param_dtype="float32", hyper=hyper,
                         gradient=GradientStreamSpec(), seed=0, size=300, steps=1)
        family = adapter.families()[family_name]
        param = initial_parameters(0, 300)
        states = family.init_states(case, param)
        assert states["state1"].shape == (2, 300)
        grad = GradientStream(case.gradient, seed=0, size=300, device="cpu", grad_dtype=torch.float32).kernel_gradient(1, param)
        family.step_states(case, param, grad, states, 1)
        if family_name == "32bit":
            fast, slow = states["state1"]
            torch.testing.assert_close(fast, (1 - hyper["beta1"]) * grad, rtol=2 ** -22, atol=0)
            torch.testing.assert_close(slow, (1 - hyper["beta3"]) * grad, rtol=2 ** -22, atol=0)
        else:
            assert states["absmax1"].shape == (2, 2)  # two blocks of 256 for each of fast and slow
            # Each row's absmax is its state's largest magnitude: (1-beta1)|g| and (1-beta3)|g|.
            ratio = states["absmax1"][0] / states["absmax1"][1]
            torch.testing.assert_close(ratio, torch.full_like(ratio, (1 - hyper["beta1"]) / (1 - hyper["beta3"])),
                                       rtol=1e-5, atol=0)


def test_a_bitsandbytes_source_tree_loads_in_a_kernel_host_and_a_wrong_one_is_broken(tmp_path):
    installed = Path(bnb.__file__).parent
    tree = tmp_path / "bitsandbytes-src"
    # A source tree after its build: the package with its CPU library in place (GPU libraries left out).
    shutil.copytree(installed, tree / "bitsandbytes",
                    ignore=lambda d, names: [n for n in names if n.endswith(".so") and "cpu" not in n or n == "__pycache__"])
    case = _adam_case(0.1, 0.1, steps=3, size=513)
    with KernelHost(tree, device="cpu", adapter="bitsandbytes") as host:
        result = host.run(case)
    assert result.status == "ok", result.message
    with KernelHost(tmp_path / "empty", device="cpu", adapter="bitsandbytes", startup_timeout_s=60) as host:
        result = host.run(case)
    assert result.status == "broken" and "holds no bitsandbytes package" in result.message
