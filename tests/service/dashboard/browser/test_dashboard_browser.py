"""The dashboard in a real browser, on data from a real engine run (see engine_seed.py)."""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

import pytest

from sqlalchemy import create_engine, text

from service.core.case_names import case_name
from service.core.verdicts import compare_runs
from tests.service.dashboard.browser.conftest import SCREENSHOTS
from tests.service.dashboard.browser.engine_seed import (
    FETCH_ERROR, FLAKY_REPEATS, NOT_APPLICABLE_REASON, PROJECT, RUNNING_CASES_DONE, set_aside_cases,
)
from worker.mutations import DECAY_AFTER_UPDATE_OPTIMIZERS

FINAL_STEP = -1
# Pages kept as docs/screenshots/*.png (the others are loaded and checked, not photographed).
# releases.png and releases-line-plot.png are test_release_drift_browser.py's (a seed made for them).
SCREENSHOT_PAGES = {"overview", "commit-flagged", "commit-broken", "run-progress"}


def _open(page, url: str) -> None:  # noqa: ANN001
    response = page.goto(url, wait_until="networkidle")
    assert response is not None and response.status == 200, (url, response and response.status)


def _no_console_errors(page) -> None:  # noqa: ANN001
    assert page.console_watch.errors == [], page.console_watch.errors


def _changed_ids(result_commit, result_base) -> set[str]:  # noqa: ANN001
    base = {c.case.case_id: c for c in result_base.cases}
    return {c.case.case_id for c in result_commit.cases
            if c.trajectory.digests != base[c.case.case_id].trajectory.digests}


def _changed_badge(commit, baseline) -> str:  # noqa: ANN001
    """The badge text for a changed run, from the engine's own comparison of the two results."""
    directions = Counter(c.direction for c in compare_runs(commit, baseline).cases if c.verdict == "changed")
    farther, closer = directions["farther"], directions["closer"]
    assert farther or closer
    if farther and closer:
        return f"changed → mixed: {farther} farther, {closer} closer"
    return "changed → farther" if farther else "changed → closer"


def test_every_page_loads_without_console_errors_and_screenshots(dashboard, page, phone_page) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    run_ids = dashboard.seeded.run_ids
    pages = {
        "overview": f"/projects/{PROJECT}",
        "overview-filtered": f"/projects/{PROJECT}?verdict=changed",
        "commit-flagged": f"/projects/{PROJECT}/commits/b2-decay-after",
        "commit-closer": f"/projects/{PROJECT}/commits/c3-fix-decay",
        "commit-unchanged": f"/projects/{PROJECT}/commits/d4-docs",
        "commit-no-baseline": f"/projects/{PROJECT}/commits/a1-base",
        "commit-broken": f"/projects/{PROJECT}/commits/e5-broken",
        "commit-nondeterministic": f"/projects/{PROJECT}/commits/g7-flaky",
        "commit-error": f"/projects/{PROJECT}/commits/h8-error",
        "run-progress": f"/runs/{run_ids['f6-running']}",
        "verify-run": f"/runs/{run_ids['verify']}",
        "releases": f"/projects/{PROJECT}/releases",
    }
    for name, path in pages.items():
        _open(page, dashboard.url + path)
        _no_console_errors(page)
        if name in SCREENSHOT_PAGES:
            page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=False)
    for name, path, selector in (("commit-flagged-plots", pages["commit-flagged"], ".plots"),
                                 ("verify-run-plots", pages["verify-run"], ".plots")):
        _open(page, dashboard.url + path)
        page.locator(selector).screenshot(path=str(SCREENSHOTS / f"{name}.png"))
    # "/" redirects to the only project.
    _open(page, dashboard.url + "/")
    assert page.url.endswith(f"/projects/{PROJECT}")
    for name in ("overview", "commit-flagged", "releases"):
        _open(phone_page, dashboard.url + pages[name])
        _no_console_errors(phone_page)
        # Nothing wider than the phone except inside the horizontally scrolling tables.
        overflow = phone_page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, (name, overflow)
        phone_page.screenshot(path=str(SCREENSHOTS / f"phone-{name}.png"), full_page=False)


