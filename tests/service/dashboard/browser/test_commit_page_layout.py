"""The commit page and the verify page at desktop sizes (issue 34 item 1, the Proof's first bullet):
nothing wider than its container, and the headline (the verdict) and the small multiples above the fold.

Screenshots go to docs/screenshots/ when OPTDRIFT_WRITE_SCREENSHOTS=1, otherwise to a scratch folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.service.dashboard.browser.conftest import SCREENSHOTS
from tests.service.dashboard.browser.engine_seed import PROJECT

VIEWPORTS = [(1280, 800), (1920, 1080)]
SCREENSHOT_DIR = (Path(__file__).resolve().parents[4] / "docs" / "screenshots"
                  if os.environ.get("OPTDRIFT_WRITE_SCREENSHOTS") == "1" else SCREENSHOTS)

# Every visible element whose content is wider than its box, except boxes meant to scroll sideways
# (.scroll wraps wide tables) and the plot library's own drawing surfaces.
OVERFLOWING = """() => [...document.querySelectorAll('body *')].filter(e => {
  const box = e.getBoundingClientRect();
  if (box.width === 0 || box.height === 0) return false;
  if (e.closest('.scroll, .js-plotly-plot, svg, pre, details:not([open])')) return false;
  return e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX !== 'auto';
}).map(e => `${e.tagName.toLowerCase()}#${e.id}.${e.className}: ${e.scrollWidth} > ${e.clientWidth}`)"""


def _pages(dashboard) -> dict[str, str]:  # noqa: ANN001
    return {"commit-flagged": f"/projects/{PROJECT}/commits/b2-decay-after",
            "verify-run": f"/runs/{dashboard.seeded.run_ids['verify']}"}


@pytest.fixture(params=VIEWPORTS, ids=lambda v: f"{v[0]}x{v[1]}")
def sized_page(browser, request):  # noqa: ANN001
    width, height = request.param
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    page.viewport = (width, height)
    yield page
    context.close()


@pytest.mark.parametrize("name", ["commit-flagged", "verify-run"])
def test_nothing_is_wider_than_its_container(dashboard, sized_page, name: str) -> None:
    response = sized_page.goto(dashboard.url + _pages(dashboard)[name], wait_until="networkidle")
    assert response is not None and response.status == 200
    assert sized_page.evaluate(OVERFLOWING) == []


@pytest.mark.parametrize("name", ["commit-flagged", "verify-run"])
def test_verdict_and_plot_are_above_the_fold(dashboard, sized_page, name: str) -> None:
    response = sized_page.goto(dashboard.url + _pages(dashboard)[name], wait_until="networkidle")
    assert response is not None and response.status == 200
    width, height = sized_page.viewport
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    sized_page.screenshot(path=str(SCREENSHOT_DIR / f"{name}-{width}x{height}.png"))
    for selector in ("#headline", "#panel-1"):
        box = sized_page.locator(selector).bounding_box()
        assert box is not None, selector
        assert box["y"] + box["height"] <= height, (selector, box, height)


def _verdict_detail(page, dashboard, run_id: str) -> dict:  # noqa: ANN001
    response = page.request.get(f"{dashboard.url}/api/v1/runs/{run_id}")
    assert response.status == 200, response.text()
    return response.json()["verdict"]["detail"]


@pytest.mark.parametrize("name", ["commit-flagged", "verify-run"])
def test_changed_cases_table_holds_four_columns_with_the_apis_numbers(dashboard, page, name: str) -> None:  # noqa: ANN001
    """Each number in the table is the API's figure at the precision shown: the first divergent step
    exactly, the size relative to its scale parsed back from wording.number's 4 significant digits
    (so a relative tolerance of 5e-4, half a unit in the last digit shown)."""
    response = page.goto(dashboard.url + _pages(dashboard)[name], wait_until="networkidle")
    assert response is not None and response.status == 200
    headers = page.locator("#changed-cases thead th").all_inner_texts()
    assert headers == ["case", "first divergent step", "direction vs float64", "size relative to its scale"]
    detail = _verdict_detail(page, dashboard, page.locator("#run").get_attribute("data-run-id"))
    cases = {c["case_id"]: c for c in detail["cases"]}
    attribution = detail.get("attribution") or {}
    rows = page.locator("#changed-cases tbody tr").all()
    assert rows
    sized = 0
    for row in rows:
        case_id = row.get_attribute("data-case-id")
        assert row.locator(":scope > td").count() == 4
        case = cases[case_id]
        step = row.locator("td.first-step").inner_text()
        assert step == str(case["first_divergent_step"] or "—")
        if case["direction"] is None:  # withheld (a quantized case without its step figures, a moved reference)
            assert row.locator("td.direction .direction-withheld").inner_text() == "not judged"
        else:
            assert row.locator("td.direction .badge").inner_text() == case["direction"]
        stored = attribution.get(case_id) or {}
        for selector, key in ((".peak-ulps", "peak_ulps"), (".relative", "change_vs_baseline_distance")):
            shown = row.locator(f"td.scale {selector}")
            if shown.count():
                assert float(shown.inner_text()) == pytest.approx(stored[key], rel=5e-4), (case_id, key)
                sized += 1
        ratio = row.locator("td.scale .diff-ratio")
        if ratio.count():  # before the co-run's attribution: max |commit − baseline| / baseline's peak distance
            diffs = [d for d in case["max_abs_diff_per_step"] if d is not None]
            expected = max(diffs) / case["baseline_peak_ref64_distance"]
            assert float(ratio.inner_text()) == pytest.approx(expected, rel=5e-4), case_id
            sized += 1
        if not row.locator("td.scale span").count():  # nothing to size it by: the API has no figure either
            assert row.locator("td.scale").inner_text() == "—"
            assert not stored and not [d for d in case.get("max_abs_diff_per_step") or [] if d is not None]
    # The verify run has its co-run differences stored; the flagged commit's seed has none.
    assert sized or name == "commit-flagged", "no row showed a size relative to its scale"


def test_headline_counts_are_the_apis_figures(dashboard, page) -> None:  # noqa: ANN001
    response = page.goto(dashboard.url + _pages(dashboard)["commit-flagged"], wait_until="networkidle")
    assert response is not None and response.status == 200
    run = page.request.get(f"{dashboard.url}/api/v1/runs/{page.locator('#run').get_attribute('data-run-id')}").json()
    figures = run["verdict"]["figures"]
    assert page.locator("#headline-first-step strong").inner_text() == str(figures["first_divergent_step"])
    for direction in ("farther", "closer", "same"):
        shown = page.locator(f"#headline-directions [data-direction={direction}] strong").inner_text()
        assert int(shown) == figures["directions"].get(direction, 0), direction
