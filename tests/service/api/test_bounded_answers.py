"""Issue 43, "Bounded batteries" and "CI's feed is CI's", against the real PostgreSQL:

- a tree's battery past its run kind's limits is a 422 at submission (naming the battery, the value,
  the limit and its setting), and the CLI says so in one line and exits 2;
- no answer grows with a run's case count: the run's answer shows a bounded page of its cases and
  says the total, GET /runs/{id}/cases, the trajectories (JSON, CSV) and the dashboard's run page
  page through them;
- every verdict says its run's kind and commit; `flagged=true` holds commit runs only, and a verify
  run's verdict stays under its own run.
"""

from __future__ import annotations

import json
import re

import pytest
import typer
from sqlalchemy import func, select

from service.api.paging import VERDICT_CASES_SHOWN
from service.cli.client import OptdriftClient
from service.cli.common import expected_failures
from service.db.models import Run
from service.domain import dashboard_queries
from tests.notify_rows import finish_run, make_commit, make_project, make_run
from tests.service_fixtures import make_archive

OPTIMIZERS = ["adam", "ademamix", "lion", "momentum", "rmsprop", "adagrad"]


def _battery(seeds: int, sizes: int, steps: int = 5) -> str:
    """A battery of 6 × seeds × sizes cases."""
    return json.dumps({"name": "mine", "version": 1, "groups": [
        {"optimizers": OPTIMIZERS, "seeds": list(range(seeds)), "sizes": list(range(1, sizes + 1)), "steps": steps}]})


def _runs(db_session) -> int:  # noqa: ANN001
    return db_session.scalar(select(func.count()).select_from(Run))


# ----------------------------------------------------------------------------- submission
def test_a_verify_tree_whose_battery_is_past_the_verify_limit_is_a_422_naming_limit_and_value(api, db_session) -> None:  # noqa: ANN001
    """6 × 20 × 20 = 2,400 cases: within a commit run's 20,000, past a verify run's 2,000."""
    assert api.post("/api/v1/projects", json={"name": "kern"}).status_code == 201
    tree = make_archive({"kernel.cpp": "int x;\n", "batteries/mine.json": _battery(20, 20)})
    base = api.post("/api/v1/projects/kern/commits", data={"sha": "base1"},
                    files={"archive": ("t.tar.gz", tree)})
    assert base.status_code == 201, base.text  # the same battery in a commit run: within its limits
    before = _runs(db_session)
    refused = api.post("/api/v1/projects/kern/verify", data={"base": "base1", "battery": "batteries/mine.json"},
                       files={"archive": ("t.tar.gz", tree)})
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"]
    assert "'batteries/mine.json' has 2,400 cases" in detail
    assert "a verify run may have at most 2,000 (OPTDRIFT_VERIFY_MAX_CASES_PER_RUN)" in detail
    assert _runs(db_session) == before  # nothing queued
    # Named by the tree's optdrift.toml instead of the request: the same answer.
    by_config = make_archive({"optdrift.toml": '[project]\nbattery = "b.json"\n', "b.json": _battery(20, 20)})
    refused = api.post("/api/v1/projects/kern/verify", data={"base": "base1"},
                       files={"archive": ("t.tar.gz", by_config)})
    assert refused.status_code == 422 and "'b.json' has 2,400 cases" in refused.json()["detail"], refused.text
    # Steps and file bytes have their own limits; the file's bytes are judged before it is parsed.
    long = make_archive({"b.json": _battery(1, 1, steps=1001)})
    refused = api.post("/api/v1/projects/kern/verify", data={"base": "base1", "battery": "b.json"},
                       files={"archive": ("t.tar.gz", long)})
    assert refused.status_code == 422 and "1,001 steps in one case" in refused.json()["detail"]
    big = make_archive({"b.json": "{" + " " * (256 * 1024) + "}"})
    refused = api.post("/api/v1/projects/kern/verify", data={"base": "base1", "battery": "b.json"},
                       files={"archive": ("t.tar.gz", big)})
    assert refused.status_code == 422 and "OPTDRIFT_VERIFY_MAX_BATTERY_BYTES" in refused.json()["detail"]
    not_json = make_archive({"b.json": "groups: many"})
    refused = api.post("/api/v1/projects/kern/verify", data={"base": "base1", "battery": "b.json"},
                       files={"archive": ("t.tar.gz", not_json)})
    assert refused.status_code == 422 and "not valid JSON" in refused.json()["detail"]
    # A commit run past the commit limit (6 × 60 × 60 = 21,600 > 20,000) is refused too.
    huge = make_archive({"b.json": _battery(60, 60)})
    refused = api.post("/api/v1/projects/kern/commits", data={"sha": "c2", "battery": "b.json"},
                       files={"archive": ("t.tar.gz", huge)})
    assert refused.status_code == 422 and "21,600 cases; a commit run may have at most 20,000" in refused.text


