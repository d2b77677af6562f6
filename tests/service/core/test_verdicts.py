"""Result models (bit-exact JSON) and the comparison logic, on hand-made results (no kernels)."""

import json
import math
import struct

from service.core.results import CaseResult, RunComparison, RunResult, Trajectory
from service.core.verdicts import (DIRECTION_RELATIVE_MARGIN, DIRECTION_RELATIVE_MARGIN_16BIT, compare_runs, direction,
                              first_divergent_step)
from service.core.results import GradientStreamSpec
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case

AWKWARD_FLOATS = [0.1 + 0.2, 5e-324, -0.0, 1.7976931348623157e308, 2.0 ** -126, 1 / 3, math.nextafter(1.0, 2.0),
                  float("inf"), float("-inf")]


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _case(optimizer="adam", wd=0.1, seed=0):
    return make_case(optimizer=optimizer, family="32bit", param_dtype="float32",
                     hyper={**OPTIMIZER_HYPER_DEFAULTS[optimizer], "lr": 0.1, "weight_decay": wd},
                     gradient=GradientStreamSpec(), seed=seed, size=4, steps=3)


def _result(case, digests, distances=(1e-6, 2e-6, 3e-6), nonfinite=(0, 0, 0), status="ok", message=None):
    if status != "ok":
        return CaseResult(case=case, status=status, message=message)
    return CaseResult(case=case, status="ok", trajectory=Trajectory(
        ref64_max_abs=list(distances), ref64_max_rel=list(distances), same_precision_max_abs=list(distances),
        nonfinite_count=list(nonfinite), digests=list(digests)))


def _run(cases, digest="b"):
    return RunResult(battery_name="t", battery_version=1, battery_digest="bat", build_digest=digest, cases=cases)


def test_json_round_trip_keeps_every_float_bit_exact_and_nan():
    floats = AWKWARD_FLOATS + [float("nan")]
    case = _case()
    result = CaseResult(case=case, status="ok", trajectory=Trajectory(
        ref64_max_abs=floats, ref64_max_rel=floats, same_precision_max_abs=floats,
        nonfinite_count=[0] * len(floats), digests=["00"] * len(floats)), duration_s=0.1 + 0.2)
    run = _run([result])
    text = run.model_dump_json()
    json.loads(text)  # strict JSON (NaN/Infinity as strings), storable in PostgreSQL jsonb
    assert "NaN" in text and "Infinity" in text
    back = RunResult.model_validate_json(text)
    got = back.cases[0].trajectory.ref64_max_abs
    assert [_bits(x) for x in got[:-1]] == [_bits(x) for x in AWKWARD_FLOATS]
    assert math.isnan(got[-1])
    assert _bits(back.cases[0].duration_s) == _bits(0.1 + 0.2)
    # Through python's json too (what a service might do with the dict form).
    again = RunResult.model_validate(json.loads(json.dumps(run.model_dump(mode="json"))))
    assert [_bits(x) for x in again.cases[0].trajectory.ref64_max_rel[:-1]] == [_bits(x) for x in AWKWARD_FLOATS]


def test_first_divergent_step():
    assert first_divergent_step(["a", "b", "c"], ["a", "b", "c"]) is None
    assert first_divergent_step(["a", "x", "c"], ["a", "b", "c"]) == 2
    assert first_divergent_step(["a", "b"], ["a", "b", "c"]) == 3


def test_direction_margin():
    assert direction(1.0, 25.0) == "closer"
    assert direction(25.0, 1.0) == "farther"
    assert direction(1.0 + DIRECTION_RELATIVE_MARGIN / 2, 1.0) == "same"
    # a move no larger than what rounding at the parameter's precision explains is "same"
    assert direction(2.13e-2, 2.31e-2, rounding_floor=1.5e-2) == "same"
    assert direction(2.13e-2, 2.31e-2, rounding_floor=1e-3) == "closer"
    # 16-bit parameters: within a factor of 2 is rounding
    assert direction(2.13e-2, 2.31e-2, relative_margin=DIRECTION_RELATIVE_MARGIN_16BIT) == "same"
    assert direction(1.0e-2, 2.31e-2, relative_margin=DIRECTION_RELATIVE_MARGIN_16BIT) == "closer"
    assert direction(4.7e-2, 2.31e-2, relative_margin=DIRECTION_RELATIVE_MARGIN_16BIT) == "farther"


