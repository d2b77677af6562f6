"""Issue 17 attribution on real builds of mutated kernel trees (CPU): the worker path itself
(worker.attribution.record: kernel hosts on both builds, the analysis in its torch child).

Builds share the suite's digest cache: the decay-after-update tree is the demo's and
test_engine_check's, the one-ulp tree test_engine_check's, so a warm cache builds nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from service.core import attribution_view
from service.core.verdicts import compare_runs
from worker.attribution.analysis import MATCH_ULPS_PER_STEP, ROUNDING_ULPS_PER_STEP
from worker.attribution.record import attribute_changed
from worker.battery import load_battery
from worker.build import build_extension
from worker.engine.corun import corun_battery
from worker.mutations import copy_tree, decay_after_update

# Adam's step size lr/(1 - beta1^t) in float32 from float32 operands instead of double, rounded
# once: the same formula with another order of rounding (tests/worker/engine/test_engine_check.py's ONE_ULP).
ONE_ULP = ("optimizer_math.h",
           "rule.step_size = static_cast<float>(lr / bias_correction1);",
           "rule.step_size = static_cast<float>(lr) / static_cast<float>(bias_correction1);")
QUICK = {case.case_id.split("#")[0]: case for case in load_battery("quick").expand()}
FP32_OPEN = "adam.32bit.fp32.lr=0.1.wd=0.1.open.n4097.s0.t20"
TYPICAL_CLOSED = "adam.32bit.fp32.lr=0.001.wd=0.01.closed.n4097.s0.t20"
ADEMAMIX_FP16 = "ademamix.32bit.fp16.lr=0.1.wd=0.1.gnorm_scale=0.5.open+z0.25.n1031.s0.t10"
EIGHT_BIT = "adam.8bit_blockwise.fp32.lr=0.1.wd=0.1.open+z0.25.n1031.s0.t10"


def _build(root: Path, cache: Path) -> str:
    result = build_extension(root, cache_dir=cache)
    assert result.ok, result.error
    return result.library_path


def _attribute(library: str, baseline_library: str, names: list[str]) -> tuple[dict, dict]:
    """(attribution by case name, the verdict detail as the co-run stores it)."""
    battery, cases = load_battery("quick"), [QUICK[name] for name in names]
    # As the service has them: both runs with their metrics (the co-run gives both in one pass).
    commit, baseline, diffs = corun_battery(battery, library, baseline_library, device="cpu", cases=cases)
    comparison = compare_runs(commit, baseline, diffs)
    attribution = attribute_changed(comparison, baseline, cases, library, baseline_library, device="cpu")
    detail = {**comparison.model_dump(mode="json"), "attribution": attribution}
    return {case_id.split("#")[0]: value for case_id, value in attribution.items()}, detail


@pytest.fixture(scope="module")
def trees(tmp_path_factory, csrc_under_test, build_cache_dir, kernels_build):  # noqa: ANN001, ANN201
    root = tmp_path_factory.mktemp("attribution")
    decay = decay_after_update(copy_tree(csrc_under_test, root / "decay"))
    reorder = copy_tree(csrc_under_test, root / "reorder")
    path = reorder / ONE_ULP[0]
    assert path.read_text().count(ONE_ULP[1]) == 1, "the kernel source changed: update ONE_ULP"
    path.write_text(path.read_text().replace(ONE_ULP[1], ONE_ULP[2]))
    yield {"correct": kernels_build.library_path, "decay": _build(decay, build_cache_dir),
           "reorder": _build(reorder, build_cache_dir)}
    shutil.rmtree(root, ignore_errors=True)


def test_decay_after_update_is_named_and_8bit_blowup_is_not_the_headline(trees):  # noqa: ANN001
    names = [FP32_OPEN, TYPICAL_CLOSED, ADEMAMIX_FP16, EIGHT_BIT]
    found, detail = _attribute(trees["decay"], trees["correct"], names)
    for name in names:
        assert found[name]["class"] == "semantic" and found[name]["variant"] == "decay_after_update", (name, found[name])
        # Explained to within rounding: the residual allowance per step, and far below the change.
        steps = QUICK[name].steps
        assert found[name]["residual_ulps"] <= MATCH_ULPS_PER_STEP * steps
        assert found[name]["next_best_ratio"] > 4, found[name]["candidates"]
    # At lr 1e-3 / wd 1e-2 the reorder moves the parameters by less than float32 rounding moves them
    # from float64 (the same distance from the reference), yet it is named: the residual is taken
    # on (commit − baseline) − (variant − reference), where both roundings cancel.
    assert found[TYPICAL_CLOSED]["change_vs_baseline_distance"] < 2.0
    assert found[TYPICAL_CLOSED]["first_step_ulps"] > 100
    # The 8-bit case moves most in absolute terms, but relative to its own (quantization-sized)
    # distance to float64 it is the smallest change, so the headline names a 32-bit case.
    absolute = {name: found[name]["max_abs_diff"] for name in names}
    assert max(absolute, key=absolute.get) in (EIGHT_BIT, FP32_OPEN)
    relative = {name: found[name]["change_vs_baseline_distance"] for name in names}
    assert min(relative, key=relative.get) == EIGHT_BIT, relative
    headline = attribution_view.headline(detail)
    assert "looks like weight decay applied after the update (4)" in headline
    assert FP32_OPEN in headline and "8bit" not in headline.split("largest change")[1]


def test_reordered_rounding_is_rounding_level_with_a_few_ulps(trees):  # noqa: ANN001
    found, detail = _attribute(trees["reorder"], trees["correct"], [FP32_OPEN, TYPICAL_CLOSED])
    for name, value in found.items():
        assert value["class"] == "rounding-level" and value["variant"] is None, (name, value)
        # The step size moved by one float32 ulp: each parameter by at most ~2 ulps of its scale at
        # the first divergent step (the allowance), and no more than the allowance per step after.
        assert 0 < value["first_step_ulps"] <= ROUNDING_ULPS_PER_STEP, value
        steps_since = QUICK[name].steps - value["first_divergent_step"] + 1
        assert value["peak_ulps"] <= ROUNDING_ULPS_PER_STEP * steps_since
    view = attribution_view.by_case(detail)
    assert all(a.text.startswith("rounding-level: ") for a in view.values())
    assert "rounding-level (2)" in attribution_view.headline(detail)
