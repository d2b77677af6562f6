"""History follows the branch (issue 44): the case history and the overview follow the default
branch's first-parent line (service/domain/commit_lines.py), never submission order, and pull
requests' merge commits, which never land, are listed under their pull request.

Through the real API on PostgreSQL. Commits are submitted over HTTP as the Action submits them (a
push: ref = the branch name, parents = [the branch's previous tip], the first-parent ancestry git
gives; a pull_request: ref = pull/N/merge, parents = [base tip, head]) and finished as a worker
finishes a run (claim, trajectories, done, verdicts).

    main:    A ── B ── C ── D          C moves the tracked case; D keeps C's bits
                   \\
    topic:          X ── Y ── Z        X moves it elsewhere (far from float64); submitted between C and D
    pull request #7: M = merge of Y into D (parents D, Y), never landing on main

Submission order: A B C X Y D M Z. In that order the old history drew X and Y into main's line
(a drop and a jump), M as main's newest step, and Z (the newest commit) as its end.
"""

from __future__ import annotations

import re

import pytest

from service.core.results import CaseResult, CaseSpec, Trajectory as TrajectoryModel
from service.domain import projects, runs, trajectories, verdict_store
from tests.service_fixtures import make_archive

PROJECT = "branchy"
TRACKED = "adam-tracked"
MAIN_BITS = (["a1", "a2", "a3"], [1e-6, 2e-6, 3e-6])
MOVED_BITS = (["a1", "m2", "m3"], [1e-6, 4e-6, 5e-6])
SIDE_BITS = (["a1", "s2", "s3"], [1e-6, 9e-2, 9e-1])  # far from float64: the old chart's spike


def _finish(session, run_id: int, bits: tuple[list[str], list[float]]) -> None:  # noqa: ANN001
    assert runs.claim(session=session, run_id=run_id, worker="w")
    digests, distances = bits
    spec = CaseSpec(case_id=TRACKED, optimizer="adam", hyper={"lr": 0.1}, seed=0, size=8, steps=3)
    trajectories.store_case_result(session=session, run_id=run_id, case_index=0, result=CaseResult(
        case=spec, status="ok", trajectory=TrajectoryModel(
            ref64_max_abs=distances, ref64_max_rel=distances, nonfinite_count=[0] * 3, digests=digests)))
    runs.set_status(session=session, run_id=run_id, worker="w", status="done", battery_hash="h")
    run = runs.get(session=session, run_id=run_id)
    session.refresh(run)
    verdict_store.evaluate_with_dependants(session=session, run=run)


def _submit(api, session, project: str, sha: str, ref: str, parents: list[str], ancestry: list[str],  # noqa: ANN001
            bits: tuple[list[str], list[float]]) -> None:
    """As the Action submits a commit (the same tree under every sha), then finished by a worker."""
    data = {"sha": sha, "ref": ref, "parents": " ".join(parents), "message": f"commit {sha}",
            "allow_no_baseline": "true"}
    if ancestry:
        data["ancestry"] = " ".join(ancestry)
    archive = make_archive({"ops.cpp": "// the same tree under every sha\n"})
    response = api.post(f"/api/v1/projects/{project}/commits", data=data,
                        files={"archive": ("s.tar.gz", archive, "application/gzip")})
    assert response.status_code in (200, 201), response.text
    _finish(session, response.json()["runs"][0]["id"], bits)


@pytest.fixture
def branchy(api, db_session):  # noqa: ANN001, ANN201
    """The lineage of the module docstring, submitted and finished in that order."""
    projects.create(session=db_session, name=PROJECT)
    db_session.flush()
    # (sha, ref, parents, ancestry, bits). Y and Z come without ancestry: their line is read through
    # their first parents (as from a client that sent none), up to X, which sent its own.
    lineage = [
        ("A", "main", [], [], MAIN_BITS),
        ("B", "main", ["A"], ["A"], MAIN_BITS),
        ("C", "main", ["B"], ["B", "A"], MOVED_BITS),
        ("X", "topic", ["B"], ["B", "A"], SIDE_BITS),
        ("Y", "topic", ["X"], [], SIDE_BITS),
        ("D", "main", ["C"], ["C", "B", "A"], MOVED_BITS),
        ("M", "pull/7/merge", ["D", "Y"], ["D", "C", "B", "A"], SIDE_BITS),
        ("Z", "topic", ["Y"], [], SIDE_BITS),
    ]
    for sha, ref, parents, ancestry, bits in lineage:
        _submit(api, db_session, PROJECT, sha, ref, parents, ancestry, bits)
    return PROJECT


def _history(api, **params) -> dict:  # noqa: ANN001
    response = api.get(f"/api/v1/projects/{PROJECT}/case-history", params={"case": TRACKED, **params})
    assert response.status_code == 200, response.text
    return response.json()


def _table_shas(html: str, marker: str) -> list[str]:
    """The data-sha of each row of the table that `marker` (an attribute of its tag) opens."""
    start = html.index(marker)
    table = html[start:html.index("</table>", start)]
    return re.findall(r'<tr data-sha="([^"]+)"', table)


