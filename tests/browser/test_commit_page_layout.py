"""The commit page and the verify page at desktop sizes (issue 34 item 1, the Proof's first bullet):
nothing wider than its container, and the headline (the verdict) and the divergence plot above the fold.

Screenshots go to docs/screenshots/ when OPTDRIFT_WRITE_SCREENSHOTS=1, otherwise to a scratch folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.browser.conftest import SCREENSHOTS
from tests.browser.engine_seed import PROJECT

VIEWPORTS = [(1280, 800), (1920, 1080)]
SCREENSHOT_DIR = (Path(__file__).resolve().parents[2] / "docs" / "screenshots"
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
    for selector in ("#verdict-sentence", "#ref-plot"):
        box = sized_page.locator(selector).bounding_box()
        assert box is not None, selector
        assert box["y"] + box["height"] <= height, (selector, box, height)
