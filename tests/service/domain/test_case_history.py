"""The per-case history (service/domain/case_history.py): its JSON API and page on the real
PostgreSQL, with verdicts computed by the service's own verdict_store from stored trajectories.

Lineage (first parents), one tracked case and one bystander that never changes:

  c1  release v1   digests a1 a2 a3   distance 1e-6 2e-6 3e-6     (nothing earlier)
  c2               the same bits                                  unchanged
  c3               a1 b2 b3           1e-6 5e-5 8e-5              changed from step 2, farther; acknowledged
  c4  release v2   the same as c3                                 unchanged
  c5               back to c1's bits  1e-6 2e-6 3e-6              changed from step 2, closer
  c6  parent never submitted, submitted with baseline=c1: compared with c1 (its verdict's baseline)
c1-c5 were submitted on branch main, c6 on hotfix: the history follows main's first-parent line
(service/domain/commit_lines.py), c6's own line is `ref=c6`.
And c1 again in a second environment, so the page offers both.
"""

from __future__ import annotations

import math

from sqlalchemy import select

from service.db.models import DONE, Commit, Project, Run, SourceArchive, Verdict
from service.domain import trajectories, verdict_store
from service.core.results import CaseResult, CaseSpec, Trajectory

TRACKED = "adam.32bit.fp32.lr=0.1.wd=0.1.open.n64.s0.t3#0000aaaa"
BYSTANDER = "lion.32bit.fp32.lr=0.1.wd=0.1.open.n64.s0.t3#0000bbbb"
SAME = (["a1", "a2", "a3"], [1e-6, 2e-6, 3e-6])
MOVED = (["a1", "b2", "b3"], [1e-6, 5e-5, 8e-5])


def _case(case_id: str, bits: tuple[list[str], list[float]]) -> CaseResult:
    optimizer = case_id.split(".")[0]
    digests, distances = bits
    spec = CaseSpec(case_id=case_id, optimizer=optimizer, hyper={"lr": 0.1, "weight_decay": 0.1}, seed=0,
                    size=64, steps=3)
    return CaseResult(case=spec, status="ok", trajectory=Trajectory(
        ref64_max_abs=distances, ref64_max_rel=distances, same_precision_max_abs=[1e-9] * 3,
        nonfinite_count=[0, 0, 0], digests=[f"od2:{d}" for d in digests]))


def seed_history(session) -> dict[str, int]:  # noqa: ANN001
    """The lineage above; returns run ids by label."""
    project = Project(name="hist", environments=["cpu"])
    session.add(project)
    session.add(SourceArchive(digest="0" * 64, size_bytes=1, member_count=1))
    session.flush()
    commits: dict[str, Commit] = {}
    runs: dict[str, int] = {}
    lineage = [("c1", None, "v1", SAME), ("c2", "c1", None, SAME), ("c3", "c2", None, MOVED),
               ("c4", "c3", "v2", MOVED), ("c5", "c4", None, SAME), ("c6", "missing-parent", None, SAME)]
    for label, parent, tag, bits in lineage:
        commit = Commit(project_id=project.id, sha=label, parents=[parent] if parent else [],
                        ref="hotfix" if label == "c6" else "main", release_tag=tag, message=f"commit {label}",
                        source_digest="0" * 64)
        session.add(commit)
        session.flush()
        commits[label] = commit
        for environment in ("cpu", "gpu.sm90") if label == "c1" else ("cpu",):
            run = Run(project_id=project.id, commit_id=commit.id, source_digest="0" * 64, battery="quick",
                      environment=environment, status=DONE,
                      base_commit_id=commits["c1"].id if label == "c6" else None)
            session.add(run)
            session.flush()
            for index, case in enumerate([_case(TRACKED, bits), _case(BYSTANDER, SAME)]):
                trajectories.store_case_result(session=session, run_id=run.id, case_index=index, result=case)
            verdict_store.evaluate(session=session, run=run)
            runs[label if environment == "cpu" else f"{label}@{environment}"] = run.id
    session.flush()
    return runs


def _history(api, case: str = TRACKED, **params) -> dict:  # noqa: ANN001
    response = api.get("/api/v1/projects/hist/case-history", params={"case": case, **params})
    assert response.status_code == 200, response.text
    return response.json()


def test_history_marks_change_points_acknowledgements_and_releases(api, db_session) -> None:
    runs = seed_history(db_session)
    ack = api.post(f"/api/v1/runs/{runs['c3']}/acknowledge", json={"note": "the new ordering is intended"})
    assert ack.status_code == 200, ack.text

    body = _history(api)
    points = {p["sha"]: p for p in body["points"]}
    assert [p["sha"] for p in body["points"]] == ["c1", "c2", "c3", "c4", "c5"]  # main's line, oldest first
    assert body["off_line"] == 1  # c6, on another line
    assert body["change_points"] == ["c3", "c5"]
    assert body["releases"] == [{"tag": "v1", "sha": "c1"}, {"tag": "v2", "sha": "c4"}]
    assert body["environment"] == "cpu" and body["environments"] == ["cpu", "gpu.sm90"]
    # Distances exactly as stored (full precision): final step and the largest over the steps.
    assert points["c3"]["final_distance"] == 8e-5 and points["c3"]["max_distance"] == 8e-5
    assert points["c1"]["final_distance"] == 3e-6
    # Against the first parent, through service.core.verdicts: step 2 is the first digest that differs.
    assert (points["c3"]["compared_with"], points["c3"]["change"], points["c3"]["first_divergent_step"],
            points["c3"]["direction"]) == ("c2", "changed", 2, "farther")
    assert (points["c5"]["change"], points["c5"]["direction"]) == ("changed", "closer")
    assert points["c2"]["change"] == "unchanged" and points["c4"]["change"] == "unchanged"
    assert points["c1"]["change"] is None and points["c1"]["compared_with"] is None
    # Its parent was never submitted: its line is itself, compared with its verdict's baseline (c1,
    # the explicit base).
    alone = _history(api, ref="c6")["points"]
    assert [(p["sha"], p["compared_with"], p["change"]) for p in alone] == [("c6", "c1", "unchanged")]
    assert points["c3"]["acknowledged"] and points["c3"]["acknowledgement_note"] == "the new ordering is intended"
    assert not points["c5"]["acknowledged"]
    # What the verdict recorded for the case at a change point rides along (here its distances).
    assert points["c3"]["verdict_fields"]["commit_final_ref64_distance"] == 8e-5
    assert points["c3"]["attribution"] is None  # not attributed (yet): nothing to show


