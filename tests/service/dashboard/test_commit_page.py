"""The small multiples' bounds and scales (service/dashboard/commit_page.py), without a browser:
at most MAX_PANELS panels with the other groups named and linked, at most MAX_LINES_PER_PANEL lines a
panel, and each case in the scale its table row states."""

from __future__ import annotations

import pytest

from service.core.attribution_view import CaseAttribution
from service.dashboard import commit_page
from service.domain.dashboard_queries import ChangedCase


def _case(case_id: str, optimizer: str, family: str = "32bit", *, max_abs_diff: float = 2e-3,
          baseline_peak: float = 4e-3) -> ChangedCase:
    return ChangedCase(case_id=case_id, verdict="changed", optimizer=optimizer, family=family, dtype="float32",
                       lr=None, weight_decay=None, seed=None, gradient=None, first_divergent_step=1,
                       max_abs_diff=max_abs_diff, commit_final=None, baseline_final=None, direction="farther",
                       message=None, baseline_peak=baseline_peak)


def _attribution(case_id: str, *, peak_ulps: float | None, relative: float | None) -> CaseAttribution:
    return CaseAttribution(case_id, "semantic", None, None, None, peak_ulps, relative, None, None, None, None,
                           None, None)


def _diffs(case_id: str) -> list[float]:
    return [1e-3, 2e-3, 0.0]


def _no_distance_change(case_id: str) -> None:
    return None


def test_panels_are_bounded_and_the_rest_are_named_with_their_first_row() -> None:
    changed = [_case(f"c{g}-{i}", f"opt{g}") for g in range(10) for i in range(8)]
    multiples = commit_page.small_multiples(changed, {}, _diffs, _no_distance_change)
    assert [p.group for p in multiples.panels] == [f"opt{g} · 32bit" for g in range(commit_page.MAX_PANELS)]
    # Row ids are 1-based table rows: group 8's first case is the 65th row.
    assert multiples.not_shown == [("opt8 · 32bit", "changed-65"), ("opt9 · 32bit", "changed-73")]
    for panel in multiples.panels:
        assert len(panel.lines) == commit_page.MAX_LINES_PER_PANEL and panel.more == 2


def test_each_case_is_drawn_in_its_rows_scale_and_peaks_at_its_figure() -> None:
    float_case = _case("f", "adam")
    eight_bit = _case("q", "adam", "8bit_blockwise", baseline_peak=4e4)
    no_attribution = _case("n", "lion")
    attribution = {"f": _attribution("f", peak_ulps=40.0, relative=0.5),
                   # An 8-bit case's ulps are not its scale: its distance to float64 is quantization.
                   "q": _attribution("q", peak_ulps=9e6, relative=5e-8)}
    multiples = commit_page.small_multiples([float_case, eight_bit, no_attribution], attribution, _diffs,
                                            _no_distance_change)
    lines = {line.case_id: line for panel in multiples.panels for line in panel.lines}
    units = {panel.group: panel.unit for panel in multiples.panels}
    assert units == {"adam · 32bit": commit_page.ULP, "adam · 8bit_blockwise": commit_page.BASELINE_DISTANCE,
                     "lion · 32bit": commit_page.BASELINE_DISTANCE}
    # Exact: the unit is peak |Δ| / figure, so the peak step's value is figure times (x / x).
    assert lines["f"].values[:2] == pytest.approx([20.0, 40.0], rel=1e-15)
    assert lines["q"].values[1] == pytest.approx(5e-8, rel=1e-15)
    assert lines["n"].values[1] == pytest.approx(2e-3 / 4e-3, rel=1e-15)  # max |Δ| / baseline's peak
    assert lines["f"].values[2] is None  # an exact zero has no place on a log axis


def test_before_the_co_run_the_change_in_distance_is_drawn_and_said() -> None:
    case = _case("d", "adam", max_abs_diff=None, baseline_peak=1e-4)
    multiples = commit_page.small_multiples([case], {}, lambda _: None, lambda _: [0.0, 5e-5, 1e-4])
    (panel,) = multiples.panels
    assert panel.unit == commit_page.DISTANCE_CHANGE and multiples.estimated
    assert panel.lines[0].values[0] is None and panel.lines[0].values[1:] == pytest.approx([0.5, 1.0], rel=1e-15)
    assert '"values": [null, 0.5, 1.0]' in multiples.as_json()


def test_the_page_draws_the_distance_change_from_both_runs_stored_series(api, db_session) -> None:  # noqa: ANN001
    """Before the co-run, the route reads each drawn case's two ref64 series from the database
    (dashboard_queries.reference_distances) and draws |commit's − baseline's distance| per step."""
    import json
    import re

    from service.core.results import CaseResult, CaseSpec, RunResult, Trajectory
    from service.core.verdicts import compare_runs
    from service.db.models import DONE, Commit, Project, Run, SourceArchive, Verdict
    from service.domain import trajectories

    spec = CaseSpec(case_id="adam-a", optimizer="adam", hyper={"lr": 0.1, "weight_decay": 0.1}, seed=0, size=8,
                    steps=3)

    def result(distances: list[float], digests: list[str]) -> RunResult:
        trajectory = Trajectory(ref64_max_abs=distances, ref64_max_rel=[0.0] * 3, nonfinite_count=[0] * 3,
                                digests=digests)
        return RunResult(battery_name="quick", battery_version=1, battery_digest="q",
                         cases=[CaseResult(case=spec, status="ok", trajectory=trajectory, duration_s=0.1)])

    base = result([1.0, 2.0, 2.5], ["od2:" + "a" * 32] * 3)
    ours = result([1.0, 3.0, 4.0], ["od2:" + "a" * 32, "od2:" + "b" * 32, "od2:" + "c" * 32])
    project = Project(name="distance-page", environments=["cpu"])
    db_session.add(project)
    if db_session.get(SourceArchive, "0" * 64) is None:
        db_session.add(SourceArchive(digest="0" * 64, size_bytes=1, member_count=1))
    db_session.flush()
    runs = {}
    for sha, stored in (("base", base), ("ours", ours)):
        commit = Commit(project_id=project.id, sha=sha, parents=["base"] if sha == "ours" else [],
                        source_digest="0" * 64)
        db_session.add(commit)
        db_session.flush()
        runs[sha] = Run(project_id=project.id, commit_id=commit.id, source_digest="0" * 64, battery="quick",
                        battery_hash="q", environment="cpu", status=DONE)
        db_session.add(runs[sha])
        db_session.flush()
        trajectories.store_case_result(session=db_session, run_id=runs[sha].id, case_index=0,
                                       result=stored.cases[0])
    comparison = compare_runs(ours, base)  # no co-run diffs yet
    db_session.add(Verdict(run_id=runs["ours"].id, baseline_run_id=runs["base"].id, outcome=comparison.verdict,
                           flagged=True, changed_cases=1, first_divergent_step=2,
                           detail=comparison.model_dump(mode="json")))
    db_session.flush()

    page = api.get("/projects/distance-page/commits/ours")

    assert page.status_code == 200, page.text
    payload = json.loads(re.search(r'id="divergence-data">(.*?)</script>', page.text, re.S).group(1))
    (panel,) = payload
    assert panel["unit"] == commit_page.DISTANCE_CHANGE
    (line,) = panel["lines"]
    # |commit − baseline distance| per step is [0, 1, 1.5], drawn from the first divergent step (2) in
    # the baseline's scale, so the two drawn values keep that ratio whatever the normalisation.
    values = line["values"]
    assert values[0] is None and values[1] > 0, line
    assert values[2] / values[1] == pytest.approx(1.5, rel=1e-12)  # exact binary floats: only rounding
