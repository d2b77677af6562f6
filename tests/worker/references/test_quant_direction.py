"""Direction for quantized states (issue 37): the low-bit fixture (tests/fixtures/lowbit, AdamW with
8-bit blockwise states, torchao-shaped) against the quantization-aware float64 reference
(worker/references/blockwise_quant.py), judged by service.core.verdicts in quantization steps.

Baseline: round-to-nearest codes. Mutants: rounding codes down (a quantization change that moves
every state by about half a step: must read farther), and the same-math denominator reorder (no
state moves beyond float32 rounding: must read same). Each run's figure per step is the mean over
the states' elements of |state - reference| in quantization steps.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from service.core.results import CaseResult, GradientStreamSpec, Trajectory
from service.core.verdicts import QUANT_STEP_MARGIN, compare_case
from tests.fixtures.lowbit.lowbit_adamw import Blockwise8State, LowBitAdamW
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case
from worker.references.blockwise_quant import Codec, QuantAwareAdamW, state_steps

SIZE, STEPS = 4096, 12
HYPER = {**OPTIMIZER_HYPER_DEFAULTS["adam"], "lr": 1e-2, "weight_decay": 0.1}
CASE = make_case(optimizer="adam", family="8bit_blockwise", param_dtype="float32", hyper=HYPER,
                 gradient=GradientStreamSpec(), seed=0, size=SIZE, steps=STEPS)
# The fixture's codes: signed on -127..127, the second moment's square root on 0..255, per 256.
CODEC = Codec.for_family("8bit_blockwise")


def _run(**options: object) -> CaseResult:
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(SIZE, generator=generator)
    param = torch.nn.Parameter(start.clone(), requires_grad=False)
    optimizer = LowBitAdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"], **options)
    options_64 = dict(lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                      weight_decay=HYPER["weight_decay"])
    reference = QuantAwareAdamW(start, CODEC, **options_64)
    float64 = QuantAwareAdamW(start, None, **options_64)  # torch.optim's AdamW in float64: no quantization
    steps, digests, distance, params = [], [], [], []
    for _ in range(STEPS):
        grad = torch.randn(SIZE, generator=generator)  # open loop: the same stream for every run
        param.grad = grad
        optimizer.step()
        reference.step(grad)
        float64.step(grad)
        state = optimizer.state[param]
        assert isinstance(state["exp_avg"], Blockwise8State)  # quantized, not the silent fp32 fallback
        states = {name: state[name].dequantize() for name in ("exp_avg", "exp_avg_sq")}
        steps.append(state_steps(states, reference.states(), CODEC))
        distance.append((param.detach().double() - float64.p).abs().max().item())
        params.append((param.detach().double() - reference.p).abs().max().item())
        bits = b"".join(t.numpy().tobytes() for t in (param.detach(), state["exp_avg"].codes, state["exp_avg_sq"].codes,
                                                       state["exp_avg"].scale, state["exp_avg_sq"].scale))
        digests.append("od2:" + hashlib.blake2b(bits, digest_size=16).hexdigest())
    return CaseResult(case=CASE, status="ok", trajectory=Trajectory(
        # the same-precision distance (to torch.optim in float32) is taken as the float64 one: they
        # differ by float32 rounding (~1e-7), the distance itself is quantization error (~1e-3)
        ref64_max_abs=distance, ref64_max_rel=distance, same_precision_max_abs=distance, nonfinite_count=[0] * STEPS, digests=digests,
        quant_ref_steps=steps, quant_ref_max_abs=params))


@pytest.fixture(scope="module")
def baseline() -> CaseResult:
    return _run()


def test_a_correct_run_stays_within_a_hundredth_of_a_step_of_the_reference(baseline: CaseResult):
    # float32 vs float64 arithmetic moves a code only where a value lies within float32 rounding of
    # a code boundary: a few elements in a thousand, one code each.
    assert max(baseline.trajectory.quant_ref_steps) < 0.01, baseline.trajectory.quant_ref_steps


def test_rounding_codes_down_reads_farther_in_quantization_steps(baseline: CaseResult):
    mutant = _run(rounding="down")
    verdict = compare_case(mutant, baseline)
    assert verdict.verdict == "changed" and verdict.first_divergent_step == 1
    # every element's codes move by half a step on average; QUANT_STEP_MARGIN is a quarter
    assert verdict.commit_peak_quant_steps > verdict.baseline_peak_quant_steps + 2 * QUANT_STEP_MARGIN, verdict
    assert verdict.direction == "farther" and verdict.final_direction == "farther", verdict


def test_the_same_math_reorder_reads_same(baseline: CaseResult):
    refactor = _run(denominator="divided")
    verdict = compare_case(refactor, baseline)
    assert verdict.verdict == "changed", verdict  # the parameters' bits moved
    assert abs(verdict.commit_peak_quant_steps - verdict.baseline_peak_quant_steps) < QUANT_STEP_MARGIN
    assert verdict.direction == "same" and verdict.final_direction == "same", verdict


def test_decay_after_the_update_moves_the_parameters_alone_and_reads_farther(baseline: CaseResult):
    # The states do not depend on the parameters in an open loop: the parameters' distance to the
    # quantization-aware reference is what sees it.
    mutant = _run(decay="after")
    verdict = compare_case(mutant, baseline)
    assert abs(verdict.commit_peak_quant_steps - verdict.baseline_peak_quant_steps) < QUANT_STEP_MARGIN
    assert verdict.direction == "farther", verdict


def test_a_32bit_case_is_judged_on_float64_alone(baseline: CaseResult):
    # The step figures count for quantized families only: the same trajectories claimed as 32bit
    # are judged on the parameters' distance to unquantized float64, and report no step figure.
    as_32 = {"case": CASE.model_copy(update={"family": "32bit"})}
    verdict = compare_case(_run(rounding="down").model_copy(update=as_32), baseline.model_copy(update=as_32))
    assert verdict.commit_peak_quant_steps is None and verdict.direction is not None


def test_the_engine_records_the_step_figures_and_the_verdict_reads_them():
    # End to end through the engine (worker/engine/trajectory.run_case): the fixture's adapter names
    # its codec, so each step records the states' distance to the quantization-aware reference.
    from tests.fixtures.lowbit.adapter import LowBitAdamWFamily
    from worker.engine.trajectory import run_case

    case = make_case(optimizer="adam", family="8bit_blockwise", param_dtype="float32", hyper=HYPER,
                     gradient=GradientStreamSpec(), seed=0, size=SIZE, steps=6)
    cpu = torch.device("cpu")
    results = {name: run_case(case, cpu, families={"8bit_blockwise": LowBitAdamWFamily(**options)})
               for name, options in (("base", {}), ("down", {"rounding": "down"}),
                                     ("reorder", {"denominator": "divided"}))}
    base = results["base"].trajectory
    assert len(base.quant_ref_steps) == 6 and max(base.quant_ref_steps) < 0.01, base.quant_ref_steps
    assert compare_case(results["down"], results["base"]).direction == "farther"
    assert compare_case(results["reorder"], results["base"]).direction == "same"


def test_a_quantized_case_without_the_step_figures_on_both_sides_has_no_direction(baseline: CaseResult):
    # A baseline stored before its engine recorded the figures (or a library whose adapter names no
    # codec): the float64 distance is quantization error, so no direction, and the message says why.
    older = baseline.model_copy(update={"trajectory": baseline.trajectory.model_copy(
        update={"quant_ref_steps": None, "quant_ref_max_abs": None})})
    verdict = compare_case(_run(rounding="down"), older)
    assert verdict.verdict == "changed" and verdict.direction is None and verdict.final_direction is None
    assert verdict.message.startswith("direction not judged") and "the baseline recorded no distance" in verdict.message