def test_overview_badges_releases_and_filters(dashboard, page) -> None:
    engine = dashboard.engine
    _open(page, f"{dashboard.url}/projects/{PROJECT}")
    # main's line, and below it e5-broken, a commit of another branch (service/domain/commit_lines.py).
    badges = {row.get_attribute("data-sha"): row.locator(".verdict-cell > .badge").inner_text()
              for row in page.locator("#commits tbody tr, #off-line tbody tr").all()}
    assert badges["a1-base"] == "no baseline"
    assert badges["b2-decay-after"] == _changed_badge(engine.buggy, engine.base)
    assert badges["c3-fix-decay"] == _changed_badge(engine.base, engine.buggy)
    assert badges["d4-docs"] == "unchanged"
    assert badges["e5-broken"] == "broken"
    total = len(dashboard.engine.base.cases)
    assert badges["f6-running"] == f"running {RUNNING_CASES_DONE}/{total}"
    # Newest first.
    order = [row.get_attribute("data-sha") for row in page.locator("#commits tbody tr").all()]
    assert order[0] == "f6-running" and order.index("b2-decay-after") < order.index("a1-base")
    releases = {row.get_attribute("data-sha"): row.locator(".release").all_inner_texts()
                for row in page.locator("#commits tbody tr").all()}
    assert releases["a1-base"] == ["release v0.1.0"] and releases["c3-fix-decay"] == ["release v0.3.0"]
    assert releases["d4-docs"] == []

    page.select_option("select[name=verdict]", "changed")
    page.click("form.filters button")
    page.wait_for_load_state("networkidle")
    shas = {row.get_attribute("data-sha") for row in page.locator("#commits tbody tr").all()}
    assert shas == {"b2-decay-after", "c3-fix-decay"}
    # A branch's own first-parent line: its commit, then the history it shares with main.
    _open(page, f"{dashboard.url}/projects/{PROJECT}?ref=feature/broken")
    assert [r.get_attribute("data-sha") for r in page.locator("#commits tbody tr").all()] == \
        ["e5-broken", "d4-docs", "c3-fix-decay", "b2-decay-after", "a1-base"]
    _no_console_errors(page)


def test_flagged_commit_lists_changed_cases_and_plots_their_data(dashboard, page) -> None:
    engine = dashboard.engine
    expected = _changed_ids(engine.buggy, engine.base)
    # The mutation changes exactly weight-decayed Adam/AdEMAMix cases; the fp32 multi-element ones
    # must all be among them (the e2e test's argument), so the table cannot be empty or partial.
    must = {c.case.case_id for c in engine.buggy.cases if c.case.optimizer in DECAY_AFTER_UPDATE_OPTIMIZERS
            and c.case.hyper["weight_decay"] > 0 and c.case.param_dtype == "float32" and c.case.size > 1}
    assert must and must <= expected

    _open(page, f"{dashboard.url}/projects/{PROJECT}/commits/b2-decay-after")
    assert "Changed:" in page.locator("#verdict-sentence").inner_text()
    listed = set(page.locator("#changed-cases tbody tr").evaluate_all(
        "rows => rows.map(r => r.dataset.caseId)"))
    assert listed == expected
    first_row = page.locator("#changed-cases tbody tr").first
    assert first_row.locator("td.first-step").inner_text() == "1"  # first divergent step

    page.wait_for_function("document.getElementById('ref-plot').dataset.plotted")
    case_id = page.locator("#ref-plot").get_attribute("data-plotted")
    traces = page.evaluate("Array.from(document.getElementById('ref-plot').data, t => ({name: t.name, y: t.y}))")
    commit_case = next(c for c in engine.buggy.cases if c.case.case_id == case_id)
    base_case = next(c for c in engine.base.cases if c.case.case_id == case_id)
    assert traces[0]["y"] == commit_case.trajectory.ref64_max_abs  # bit-exact through JSON
    assert traces[1]["y"] == base_case.trajectory.ref64_max_abs
    assert traces[0]["y"] != traces[1]["y"]
    assert page.evaluate("document.getElementById('ref-plot').layout.yaxis.type") == "log"
    # No co-run difference stored for this commit: the note says so instead of an empty chart.
    assert page.locator("#diff-note").is_visible()

    # Another case's plot button redraws the chart with that case's data.
    other = sorted(expected - {case_id})[0]
    page.locator(f"#changed-cases tr[data-case-id='{other}'] details.case-more summary").click()
    page.locator(f"#changed-cases tr[data-case-id='{other}'] .plot-button").click()
    page.wait_for_function(f"document.getElementById('ref-plot').dataset.plotted === {other!r}")
    other_y = page.evaluate("document.getElementById('ref-plot').data[0].y")
    assert other_y == next(c for c in engine.buggy.cases if c.case.case_id == other).trajectory.ref64_max_abs
    _no_console_errors(page)


