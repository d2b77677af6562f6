"""The per-case history page in a real browser, reached from a flagged commit's changed case, on
the engine-seeded dashboard (tests/service/dashboard/browser/engine_seed.py: a1-base v0.1.0, b2-decay-after v0.2.0
flagged, c3-fix-decay v0.3.0 changed back, d4-docs unchanged, ...).

Refresh docs/screenshots/case-history.png with
OPTDRIFT_SCREENSHOTS=docs/screenshots pytest tests/service/dashboard/browser/test_case_history_browser.py."""

from __future__ import annotations

from sqlalchemy import create_engine, text

from tests.service.dashboard.browser.conftest import SCREENSHOTS
from tests.service.dashboard.browser.engine_seed import PROJECT, set_aside_cases

ACK_NOTE = "decay after the update, on purpose for this test"


def _open(page, url: str) -> None:  # noqa: ANN001
    response = page.goto(url, wait_until="networkidle")
    assert response is not None and response.status == 200, (url, response and response.status)


def _set_acknowledged(database_url: str, run_id: int, note: str | None) -> None:
    engine = create_engine(database_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE verdicts SET acknowledged = :ack, acknowledgement_note = :note, "
                                "acknowledged_by = :by WHERE run_id = :run"),
                           {"ack": note is not None, "note": note, "by": "maintainer" if note else None,
                            "run": run_id})
    engine.dispose()


def test_history_page_from_a_flagged_commit(dashboard, page) -> None:
    engine = dashboard.engine
    run_ids = dashboard.seeded.run_ids
    _open(page, f"{dashboard.url}/projects/{PROJECT}/commits/b2-decay-after")
    link = page.locator("#changed-cases tbody tr").first.locator("a.history-link")
    case_id = page.locator("#changed-cases tbody tr").first.get_attribute("data-case-id")
    link.click()
    page.wait_for_load_state("networkidle")
    assert "/case-history?case=" in page.url
    assert page.locator("#case-id").inner_text() == case_id
    page.wait_for_function("document.getElementById('history-plot').dataset.plotted")

    rows = {row.get_attribute("data-sha"): row for row in page.locator("#case-history tbody tr").all()}
    # The decay reorder changed this case at b2, and c3 changed it back: the two change points.
    changes = {sha: row.get_attribute("data-change-point") for sha, row in rows.items()
               if row.get_attribute("data-change-point")}
    assert changes == {"b2-decay-after": "changed", "c3-fix-decay": "changed"}
    assert "farther" in rows["b2-decay-after"].locator(".change").inner_text()
    assert "closer" in rows["c3-fix-decay"].locator(".change").inner_text()
    assert rows["d4-docs"].locator(".change").inner_text().strip() == "unchanged"
    assert rows["a1-base"].locator(".release").inner_text() == "release v0.1.0"
    # g7-flaky set one case aside (not applicable): listed with that status, not a change point.
    aside_id, _ = set_aside_cases(engine.base)
    if case_id == aside_id:
        assert rows["g7-flaky"].locator("td").nth(6).inner_text() == "not_applicable"
    # The distances shown are the engine's, and the chart plots them per commit, oldest first.
    buggy = next(c for c in engine.buggy.cases if c.case.case_id == case_id).trajectory.ref64_max_abs
    assert rows["b2-decay-after"].locator(".final-distance").inner_text() == f"{buggy[-1]:.3e}"
    plotted = page.evaluate("document.getElementById('history-plot').data[0]")
    order = [sha for sha in ("a1-base", "b2-decay-after", "c3-fix-decay", "d4-docs") if sha in rows]
    assert [label.split(" ")[1] for label in plotted["x"][:4]] == [sha[:8] for sha in order]
    assert plotted["y"][1] == buggy[-1]
    annotations = page.evaluate("document.getElementById('history-plot').layout.annotations.map(a => a.text)")
    assert annotations == ["v0.1.0", "v0.2.0", "v0.3.0"]
    assert page.console_watch.errors == [], page.console_watch.errors
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    # An acknowledged change is shown as such (the maintainer and the note), in the table and the chart.
    _set_acknowledged(dashboard.database_url, run_ids["b2-decay-after"], ACK_NOTE)
    try:
        page.reload(wait_until="networkidle")
        page.wait_for_function("document.getElementById('history-plot').dataset.plotted")
        change = page.locator("#case-history tr[data-sha='b2-decay-after'] .change").inner_text()
        assert "acknowledged" in change and ACK_NOTE in change and "maintainer" in change
        names = page.evaluate("document.getElementById('history-plot').data.map(t => t.name)")
        assert "acknowledged change" in names and "bits changed here" in names
        page.screenshot(path=str(SCREENSHOTS / "case-history.png"), full_page=False)
    finally:
        _set_acknowledged(dashboard.database_url, run_ids["b2-decay-after"], None)
    assert page.console_watch.errors == [], page.console_watch.errors
