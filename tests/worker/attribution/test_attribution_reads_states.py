"""The attribution's re-run records the state leaves beside the parameters through real kernel hosts
(worker/attribution/pair_run.py, worker/engine/states_file.py), and the analysis reads them: the
weight-decay reorder of the bundled kernels, built, on a float32-state bfloat16 case and an 8-bit
blockwise case."""

from __future__ import annotations

import pytest

from service.core.results import GradientStreamSpec
from worker.attribution.analysis import analyze_files
from worker.attribution.pair_run import record_parameters, states_path
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case
from worker.engine import states_file

pytestmark = pytest.mark.slow


def _case(family: str, dtype: str, size: int):  # noqa: ANN202
    return make_case(optimizer="adam", family=family, param_dtype=dtype,
                     hyper={**OPTIMIZER_HYPER_DEFAULTS["adam"], "lr": 0.1, "weight_decay": 0.1},
                     gradient=GradientStreamSpec(kind="open"), seed=3, size=size, steps=3)


def test_the_reruns_record_each_step_s_states_and_the_analysis_reads_them(tmp_path, kernels_build, decay_build):
    cases = [_case("32bit", "bfloat16", 257), _case("8bit_blockwise", "float32", 4097)]
    recorded = record_parameters(decay_build.library_path, kernels_build.library_path, cases, tmp_path,
                                 device="cpu", states=True)
    assert sorted(recorded) == sorted(c.case_id for c in cases)
    for case in cases:
        commit_file, baseline_file, step = recorded[case.case_id]
        assert step == 1
        limit = states_file.byte_limit(case.size, case.steps)
        commit = states_file.read(states_path(commit_file), steps=case.steps, max_bytes=limit)
        baseline = states_file.read(states_path(baseline_file), steps=case.steps, max_bytes=limit)
        assert list(commit.steps[0]) == list(baseline.steps[0]) and commit.steps[0]
        if case.family == "8bit_blockwise":  # the codes come back as the integers they are
            assert any(values.dtype.kind == "u" for values in commit.steps[0].values()), list(commit.steps[0])
        found = analyze_files(case, str(commit_file), str(baseline_file), step,
                              states_files=(str(states_path(commit_file)), str(states_path(baseline_file))))
        assert found["states_read"] and "states_unread" not in found, found
        assert found["class"] == "semantic", found  # the reorder is a real change, states or not
        if case.family == "8bit_blockwise":  # judged to the first moved code: read from the codes
            assert found["judged_over"].endswith("to the first moved code"), found
    # Without the states the parameters alone are read, and nothing is written beside them.
    (tmp_path / "again").mkdir()
    again = record_parameters(decay_build.library_path, kernels_build.library_path, cases[:1], tmp_path / "again",
                              device="cpu")
    commit_file, baseline_file, step = again[cases[0].case_id]
    assert not states_path(commit_file).exists()
    found = analyze_files(cases[0], str(commit_file), str(baseline_file), step)
    assert not found["states_read"]


def test_a_layout_case_is_attributed_through_the_tensor_that_changed_first(tmp_path, kernels_build, decay_build):
    # The PR-2040 reorder on one optimizer over two param groups: group 0 (wd 0: biases and norms)
    # is bit-identical, group 1 (wd 0.1) changes from step 1. The attribution names the first
    # changed tensor, replays it under ITS group's hyperparameters (with the case's own, group 0's
    # wd 0, no variant is a decay change at all), names the decay reorder, and lists each tensor's
    # first divergent step.
    from worker.battery import BatterySpec

    (case,) = BatterySpec.model_validate({"name": "l", "version": 1, "groups": [{
        "optimizers": ["adam"], "steps": 4, "points": [{"lr": 0.1, "weight_decay": 0.1}],
        "layouts": [{"groups": [{"sizes": [513], "point": {"weight_decay": 0.0}}, {"sizes": [257, 1031]}]}]}]}).expand()
    recorded = record_parameters(decay_build.library_path, kernels_build.library_path, [case], tmp_path,
                                 device="cpu", states=True)
    commit_file, baseline_file, step = recorded[case.case_id]
    assert step == 1
    found = analyze_files(case, str(commit_file), str(baseline_file), step,
                          states_files=(str(states_path(commit_file)), str(states_path(baseline_file))))
    assert case.hyper["weight_decay"] == 0.0  # the case's own hyperparameters are group 0's
    assert found["tensor"] == 1 and found["tensor_group"] == 1, found
    assert found["tensor_first_steps"] == {"t0": None, "t1": 1, "t2": 1}
    assert found["variant"] == "decay_after_update", found
    assert found["states_read"]
