"""Issue 14 through the real API and dashboard pages on PostgreSQL: the direction over the
trajectory beside the final step's, not-applicable and nondeterministic cases counted and listed
apart from the verdict, and an `error` run shown as optdrift's failure, not the commit's."""

from __future__ import annotations

import re

from service.domain import projects, runs, submissions, trajectories, verdict_store
from service.core.results import CaseResult, CaseSpec, RepeatCheck, Trajectory
from tests.service_fixtures import make_archive

REASON = "the library has no bfloat16 32-bit kernel for adam"
# The commit wanders 6.8e-4 off the float64 reference and is back at the final step (issue item 9).
BASELINE_DISTANCES = [1e-6, 2e-6, 3e-6, 4e-6, 5e-6]
WANDERING_DISTANCES = [1e-6, 2e-4, 6.8e-4, 1e-4, 5e-6]


def _case(case_id: str, dtype: str = "float32") -> CaseSpec:
    return CaseSpec(case_id=case_id, optimizer="adam", param_dtype=dtype, hyper={"lr": 0.1, "weight_decay": 0.1},
                    seed=0, size=8, steps=5)


def _ok(case_id: str, digests: list[str], distances=BASELINE_DISTANCES, repeat_check=None,  # noqa: ANN001
        dtype: str = "float32") -> CaseResult:
    return CaseResult(case=_case(case_id, dtype), status="ok", repeat_check=repeat_check, trajectory=Trajectory(
        ref64_max_abs=list(distances), ref64_max_rel=list(distances), same_precision_max_abs=[1e-7] * 5,
        nonfinite_count=[0] * 5, digests=digests))


SAME = [f"s{i}" for i in range(5)]
MOVED = SAME[:1] + [f"m{i}" for i in range(1, 5)]


def _run_with(session, settings, sha, parents, results):  # noqa: ANN001, ANN202
    project = projects.ensure(session=session, name="p")
    run = submissions.submit_commit(session=session, settings=settings, project=project, sha=sha,
                                    parents=parents, archive=make_archive({"a.cpp": sha})).runs[0]
    assert runs.claim(session=session, run_id=run.id, worker="w")
    for index, result in enumerate(results):
        trajectories.store_case_result(session=session, run_id=run.id, case_index=index, result=result)
    runs.set_status(session=session, run_id=run.id, worker="w", status="done", battery_hash="h")
    session.refresh(run)
    verdict_store.evaluate_with_dependants(session=session, run=run)
    return run


def _seed(session, settings):  # noqa: ANN001, ANN202
    """a: the base. b: wandering case changed, bf16 case not applicable. c: the same as b but one case
    does not reproduce itself. d: optdrift could not run it (error)."""
    a = _run_with(session, settings, "a", [], [_ok("wander", SAME), _ok("bf16", SAME, dtype="bfloat16"), _ok("steady", SAME)])
    aside = CaseResult(case=_case("bf16", "bfloat16"), status="not_applicable", message=REASON)
    b = _run_with(session, settings, "b", ["a"], [_ok("wander", MOVED, WANDERING_DISTANCES), aside,
                                                  _ok("steady", SAME)])
    c = _run_with(session, settings, "c", ["b"], [
        _ok("wander", MOVED, WANDERING_DISTANCES), aside,
        _ok("steady", SAME, repeat_check=RepeatCheck(runs=4, differing=2, first_divergent_step=3))])
    project = projects.ensure(session=session, name="p")
    d = submissions.submit_commit(session=session, settings=settings, project=project, sha="d", parents=["c"],
                                  archive=make_archive({"a.cpp": "d"})).runs[0]
    assert runs.claim(session=session, run_id=d.id, worker="w")
    runs.set_status(session=session, run_id=d.id, worker="w", status="error",
                    error="source fetch refused: HTTP 401 from http://api:8000")
    session.refresh(d)
    return a, b, c, d


