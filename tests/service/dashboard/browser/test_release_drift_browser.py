"""The release drift page in Chromium (issue 47), on the seeded five releases of
tests/service/dashboard/release_seed.py served by the real app on PostgreSQL: the fp32 ×1700
regression is the most salient cell, the unchanged 8-bit row stays neutral, releases read in version
order though submitted out of it, the flags-only release is labelled with its flags, an empty column
says why; every figure on the page parsed back equals the matrix API's; and no page of the project
shows a Python repr or a worker's path."""

from __future__ import annotations

import math
import re

import httpx
import pytest

from service.core.case_names import case_name
from tests.service.dashboard import release_seed as s
from tests.service.dashboard.browser.conftest import SCREENSHOTS

LION = "lion · 32bit · float32"
EIGHT_BIT = "adam · 8bit_blockwise · float32"
# What the page writes with service.core.wording.number: four significant digits, so a figure read
# back from the page equals the API's to half a unit of the fourth digit.
FOUR_DIGITS = 5e-4


@pytest.fixture
def drift(live_api, db_session):  # noqa: ANN001, ANN201
    seeded = s.seed(db_session)
    return live_api, seeded


def _open(page, url: str) -> None:  # noqa: ANN001
    response = page.goto(url, wait_until="networkidle")
    assert response is not None and response.status == 200, (url, response and response.status)


def _salience(rgb: str) -> float:
    """How much a cell's background colour stands out of a white page: 1 − its relative luminance,
    blended over white by its alpha (a no-data cell's colour is transparent under its light stripes)."""
    values = [float(v) for v in re.findall(r"[\d.]+", rgb)]
    alpha = values[3] if len(values) > 3 else 1.0
    red, green, blue = (alpha * v / 255 + (1 - alpha) for v in values[:3])
    return 1 - (0.2126 * red + 0.7152 * green + 0.0722 * blue)


def _cells(page) -> list[dict]:  # noqa: ANN001
    return page.locator("#release-matrix td.cell").evaluate_all("""cells => cells.map(c => ({
        group: c.parentElement.dataset.group, release: c.dataset.release, state: c.dataset.state,
        intensity: +c.dataset.intensity, background: getComputedStyle(c).backgroundColor,
        image: getComputedStyle(c).backgroundImage,
        change: c.querySelector('.change')?.innerText ?? null, kind: c.querySelector('.kind')?.innerText ?? null,
        step: c.querySelector('.first-step .step')?.innerText ?? null,
        ulps: c.querySelector('.first-step .ulps')?.innerText ?? null,
        apart: c.querySelector('.ulps-apart .value')?.innerText ?? null,
        apart_text: c.querySelector('.ulps-apart')?.innerText ?? null,
        distance: c.querySelector('.distance .value')?.innerText ?? null,
        changed: c.querySelector('.mark.changed')?.innerText ?? null,
        note: c.querySelector('.empty')?.title ?? null}))""")


def test_the_regression_stands_out_and_unchanged_rows_stay_neutral(drift, page) -> None:  # noqa: ANN001
    url, _seeded = drift
    _open(page, f"{url}/projects/{s.PROJECT}/releases")
    # Version order, whatever the submission order; each tag whole.
    assert page.locator("#release-matrix thead th[data-release]").evaluate_all(
        "hs => hs.map(h => h.dataset.release)") == s.VERSION_ORDER
    assert page.locator("#release-matrix thead th[data-release] .tag").all_inner_texts() == s.VERSION_ORDER
    # The battery that ran, not the one asked for.
    assert page.locator("#pair-select option:checked").inner_text().startswith(f"{s.ENVIRONMENT} / {s.RAN_BATTERY}")

    cells = _cells(page)
    salience = {(c["group"], c["release"]): _salience(c["background"]) for c in cells}
    regression = (LION, "v1.10.0")
    others = [value for key, value in salience.items() if key != regression]
    assert salience[regression] > max(others) + 0.2, salience
    for cell in cells:
        if cell["group"] == EIGHT_BIT and cell["state"] != "no-data":
            # Its distance to float64 is 4.2e+04 (its quantization error); it never changed: white.
            assert cell["background"] == "rgb(255, 255, 255)", cell
        if cell["state"] in ("first", "unchanged"):
            assert salience[(cell["group"], cell["release"])] == 0, cell
    flags = next(c for c in cells if (c["group"], c["release"]) == (LION, "v1.10.1"))
    assert 0 < salience[(LION, "v1.10.1")] < salience[regression]
    assert flags["kind"] == "rounding-level · build flags changed: + -march=native -fopenmp, - -g"
    header = page.locator("#release-matrix thead th[data-release='v1.10.1'] .build-change")
    assert header.inner_text() == "build flags changed: + -march=native -fopenmp, - -g"
    empty = page.locator("#release-matrix thead th[data-release='v1.11.0'] .no-data").inner_text()
    assert empty == f"no data: build failed in {s.ENVIRONMENT}: {s.BUILD_ERROR}"
    assert all("no data: " + c["note"] == empty for c in cells if c["release"] == "v1.11.0")
    regression_cell = next(c for c in cells if (c["group"], c["release"]) == regression)
    assert regression_cell["change"] == "×1.700e+03" and regression_cell["kind"] == "semantic: decoupled weight decay"
    assert regression_cell["step"] == str(s.REGRESSION_FIRST_STEP)
    assert page.console_watch.errors == []
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "releases.png"), full_page=False)
    page.select_option("#group-select", LION)
    page.wait_for_function(f"document.getElementById('line-plot').dataset.plotted === '{LION}'")
    page.locator(".plots").screenshot(path=str(SCREENSHOTS / "releases-line-plot.png"))


