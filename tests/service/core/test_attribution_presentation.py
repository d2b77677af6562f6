"""Issue 17/16: a stored attribution shown through the real API, the run page and the CLI's tables
(PostgreSQL). The attribution is what worker.attribution.record stores beside the verdict; its
numbers here are those the decay-after-update tree gives (tests/worker/attribution/test_attribution.py)."""

from __future__ import annotations

import io

from rich.console import Console
from sqlalchemy.orm.attributes import flag_modified

from service.cli.report import print_report
from service.db.models import Verdict
from tests.service.core.test_verdict_presentation import BASELINE_DISTANCES, MOVED, SAME, _ok, _run_with

DECAY = {"class": "semantic", "variant": "decay_after_update", "label": "weight decay applied after the update",
         "kind": "decay order", "first_divergent_step": 1, "first_step_ulps": 268436.0, "peak_ulps": 322297.0,
         "change_vs_baseline_distance": 1390.8, "residual_ulps": 6.34, "distance": 9.65e-06,
         "reference_distance": 0.01255, "next_best": "eps_before_bias_correction", "next_best_ratio": 50807.1,
         "max_abs_diff": 0.01255}
# The 8-bit case: the largest |commit − baseline| by far, and a hundredth of its own distance to float64.
EIGHT_BIT = {**DECAY, "change_vs_baseline_distance": 0.0100, "max_abs_diff": 365.1}
REORDER = {"class": "rounding-level", "variant": None, "first_divergent_step": 3, "first_step_ulps": 2.0,
           "peak_ulps": 4.0, "change_vs_baseline_distance": 0.02, "candidates": []}


def _seed(session, settings):  # noqa: ANN001, ANN202
    _run_with(session, settings, "a", [], [_ok("decayed", SAME), _ok("eightbit", SAME), _ok("reorder", SAME)])
    moved = [_ok("decayed", MOVED, [d * 1000 for d in BASELINE_DISTANCES]), _ok("eightbit", MOVED),
             _ok("reorder", MOVED)]
    run = _run_with(session, settings, "b", ["a"], moved)
    verdict = session.get(Verdict, run.verdict.id)
    verdict.detail = {**verdict.detail, "attribution": {"decayed": DECAY, "eightbit": EIGHT_BIT, "reorder": REORDER}}
    flag_modified(verdict, "detail")
    session.flush()
    return run


def test_api_run_page_and_cli_show_the_kind_of_change(api, db_session, api_settings):  # noqa: ANN001
    run = _seed(db_session, api_settings)
    verdict = api.get(f"/api/v1/runs/{run.id}").json()["verdict"]
    by_case = {a["case_id"]: a for a in verdict["attribution"]}
    assert by_case["decayed"]["kind"] == "semantic" and by_case["decayed"]["variant"] == "decay_after_update"
    assert by_case["decayed"]["text"] == ("semantic: weight decay applied after the update — 9.650e-06 from that "
                                          "variant, 1.255e-02 from the reference (next best ×5.081e+04 worse)")
    assert by_case["reorder"]["text"] == "rounding-level: 2.000e+00 ulp at the first divergent step, 4.000e+00 ulp at most"
    assert by_case["reorder"]["first_step_ulps"] == 2.0
    # The headline ranks by the change relative to the case's own scale: the 8-bit case's huge
    # absolute change (its quantization error) does not lead it.
    assert verdict["attribution_summary"] == (
        "attribution: semantic — looks like weight decay applied after the update (2), rounding-level (1); "
        "largest change ×1.391e+03 the baseline's own distance to float64 (decayed)")

    page = api.get("/projects/p/commits/b").text
    assert 'id="attribution-summary"' in page and "looks like weight decay applied after the update (2)" in page
    # Rows lead with the largest change relative to the case's own distance, not the 8-bit case.
    order = [page.index(f'<tr data-case-id="{name}"') for name in ("decayed", "reorder", "eightbit")]
    assert order == sorted(order)
    row = page.split('<tr data-case-id="reorder"')[1].split("</tr>")[0]
    assert "2.000e+00 / 4.000e+00 ulp" in row and "kind-rounding-level" in row
    row = page.split('<tr data-case-id="decayed"')[1].split("</tr>")[0]
    assert "2.684e+05 / 3.223e+05 ulp" in row and "1.391e+03×" in row and "weight decay applied after the update" in row

    run_json = api.get(f"/api/v1/runs/{run.id}").json()
    out = io.StringIO()
    print_report(Console(file=out, width=1000), [run_json])
    text = out.getvalue()
    assert "ulp first / peak" in text and "2.684e+05 / 3.223e+05" in text
    assert "semantic: weight decay applied after the update" in text and "rounding-level: 2.000e+00 ulp" in text
    assert f"run {run.id}: attribution: semantic — looks like weight decay applied after the update (2)" in text


def test_a_failed_attribution_is_said_and_changes_nothing(api, db_session, api_settings):  # noqa: ANN001
    run = _seed(db_session, api_settings)
    verdict = db_session.get(Verdict, run.verdict.id)
    outcome = verdict.outcome
    verdict.detail = {**verdict.detail, "attribution": {"error": "RuntimeError: attribution child failed (1)"}}
    flag_modified(verdict, "detail")
    db_session.flush()
    body = api.get(f"/api/v1/runs/{run.id}").json()["verdict"]
    assert body["attribution"] == [] and body["attribution_summary"] is None and body["outcome"] == outcome
    assert "attribution failed: RuntimeError: attribution child failed (1)" in api.get("/projects/p/commits/b").text


def test_a_precision_change_reads_as_precision_with_its_variant():
    """A named precision variant (an intermediate's precision, beyond a rounding) is worded and
    counted as precision, not as semantic."""
    from service.core.attribution_view import by_case, headline

    detail = {"attribution": {"adam.a": {"class": "precision", "variant": "bias_correction_float32_powers",
                                         "label": "the bias corrections from float32 powers of beta",
                                         "distance": 1e-7, "reference_distance": 2e-5, "next_best_ratio": 20.0,
                                         "first_step_ulps": 182.0, "peak_ulps": 260.0},
                              "adam.b": {"class": "rounding-level", "variant": None, "first_step_ulps": 1.0,
                                         "peak_ulps": 1.0}}}
    cases = by_case(detail)
    assert cases["adam.a"].text.startswith("precision: the bias corrections from float32 powers of beta — 1.000e-07")
    line = headline(detail)
    assert "precision — looks like the bias corrections from float32 powers of beta (1)" in line
    assert "semantic" not in line and "rounding-level (1)" in line
