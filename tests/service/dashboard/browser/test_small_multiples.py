"""The commit page's small multiples (issue 34 item 1) on a bitsandbytes-like flagged commit: 8-bit
blockwise and 32-bit cases changed together, the co-run's per-step |commit − baseline| stored, so an
8-bit case (|Δ| ~1e-3, its distance to float64 the quantization error) and an fp32 case (|Δ| ~1e-7)
sit side by side, each in its own scale. And the run's toolchain / build variant line (issue 36).

At 1280×800 and 1920×1080: nothing wider than its container, the headline and the first row of panels
above the fold, one panel per optimizer · family, every number shown equal to the API's.
"""

from __future__ import annotations

import math
from collections import defaultdict
from datetime import datetime, timedelta, timezone

import pytest

from service.core.case_names import case_name

from tests.service.dashboard.browser.engine_seed import BATTERY, PROJECT
from tests.service.dashboard.browser.test_commit_page_layout import (
    OVERFLOWING, SCREENSHOT_DIR, VIEWPORTS,
)

SHA = "i9-bnb-like"
TOOLCHAIN = {"cxx": "/usr/bin/x86_64-linux-gnu-g++-12", "cxx_version": "g++ (Debian 12.2.0-14) 12.2.0",
             "nvcc": None, "nvcc_version": None}
BUILD_VARIANT = {"compiler": None, "cflags": ["-O3"], "cuda_cflags": [], "cuda_archs": None}
# wording.number writes 4 significant digits: a number parsed back is within half a unit in the
# last digit, 5e-4 relative.
SHOWN = 5e-4


@pytest.fixture(scope="module")
def bnb_like(dashboard) -> int:  # noqa: ANN001
    """A commit run of the decay-after-update tree against a1-base, stored as the worker stores it
    after its co-run: the verdict of compare_runs with the per-step |commit − baseline|, and the
    toolchain and build variant the worker records beside the fingerprint. Returns the run id."""
    from sqlalchemy import create_engine, select
    from sqlalchemy.orm import Session

    from service.core.verdicts import compare_runs
    from service.db.models import DONE, Commit, Project, Run, SourceArchive, Verdict
    from service.domain import trajectories

    engine_run, baseline_run_id = dashboard.engine, dashboard.seeded.run_ids["a1-base"]
    db = create_engine(dashboard.database_url)
    with Session(db) as session:
        existing = session.scalar(select(Run.id).join(Commit, Run.commit_id == Commit.id).where(Commit.sha == SHA))
        if existing is not None:
            return existing
        project = session.scalar(select(Project).where(Project.name == PROJECT))
        at = datetime(2025, 1, 6, 12, 50, tzinfo=timezone.utc)  # before f6-running, the newest row
        digest = "b" * 64
        session.add(SourceArchive(digest=digest, size_bytes=1, member_count=1, created_at=at))
        session.flush()
        commit = Commit(project_id=project.id, sha=SHA, parents=["a1-base"], ref="main",
                        message="8-bit and 32-bit optimizers: decay after the update", source_digest=digest,
                        created_at=at)
        session.add(commit)
        session.flush()
        result = engine_run.buggy
        run = Run(project_id=project.id, kind="commit", commit_id=commit.id, source_digest=digest,
                  battery=BATTERY, battery_hash=result.battery_digest, environment="cpu",
                  environment_detail={"battery_version": 1, "build_ok": True,
                                      "fingerprint": result.environment.model_dump(mode="json"),
                                      "toolchain": TOOLCHAIN, "build_variant": BUILD_VARIANT},
                  status=DONE, attempt=1, worker="seed@localhost", created_at=at, dispatched_at=at,
                  started_at=at, heartbeat_at=at, finished_at=at + timedelta(seconds=60),
                  cases_total=len(result.cases), cases_done=len(result.cases),
                  build_digest=result.build_digest, build_cached=False, build_log=engine_run.buggy_log)
        session.add(run)
        session.flush()
        for index, case in enumerate(result.cases):
            trajectories.store_case_result(session=session, run_id=run.id, case_index=index, result=case)
        comparison = compare_runs(result, engine_run.base, engine_run.diffs)
        changed = [c for c in comparison.cases if c.verdict in ("changed", "broken")]
        steps = [c.first_divergent_step for c in changed if c.first_divergent_step]
        session.add(Verdict(run_id=run.id, baseline_run_id=baseline_run_id, outcome=comparison.verdict,
                            flagged=True, changed_cases=len(changed), first_divergent_step=min(steps),
                            detail=comparison.model_dump(mode="json"), created_at=at))
        session.commit()
        run_id = run.id
    db.dispose()
    return run_id