def test_a_change_point_shows_its_attribution_on_the_case_scale(api, db_session) -> None:
    runs = seed_history(db_session)
    verdict = db_session.scalar(select(Verdict).where(Verdict.run_id == runs["c5"]))
    # As worker/attribution's co-run stores it: per case, its kind and the change in ulps.
    verdict.detail = {**verdict.detail, "attribution": {TRACKED: {
        "class": "rounding-level", "first_step_ulps": 1.0, "peak_ulps": 3.5, "change_vs_baseline_distance": 0.02}}}
    db_session.flush()
    point = next(p for p in _history(api)["points"] if p["sha"] == "c5")
    assert point["attribution"]["kind"] == "rounding-level"
    assert (point["attribution"]["first_step_ulps"], point["attribution"]["peak_ulps"]) == (1.0, 3.5)
    assert "1.000e+00 ulp at the first divergent step" in point["attribution"]["text"]
    html = api.get("/projects/hist/case-history", params={"case": TRACKED}).text
    assert "rounding-level: 1.000e+00 ulp at the first divergent step, 3.500e+00 ulp at most" in html

    # The bystander never changed; another environment has only c1.
    assert _history(api, BYSTANDER)["change_points"] == []
    assert [p["sha"] for p in _history(api, environment="gpu.sm90")["points"]] == ["c1"]
    # limit keeps the newest commits.
    limited = _history(api, limit=2)
    assert [p["sha"] for p in limited["points"]] == ["c4", "c5"] and limited["truncated"] is True


def test_history_page_and_links_from_the_commit_page(api, db_session) -> None:
    runs = seed_history(db_session)
    page = api.get("/projects/hist/case-history", params={"case": TRACKED})
    assert page.status_code == 200, page.text
    html = page.text
    assert html.count('class="change-point"') == 2 and 'data-change-point="changed"' in html
    assert "release v1" in html and "release v2" in html and 'id="history-plot"' in html
    # The commit page links each changed case to its history.
    commit_page = api.get(f"/projects/hist/commits/c3?run={runs['c3']}").text
    assert "/projects/hist/case-history?case=adam.32bit.fp32.lr%3D0.1.wd%3D0.1.open.n64.s0.t3%230000aaaa" in commit_page


def test_unknown_case_environment_or_project_is_a_404_that_says_what_to_do(api, db_session) -> None:
    seed_history(db_session)
    response = api.get("/api/v1/projects/hist/case-history", params={"case": "nope"})
    assert response.status_code == 404 and "has run a case 'nope'" in response.json()["detail"]
    response = api.get("/api/v1/projects/hist/case-history", params={"case": TRACKED, "environment": "tpu"})
    assert response.status_code == 404 and "it ran in cpu, gpu.sm90" in response.json()["detail"]
    assert api.get("/api/v1/projects/none/case-history", params={"case": TRACKED}).status_code == 404
    assert api.get("/api/v1/projects/hist/case-history").status_code == 422  # case is required
    assert api.get("/projects/hist/case-history", params={"case": "nope"}).status_code == 404


def test_a_commit_that_set_the_case_aside_is_no_change_point_and_is_skipped_as_a_reference(api, db_session) -> None:
    runs = seed_history(db_session)
    aside = _case(TRACKED, SAME).model_copy(update={"status": "not_applicable", "trajectory": None,
                                                    "message": "no kernel for this case here"})
    trajectories.store_case_result(session=db_session, run_id=runs["c2"], case_index=0, result=aside)
    db_session.flush()
    points = {p["sha"]: p for p in _history(api)["points"]}
    assert points["c2"]["status"] == "not_applicable" and not points["c2"]["change_point"]
    # c3 is compared with c1, the nearest ancestor that ran the case: still a change from step 2.
    assert (points["c3"]["compared_with"], points["c3"]["change"], points["c3"]["first_divergent_step"]) == \
        ("c1", "changed", 2)


def test_non_finite_distances_are_null_in_json(api, db_session) -> None:
    runs = seed_history(db_session)
    run = db_session.get(Run, runs["c5"])
    broken = _case(TRACKED, (["a1", "x2", "x3"], [1e-6, math.nan, math.inf]))
    trajectories.store_case_result(session=db_session, run_id=run.id, case_index=0, result=broken)
    db_session.flush()
    point = next(p for p in _history(api)["points"] if p["sha"] == "c5")
    assert point["final_distance"] is None and point["max_distance"] is None
