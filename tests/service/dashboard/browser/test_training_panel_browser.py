"""The training-impact section in Chromium at 1280×800 (issue 46), on the rows of
tests/service/dashboard/test_training_panel.py served by the real app on PostgreSQL: every card
inside the page (nothing clipped, no horizontal scroll), plotly drew each panel's six traces (two
bands of two edges, two means) and the first-divergent-step line, and the key names what is drawn;
the difference view (the default) draws the commit's mean minus the baseline's and the bands about
zero, the loss view the means and bands themselves.

The screenshot goes to docs/screenshots/training-impact-1280.png when OPTDRIFT_WRITE_SCREENSHOTS=1
(tests/service/dashboard/browser/test_commit_page_layout.py), otherwise to a scratch folder."""

from __future__ import annotations

import pytest

from tests.service.dashboard.browser.conftest import SCREENSHOTS
from tests.service.dashboard.browser.test_commit_page_layout import OVERFLOWING, SCREENSHOT_DIR
from service.dashboard.training_panel import curve_bands
from tests.service.dashboard.test_training_panel import PROJECT, STEPS, seed, trained_results

WIDTH, HEIGHT = 1280, 800
# Per panel: the seed spread and the one-ulp floor (each a lower edge and a filled upper edge), the
# baseline's mean and the commit's mean (dashboard.js trainingPanels).
TRACES_PER_PANEL = 6


@pytest.fixture
def training_page(live_api, db_session, browser):  # noqa: ANN001, ANN201
    seeded = seed(db_session)
    context = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    response = page.goto(f"{live_api}/projects/{PROJECT}/commits/trained", wait_until="networkidle")
    assert response is not None and response.status == 200
    page.wait_for_function("document.getElementById('training-panels')?.dataset.plotted === 'true'")
    yield page, seeded, errors
    context.close()


def _by_verdict(results):  # noqa: ANN001, ANN202
    """The cards' order: the most severe verdict first."""
    return sorted(results, key=lambda r: ["within_floor", "within_noise", "beyond_noise"].index(r.figures.verdict),
                  reverse=True)


def test_the_training_panels_fit_1280_and_plotly_drew_every_trace(training_page) -> None:  # noqa: ANN001
    page, _seeded, errors = training_page
    page.evaluate("document.getElementById('training').scrollIntoView()")
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT_DIR / "training-impact-1280.png"))
    assert errors == []
    assert page.evaluate(OVERFLOWING) == []
    assert page.evaluate("document.documentElement.scrollWidth") <= WIDTH
    results = trained_results()
    cards = page.locator("#training-panels .training-panel").all()
    assert len(cards) == len(results)
    for card in cards:
        assert card.is_visible()
        for part in (card, card.locator(".training-plot"), card.locator(".training-verdict")):
            box = part.bounding_box()
            assert box is not None and box["width"] > 0 and box["height"] > 0
            assert box["x"] >= 0 and box["x"] + box["width"] <= WIDTH, box
    # The plot beside the verdict at this width, and wide enough to read a curve.
    plot, verdict = cards[0].locator(".training-plot").bounding_box(), cards[0].locator(".training-verdict").bounding_box()
    assert plot["width"] >= 300 and verdict["x"] >= plot["x"] + plot["width"], (plot, verdict)
    drawn = page.evaluate("""() => [...document.querySelectorAll('#training-panels .training-plot')].map(el => ({
        traces: el.data.length, svgTraces: el.querySelectorAll('.scatterlayer .trace').length,
        fills: el.querySelectorAll('.scatterlayer .trace .fills path').length,
        points: el.data.map(t => t.y.filter(v => v !== null).length),
        shapes: (el.layout.shapes || []).map(s => s.x0), plotted: el.dataset.plotted}))""")
    for panel, result in zip(drawn, _by_verdict(results)):
        assert panel["traces"] == panel["svgTraces"] == TRACES_PER_PANEL, panel
        assert panel["fills"] == 2, panel  # the two shaded bands
        assert panel["points"] == [STEPS] * TRACES_PER_PANEL, panel
        assert panel["shapes"] == [result.first_divergent_step], panel
    key = page.locator("#training-key li").all_inner_texts()
    assert len(key) == 5 and all(page.locator("#training-key li").nth(i).is_visible() for i in range(5))
    assert any("± 1 sample std" in entry for entry in key) and any("RMS" in entry for entry in key)