def test_the_cli_says_the_limit_in_one_line_and_exits_2(api, tmp_path, capsys) -> None:  # noqa: ANN001
    assert api.post("/api/v1/projects", json={"name": "kern"}).status_code == 201
    tree = tmp_path / "tree"
    (tree / "batteries").mkdir(parents=True)
    (tree / "kernel.cpp").write_text("int x;\n")
    (tree / "batteries" / "mine.json").write_text(_battery(20, 20))
    client = OptdriftClient("http://testserver")
    client.http = api  # the app in this process, the test's transaction
    client.submit_commit(project="kern", sha="base1", source_dir=tree)
    with pytest.raises(typer.Exit) as ended, expected_failures("http://testserver"):
        client.verify(project="kern", base="base1", source_dir=tree, battery="batteries/mine.json")
    assert ended.value.exit_code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: POST /api/v1/projects/kern/verify -> 422:") and "\n" not in line
    assert "has 2,400 cases; a verify run may have at most 2,000 (OPTDRIFT_VERIFY_MAX_CASES_PER_RUN)" in line


# ----------------------------------------------------------------------------- paging
def _many_cases(total: int, changed_at: range) -> list[dict]:
    cases = []
    for index in range(total):
        verdict = "changed" if index in changed_at else ("not_applicable" if index % 40 == 7 else "unchanged")
        cases.append({"case_id": f"case-{index:04d}", "optimizer": "adam", "verdict": verdict,
                      **({"first_divergent_step": 1, "direction": "farther"} if verdict == "changed" else {}),
                      **({"message": "not here"} if verdict == "not_applicable" else {})})
    return cases


def test_a_run_with_more_cases_than_a_page_answers_bounded_pages_and_the_total(api, db_session) -> None:  # noqa: ANN001
    project = make_project(db_session)
    run = make_run(db_session, make_commit(db_session, project, "c" * 40), status="done")
    stored = _many_cases(130, changed_at=range(120, 123))
    finish_run(db_session, run, outcome="changed", cases=stored)
    ids = [c["case_id"] for c in stored]

    verdict = api.get(f"/api/v1/runs/{run.id}").json()["verdict"]
    assert verdict["cases_total"] == 130 and verdict["cases_shown"] == VERDICT_CASES_SHOWN == 50
    shown = [c["case_id"] for c in verdict["detail"]["cases"]]
    # What matters first: the changed cases, then the not-applicable ones, then unchanged, in stored order.
    assert shown[:3] == ids[120:123] and shown[3:7] == ["case-0007", "case-0047", "case-0087", "case-0127"]
    assert len(shown) == 50 and verdict["cases_url"] == f"/api/v1/runs/{run.id}/cases"
    assert verdict["run_kind"] == "commit" and verdict["commit_sha"] == "c" * 40

    pages = [api.get(verdict["cases_url"], params={"limit": 100, "offset": offset}).json() for offset in (0, 100)]
    assert [p["count"] for p in pages] == [130, 130] and [len(p["data"]) for p in pages] == [100, 30]
    assert [c["case_id"] for p in pages for c in p["data"]] == ids  # stored order, no gap, no repeat
    assert api.get(verdict["cases_url"]).json()["limit"] == 100
    assert api.get(verdict["cases_url"], params={"limit": 501}).status_code == 422

    trajectories = api.get(f"/api/v1/runs/{run.id}/trajectories").json()
    assert trajectories["count"] == 130 and len(trajectories["data"]) == 50
    tail = api.get(f"/api/v1/runs/{run.id}/trajectories", params={"offset": 120, "limit": 200}).json()
    assert [t["case_id"] for t in tail["data"]] == ids[120:]
    assert api.get(f"/api/v1/runs/{run.id}/trajectories", params={"limit": 201}).status_code == 422
    csv = api.get(f"/api/v1/runs/{run.id}/trajectories.csv", params={"limit": 10})
    assert csv.headers["x-total-count"] == "130" and "cases1-10" in csv.headers["content-disposition"]
    assert api.get(f"/api/v1/runs/{run.id}/trajectories/case-0125").json()["case_index"] == 125

    # The CLI's client reads every case back, page by page, as a small run's answer has them, with
    # every case's stored attribution (the run's answer carries the shown cases' alone).
    verdict_row = run.verdict
    verdict_row.detail = {**verdict_row.detail, "attribution": {
        case_id: {"kind": "semantic", "variant": "decay_after_update"} for case_id in ids[120:123] + ids[99:101]}}
    db_session.flush()
    shown = api.get(f"/api/v1/runs/{run.id}").json()["verdict"]
    assert set(shown["detail"]["attribution"]) == set(ids[120:123])  # case-0099/0100: past the first 50
    assert {a["case_id"] for a in shown["attribution"]} == set(ids[120:123])
    client = OptdriftClient("http://testserver")
    client.http = api
    whole = client.run(run.id)["verdict"]
    assert [c["case_id"] for c in whole["detail"]["cases"]] == ids
    assert set(whole["detail"]["attribution"]) == set(ids[120:123] + ids[99:101])
    assert {a["case_id"] for a in whole["attribution"]} == set(ids[120:123] + ids[99:101])
    assert [c["case_id"] for c in whole["not_applicable"]] == ["case-0007", "case-0047", "case-0087", "case-0127"]
    assert len(client.trajectories(run.id)) == 130


