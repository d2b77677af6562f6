"""Direction for quantized states on the bundled 8-bit blockwise kernels (issue 37), on the CPU
builds: the adapter names its dynamic-map codec (worker/adapters/bundled_8bit.py), the engine runs
the quantization-aware float64 reference beside each 8-bit Adam case (worker/engine/trajectory.py,
worker/references/blockwise_quant.py) and records the states' mean distance to it in quantization
steps, which service.core.verdicts judges direction on (QUANT_STEP_MARGIN = 0.25 step).

Builds (one kernel host each, the slow engine's run_case): the bundled tree; quant8/round_down
(codes rounded down to the map value below: about half the elements one code low at every step,
and the error feeds the next step); precision/adam_second_moment_reassociated ((1-b2)*(g*g) as
((1-b2)*g)*g: the same math, one float32 rounding moved, so a second-moment code moves only where
that rounding decides the nearest code). Cases: Adam, fp32, 12 steps: open loop at the
discriminating point (lr 0.1, wd 0.1) and closed loop at the typical point (lr 1e-3, wd 1e-2), n
4097 (a partial last block); the ci battery's 8-bit Adam case (n 257, half the gradients zero,
skip_zeros, gnorm_scale 0.5), where the reassociation moves codes from step 1.
"""

from __future__ import annotations

import pytest

from service.core.results import CaseResult, GradientStreamSpec
from service.core.verdicts import QUANT_STEP_MARGIN, compare_case
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case
from worker.engine.host import KernelHost

pytestmark = pytest.mark.slow

STEPS, SIZE = 12, 4097
ADAM = OPTIMIZER_HYPER_DEFAULTS["adam"]
CASES = [
    make_case(optimizer="adam", family="8bit_blockwise", param_dtype="float32",
              hyper={**ADAM, "lr": 0.1, "weight_decay": 0.1}, gradient=GradientStreamSpec(), seed=0,
              size=SIZE, steps=STEPS),
    make_case(optimizer="adam", family="8bit_blockwise", param_dtype="float32",
              hyper={**ADAM, "lr": 1e-3, "weight_decay": 1e-2}, gradient=GradientStreamSpec(kind="closed"),
              seed=1, size=SIZE, steps=STEPS),
    make_case(optimizer="adam", family="8bit_blockwise", param_dtype="float32",
              hyper={**ADAM, "lr": 0.1, "weight_decay": 0.1, "gnorm_scale": 0.5, "skip_zeros": True},
              gradient=GradientStreamSpec(kind="open", zero_fraction=0.5), seed=0, size=257, steps=STEPS),
]
MUTANTS = ("quant8/round_down", "precision/adam_second_moment_reassociated")


def _run(library: str) -> list[CaseResult]:
    with KernelHost(library, device="cpu") as host:
        results = [host.run(case) for case in CASES]
    assert all(r.status == "ok" for r in results), [r.message for r in results]
    return results


@pytest.fixture(scope="module")
def runs(kernels_build, csrc_under_test, build_cache_dir, tmp_path_factory) -> dict[str, list[CaseResult]]:
    """Each build's results: "bundled", "bundled again" (a second host on the same build), and the
    mutants by catalogue id (built once into the session's digest-keyed cache)."""
    from worker.build import build_extension
    from worker.sensitivity.catalogue import load_catalogue, mutant_tree

    catalogue = {m.id: m for m in load_catalogue()}
    results = {"bundled": _run(kernels_build.library_path), "bundled again": _run(kernels_build.library_path)}
    for mutant_id in MUTANTS:
        tree = mutant_tree(catalogue[mutant_id], csrc_under_test,
                           tmp_path_factory.mktemp(mutant_id.replace("/", "_")) / "csrc")
        built = build_extension(tree, cache_dir=build_cache_dir, cuda_archs=[])
        assert built.ok, built.error
        results[mutant_id] = _run(built.library_path)
    return results


def test_the_correct_kernels_stay_within_a_hundredth_of_a_step_of_the_reference(runs):
    # float32 against float64 arithmetic moves a code only where a state lies within float32
    # rounding of a code boundary: a few elements, one code each.
    for result in runs["bundled"]:
        figures = result.trajectory.quant_ref_steps
        assert len(figures) == STEPS and max(figures) < 0.01, (result.case.case_id, figures)
        assert len(result.trajectory.quant_ref_max_abs) == STEPS


def test_an_unchanged_tree_reads_unchanged(runs):
    for again, base in zip(runs["bundled again"], runs["bundled"]):
        assert again.trajectory.quant_ref_steps == base.trajectory.quant_ref_steps  # the same bits, the same figure
        assert compare_case(again, base).verdict == "unchanged"


def test_rounding_codes_down_reads_farther_in_quantization_steps(runs):
    for mutant, base in zip(runs["quant8/round_down"], runs["bundled"]):
        verdict = compare_case(mutant, base)
        assert verdict.verdict == "changed" and verdict.first_divergent_step == 1, verdict
        # about half of the elements one code low: half a step on average, QUANT_STEP_MARGIN is a quarter
        assert verdict.commit_peak_quant_steps > verdict.baseline_peak_quant_steps + 2 * QUANT_STEP_MARGIN, verdict
        assert verdict.direction == "farther" and verdict.final_direction == "farther", verdict


def test_the_same_math_reassociation_reads_same(runs):
    changed = 0
    for reorder, base in zip(runs["precision/adam_second_moment_reassociated"], runs["bundled"]):
        verdict = compare_case(reorder, base)
        if verdict.verdict == "unchanged":
            continue  # no state landed on a boundary the last bit decides in this case
        changed += 1
        assert abs(verdict.commit_peak_quant_steps - verdict.baseline_peak_quant_steps) < QUANT_STEP_MARGIN
        assert verdict.direction == "same" and verdict.final_direction == "same", verdict
    assert changed, "the reorder moved no code: the test would say nothing"
