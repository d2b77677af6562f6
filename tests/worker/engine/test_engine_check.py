"""Acceptance: `optdrift check` on real builds of mutated kernel trees (quick battery, CPU).

Each mutation is a text substitution that must match (worker.mutations raises otherwise), so a
test can never pass because its mutation silently did nothing.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from service.cli.check import run_check
from worker.mutations import comment_only, decay_after_update

pytestmark = pytest.mark.slow

# One-ulp mutation: Adam's step size lr/(1 - beta1^t) computed in float32 from float32 operands
# instead of in double and rounded once. Same formula, another order of rounding.
ONE_ULP = ("optimizer_math.h",
           "rule.step_size = static_cast<float>(lr / bias_correction1);",
           "rule.step_size = static_cast<float>(lr) / static_cast<float>(bias_correction1);")


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "build"))
    return dest


def _check(tmp_path, source, baseline, build_cache_dir):
    out = tmp_path / f"{source.name}-vs-{baseline.name}.json"
    code = run_check(source, baseline, "quick", device="cpu", cache_dir=build_cache_dir, json_out=out)
    payload = json.loads(out.read_text())
    specs = {c["case"]["case_id"]: c["case"] for c in payload["commit"]["cases"]}
    return code, payload["comparison"], specs, payload["attribution"]


def test_decay_after_update_is_changed_at_step_1_only_where_it_must_be(tmp_path, csrc_under_test, build_cache_dir,
                                                                      capsys):
    correct = _copy(csrc_under_test, tmp_path / "correct")
    wrong = decay_after_update(_copy(csrc_under_test, tmp_path / "wrong"))
    code, comparison, specs, attribution = _check(tmp_path, wrong, correct, build_cache_dir)
    assert code == 1 and comparison["verdict"] == "changed"
    ratios = []
    for case in comparison["cases"]:
        spec = specs[case["case_id"]]
        decayed_two_state = spec["optimizer"] in ("adam", "ademamix") and spec["hyper"]["weight_decay"] > 0
        if not decayed_two_state:
            assert case["verdict"] == "unchanged", case["case_id"]
            continue
        assert case["verdict"] == "changed" and case["first_divergent_step"] == 1, case["case_id"]
        assert case["max_abs_diff_per_step"][0] > 0
        # 32-bit only: multi-step 8-bit runs are dominated by quantization error (their reference
        # distance does not resolve the ordering); the 8-bit one-step closed form is issue 6's test.
        if (spec["family"] == "32bit" and spec["hyper"]["lr"] == 0.1 and spec["hyper"]["weight_decay"] == 0.1
                and spec["param_dtype"] == "float32"):
            assert case["direction"] == "farther", case["case_id"]
            ratios.append(case["commit_final_ref64_distance"] / case["baseline_final_ref64_distance"])
            # check names the change, as a service run's verdict does (worker/attribution)
            assert attribution[case["case_id"]]["variant"] == "decay_after_update", attribution[case["case_id"]]
    # The correct ordering is closer to torch.optim.AdamW / the AdEMAMix paper by a large factor:
    # the ordering gap (~lr^2*wd per step, 1e-3) dwarfs float32 rounding error (~1e-5 here).
    assert len(ratios) >= 6 and min(ratios) > 100, ratios
    assert "adam" in comparison["summary"] and "step 1" in comparison["summary"]
    shown = capsys.readouterr().out
    assert "kind of change" in shown and "weight decay applied after the update" in shown


def test_comment_only_change_and_same_source_are_unchanged(tmp_path, csrc_under_test, build_cache_dir):
    correct = _copy(csrc_under_test, tmp_path / "correct")
    commented = comment_only(_copy(csrc_under_test, tmp_path / "commented"))
    code, comparison, _, attribution = _check(tmp_path, commented, correct, build_cache_dir)
    assert (code, comparison["verdict"]) == (0, "unchanged") and attribution == {}
    assert comparison["commit_build_digest"] != comparison["baseline_build_digest"]  # two real builds
    code, comparison, _, attribution = _check(tmp_path, correct, correct, build_cache_dir)
    assert (code, comparison["verdict"]) == (0, "unchanged")


def _first_step_size_difference(lr: float, beta1: float, steps: int) -> int | None:
    for t in range(1, steps + 1):
        bias_correction1 = 1.0 - beta1 ** t
        if np.float32(lr / bias_correction1) != np.float32(lr) / np.float32(bias_correction1):
            return t
    return None


def test_one_ulp_change_is_flagged_at_the_predicted_step(tmp_path, csrc_under_test, build_cache_dir):
    correct = _copy(csrc_under_test, tmp_path / "correct")
    ulp = _copy(csrc_under_test, tmp_path / "ulp")
    path = ulp / ONE_ULP[0]
    text = path.read_text()
    assert text.count(ONE_ULP[1]) == 1, "the kernel source changed: update ONE_ULP"
    path.write_text(text.replace(ONE_ULP[1], ONE_ULP[2]))

    code, comparison, specs, attribution = _check(tmp_path, ulp, correct, build_cache_dir)
    assert code == 1 and comparison["verdict"] == "changed"
    checked = 0
    for case in comparison["cases"]:
        spec = specs[case["case_id"]]
        if spec["optimizer"] != "adam":
            assert case["verdict"] == "unchanged", case["case_id"]
        elif spec.get("layout") is not None:
            # A layout case's Adam bias corrections come from the multi-tensor op's running float32
            # powers (docs/KERNELS.md), not make_adam_rule's: this change does not reach them.
            assert case["verdict"] == "unchanged", case["case_id"]
        elif spec["family"] == "32bit" and spec["param_dtype"] == "float32" and spec["size"] >= 1000:
            # The step size moves by one float32 ulp at the steps numpy predicts; over >= 1000
            # elements some parameter rounds differently at the first of them.
            expected = _first_step_size_difference(spec["hyper"]["lr"], spec["hyper"]["beta1"], spec["steps"])
            assert expected is not None
            assert case["verdict"] == "changed" and case["first_divergent_step"] == expected, case["case_id"]
            assert max(case["max_abs_diff_per_step"]) < 1e-4  # tiny: a rounding-level change
            assert attribution[case["case_id"]]["class"] == "rounding-level", attribution[case["case_id"]]
            checked += 1
    assert checked >= 5