def test_the_dashboard_run_page_shows_one_page_of_cases_and_links_to_more(api, db_session, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(dashboard_queries, "RUN_PAGE_CASES", 20)
    project = make_project(db_session)
    commit = make_commit(db_session, project, "d" * 40)
    run = make_run(db_session, commit, status="done")
    finish_run(db_session, run, outcome="changed", cases=_many_cases(60, changed_at=range(5, 50)))

    def changed_rows(html: str) -> list[str]:
        table = html.split('id="changed-cases"', 1)[1].split("</table>", 1)[0]
        return re.findall(r'<tr data-case-id="([^"]+)"', table)

    first = api.get(f"/runs/{run.id}")
    assert first.status_code == 200
    rows = changed_rows(first.text)
    assert len(rows) == 20 and "Changed cases (45)" in first.text
    more = re.search(r'href="([^"]+)" id="more-cases"', first.text).group(1).replace("&amp;", "&")
    assert more == f"/runs/{run.id}?cases_page=2"
    second = changed_rows(api.get(more).text)
    third_page = api.get(f"/runs/{run.id}?cases_page=3").text
    third = changed_rows(third_page)
    assert len(second) == 20 and len(third) == 5 and 'id="more-cases"' not in third_page
    assert sorted(rows + second + third) == [f"case-{i:04d}" for i in range(5, 50)]
    # The commit page keeps its `run` parameter in the link.
    page = api.get(f"/projects/{project.name}/commits/{commit.sha}?run={run.id}").text
    assert f"?run={run.id}&amp;cases_page=2" in page


# ----------------------------------------------------------------------------- CI's feed
def _verify_run(db_session, project, base) -> Run:  # noqa: ANN001
    run = Run(project_id=project.id, kind="verify", commit_id=None, base_commit_id=base.id,
              source_digest="e" * 64, battery="quick", environment="cpu", status="done", attempt=1)
    db_session.add(run)
    db_session.flush()
    return run


def test_ci_feed_holds_commit_runs_only_and_every_verdict_says_kind_and_commit(api, db_session) -> None:  # noqa: ANN001
    project = make_project(db_session)
    commit = make_commit(db_session, project, "a" * 40)
    commit_run = make_run(db_session, commit, status="done")
    finish_run(db_session, commit_run, outcome="changed")
    # Contributors' verify runs, flagged, newer than CI's entry: they used to push it out of the window.
    verify_runs = [_verify_run(db_session, project, commit) for _ in range(3)]
    for run in verify_runs:
        finish_run(db_session, run, outcome="broken", cases=[{"case_id": "x", "optimizer": "adam", "verdict": "broken"}])

    feed = api.get(f"/api/v1/projects/{project.name}/verdicts", params={"flagged": "true", "limit": 1}).json()
    assert [v["run_id"] for v in feed["data"]] == [commit_run.id] and feed["count"] == 1
    every = api.get(f"/api/v1/projects/{project.name}/verdicts").json()["data"]
    assert {v["run_id"] for v in every} == {commit_run.id}
    for verdict in feed["data"] + every:
        assert verdict["run_kind"] == "commit" and verdict["commit_sha"] == "a" * 40
    for run in verify_runs:  # reachable under the verify run itself
        verdict = api.get(f"/api/v1/runs/{run.id}").json()["verdict"]
        assert verdict["run_kind"] == "verify" and verdict["commit_sha"] is None and verdict["flagged"] is True
    commit_verdicts = api.get(f"/api/v1/projects/{project.name}/commits/{commit.sha}/verdicts").json()["data"]
    assert [(v["run_id"], v["run_kind"], v["commit_sha"]) for v in commit_verdicts] == [
        (commit_run.id, "commit", "a" * 40)]