def test_verify_run_page_plots_the_corun_difference(dashboard, page) -> None:
    engine = dashboard.engine
    _open(page, f"{dashboard.url}/runs/{dashboard.seeded.run_ids['verify']}")
    assert "Verify run" in page.locator("h1").inner_text()
    page.wait_for_function("document.getElementById('ref-plot').dataset.plotted")
    case_id = page.locator("#ref-plot").get_attribute("data-plotted")
    diff_y = page.evaluate("document.getElementById('diff-plot').data[0].y")
    assert diff_y == engine.diffs[case_id]
    assert max(diff_y) > 0
    cell = page.locator(f"#changed-cases tr[data-case-id='{case_id}'] .max-diff").text_content()
    assert cell == f"{max(engine.diffs[case_id]):.3e}"
    _no_console_errors(page)


def test_release_matrix_shows_the_right_cells(dashboard, page) -> None:
    """Each cell: the change from the previous release (issue 47). From the engine's own results:
    per group and release how many cases changed, and the largest factor by which a case's final
    distance to float64 moved; unchanged cells neutral."""
    engine = dashboard.engine
    results = {"v0.1.0": engine.base, "v0.2.0": engine.buggy, "v0.3.0": engine.base}
    finals = {tag: {c.case.case_id: c.trajectory.ref64_max_abs[FINAL_STEP] for c in result.cases}
              for tag, result in results.items()}
    changed = _changed_ids(engine.buggy, engine.base)
    group_of = {c.case.case_id: f"{c.case.optimizer} · {c.case.family} · {c.case.param_dtype}" for c in engine.base.cases}
    changed_per_group: dict[str, int] = defaultdict(int)
    for case_id in changed:
        changed_per_group[group_of[case_id]] += 1

    quant = {tag: {c.case.case_id: c.trajectory.quant_ref_steps[FINAL_STEP] for c in result.cases
                   if c.trajectory.quant_ref_steps} for tag, result in results.items()}

    def largest_factor(group: str, before: str, after: str) -> float:
        factors = [finals[after][c] / finals[before][c] for c in changed if group_of[c] == group]
        return max(factors, key=lambda f: abs(math.log10(f)))

    def largest_move(group: str, before: str, after: str) -> float:
        """8-bit rows: the move of the states' distance to the quantization-aware reference (steps)."""
        moves = [quant[after][c] - quant[before][c] for c in changed if group_of[c] == group]
        return max(moves, key=abs)

    _open(page, f"{dashboard.url}/projects/{PROJECT}/releases")
    headers = page.locator("#release-matrix thead th[data-release]").evaluate_all("hs => hs.map(h => h.dataset.release)")
    assert headers == ["v0.1.0", "v0.2.0", "v0.3.0"]
    cells = page.locator("#release-matrix td.cell").evaluate_all(
        "cs => cs.map(c => ({group: c.parentElement.dataset.group, release: c.dataset.release,"
        " scale: c.parentElement.dataset.scale,"
        " state: c.dataset.state, intensity: +c.dataset.intensity, changed: +c.dataset.changed,"
        " change: c.querySelector('.change').innerText}))")
    assert len(cells) == len(set(group_of.values())) * 3
    for cell in cells:
        if cell["release"] == "v0.1.0":
            assert (cell["state"], cell["intensity"]) == ("first", 0), cell
            continue
        # v0.2.0 changed from v0.1.0, v0.3.0 changed back: the same cases both times.
        assert cell["changed"] == changed_per_group.get(cell["group"], 0), cell
        if cell["group"] not in changed_per_group:
            assert (cell["state"], cell["intensity"], cell["change"]) == ("unchanged", 0, "= same"), cell
            continue
        assert cell["state"] == "changed" and cell["intensity"] > 0, cell
        before = "v0.1.0" if cell["release"] == "v0.2.0" else "v0.2.0"
        if cell["scale"] == "quantization-steps":
            move = largest_move(cell["group"], before, cell["release"])
            assert float(cell["change"].split()[0]) == pytest.approx(move, rel=5e-4, abs=1e-300), cell
            continue
        factor = largest_factor(cell["group"], before, cell["release"])
        near_one = re.fullmatch(r"×\(1 ([+−]) (\S+)\)", cell["change"])
        if near_one:  # within 1 % of one: its distance from one, to four digits
            amount = float(near_one.group(2)) * (1 if near_one.group(1) == "+" else -1)
            assert amount == pytest.approx(factor - 1, rel=5e-4), cell
        else:
            assert float(cell["change"].removeprefix("×")) == pytest.approx(factor, rel=5e-4), cell
    assert "adam · 32bit · float32" in changed_per_group and "lion · 32bit · float32" not in changed_per_group

    # The line plot across releases for a chosen family: one trace per case, named by what it is.
    page.select_option("#group-select", "adam · 32bit · float32")
    page.wait_for_function("document.getElementById('line-plot').dataset.plotted === 'adam · 32bit · float32'")
    traces = page.evaluate("Array.from(document.getElementById('line-plot').data, t => ({name: t.name, y: t.y}))")
    adam = [c for c in engine.base.cases if (c.case.optimizer, c.case.family, c.case.param_dtype)
            == ("adam", "32bit", "float32")]
    assert len(traces) == len(adam)
    assert {t["name"] for t in traces} == {case_name(c.case.case_id) for c in adam}
    buggy = {c.case.case_id: c for c in engine.buggy.cases}
    assert {tuple(t["y"]) for t in traces} == {
        (c.trajectory.ref64_max_abs[-1], buggy[c.case.case_id].trajectory.ref64_max_abs[-1],
         c.trajectory.ref64_max_abs[-1]) for c in adam}
    _no_console_errors(page)


