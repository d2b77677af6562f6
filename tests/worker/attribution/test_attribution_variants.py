"""The attribution's float64 variants (worker/attribution/variants.py): the uncatalogued setting is
the float64 reference itself, and each variant differs from it where, and only where, it must."""

from __future__ import annotations

import pytest
import torch

from worker.attribution import variants
from worker.battery import load_battery
from worker.engine.gradients import GradientStream, initial_parameters
from worker.references.optimizers import make_reference

# The flat cases: a layout case is replayed one tensor at a time (analysis.analyze_layout), never whole.
QUICK = [c for c in load_battery("quick").expand() if c.layout is None]
# Each optimizer in open and closed loop (float32), skip_zeros, and gnorm_scale at 16 bits.
PICKED = list({(c.optimizer, c.gradient.kind, c.hyper.get("skip_zeros", False)): c
               for c in QUICK if c.family == "32bit" and c.param_dtype == "float32"}.values()) + [
    c for c in QUICK if c.family == "32bit" and c.optimizer in ("adam", "lion") and c.param_dtype != "float32"][:2]


@pytest.mark.parametrize("case", PICKED, ids=lambda c: c.case_id.split("#")[0])
def test_the_correct_setting_is_the_float64_reference(case):  # noqa: ANN001
    path = variants.replay(case, [variants.CORRECT])["reference"]
    dtype = variants._DTYPES[case.param_dtype]
    reference = make_reference(case, initial_parameters(case.seed, case.size).to(dtype).to(torch.float64))
    stream = GradientStream(case.gradient, seed=case.seed, size=case.size, device="cpu", grad_dtype=dtype)
    for step in range(1, case.steps + 1):
        reference.step(step, stream.reference_gradient(step, reference.param))
        # Both are float64 evaluations of one formula, in another association order at most: a few
        # float64 roundings of parameters of magnitude <= ~40, far below any float32 ulp (~1e-7).
        assert (path[step - 1] - reference.param).abs().max().item() <= 1e-12, step


def test_variants_differ_only_where_their_hyperparameter_is_on():
    by_id = {c.case_id.split("#")[0]: c for c in QUICK}
    decayed = by_id["adam.32bit.fp32.lr=0.1.wd=0.1.open.n4097.s0.t20"]
    undecayed = by_id["adam.32bit.fp32.lr=0.1.wd=0.0.open.n4097.s0.t20"]
    names = {v.name for v in variants.applicable(decayed)}
    assert {"decay_after_update", "eps_inside_sqrt", "betas_swapped", "bias_correction1_missing"} <= names
    assert "decay_after_update" not in {v.name for v in variants.applicable(undecayed)}
    assert "skip_zeros_ignored" not in names and "gnorm_scale_ignored" not in names
    paths = variants.replay(decayed, [variants.CORRECT, variants.BY_NAME["decay_after_update"]])
    # p(1 - lr wd) - u  versus  (p - u)(1 - lr wd): they differ by lr*wd*u at step 1, and Adam's
    # first update has |u| = lr |g|/(|g| + eps) < lr: the largest gap is just under lr^2 wd = 1e-3.
    gap = (paths["decay_after_update"][0] - paths["reference"][0]).abs().max().item()
    assert 0.99e-3 < gap < 1e-3


def _rounded_paths(case, variant_name):  # noqa: ANN001, ANN202
    """(commit, baseline): the variant's and the algorithm's float64 trajectories rounded to float32
    at each step, as stand-ins for two kernels that implement them (rounding-level apart)."""
    paths = variants.replay(case, [variants.CORRECT, variants.BY_NAME[variant_name]])
    return paths[variant_name].to(torch.float32).numpy(), paths["reference"].to(torch.float32).numpy()