@pytest.fixture(params=VIEWPORTS, ids=lambda v: f"{v[0]}x{v[1]}")
def sized_page(browser, request):  # noqa: ANN001
    width, height = request.param
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    page.viewport = (width, height)
    yield page
    context.close()


def _open(page, dashboard, path: str) -> None:  # noqa: ANN001
    response = page.goto(dashboard.url + path, wait_until="networkidle")
    assert response is not None and response.status == 200
    page.wait_for_function("document.getElementById('divergence-panels')?.dataset.plotted === 'true'")


def _api_run(page, dashboard, run_id: int) -> dict:  # noqa: ANN001
    response = page.request.get(f"{dashboard.url}/api/v1/runs/{run_id}")
    assert response.status == 200, response.text()
    return response.json()


def test_the_seed_has_8bit_and_fp32_changes_together(dashboard, bnb_like, page) -> None:  # noqa: ANN001
    cases = _api_run(page, dashboard, bnb_like)["verdict"]["detail"]["cases"]
    families = {c["family"] for c in cases if c["verdict"] == "changed"}
    assert {"8bit_blockwise", "32bit"} <= families, families


@pytest.mark.parametrize("path", ["commit", "run"])
def test_bnb_like_page_fits_and_leads_with_headline_and_panels(dashboard, bnb_like, sized_page, path: str) -> None:  # noqa: ANN001
    _open(sized_page, dashboard, f"/projects/{PROJECT}/commits/{SHA}" if path == "commit" else f"/runs/{bnb_like}")
    width, height = sized_page.viewport
    if path == "commit":
        SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
        sized_page.screenshot(path=str(SCREENSHOT_DIR / f"commit-8bit-and-fp32-{width}x{height}.png"))
    assert sized_page.evaluate(OVERFLOWING) == []
    panels = sized_page.locator("#divergence-panels .panel-plot").all()
    assert panels
    # The headline and the panels' first row: whole, above the fold.
    first_row_top = panels[0].bounding_box()["y"]
    for locator in [sized_page.locator("#headline"),
                    *[p for p in panels if p.bounding_box()["y"] == first_row_top]]:
        box = locator.bounding_box()
        assert box is not None and box["y"] + box["height"] <= height, (box, height)


def test_one_panel_per_family_each_case_in_its_own_scale(dashboard, bnb_like, page) -> None:  # noqa: ANN001
    """Panels: one per optimizer · family of the changed cases (at most 8, the rest named). Each
    drawn line is a changed case's per-step max |commit − baseline| over its unit, so its values are
    the API's per-step figures divided by one constant, and its peak is the figure its table row
    shows (parsed back, SHOWN)."""
    _open(page, dashboard, f"/projects/{PROJECT}/commits/{SHA}")
    cases = {c["case_id"]: c for c in _api_run(page, dashboard, bnb_like)["verdict"]["detail"]["cases"]}
    groups = defaultdict(list)
    for case in cases.values():
        if case["verdict"] == "changed":
            groups[f"{case['optimizer']} · {case['family']}"].append(case["case_id"])
    shown = page.locator("#divergence-panels .panel").evaluate_all("els => els.map(e => e.dataset.group)")
    named = page.locator("#groups-not-shown a").all_inner_texts()
    assert len(shown) == len(set(shown)) == min(len(groups), 8)
    assert set(shown) | set(named) == set(groups)
    assert any("8bit_blockwise" in g for g in shown) and any("32bit" in g for g in shown)
    drawn = page.evaluate("""() => [...document.querySelectorAll('#divergence-panels .panel-plot')]
        .flatMap(el => el.data.map(t => ({group: el.closest('.panel').dataset.group, name: t.name,
                                          y: Array.from(t.y)})))""")
    rows = {row.get_attribute("data-case-id"): row for row in page.locator("#changed-cases tbody tr").all()}
    units = {}
    for trace in drawn:
        case_id = next(c for c in groups[trace["group"]] if case_name(c) == trace["name"])
        per_step = cases[case_id]["max_abs_diff_per_step"]
        # One constant per case: the ratio of the API's |Δ| to the drawn value, wherever both exist.
        ratios = [d / y for d, y in zip(per_step, trace["y"]) if y is not None and d]
        assert ratios and max(ratios) == pytest.approx(min(ratios), rel=1e-12), case_id
        units[case_id] = ratios[0]
        figure = rows[case_id].locator("td.scale span").first.inner_text()
        assert max(y for y in trace["y"] if y is not None) == pytest.approx(float(figure), rel=SHOWN), case_id
    # The 8-bit and the fp32 lines have units orders of magnitude apart: each against its own scale.
    eight = [u for c, u in units.items() if cases[c]["family"] == "8bit_blockwise"]
    fp32 = [u for c, u in units.items() if cases[c]["family"] == "32bit"]
    # In this seed the 10-step 8-bit cases' baseline distance is ~4e4 (their quantization error;
    # the 1-step closed-form ones' ~1e-6) and a 32-bit case's at most ~0.3 (bf16): units more than
    # 1e3 apart, which one shared axis would flatten to nothing.
    assert eight and fp32 and all(math.isfinite(u) and u > 0 for u in units.values())
    assert max(eight) > 1e3 * max(fp32), (max(eight), max(fp32))