def _factor(text: str) -> float:
    """A factor as release_matrix.factor_text writes it, read back: ×1.700e+03, ×(1 + 2.400e-05)."""
    near_one = re.fullmatch(r"×\(1 ([+−]) (\S+)\)", text)
    if near_one:
        return 1 + (1 if near_one.group(1) == "+" else -1) * float(near_one.group(2))
    return float(text.removeprefix("×"))


def _close(shown: float, value: float, around: float = 0.0) -> bool:
    # `around`: a figure written as its distance from `around` has four digits of that distance.
    return math.isclose(shown - around, value - around, rel_tol=FOUR_DIGITS, abs_tol=1e-300)


def test_every_figure_on_the_release_page_is_the_apis(drift, page) -> None:  # noqa: ANN001
    url, _seeded = drift
    matrix = httpx.get(f"{url}/api/v1/projects/{s.PROJECT}/releases/matrix", timeout=30).json()
    _open(page, f"{url}/projects/{s.PROJECT}/releases")
    shown = {(c["group"], c["release"]): c for c in _cells(page)}
    assert len(shown) == sum(len(row["cells"]) for row in matrix["rows"])
    checked = apart = 0
    for row in matrix["rows"]:
        for cell in row["cells"]:
            page_cell = shown[(row["label"], cell["release"])]
            assert (page_cell["state"], page_cell["intensity"]) == (cell["state"], cell["intensity"])
            if cell["state"] in ("no-data", "no-cases"):
                assert page_cell["note"] == cell["note"]
                continue
            assert page_cell["change"] == cell["change_text"]
            if cell["change"] is not None:
                if row["scale"] == "ratio":
                    around = 1.0 if page_cell["change"].startswith("×(") else 0.0
                    assert _close(_factor(page_cell["change"]), cell["change"], around), (page_cell, cell)
                else:
                    assert _close(float(page_cell["change"].split()[0]), cell["change"]), (page_cell, cell)
                checked += 1
            assert page_cell["kind"] == cell["kind_text"]
            assert page_cell["step"] == (str(cell["first_divergent_step"]) if cell["first_divergent_step"] else None)
            if cell["first_step_ulps"] is not None:
                assert _close(float(page_cell["ulps"]), cell["first_step_ulps"])
            if cell["ulps_at_least"] is not None:
                assert _close(float(page_cell["apart"]), cell["ulps_at_least"]), (page_cell, cell)
                assert page_cell["apart_text"].endswith(f"ulp apart (step {cell['ulps_step']})")
                apart += 1
            else:
                assert page_cell["apart"] is None
            assert _close(float(page_cell["distance"]), cell["distance"])
            if cell["changed"]:
                assert page_cell["changed"] == f"Δ changed {cell['changed']}/{cell['compared']}"
    assert checked == 3  # the regression, and the flags release in the two float rows
    assert apart == 3    # the same three cells say how many ulps apart their releases are at least
    # The sparklines hold the API's figures, one dot per release with data.
    for row in matrix["rows"]:
        svg = page.locator(f"#release-matrix tr[data-group='{row['label']}'] svg.sparkline")
        assert svg.evaluate("s => JSON.parse(s.dataset.values)") == row["sparkline"]
        assert svg.locator("circle").count() == sum(v is not None for v in row["sparkline"])
    # The line plot: one trace per case, named by what it is, its finals the API's.
    page.select_option("#group-select", LION)
    page.wait_for_function(f"document.getElementById('line-plot').dataset.plotted === '{LION}'")
    traces = page.evaluate("Array.from(document.getElementById('line-plot').data, t => ({name: t.name, y: t.y}))")
    row = next(r for r in matrix["rows"] if r["label"] == LION)
    assert traces == [{"name": line["name"], "y": line["finals"]} for line in row["cases"]]
    assert all("#" not in trace["name"] for trace in traces)
    assert page.console_watch.errors == []


