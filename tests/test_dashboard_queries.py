"""Dashboard queries and wording without a browser (the pages in a browser: tests/browser/)."""

from __future__ import annotations

from service.domain.dashboard_queries import badge, direction_counts
from service.core.results import CaseComparison, RunResult
from service.core.verdicts import summarize


def _changed(case_id: str, direction: str) -> CaseComparison:
    commit = {"closer": 1.0, "farther": 4.0, "same": 2.0}[direction]
    return CaseComparison(case_id=case_id, optimizer="adam", verdict="changed", first_divergent_step=1,
                          commit_final_ref64_distance=commit, baseline_final_ref64_distance=2.0,
                          direction=direction)


def test_direction_counts_read_the_summary_that_service_verdicts_writes() -> None:
    # The overview reads directions from the summary line instead of every case of the detail; if
    # summarize changes its wording, this fails instead of every badge silently losing its direction.
    cases = [_changed("a", "farther"), _changed("b", "farther"), _changed("c", "closer"), _changed("d", "same"),
             CaseComparison(case_id="e", optimizer="lion", verdict="unchanged")]
    run = RunResult(battery_name="quick", battery_version=1, battery_digest="x")
    summary = summarize("changed", cases, run, run)
    assert direction_counts(summary) == {"farther": 2, "closer": 1, "same": 1}
    assert direction_counts("UNCHANGED: 5 unchanged of 5 cases") == {}
    assert direction_counts(None) == {}


def test_badges_say_the_verdict_in_words() -> None:
    farther = "CHANGED: 1 changed of 2 cases\nvs float64 reference: 1 farther (final distance commit/baseline from 2x to 2x)"
    closer = "CHANGED: 1 changed\nvs float64 reference: 3 closer"
    mixed = "CHANGED\nvs float64 reference: 3 closer, 2 farther, 1 same"
    assert badge(status="done", outcome="changed", summary=farther).text == "changed → farther"
    assert badge(status="done", outcome="changed", summary=closer).text == "changed → closer"
    assert badge(status="done", outcome="changed", summary=mixed).text == "changed → mixed: 2 farther, 3 closer"
    assert badge(status="done", outcome="changed", summary=closer, acknowledged=True).text == \
        "changed → closer (acknowledged)"
    assert badge(status="done", outcome="unchanged").text == "unchanged"
    assert badge(status="done", outcome="no-baseline").text == "no baseline"
    assert badge(status="failed", outcome="broken").text == "broken"
    assert badge(status="running", outcome=None, cases_done=3, cases_total=81).text == "running 3/81"
    assert badge(status="queued", outcome=None).text == "queued"


def test_pages_answer_404_and_422_with_what_to_do(api) -> None:
    response = api.get("/projects/nope")
    assert response.status_code == 404 and "no project named 'nope'" in response.json()["detail"]
    api.post("/api/v1/projects", json={"name": "dash"})
    assert api.get("/projects/dash").status_code == 200
    response = api.get("/projects/dash?verdict=bogus")
    assert response.status_code == 422 and "unknown verdict filter 'bogus'" in response.json()["detail"]
    assert api.get("/runs/999999").status_code == 404
    assert api.get("/projects/dash/releases").status_code == 200
    # plotly.js comes from the installed package, not a CDN.
    script = api.get("/static/vendor/plotly.min.js")
    assert script.status_code == 200 and "plotly" in script.text[:2000].lower()
    assert api.get("/static/dashboard/dashboard.css").status_code == 200


def test_badges_for_nondeterminism_set_aside_cases_and_optdrift_errors() -> None:
    from service.domain.dashboard_queries import side_notes

    error = badge(status="error", outcome=None)
    assert (error.text, error.css) == ("optdrift error", "error") and "not the commit's fault" in error.title
    assert badge(status="done", outcome="nondeterministic").text == "nondeterministic"
    # Set-aside cases are notes beside the badge, never in it; a nondeterministic verdict is not repeated.
    notes = side_notes(outcome="broken", not_applicable=3, nondeterministic=2)
    assert [n.text for n in notes] == ["2 nondeterministic", "3 not applicable"]
    assert [n.text for n in side_notes(outcome="nondeterministic", not_applicable=None, nondeterministic=1)] == []
