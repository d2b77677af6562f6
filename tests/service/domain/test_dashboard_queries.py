"""Dashboard queries and wording without a browser (the pages in a browser: tests/service/dashboard/browser/)."""

from __future__ import annotations

from service.core.results import CaseComparison, RunResult
from service.core.verdicts import compare_runs, figures
from service.db.models import DONE, Commit, Project, Run, SourceArchive, Verdict
from service.domain import dashboard_queries
from service.domain.dashboard_queries import badge


def _changed(case_id: str, direction: str) -> CaseComparison:
    commit = {"closer": 1.0, "farther": 4.0, "same": 2.0}[direction]
    return CaseComparison(case_id=case_id, optimizer="adam", verdict="changed", first_divergent_step=1,
                          commit_final_ref64_distance=commit, baseline_final_ref64_distance=2.0,
                          direction=direction)


CASES = [_changed("a", "farther"), _changed("b", "farther"), _changed("c", "closer"), _changed("d", "same"),
         CaseComparison(case_id="e", optimizer="lion", verdict="unchanged")]


def test_direction_counts_are_a_field_of_the_comparison() -> None:
    counted = figures(CASES)
    assert counted.directions == {"farther": 2, "closer": 1, "same": 1}
    assert (counted.changed, counted.unchanged, counted.judged, counted.first_divergent_step) == (4, 1, 5, 1)
    # Stored with the verdict: compare_runs puts the figures on the comparison it returns.
    empty = RunResult(battery_name="quick", battery_version=1, battery_digest="x")
    assert compare_runs(empty, empty).figures.directions == {"closer": 0, "farther": 0, "same": 0}


def test_badges_say_the_verdict_in_words() -> None:
    farther, closer = {"farther": 1, "closer": 0}, {"closer": 3}
    mixed = {"closer": 3, "farther": 2, "same": 1}
    assert badge(status="done", outcome="changed", directions=farther).text == "changed → farther"
    assert badge(status="done", outcome="changed", directions=closer).text == "changed → closer"
    assert badge(status="done", outcome="changed", directions=mixed).text == "changed → mixed: 2 farther, 3 closer"
    assert badge(status="done", outcome="changed", directions=closer, acknowledged=True).text == \
        "changed → closer (acknowledged)"
    assert badge(status="done", outcome="changed").text == "changed → same distance"
    assert badge(status="done", outcome="unchanged").text == "unchanged"
    assert badge(status="done", outcome="no-baseline").text == "no baseline"
    assert badge(status="failed", outcome="broken").text == "broken"
    assert badge(status="running", outcome=None, cases_done=3, cases_total=81).text == "running 3/81"
    assert badge(status="queued", outcome=None).text == "queued"


def _changed_run(session, project: Project, sha: str, detail: dict) -> Run:  # noqa: ANN001
    commit = Commit(project_id=project.id, sha=sha, parents=[], source_digest="0" * 64)
    session.add(commit)
    session.flush()
    run = Run(project_id=project.id, commit_id=commit.id, source_digest="0" * 64, battery="quick",
              battery_hash="b" * 64, environment="cpu", status=DONE)
    session.add(run)
    session.flush()
    session.add(Verdict(run_id=run.id, outcome="changed", flagged=True, changed_cases=4, first_divergent_step=1,
                        detail=detail))
    session.flush()
    return run


def test_the_overview_badge_reads_the_stored_figures_never_the_summary_text(api, db_session) -> None:  # noqa: ANN001
    project = Project(name="figures", environments=["cpu"])
    db_session.add(project)
    if db_session.get(SourceArchive, "0" * 64) is None:
        db_session.add(SourceArchive(digest="0" * 64, size_bytes=1, member_count=1))
    db_session.flush()
    cases = [c.model_dump(mode="json") for c in CASES]
    # A summary whose words say otherwise: a badge that parsed them would read "closer".
    lying = "CHANGED: 4 changed of 5 cases\nvs float64 reference: 9 closer"
    # Stored with figures: the field wins (its counts differ from the cases' on purpose).
    new = _changed_run(db_session, project, "new", {"summary": lying, "cases": cases,
                                                     "figures": figures(CASES[2:]).model_dump(mode="json")})
    # Stored before the figures were: counted from the stored cases.
    old = _changed_run(db_session, project, "old", {"summary": lying, "cases": cases})

    # Two root commits: the newer is the line, the older is listed off it (service/domain/commit_lines.py).
    listed = dashboard_queries.overview(session=db_session, project_name="figures")
    rows = {row.sha: row.badge.text for row in [*listed.rows, *listed.off_line]}

    assert rows == {"new": "changed → closer", "old": "changed → mixed: 2 farther, 1 closer"}
    # The API gives the same figures to every client (the CLI's tables read them).
    figured = {run.id: api.get(f"/api/v1/runs/{run.id}").json()["verdict"]["figures"] for run in (new, old)}
    assert figured[new.id]["directions"] == {"closer": 1, "farther": 0, "same": 1}
    assert figured[old.id]["directions"] == {"closer": 1, "farther": 2, "same": 1}
    assert (figured[old.id]["changed"], figured[old.id]["first_divergent_step"]) == (4, 1)


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
