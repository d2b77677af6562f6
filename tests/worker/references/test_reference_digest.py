"""The references' digests (worker/references/digest.py) and what a verdict does when they differ
between a commit's run and its baseline's (service.core.verdicts.reference_moved): "reference
changed", the verdict kept, the direction not judged. The whole path (a real torch.optim change in
the kernel hosts of `optdrift serve`) is tests/scenarios/test_reference_upgrade.py."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

from service.core.results import CaseResult, GradientStreamSpec, RunResult, Trajectory
from service.core.verdicts import compare_runs
from tests.service_fixtures import REPO_ROOT
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case
from worker.references.digest import (
    PAPER_OPTIMIZERS, TORCH_OPTIM_CLASSES, case_reference_digests, reference_digests,
)
from worker.references.optimizers import TorchOptimReference, make_reference


def _case(optimizer: str = "adam", dtype: str = "float32", seed: int = 0):  # noqa: ANN202
    return make_case(optimizer=optimizer, family="32bit", param_dtype=dtype,
                     hyper={**OPTIMIZER_HYPER_DEFAULTS[optimizer], "lr": 0.1, "weight_decay": 0.1},
                     gradient=GradientStreamSpec(), seed=seed, size=4, steps=3)


@pytest.mark.parametrize("optimizer", sorted(TORCH_OPTIM_CLASSES) + list(PAPER_OPTIMIZERS))
def test_the_digested_torch_optim_class_is_the_one_the_reference_runs(optimizer: str) -> None:
    reference = make_reference(_case(optimizer), torch.zeros(4, dtype=torch.float64))
    if optimizer in PAPER_OPTIMIZERS:
        assert not isinstance(reference, TorchOptimReference)
    else:
        assert type(reference.optim).__name__ == TORCH_OPTIM_CLASSES[optimizer]


def test_the_digests_are_the_same_in_another_process() -> None:
    # Two kernel hosts of one worker must agree, or every verdict would read "reference changed".
    code = "import json; from worker.references.digest import reference_digests as d; print(json.dumps(d()))"
    answers = [json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                         cwd=REPO_ROOT, env={**os.environ, "PYTHONHASHSEED": seed}).stdout)
               for seed in ("1", "2")]
    assert answers[0] == answers[1] == reference_digests()


def test_a_replaced_torch_optim_function_changes_its_optimizer_s_digest_only(monkeypatch) -> None:  # noqa: ANN001
    adam_module = importlib.import_module("torch.optim.adam")  # torch.optim's `adam` is the function
    before = reference_digests()
    original = adam_module._single_tensor_adam

    def _single_tensor_adam(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return original(*args, **kwargs)

    monkeypatch.setattr(adam_module, "_single_tensor_adam", _single_tensor_adam)
    after = reference_digests()
    assert after["adam"] != before["adam"]
    assert {k: v for k, v in after.items() if k != "adam"} == {k: v for k, v in before.items() if k != "adam"}


def test_each_case_s_digest_is_its_optimizer_s_at_its_dtype() -> None:
    cases = [_case("adam"), _case("adam", seed=1), _case("adam", "bfloat16"), _case("lion")]
    digests = case_reference_digests(cases, reference_digests())
    assert digests[cases[0].case_id] == digests[cases[1].case_id]
    assert len({digests[c.case_id] for c in (cases[0], cases[2], cases[3])}) == 3
    assert case_reference_digests(cases, None) == {}


def _result(case, digests: list[str], distances: list[float]) -> CaseResult:  # noqa: ANN001
    return CaseResult(case=case, status="ok", trajectory=Trajectory(
        ref64_max_abs=distances, ref64_max_rel=distances, same_precision_max_abs=[0.0] * len(distances),
        nonfinite_count=[0] * len(distances), digests=digests))


def _run(results: list[CaseResult], references: dict[str, str]) -> RunResult:
    return RunResult(battery_name="t", battery_version=1, battery_digest="bat", build_digest="b", cases=results,
                     reference_digests=case_reference_digests([r.case for r in results], references))


def test_a_changed_reference_keeps_the_verdict_and_withholds_the_direction() -> None:
    adam, lion, momentum = _case("adam"), _case("lion"), _case("momentum")
    old = {"adam": "a1", "lion": "l1", "momentum": "m1"}
    new = {"adam": "a2", "lion": "l1", "momentum": "m2"}  # torch.optim moved; Lion's paper reference did not
    # adam and lion changed (their kernels moved from step 2, farther by a factor of 3); momentum did not.
    baseline = [_result(adam, ["x", "y", "z"], [1e-6, 1e-6, 1e-6]), _result(lion, ["x", "y", "z"], [1e-6, 1e-6, 1e-6]),
                _result(momentum, ["m", "n", "o"], [1e-6, 1e-6, 1e-6])]
    commit = [_result(adam, ["x", "Y", "Z"], [1e-6, 3e-6, 3e-6]), _result(lion, ["x", "Y", "Z"], [1e-6, 3e-6, 3e-6]),
              _result(momentum, ["m", "n", "o"], [1e-6, 2e-6, 2e-6])]

    same = compare_runs(_run(commit, old), _run(baseline, old))
    assert [(c.verdict, c.direction, c.reference_changed) for c in same.cases] == [
        ("changed", "farther", False), ("changed", "farther", False), ("unchanged", None, False)]
    assert same.figures.reference_changed == 0 and "reference changed" not in same.summary

    moved = compare_runs(_run(commit, new), _run(baseline, old))
    # The kernels' verdicts are the same comparison's; only what depends on the references goes.
    assert moved.verdict == same.verdict == "changed"
    assert [(c.case_id, c.verdict, c.first_divergent_step) for c in moved.cases] == \
        [(c.case_id, c.verdict, c.first_divergent_step) for c in same.cases]
    adam_case, lion_case, momentum_case = moved.cases
    assert adam_case.reference_changed and adam_case.direction is None and adam_case.final_direction is None
    assert momentum_case.reference_changed and momentum_case.verdict == "unchanged"
    assert not lion_case.reference_changed and lion_case.direction == "farther"
    assert moved.figures.reference_changed == 2
    assert moved.figures.directions == {"closer": 0, "farther": 1, "same": 0}
    assert moved.figures.final_ratio_low == moved.figures.final_ratio_high == pytest.approx(3.0)  # Lion's alone
    assert "reference changed since the baseline (torch or torch.optim differs), not this commit's doing: " \
           "adam 1, momentum 1 (2 cases)" in moved.summary
    assert "1 farther, 1 not judged (reference changed)" in moved.summary

    # A baseline that recorded no digests (an older worker): nothing is known to have changed.
    unknown = compare_runs(_run(commit, new), _run(baseline, {}))
    assert unknown.figures.reference_changed == 0 and unknown.cases[0].direction == "farther"