def test_direction_band_comes_from_the_smaller_finite_same_precision_distance():
    case = _case()

    def result(distance, same, digest="x"):
        return CaseResult(case=case, status="ok", trajectory=Trajectory(
            ref64_max_abs=[distance], ref64_max_rel=[distance], same_precision_max_abs=[same],
            nonfinite_count=[0], digests=[digest]))

    def verdict(commit, baseline):
        baseline = baseline.model_copy(update={"trajectory": baseline.trajectory.model_copy(update={"digests": ["y"]})})
        return compare_runs(_run([commit]), _run([baseline])).cases[0].direction

    # float16-like: both distances are float16 rounding (same-precision distances ~1.6e-2)
    assert verdict(result(2.13e-2, 1.6e-2), result(2.31e-2, 0.5)) == "same"
    # the decay reorder at float32: the defective side is far from torch too, the fixed side is not
    assert verdict(result(1.6e-5, 1e-6), result(6.6e-2, 0.5)) == "closer"
    assert verdict(result(6.6e-2, 0.5), result(1.6e-5, 1e-6)) == "farther"
    # a non-finite same-precision reference (float16 torch.optim Adam) is no band at all
    assert verdict(result(2.13e-2, float("inf")), result(2.31e-2, float("nan"))) == "closer"
    # ...but a float16 parameter's distance is its own rounding: within a factor of 2 is "same"
    case = make_case(optimizer="adam", family="32bit", param_dtype="float16",
                     hyper={**OPTIMIZER_HYPER_DEFAULTS["adam"], "lr": 0.1, "weight_decay": 0.1},
                     gradient=GradientStreamSpec(), seed=0, size=4, steps=1)
    assert verdict(result(2.13e-2, float("inf")), result(2.31e-2, float("nan"))) == "same"
    assert verdict(result(1.6e-5, float("inf")), result(6.6e-2, float("nan"))) == "closer"


def test_unchanged_changed_broken_new_and_the_run_verdicts():
    same, moved, crash, fresh = _case(wd=0.1), _case(wd=0.0), _case(seed=1), _case(seed=2)
    baseline = _run([_result(same, "abc"), _result(moved, "abc", distances=(1e-6, 1e-6, 1e-6)),
                     _result(crash, "abc")], digest="base")
    commit = _run([_result(same, "abc"), _result(moved, "abd", distances=(1e-6, 1e-3, 2.5e-5)),
                   _result(crash, "", status="broken", message="kernel host crashed: killed by SIGABRT"),
                   _result(fresh, "abc")], digest="head")
    comparison = compare_runs(commit, baseline, {moved.case_id: [0.0, 0.0, 4e-3]})
    verdicts = {c.case_id: c for c in comparison.cases}
    assert verdicts[same.case_id].verdict == "unchanged"
    changed = verdicts[moved.case_id]
    assert (changed.verdict, changed.first_divergent_step, changed.direction) == ("changed", 3, "farther")
    assert changed.max_abs_diff_per_step == [0.0, 0.0, 4e-3]
    assert (changed.commit_final_ref64_distance, changed.baseline_final_ref64_distance) == (2.5e-5, 1e-6)
    assert verdicts[crash.case_id].verdict == "broken" and "SIGABRT" in verdicts[crash.case_id].message
    assert verdicts[fresh.case_id].verdict == "new"
    assert comparison.verdict == "broken"
    assert comparison.counts == {"unchanged": 1, "changed": 1, "broken": 1, "new": 1}
    assert "SIGABRT" in comparison.summary and "adam 1" in comparison.summary

    without_crash = _run([c for c in commit.cases if c.status == "ok"])
    assert compare_runs(without_crash, baseline).verdict == "changed"
    assert compare_runs(_run([_result(same, "abc")]), baseline).verdict == "unchanged"
    assert compare_runs(_run([_result(same, "abc")]), None).verdict == "no-baseline"
    RunComparison.model_validate_json(comparison.model_dump_json())


def test_nan_where_the_baseline_was_finite_is_broken():
    case = _case()
    baseline = _run([_result(case, "abc")])
    commit = _run([_result(case, "abd", distances=(1e-6, float("nan"), float("nan")), nonfinite=(0, 4, 4))])
    comparison = compare_runs(commit, baseline)
    assert comparison.verdict == "broken"
    assert comparison.cases[0].first_divergent_step == 2 and "NaN/Inf" in comparison.cases[0].message


