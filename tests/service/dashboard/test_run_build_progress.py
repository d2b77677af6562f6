"""Issue 47: while a run builds, GET /api/v1/runs/{id} and its page (/runs/{id}) show the build's
progress as the worker stored it (service.run_store.build_progress): "building: 12/40 units" and a
bar at 12 of 40; once the run is past its build, its cases' progress again. Real rows in PostgreSQL."""

from __future__ import annotations

import re

from service import run_store
from service.api.schemas import BuildProgress
from tests.notify_rows import make_commit, make_project, make_run

WORKER = "w@run-page"


def _building_run(session):  # noqa: ANN001, ANN202
    run = make_run(session, make_commit(session, make_project(session), "b2d"), status="building")
    run.worker = WORKER
    session.flush()
    return run


def _progress_block(page: str) -> str:
    return page[page.index('<div class="progress" id="progress">'):].split("</div>", 1)[0]


def test_a_building_runs_stored_build_progress_on_its_page_and_in_the_api(api, db_session) -> None:  # noqa: ANN001
    run = _building_run(db_session)
    # Before the build has said anything countable: the run's status alone.
    assert "build" not in api.get(f"/api/v1/runs/{run.id}").json()["progress"]
    assert run_store.build_progress(run.id, worker=WORKER, done=12, total=40, unit="units", session=db_session)
    db_session.expire_all()

    progress = api.get(f"/api/v1/runs/{run.id}").json()["progress"]
    assert progress["build"] == {"phase": "building", "done": 12, "total": 40, "unit": "units",
                                 "text": "building: 12/40 units"}
    block = _progress_block(api.get(f"/runs/{run.id}").text)
    assert '<span id="progress-text">building: 12/40 units</span>' in block
    bar = re.search(r'<progress id="progress-bar" max="(\d+)" value="(\d+)">', block)
    assert bar and bar.groups() == ("40", "12")

    # Past the build: the worker's record of the built tree replaces the detail, then cases start.
    claimed = run_store.ClaimedRun(db_session, run_id=run.id, worker=WORKER)
    assert claimed.record(environment_detail={"battery": "quick", "build_ok": True})
    db_session.expire_all()
    # Still `building` (the cases have not started), but its build is over: no build progress.
    answer = api.get(f"/api/v1/runs/{run.id}").json()
    assert answer["status"] == "building" and "build" not in answer["progress"]
    claimed.start_cases(7)
    db_session.expire_all()
    progress = api.get(f"/api/v1/runs/{run.id}").json()["progress"]
    assert progress == {"cases_done": 0, "cases_total": 7}  # absent, not null: as before builds reported
    block = _progress_block(api.get(f"/runs/{run.id}").text)
    assert "running: 0 of 7 cases" in block and "building" not in block


def test_the_build_progress_in_words() -> None:
    def text(done, total, unit):  # noqa: ANN001, ANN202
        return BuildProgress.of({"phase": "building", "done": done, "total": total, "unit": unit}).text

    assert text(12, 40, "units") == "building: 12/40 units"
    assert text(45, 100, "percent") == "building: 45 %"
    assert text(3, None, "units") == "building: 3 units compiled"
    assert text(None, None, "units") == "building"
    assert BuildProgress.of(None) is None
    assert BuildProgress.of({"done": "x", "unit": "furlongs"}) is None  # a shape this version does not know