def test_headline_and_table_show_the_apis_numbers(dashboard, bnb_like, page) -> None:  # noqa: ANN001
    """The headline's counts and each row's first step, direction and size (max |commit − baseline|
    over the baseline's peak distance, parsed back within SHOWN) are the API's."""
    _open(page, dashboard, f"/projects/{PROJECT}/commits/{SHA}")
    verdict = _api_run(page, dashboard, bnb_like)["verdict"]
    figures, cases = verdict["figures"], {c["case_id"]: c for c in verdict["detail"]["cases"]}
    assert page.locator("#headline-first-step strong").inner_text() == str(figures["first_divergent_step"])
    for direction in ("farther", "closer", "same"):
        shown = page.locator(f"#headline-directions [data-direction={direction}] strong").inner_text()
        assert int(shown) == figures["directions"].get(direction, 0), direction
    rows = page.locator("#changed-cases tbody tr").all()
    assert len(rows) == sum(1 for c in cases.values() if c["verdict"] in ("changed", "broken"))
    for row in rows:
        case = cases[row.get_attribute("data-case-id")]
        assert row.locator("td.first-step").inner_text() == str(case["first_divergent_step"])
        if case["direction"] is None:  # withheld (a quantized case without its step figures)
            assert row.locator("td.direction .direction-withheld").inner_text() == "not judged"
        else:
            assert row.locator("td.direction .badge").inner_text() == case["direction"]
        expected = max(d for d in case["max_abs_diff_per_step"] if d is not None) / case["baseline_peak_ref64_distance"]
        assert float(row.locator("td.scale .diff-ratio").inner_text()) == pytest.approx(expected, rel=SHOWN)
        # 8-bit rows say why their distance to float64 is large, 32-bit rows do not.
        notes = row.locator("td.scale .eight-bit-note").count()
        assert notes == (1 if case["family"] == "8bit_blockwise" else 0), case["case_id"]


@pytest.mark.parametrize("path", ["run", "commit"])
def test_the_run_page_says_what_built_it(dashboard, bnb_like, page, path: str) -> None:  # noqa: ANN001
    """Issue 36's toolchain and build variant, as the API returns them, in the run's head and its
    environment table, on /runs/N and on the commit's page alike."""
    _open(page, dashboard, f"/runs/{bnb_like}" if path == "run" else f"/projects/{PROJECT}/commits/{SHA}")
    run = _api_run(page, dashboard, bnb_like)
    line = page.locator("#build-line").inner_text()
    assert run["toolchain"]["cxx_version"] in line and "-O3" in line
    assert run["build_variant"]["cflags"] == ["-O3"]
    assert page.locator("#build-detail").inner_text() in line
    # A run whose worker recorded neither has no such line.
    page.goto(f"{dashboard.url}/runs/{dashboard.seeded.run_ids['verify']}", wait_until="networkidle")
    assert page.locator("#build-line").count() == 0
