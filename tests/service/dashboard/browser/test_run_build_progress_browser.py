"""A building run's page in Chromium (issue 47): it opens on the build progress the worker stored
("building: 3/40 units", the bar at 3 of 40) and, polling GET /api/v1/runs/{id}, moves to what the
API answers later ("building: 12/40 units"). The later answer is the real API's, taken before the
page opens (the test's database session serves one thread at a time) and handed to the page's poll."""

from __future__ import annotations

import httpx

from service import run_store
from tests.notify_rows import make_commit, make_project, make_run

WORKER = "w@run-page-browser"


def test_the_run_page_follows_the_builds_progress(live_api, db_session, browser, admin_token) -> None:  # noqa: ANN001
    run = make_run(db_session, make_commit(db_session, make_project(db_session), "b3d"), status="building")
    run.worker = WORKER
    db_session.flush()
    assert run_store.build_progress(run.id, worker=WORKER, done=12, total=40, unit="units", session=db_session)
    later = httpx.get(f"{live_api}/api/v1/runs/{run.id}", headers={"Authorization": f"Bearer {admin_token}"}).json()
    assert later["progress"]["build"]["text"] == "building: 12/40 units"
    assert run_store.build_progress(run.id, worker=WORKER, done=3, total=40, unit="units", session=db_session)

    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.route(f"**/api/v1/runs/{run.id}", lambda route: route.fulfill(json=later))
    response = page.goto(f"{live_api}/runs/{run.id}", wait_until="domcontentloaded")
    assert response is not None and response.status == 200
    assert page.locator("#progress-text").inner_text() == "building: 3/40 units"
    assert page.locator("#progress-bar").evaluate("bar => [bar.value, bar.max]") == [3, 40]
    page.wait_for_function("document.getElementById('progress-text').textContent.includes('12/40')")
    assert page.locator("#progress-text").inner_text() == "building: 12/40 units"
    assert page.locator("#progress-bar").evaluate("bar => [bar.value, bar.max]") == [12, 40]
    assert errors == []
    context.close()