def test_run_progress_updates_while_the_run_executes(dashboard, page) -> None:
    run_id = dashboard.seeded.run_ids["f6-running"]
    total = len(dashboard.engine.base.cases)
    _open(page, f"{dashboard.url}/runs/{run_id}")
    assert page.locator("#progress-text").inner_text() == f"running: {RUNNING_CASES_DONE} of {total} cases"
    page.evaluate("window.__sameDocument = true")
    engine = create_engine(dashboard.database_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE runs SET cases_done = :n WHERE id = :id"),
                               {"n": RUNNING_CASES_DONE + 15, "id": run_id})
        page.wait_for_function(
            f"document.getElementById('progress-text').textContent === 'running: {RUNNING_CASES_DONE + 15} of {total} cases'",
            timeout=10_000)
        assert page.evaluate("window.__sameDocument") is True  # updated in place, not reloaded
        assert page.evaluate("document.getElementById('progress-bar').value") == RUNNING_CASES_DONE + 15
    finally:
        with engine.begin() as connection:
            connection.execute(text("UPDATE runs SET cases_done = :n WHERE id = :id"),
                               {"n": RUNNING_CASES_DONE, "id": run_id})
        engine.dispose()
    _no_console_errors(page)


def test_broken_commit_names_the_compiler_error_and_shows_the_log(dashboard, page) -> None:
    _open(page, f"{dashboard.url}/projects/{PROJECT}/commits/e5-broken")
    sentence = page.locator("#verdict-sentence").inner_text()
    assert sentence.startswith("Broken:") and "error:" in sentence and "optdrift_missing_symbol" in sentence
    assert len(sentence) < 400  # one telling line, not the whole log
    assert page.locator("#build-log").get_attribute("open") is not None
    assert "optdrift_missing_symbol" in page.locator("#build-log pre").inner_text()
    _no_console_errors(page)