def test_the_case_history_follows_main_in_first_parent_order(api, branchy) -> None:  # noqa: ANN001
    body = _history(api)
    # main's line, oldest first; X, Y, Z (another branch) and M (a pull request) are no points of it.
    assert [p["sha"] for p in body["points"]] == ["A", "B", "C", "D"]
    assert body["off_line"] == 4 and body["branch"] == "main" and body["tip"] == "D"
    assert "main" in body["line"] and "D" in body["line"]
    # Every change is marked, each against the commit before it on the line: C moved the case, D
    # kept C's bits (submitted after the side branch, it is compared with C, not with Y).
    assert body["change_points"] == ["C"]
    points = {p["sha"]: p for p in body["points"]}
    assert (points["C"]["compared_with"], points["C"]["change"]) == ("B", "changed")
    assert (points["D"]["compared_with"], points["D"]["change"]) == ("C", "unchanged")
    # The side branch's distance (9e-1) is nowhere on main's line.
    assert max(p["final_distance"] for p in body["points"]) == MOVED_BITS[1][-1]

    page = api.get(f"/projects/{PROJECT}/case-history", params={"case": TRACKED})
    assert page.status_code == 200, page.text
    assert _table_shas(page.text, 'id="case-history"') == ["D", "C", "B", "A"]  # the table: newest first
    assert 'id="history-off-line">4 commits that ran this case are not on this line' in page.text
    chart = re.search(r'<script type="application/json" id="case-history-data">(.*?)</script>', page.text, re.S)
    assert [sha for sha in re.findall(r'"sha": "([A-Z])"', chart.group(1))] == ["A", "B", "C", "D"]


def test_a_ref_selects_another_line(api, branchy) -> None:  # noqa: ANN001
    # A branch name: its newest commit's line (Z and Y sent no ancestry: read through their parents).
    topic = _history(api, ref="topic")
    assert [p["sha"] for p in topic["points"]] == ["A", "B", "X", "Y", "Z"]
    assert topic["change_points"] == ["X"] and topic["branch"] == "topic" and topic["off_line"] == 3
    # A sha: the pull request's merge commit sits on top of its base, main's D.
    merge = _history(api, ref="M")
    assert [p["sha"] for p in merge["points"]] == ["A", "B", "C", "D", "M"]
    assert merge["change_points"] == ["C", "M"]  # M: the pull request's change against its base tip D
    page = api.get(f"/projects/{PROJECT}/case-history", params={"case": TRACKED, "ref": "topic"})
    assert _table_shas(page.text, 'id="case-history"') == ["Z", "Y", "X", "B", "A"]
    # A ref that names nothing: 404 that says what to give.
    missing = api.get(f"/api/v1/projects/{PROJECT}/case-history", params={"case": TRACKED, "ref": "nope"})
    assert missing.status_code == 404
    assert "ref 'nope' is neither a commit, a branch nor a release" in missing.json()["detail"]


def test_the_overview_lists_main_then_other_branches_and_pull_requests_apart(api, branchy) -> None:  # noqa: ANN001
    html = api.get(f"/projects/{PROJECT}").text
    # main's line, newest first along the line.
    assert _table_shas(html, 'id="commits"') == ["D", "C", "B", "A"]
    assert 'id="overview-line">main (the branch most commits were submitted on)' in html
    # The other branch's commits apart, newest first; the merge commit under its pull request, linked.
    assert _table_shas(html, 'id="off-line"') == ["Z", "Y", "X"]
    assert _table_shas(html, 'data-pull-request="7"') == ["M"]
    assert '<h3 class="pull-request" id="pull-7">pull request #7</h3>' in html
    assert re.search(r'href="/projects/branchy/commits/M\?run=\d+"', html)
    # The ref selector offers branches, not pull requests' refs.
    assert '<option value="topic"' in html and 'value="pull/7/merge"' not in html

    # A branch's own line: the side branch, then the history it shares with main.
    topic = api.get(f"/projects/{PROJECT}", params={"ref": "topic"}).text
    assert _table_shas(topic, 'id="commits"') == ["Z", "Y", "X", "B", "A"]
    assert _table_shas(topic, 'id="off-line"') == ["D", "C"]


def test_commits_submitted_out_of_order_are_shown_in_line_order(api, db_session) -> None:  # noqa: ANN001
    """A backfill (`optdrift submit` of older commits after the tip): P ── Q ── R on main,
    submitted R, P, Q. The line's order is git's, whatever the submission order."""
    projects.create(session=db_session, name="backfill")
    db_session.flush()
    for sha, parents, ancestry, bits in [("R", ["Q"], ["Q", "P"], MOVED_BITS), ("P", [], [], MAIN_BITS),
                                         ("Q", ["P"], ["P"], MAIN_BITS)]:
        _submit(api, db_session, "backfill", sha, "main", parents, ancestry, bits)
    history = api.get("/api/v1/projects/backfill/case-history", params={"case": TRACKED}).json()
    assert [p["sha"] for p in history["points"]] == ["P", "Q", "R"] and history["change_points"] == ["R"]
    assert _table_shas(api.get("/projects/backfill").text, 'id="commits"') == ["R", "Q", "P"]