@pytest.mark.parametrize("case_name, variant_name", [
    ("adam.32bit.fp32.lr=0.1.wd=0.1.open.n4097.s0.t20", "eps_inside_sqrt"),
    # the same misplacement written the other way round, √(v + eps)/√bc2 (catalogue eps/adam_inside_sqrt)
    ("adam.32bit.fp32.lr=0.1.wd=0.1.open.n4097.s0.t20", "eps_inside_sqrt_before_bias_correction"),
    ("ademamix.32bit.fp32.lr=0.1.wd=0.1.closed.n4097.s0.t20", "bias_correction1_missing"),
    # parameters that grow far beyond the baseline's: the residual is counted in ulps of the larger
    ("ademamix.32bit.fp32.lr=0.1.wd=0.1.open.n4097.s0.t20", "bias_correction2_missing"),
    ("lion.32bit.fp32.lr=0.01.wd=0.1.open.n4097.s0.t20", "decay_after_update"),
    ("rmsprop.32bit.fp32.lr=0.01.wd=0.1.closed.n4097.s0.t20", "decay_decoupled"),
    ("momentum.32bit.fp32.lr=0.01.wd=0.1.open.n4097.s0.t20", "momentum_dampened"),
])
def test_analysis_names_the_variant_a_trajectory_follows(case_name, variant_name):  # noqa: ANN001
    from worker.attribution.analysis import analyze

    # Five steps: every variant here differs from the algorithm from step 1 or 2.
    case = next(c for c in QUICK if c.case_id.startswith(case_name + "#")).model_copy(update={"steps": 5})
    commit, baseline = _rounded_paths(case, variant_name)
    step = next(t for t in range(case.steps) if (commit[t] != baseline[t]).any()) + 1
    found = analyze(case, commit, baseline, step)
    assert (found["class"], found["variant"]) == ("semantic", variant_name), found["candidates"]


def test_a_precision_loss_beyond_rounding_is_named_and_called_precision():
    """1 − βᵗ from float32 powers (catalogue precision/adam_bias_correction_powf): far beyond a
    rounding (hundreds of ulps of the step), yet the same algorithm: class precision, its variant
    named; the rounded reference against itself stays rounding-level (nothing to name)."""
    from worker.attribution.analysis import analyze

    case = next(c for c in QUICK if c.case_id.startswith("adam.32bit.fp32.lr=0.1.wd=0.1.open.n4097.s0.t20#"))
    commit, baseline = _rounded_paths(case, "bias_correction_float32_powers")
    step = next(t for t in range(case.steps) if (commit[t] != baseline[t]).any()) + 1
    found = analyze(case, commit, baseline, step)
    assert (found["class"], found["variant"]) == ("precision", "bias_correction_float32_powers"), found["candidates"]
    assert found["first_step_ulps"] > 20  # not a rounding: why it needs a name of its own


def test_large_cases_replay_a_subset_and_still_name_the_variant(monkeypatch):  # noqa: ANN001
    from worker.attribution import reading
    from worker.attribution.analysis import analyze

    # The subset's rule at a smaller scale (the real cap, 65536, needs a case 16x this one).
    monkeypatch.setattr(reading, "MAX_REPLAYED_ELEMENTS", 1024)
    monkeypatch.setattr(reading, "TOP_CHANGED_ELEMENTS", 64)
    MAX_REPLAYED_ELEMENTS = reading.MAX_REPLAYED_ELEMENTS
    template = next(c for c in QUICK if c.case_id.startswith("adam.32bit.fp32.lr=0.1.wd=0.1.open.n4097"))
    case = template.model_copy(update={"steps": 3})
    commit, baseline = _rounded_paths(case, "decay_after_update")
    found = analyze(case, commit, baseline, 1)
    assert found["replayed_elements"] <= MAX_REPLAYED_ELEMENTS
    assert (found["class"], found["variant"]) == ("semantic", "decay_after_update"), found["candidates"]
    # The same parameters at every step while the digests differ: the state alone changed, which
    # the parameters cannot bound (issue 37): never rounding-level, and with no element moved and
    # the states unread, never semantic either (issue 47): not attributed, saying why.
    same = analyze(case, baseline, baseline.copy(), 1)
    assert same["first_step_ulps"] == 0 and same["class"] == "unknown" and "state changed" in same["note"]