def test_api_counts_and_lists_set_aside_cases_and_both_directions(api, db_session, api_settings):  # noqa: ANN001
    _a, b, c, d = _seed(db_session, api_settings)

    changed = api.get(f"/api/v1/runs/{b.id}").json()
    verdict = changed["verdict"]
    assert (changed["status"], changed["fault"], verdict["outcome"]) == ("done", None, "changed")
    assert verdict["counts"] == {"unchanged": 1, "changed": 1, "broken": 0, "new": 0, "not_applicable": 1,
                                 "nondeterministic": 0}
    assert verdict["not_applicable"] == [{"case_id": "bf16", "optimizer": "adam", "reason": REASON}]
    assert verdict["nondeterministic"] == []
    assert verdict["direction_disagreements"] == [
        {"case_id": "wander", "optimizer": "adam", "direction": "farther", "final_direction": "same"}]
    case = next(x for x in verdict["detail"]["cases"] if x["case_id"] == "wander")
    assert (case["commit_peak_ref64_distance"], case["baseline_peak_ref64_distance"]) == (6.8e-4, 5e-6)
    assert REASON in verdict["summary"] and "final step alone reads otherwise" in verdict["summary"]
    assert "broken" not in verdict["summary"]

    unsteady = api.get(f"/api/v1/runs/{c.id}").json()["verdict"]
    assert (unsteady["outcome"], unsteady["flagged"]) == ("nondeterministic", True)
    assert unsteady["counts"]["nondeterministic"] == 1 and unsteady["counts"]["broken"] == 0
    assert unsteady["nondeterministic"] == [{"case_id": "steady", "optimizer": "adam", "runs": 4, "differing": 2,
                                             "first_divergent_step": 3, "nondeterminism": None,
                                             "baseline_runs": None, "baseline_differing": None}]

    errored = api.get(f"/api/v1/runs/{d.id}").json()
    assert (errored["status"], errored["fault"], errored["verdict"]) == ("error", "optdrift", None)


def _badges(html: str) -> dict[str, list[str]]:
    """sha -> the texts of the badges in its overview row."""
    rows = re.findall(r'<tr data-sha="([^"]+)".*?</tr>', html, re.S)
    bodies = re.findall(r'<tr data-sha="[^"]+".*?</tr>', html, re.S)
    return {sha: re.findall(r'data-badge="[^"]*">([^<]*)</span>', body) for sha, body in zip(rows, bodies)}


def test_dashboard_shows_set_aside_cases_apart_and_an_error_as_optdrifts(api, db_session, api_settings):  # noqa: ANN001
    _seed(db_session, api_settings)
    overview = api.get("/projects/p").text
    badges = _badges(overview)
    assert badges["a"] == ["no baseline"]
    assert badges["b"] == ["changed → farther", "1 not applicable"]
    assert badges["c"] == ["nondeterministic", "1 not applicable"]
    assert badges["d"] == ["optdrift error"]
    assert "broken" not in overview.split("<tbody>")[1]
    assert [sha for sha in _badges(api.get("/projects/p?verdict=error").text)] == ["d"]
    assert [sha for sha in _badges(api.get("/projects/p?verdict=nondeterministic").text)] == ["c"]

    page = api.get("/projects/p/commits/b").text
    assert 'id="not-applicable-cases"' in page and REASON in page
    assert "1 case not applicable on this device" in page
    # The wandering case: farther over the trajectory, and the final step's "same" shown beside it.
    assert "changed → farther" in page and "final step alone: same distance" in page
    assert "peak 5.000e-06 → 6.800e-04" in page and "final 5.000e-06 → 5.000e-06" in page
    assert "The final step alone reads otherwise for 1 case" in page

    page = api.get("/projects/p/commits/c").text
    assert 'id="nondeterministic-cases"' in page
    row = re.search(r'<tr data-case-id="steady">.*?</tr>', page.split('id="nondeterministic-cases"')[1], re.S).group(0)
    assert "2 of 3" in row and ">3<" in row and "not blamed" in row  # no baseline repeats stored
    assert "Nondeterministic: 1 case of 2 did not reproduce on the same build (repeats differ from step 3)" in page

    page = api.get("/projects/p/commits/d").text
    assert "optdrift error, not the commit&#39;s: source fetch refused: HTTP 401" in page
    assert "badge-broken" not in page


def test_release_matrix_keeps_not_applicable_cases_out_of_broken_and_changed(db_session, api_settings):  # noqa: ANN001
    from service.dashboard import release_matrix

    a, b, _c, _d = _seed(db_session, api_settings)
    a.commit.release_tag, b.commit.release_tag = "v1", "v2"
    db_session.flush()
    matrix = release_matrix.build(session=db_session, project_name="p")
    cells = matrix.row("adam · 32bit · bfloat16").cells
    assert (cells[1].not_applicable, cells[1].broken, cells[1].changed, cells[1].cases) == (1, 0, 0, 0)
    assert cells[1].intensity == 0
    assert cells[0].cases == 1