def test_a_source_that_does_not_build_is_broken_with_the_compiler_message():
    commit = RunResult(battery_name="t", battery_version=1, battery_digest="bat", build_ok=False,
                       build_error="ops.cpp:3:1: error: expected ';' before '}' token")
    comparison = compare_runs(commit, None)
    assert comparison.verdict == "broken" and "expected ';'" in comparison.summary


# ----------------------------------------------------------------------------- direction over the trajectory
# Constructed float32 trajectories: distances to the float64 reference per step. The same-precision
# distances (the rounding band) are 1e-7, far below every move judged here, so only the relative
# margin decides: DIRECTION_RELATIVE_MARGIN (1 %) at float32, a factor of 2 at 16 bits.
BAND = 1e-7


def _series_result(case, distances, digests, same_precision=None):
    n = len(distances)
    return CaseResult(case=case, status="ok", trajectory=Trajectory(
        ref64_max_abs=list(distances), ref64_max_rel=list(distances),
        same_precision_max_abs=list(same_precision or [BAND] * n), nonfinite_count=[0] * n, digests=list(digests)))


def _compare_series(commit_distances, baseline_distances, diverge_at=1, case=None, **kwargs):
    """Compare a commit whose digests differ from the baseline's from step `diverge_at` on."""
    case = case or _case()
    n = len(baseline_distances)
    base_digests = [f"b{i}" for i in range(n)]
    commit_digests = base_digests[:diverge_at - 1] + [f"c{i}" for i in range(diverge_at - 1, n)]
    comparison = compare_runs(_run([_series_result(case, commit_distances, commit_digests, **kwargs)]),
                              _run([_series_result(case, baseline_distances, base_digests, **kwargs)]))
    return comparison, comparison.cases[0]


def test_a_change_that_wanders_off_and_comes_back_reads_farther_not_same():
    # Issue 14 item 9: |commit - baseline| reached 6.8e-4 on the way, the last step agrees.
    baseline = [1e-6, 2e-6, 3e-6, 4e-6, 5e-6]
    commit = [1e-6, 2e-4, 6.8e-4, 1e-4, 5e-6]
    comparison, case = _compare_series(commit, baseline, diverge_at=2)
    assert case.final_direction == "same"  # what the old final-step rule said
    assert case.direction == "farther"
    assert (case.commit_peak_ref64_distance, case.baseline_peak_ref64_distance) == (6.8e-4, 5e-6)
    assert (case.commit_final_ref64_distance, case.baseline_final_ref64_distance) == (5e-6, 5e-6)
    # The summary counts the trajectory's direction and says where the final step alone disagrees.
    assert "vs float64 reference: 1 farther (" in comparison.summary
    assert "final step alone reads otherwise for 1 case:" in comparison.summary
    assert "farther over the trajectory (peak 5.000e-06 → 6.800e-04), same at the final step" in comparison.summary


def test_a_change_that_stays_closer_until_the_last_step_reads_closer():
    baseline = [1e-6, 5e-5, 5e-5, 5e-5, 1e-6]
    commit = [1e-6, 1e-6, 1e-6, 1e-6, 1e-6]
    _, case = _compare_series(commit, baseline, diverge_at=2)
    assert (case.final_direction, case.direction) == ("same", "closer")


def test_farther_at_the_peak_wins_over_closer_on_average():
    # Mean 0.8e-5 vs 1e-5 (closer) but the peak 1.2e-5 vs 1e-5 (farther): farther is what a
    # maintainer must see.
    _, case = _compare_series([0.5e-5, 1.2e-5, 0.5e-5, 1.0e-5], [1e-5, 1e-5, 1e-5, 1e-5])
    assert (case.direction, case.final_direction) == ("farther", "same")


def test_the_mean_alone_can_show_a_move_the_peak_does_not():
    # Peak equal (2e-5 at the last step for both); on the way the commit sat farther.
    _, case = _compare_series([1e-5, 1.5e-5, 1.5e-5, 2e-5], [1e-5, 1e-5, 1e-5, 2e-5], diverge_at=2)
    assert (case.baseline_peak_ref64_distance, case.commit_peak_ref64_distance) == (2e-5, 2e-5)
    assert case.commit_mean_ref64_distance > case.baseline_mean_ref64_distance * (1 + DIRECTION_RELATIVE_MARGIN)
    assert (case.direction, case.final_direction) == ("farther", "same")