def test_the_difference_view_first_then_the_loss(training_page) -> None:  # noqa: ANN001
    """By default the commit's mean minus the baseline's per step, the baseline at zero and each band
    minus the baseline's mean (the same float64 subtraction in JS as here, so equal exactly); the
    loss view draws the bands and means as computed."""
    page, _seeded, errors = training_page
    assert page.evaluate("document.getElementById('training-panels').dataset.view") == "difference"

    def drawn() -> list[dict]:
        return page.evaluate("""() => [...document.querySelectorAll('#training-panels .training-plot')].map(el =>
            ({ys: el.data.map(t => Array.from(t.y)), title: el.layout.yaxis.title.text}))""")

    results = _by_verdict(trained_results())
    for panel, result in zip(drawn(), results):
        bands = curve_bands(result.curves)
        minus = lambda values: [v - b for v, b in zip(values, bands.baseline_mean)]  # noqa: E731
        assert panel["title"] == "Δ loss vs baseline"
        assert panel["ys"] == [minus(bands.spread_low), minus(bands.spread_high), minus(bands.floor_low),
                               minus(bands.floor_high), [0] * STEPS, minus(bands.commit_mean)]
    page.locator("input[name=training-y][value=loss]").check()
    page.wait_for_function("document.getElementById('training-panels').dataset.view === 'loss'")
    page.evaluate("document.getElementById('training').scrollIntoView()")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "training-impact-loss-1280.png"))
    for panel, result in zip(drawn(), results):
        bands = curve_bands(result.curves)
        assert panel["title"] == "loss"
        assert panel["ys"] == [bands.spread_low, bands.spread_high, bands.floor_low, bands.floor_high,
                               bands.baseline_mean, bands.commit_mean]
    assert errors == []


def test_a_running_job_updates_its_progress_from_the_api(live_api, db_session, browser) -> None:  # noqa: ANN001
    """The page polls GET /api/v1/runs/{id}/training?curves=false and writes what it answers (here
    a later progress, served by the route below) as text: the phase never becomes markup."""
    from tests.service.dashboard.test_training_panel import HOSTILE

    seeded = seed(db_session)
    run_id = seeded.run_ids["running"]
    context = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
    page = context.new_page()
    later = {"id": 1, "run_id": run_id, "baseline_run_id": seeded.run_ids["base"], "status": "running",
             "model_set": "quick", "progress": {"runs_done": 30, "runs_total": 72, "phase": HOSTILE},
             "results": [], "error": None, "seconds": None, "device": None}
    page.route(f"**/api/v1/runs/{run_id}/training?curves=false", lambda route: route.fulfill(json=later))
    response = page.goto(f"{live_api}/projects/{PROJECT}/commits/running", wait_until="domcontentloaded")
    assert response is not None and response.status == 200
    assert page.locator("#training-progress-text").inner_text() == "running: 12/72 training runs done · phase: baseline"
    page.wait_for_function("document.getElementById('training-progress-text').textContent.includes('30/72')")
    assert page.locator("#training-progress-text").inner_text() == f"running: 30/72 training runs done · phase: {HOSTILE}"
    assert page.locator("#training-progress-bar").evaluate("bar => [bar.value, bar.max]") == [30, 72]
    assert page.locator("#training img").count() == 0
    context.close()


def test_on_a_phone_the_cards_stack_inside_the_page(live_api, db_session, browser) -> None:  # noqa: ANN001
    """At 390 px a card takes the page's width, its verdict under its plot: still nothing wider than its box."""
    seed(db_session)
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    page = context.new_page()
    response = page.goto(f"{live_api}/projects/{PROJECT}/commits/trained", wait_until="networkidle")
    assert response is not None and response.status == 200
    page.wait_for_function("document.getElementById('training-panels')?.dataset.plotted === 'true'")
    assert page.evaluate(OVERFLOWING) == []
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    plot = page.locator("#training-plot-1").bounding_box()
    verdict = page.locator("#training-1 .training-verdict").bounding_box()
    assert verdict["y"] >= plot["y"] + plot["height"], (plot, verdict)
    context.close()
