"""The size of a change is told per kernel family and dtype, never as one figure across scales
(issue 34, item 2).

The decay reorder moves the fp32 cases' peak distance to float64 from ~9e-06 to ~1.3e-02 (×1400), and
leaves the 8-bit cases' at ~3.6e4, their states' quantization error, by design. `submit --wait` printed
"to float64 before → after 3.66e+04 → 3.61e+04": the max over every changed case, so the 8-bit
figure, whatever the fp32 cases did. The verdict's summary (worker), the CLI's tables and the
dashboard's sentence all take their figures from service.core.verdicts.change_size_by_scale.
"""

from __future__ import annotations

from rich.console import Console

from service.cli.report import print_report
from service.dashboard.wording import size_sentence
from service.domain.dashboard_queries import ChangedCase
from service.core.results import CaseResult, GradientStreamSpec, RunResult, Trajectory
from service.core.verdicts import case_scale, change_size_by_scale, compare_runs
from service.core.wording import scale_label
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case

FP32 = (9.0e-06, 1.3e-02)        # peak distance to float64, baseline → commit
EIGHT_BIT = (3.66e4, 3.61e4)
DIFF = {"32bit": 1.25e-02, "8bit_blockwise": 3.0e2}   # largest per-step |commit − baseline|


def _case(family: str, seed: int):
    return make_case(optimizer="adam", family=family, param_dtype="float32",
                     hyper={**OPTIMIZER_HYPER_DEFAULTS["adam"], "lr": 1e-3, "weight_decay": 0.01},
                     gradient=GradientStreamSpec(), seed=seed, size=64, steps=2)


def _result(case, distance: float, digests: list[str]) -> CaseResult:
    return CaseResult(case=case, status="ok", trajectory=Trajectory(
        ref64_max_abs=[distance, distance], ref64_max_rel=[1e-3, 1e-3], same_precision_max_abs=[0.0, 0.0],
        nonfinite_count=[0, 0], digests=digests))


def _verdict():
    cases = [(_case(family, seed), distances) for family, distances in (("32bit", FP32), ("8bit_blockwise", EIGHT_BIT))
             for seed in (0, 1)]
    baseline = RunResult(battery_name="t", battery_version=1, battery_digest="bat", build_digest="base",
                         cases=[_result(case, before, ["od2:a", "od2:b"]) for case, (before, _) in cases])
    commit = RunResult(battery_name="t", battery_version=1, battery_digest="bat", build_digest="commit",
                       cases=[_result(case, after, ["od2:x", "od2:y"]) for case, (_, after) in cases])
    diffs = {case.case_id: [DIFF[case.family] / 2, DIFF[case.family]] for case, _ in cases}
    return compare_runs(commit, baseline, diffs)


def test_the_summary_gives_each_family_and_dtype_its_own_figures() -> None:
    comparison = _verdict()
    assert comparison.verdict == "changed"
    lines = comparison.summary.splitlines()
    fp32 = [line for line in lines if "32bit float32 (2 cases)" in line and "8bit" not in line]
    eight = [line for line in lines if "8bit_blockwise float32 (2 cases)" in line]
    assert len(fp32) == 1 and len(eight) == 1, comparison.summary
    assert "peak distance to float64 9.000e-06 → 1.300e-02, ×1.444e+03 (2 farther)" in fp32[0]
    assert "largest |commit - baseline| 1.250e-02" in fp32[0]
    assert "peak distance to float64 3.660e+04 → 3.610e+04, unchanged in scale (×9.863e-01)" in eight[0]
    assert "quantization error, large by design" in eight[0]
    # No line carries a figure of the other scale: the 8-bit distance and |Δ| never stand for the fp32 cases.
    for line in lines:
        if "e+04" in line or "3.00e+02" in line or "3.000e+02" in line:
            assert line.strip().startswith("8bit_blockwise float32"), line


def test_the_cli_tables_give_each_family_and_dtype_its_own_figures() -> None:
    comparison = _verdict().model_dump(mode="json")
    run = {"id": 7, "commit_sha": "decay", "base_sha": None, "environment": "cpu", "status": "done", "error": None,
           "progress": {"cases_done": 4, "cases_total": 4},
           "verdict": {"outcome": "changed", "flagged": True, "changed_cases": 4, "first_divergent_step": 1,
                       "summary": comparison["summary"], "detail": comparison}}
    console = Console(width=400, record=True)
    print_report(console, [run])
    text = console.export_text()
    assert "32bit float32: 9.000e-06 → 1.300e-02" in text and "8bit_blockwise float32: 3.660e+04 → 3.610e+04" in text
    assert "32bit float32: 1.250e-02" in text and "8bit_blockwise float32: 3.000e+02" in text  # max |Δ| per group
    assert "run 7: 8bit_blockwise float32 (2 cases): peak distance to float64 3.660e+04 → 3.610e+04" in text
    # The run row never shows a bare figure: each one is labelled with its family and dtype.
    row = next(line for line in text.splitlines() if "│ decay " in line)
    assert "3.660e+04 → 3.610e+04" not in row.replace("8bit_blockwise float32: 3.660e+04 → 3.610e+04", ""), row


def test_the_dashboard_sentence_gives_each_family_and_dtype_its_own_figures() -> None:
    def changed(family: str, before: float, after: float) -> ChangedCase:
        return ChangedCase(case_id=f"c-{family}", verdict="changed", optimizer="adam", family=family, dtype="float32",
                           lr=1e-3, weight_decay=0.01, seed=0, gradient="open", first_divergent_step=1,
                           max_abs_diff=DIFF[family], commit_final=after, baseline_final=before, direction="farther",
                           message=None, commit_peak=after, baseline_peak=before)

    sentence = size_sentence([changed("32bit", *FP32), changed("8bit_blockwise", *EIGHT_BIT)])
    assert "32bit float32, 1 case: 9.000e-06 → 1.300e-02, ×1.444e+03" in sentence
    assert ("8bit_blockwise float32, 1 case: 3.660e+04 → 3.610e+04, unchanged in scale (×9.863e-01) (with 8-bit states "
            "the distance to float64 is their quantization error") in sentence


def test_verdicts_stored_before_the_scale_was_recorded_are_grouped_by_their_case_id() -> None:
    eight, fp32 = _case("8bit_blockwise", 0), _case("32bit", 0)
    assert case_scale({"case_id": eight.case_id}) == ("8bit_blockwise", "float32")
    assert case_scale({"case_id": fp32.case_id}) == ("32bit", "float32")
    assert case_scale({"case_id": "made-up-id"}) == ("unknown family", "unknown dtype")
    groups = change_size_by_scale([
        {"case_id": eight.case_id, "verdict": "changed", "baseline_peak_ref64_distance": EIGHT_BIT[0],
         "commit_peak_ref64_distance": EIGHT_BIT[1]},
        {"case_id": fp32.case_id, "verdict": "changed", "baseline_peak_ref64_distance": FP32[0],
         "commit_peak_ref64_distance": FP32[1]}])
    assert [(scale_label(g), g.baseline_peak, g.commit_peak) for g in groups] == [
        ("32bit float32", *FP32), ("8bit_blockwise float32", *EIGHT_BIT)]