def test_direction_is_judged_from_the_first_divergent_step():
    # Bit-identical for 8 steps (the baseline's peak, 2e-5, is at step 1), then the commit is 5 %
    # farther at step 9 and back at step 10. Over the whole trajectory the peak is unchanged and the
    # mean moves 0.5 % (inside the 1 % margin); over the steps that differ it is 5 % farther.
    baseline = [2e-5] + [1e-5] * 9
    commit = [2e-5] + [1e-5] * 7 + [1.05e-5, 1e-5]
    _, case = _compare_series(commit, baseline, diverge_at=9)
    assert case.baseline_peak_ref64_distance == 1e-5 and case.commit_peak_ref64_distance == 1.05e-5
    assert (case.direction, case.final_direction) == ("farther", "same")


def test_moves_within_the_precision_margins_stay_same_over_the_trajectory():
    # float32: a peak 0.5 % higher is inside the 1 % margin.
    _, case = _compare_series([1e-5, 1.005e-5, 1e-5], [1e-5, 1e-5, 1e-5])
    assert case.direction == "same"
    # A move no larger than the same-precision distance over those steps is rounding: "same".
    _, case = _compare_series([1e-5, 3e-5, 1e-5], [1e-5, 1e-5, 1e-5], same_precision=[1e-5, 5e-5, 1e-5])
    assert case.direction == "same"
    # float16: a peak 1.8x higher is within the factor of 2 of 16-bit rounding; 2.5x is not.
    half = make_case(optimizer="adam", family="32bit", param_dtype="float16",
                     hyper={**OPTIMIZER_HYPER_DEFAULTS["adam"], "lr": 0.1, "weight_decay": 0.1},
                     gradient=GradientStreamSpec(), seed=0, size=4, steps=3)
    _, case = _compare_series([1e-2, 1.8e-2, 1e-2], [1e-2, 1e-2, 1e-2], case=half)
    assert case.direction == "same"
    _, case = _compare_series([1e-2, 2.5e-2, 1e-2], [1e-2, 1e-2, 1e-2], case=half)
    assert (case.direction, case.final_direction) == ("farther", "same")


def test_where_final_and_trajectory_agree_the_summary_says_nothing_more():
    comparison, case = _compare_series([2e-6, 4e-6, 6e-6], [1e-6, 2e-6, 3e-6])
    assert case.direction == case.final_direction == "farther"
    assert "final step alone" not in comparison.summary


# ----------------------------------------------------------------------------- cases set aside
def test_not_applicable_and_nondeterministic_are_counted_listed_and_never_broken():
    from service.core.results import RepeatCheck

    ok, aside, unsteady = _case(seed=0), _case(seed=1), _case(seed=2)
    reason = "no bfloat16 32-bit kernel for adam in this library"
    baseline = _run([_result(ok, "abc"), _result(aside, "abc"), _result(unsteady, "abc")])
    commit_cases = [_result(ok, "abc"), _result(aside, "", status="not_applicable", message=reason),
                    _result(unsteady, "abc").model_copy(update={
                        "repeat_check": RepeatCheck(runs=4, differing=1, first_divergent_step=1)})]
    comparison = compare_runs(_run(commit_cases), baseline)
    verdicts = {c.case_id: c for c in comparison.cases}
    assert verdicts[aside.case_id].verdict == "not_applicable" and verdicts[aside.case_id].message == reason
    assert verdicts[unsteady.case_id].verdict == "nondeterministic"
    assert comparison.verdict == "nondeterministic"
    assert comparison.counts == {"unchanged": 1, "not_applicable": 1, "nondeterministic": 1}
    assert f"not applicable on this device, not judged: 1 case — {reason} (1)" in comparison.summary
    assert f"{unsteady.case_id}: 1 of 3 repeats differ from step 1" in comparison.summary
    assert "broken" not in comparison.summary
    # Without the nondeterministic case, a not-applicable one does not touch the verdict.
    assert compare_runs(_run(commit_cases[:2]), baseline).verdict == "unchanged"
    assert compare_runs(_run(commit_cases[:2]), None).verdict == "no-baseline"


def test_a_case_not_applicable_in_the_baseline_is_new_not_changed():
    case = _case()
    baseline = _run([_result(case, "", status="not_applicable", message="no such kernel yet")])
    comparison = compare_runs(_run([_result(case, "abc")]), baseline)
    assert comparison.cases[0].verdict == "new" and "no such kernel yet" in comparison.cases[0].message
    assert comparison.verdict == "unchanged"