def test_set_aside_cases_and_an_optdrift_error_are_never_broken(dashboard, page) -> None:
    engine = dashboard.engine
    aside_id, flaky_id = set_aside_cases(engine.base)
    _open(page, f"{dashboard.url}/projects/{PROJECT}")
    # main's line and, below it, e5-broken of another branch (service/domain/commit_lines.py).
    rows = {row.get_attribute("data-sha"): row for row in page.locator("#commits tbody tr, #off-line tbody tr").all()}
    assert rows["g7-flaky"].locator(".verdict-cell > .badge").inner_text() == "nondeterministic"
    assert rows["g7-flaky"].locator(".side-note .badge").all_inner_texts() == ["1 not applicable"]
    error_badge = rows["h8-error"].locator(".verdict-cell > .badge")
    assert error_badge.inner_text() == "optdrift error"
    background = "el => getComputedStyle(el).backgroundColor"
    assert error_badge.evaluate(background) != rows["e5-broken"].locator(".verdict-cell > .badge").evaluate(background)
    assert rows["h8-error"].get_attribute("data-poll-run") is None  # final: nothing to poll

    _open(page, f"{dashboard.url}/projects/{PROJECT}/commits/g7-flaky")
    judged = len(engine.base.cases) - 1
    sentence = page.locator("#verdict-sentence").inner_text()
    assert sentence.startswith(f"Nondeterministic: 1 case of {judged} did not reproduce on the same build "
                               f"(repeats differ from step {FLAKY_REPEATS['first_divergent_step']})"), sentence
    assert "1 case not applicable on this device" in sentence
    flaky = page.locator(f"#nondeterministic-cases tr[data-case-id='{flaky_id}'] td")
    assert flaky.nth(4).inner_text() == f"{FLAKY_REPEATS['differing']} of {FLAKY_REPEATS['runs'] - 1}"
    assert flaky.nth(5).inner_text() == str(FLAKY_REPEATS["first_divergent_step"])
    reason = page.locator(f"#not-applicable-cases tr[data-case-id='{aside_id}'] td.reason")
    assert reason.inner_text() == NOT_APPLICABLE_REASON
    assert page.locator("#changed-cases").count() == 0 and page.locator(".badge-broken").count() == 0

    _open(page, f"{dashboard.url}/projects/{PROJECT}/commits/h8-error")
    sentence = page.locator("#verdict-sentence").inner_text()
    assert sentence.startswith("optdrift error, not the commit's: source fetch refused") and "No verdict" in sentence
    assert FETCH_ERROR in page.locator("#environment").inner_text()
    assert page.locator(".badge-broken").count() == 0 and page.locator("#progress").count() == 0
    # A final run: the page does not poll and reload itself.
    page.evaluate("window.__sameDocument = true")
    page.wait_for_timeout(2500)
    assert page.evaluate("window.__sameDocument") is True
    _no_console_errors(page)


def test_changed_cases_show_the_final_step_where_it_disagrees(dashboard, page) -> None:
    engine = dashboard.engine
    cases = {c.case_id: c for c in compare_runs(engine.buggy, engine.base).cases if c.verdict == "changed"}
    _open(page, f"{dashboard.url}/projects/{PROJECT}/commits/b2-decay-after")
    rows = page.locator("#changed-cases tbody tr").all()
    assert len(rows) == len(cases)
    for row in rows:
        case = cases[row.get_attribute("data-case-id")]
        note = row.locator(".final-differs")
        if case.final_direction != case.direction:
            expected = "same distance" if case.final_direction == "same" else case.final_direction
            assert note.inner_text() == f"final step alone: {expected}"
        else:
            assert note.count() == 0
        peak = row.locator(".peak-distance").text_content().strip()  # in the row's closed details
        assert peak == f"peak {case.baseline_peak_ref64_distance:.3e} → {case.commit_peak_ref64_distance:.3e}"
    _no_console_errors(page)