def test_any_two_releases_compare_from_the_page(drift, page) -> None:  # noqa: ANN001
    """Pick v1.8.0 and v1.10.1 and compare: two columns, the second measured from the first (what
    lies between does not enter), its figures the API's for the same two releases."""
    url, _seeded = drift
    _open(page, f"{url}/projects/{s.PROJECT}/releases")
    page.select_option("#compare-from", "v1.8.0")
    page.select_option("#compare-to", "v1.10.1")
    with page.expect_navigation(wait_until="networkidle"):
        page.click("#compare-form button[type=submit]")
    assert page.locator("#release-matrix thead th[data-release]").evaluate_all(
        "hs => hs.map(h => h.dataset.release)") == ["v1.8.0", "v1.10.1"]
    assert "Showing 2 of 5 releases (v1.8.0 → v1.10.1)" in page.locator("#only-note").inner_text()
    matrix = httpx.get(f"{url}/api/v1/projects/{s.PROJECT}/releases/matrix",
                       params={"releases": ["v1.8.0", "v1.10.1"]}, timeout=30).json()
    shown = {(c["group"], c["release"]): c for c in _cells(page)}
    lion = next(cell for row in matrix["rows"] if row["label"] == LION for cell in row["cells"]
                if cell["release"] == "v1.10.1")
    page_lion = shown[(LION, "v1.10.1")]
    assert page_lion["change"] == lion["change_text"] and page_lion["kind"] == lion["kind_text"]
    assert _close(float(page_lion["apart"]), lion["ulps_at_least"])
    # The JSON link keeps the two releases.
    link = page.locator("a", has_text="This matrix as JSON").get_attribute("href")
    assert "releases=v1.8.0" in link and "releases=v1.10.1" in link
    assert page.console_watch.errors == []


REPR = [re.compile(pattern) for pattern in (r"\{'", r"'\}", r"\bFalse\b", r"\bTrue\b", r"\bNone\b")]
PATHS = ("/tmp/", s.WORKER_HOME)


def test_no_page_shows_a_python_repr_or_a_worker_path(drift, page) -> None:  # noqa: ANN001
    url, seeded = drift
    paths = [f"/projects/{s.PROJECT}", f"/projects/{s.PROJECT}/releases", f"/projects/{s.PROJECT}/environments"]
    paths += [f"/projects/{s.PROJECT}/commits/{sha}" for sha, _parent, _hours in s.RELEASES.values()]
    paths += [f"/runs/{run_id}" for run_id in seeded.run_ids.values()]
    paths += [f"/projects/{s.PROJECT}/case-history?{httpx.QueryParams({'case': case})}" for case in s.SPECS]
    for path in paths:
        _open(page, url + path)
        text = page.locator("body").inner_text()
        html = page.content()
        for pattern in REPR:
            assert not pattern.search(text), (path, pattern.pattern, text[max(0, pattern.search(text).start() - 80):][:160])
        for fragment in PATHS:
            assert fragment not in html, (path, fragment)
        assert page.console_watch.errors == [], (path, page.console_watch.errors)
    # What those rows say instead: the references in words, the worker's library by its file name.
    _open(page, f"{url}/runs/{seeded.run_ids['v1.10.0']}")
    assert page.locator("#environment").inner_text().count("references\tadam: 9f2c1e0a; lion: 77ab03d4") == 1
    assert "library: …/optdrift_ops.so" in page.locator("#adapter").inner_text()


def test_the_commit_page_counts_every_changed_case_and_plots_the_tables_ulps(drift, page) -> None:  # noqa: ANN001
    url, seeded = drift
    # v1.10.1: three cases changed; lion wd=0's references changed, so it has no direction.
    run = httpx.get(f"{url}/api/v1/runs/{seeded.run_ids['v1.10.1']}", timeout=30).json()
    figures = run["verdict"]["figures"]
    _open(page, f"{url}/projects/{s.PROJECT}/commits/c1101")
    counts = dict(page.locator("#headline-directions .direction-count").evaluate_all(
        "xs => xs.map(x => [x.dataset.direction, +x.querySelector('strong').innerText])"))
    assert int(page.locator("#headline-changed").inner_text()) == figures["changed"] == 3
    assert sum(counts.values()) == figures["changed"], counts
    assert counts["not-judged"] == 1
    assert "; 1 not judged (over the steps that differ)" in page.locator("#verdict-sentence").inner_text()
    for direction in ("farther", "closer", "same"):
        assert counts[direction] == figures["directions"].get(direction, 0)
    # Each changed case named by what it is, never cut, the hash only in the link's title.
    names = page.locator("#changed-cases tbody .case-name").all_inner_texts()
    assert sorted(names) == sorted(case_name(c) for c in (s.LION_WD, s.LION, s.ADAM))

    # v1.10.0: the table's ulps at the first divergent step is the plot's value at that step.
    _open(page, f"{url}/projects/{s.PROJECT}/commits/c1100")
    table = page.locator(f"#changed-cases tr[data-case-id='{s.LION_WD}'] dd.ulps").text_content().strip()
    first_step_ulps = float(table.split(" / ")[0])
    page.wait_for_function("document.getElementById('panel-1') && document.getElementById('panel-1').data")
    trace = page.evaluate("(() => { const t = document.getElementById('panel-1').data[0]; return {x: t.x, y: t.y}; })()")
    at_first = trace["y"][trace["x"].index(s.REGRESSION_FIRST_STEP)]
    assert _close(at_first, first_step_ulps) and _close(first_step_ulps, s.REGRESSION_ULPS), (at_first, table)
    assert _close(max(v for v in trace["y"] if v is not None), s.REGRESSION_PEAK_ULPS)
    assert page.console_watch.errors == []
