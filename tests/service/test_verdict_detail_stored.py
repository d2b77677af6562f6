"""The co-run's writes to a verdict's detail through service.run_store (typed now:
service/core/verdict_detail.py) leave in PostgreSQL the same JSON text the untyped dict code left,
key order included, on a detail judged now and on one stored by the previous code
(tests/fixtures/verdict_details/stored_at_8bf4ca1.json). Each test in a transaction rolled back."""

from __future__ import annotations

import json

from sqlalchemy import text

from service import run_store
from service.core.results import RepeatCheck
from service.core.verdict_detail import CorunFinding, CorunRecord, CorunWindow
from service.core.verdicts import compare_runs
from service.domain import runs, trajectories
from tests.service.core.test_verdict_detail import STORED, _old_build_change
from tests.service.test_attribution_build_change import BASELINE_BUILD, COMMIT_BUILD, ROUNDING, _judged
from tests.service.test_corun_findings import FINDING

BUILD_CHANGE = {"flags_added": ["-march=native", "-fopenmp", "-D__AVX512__=1"], "flags_removed": ["-g"],
                "compilers": None}
WINDOW = {"worker": "node-1:42", "started_at": "2026-12-06T15:00:00+00:00",
          "finished_at": "2026-12-06T15:00:01.250000+00:00"}
EXTRA = {"corun_seconds": 1.25, "corun_window": WINDOW, "corun_phases": {"load": 0.5, "compare": 0.125},
         "corun_kernels": {"chunks": 2, "commit_s": 0.5}, "training_impact": "quick"}
RECORD = CorunRecord(corun_seconds=1.25, corun_window=CorunWindow(**WINDOW), corun_phases={"load": 0.5, "compare": 0.125},
                     corun_kernels={"chunks": 2, "commit_s": 0.5}, training_impact="quick")


def _stored_text(session, run_id: int) -> str:  # noqa: ANN001
    """The detail as PostgreSQL holds it (a json column keeps the text it was given)."""
    return session.execute(text("SELECT detail::text FROM verdicts WHERE run_id = :run_id"),
                           {"run_id": run_id}).scalar_one()


def _store_text(session, run_id: int, detail: str) -> None:  # noqa: ANN001
    session.execute(text("UPDATE verdicts SET detail = CAST(:detail AS json) WHERE run_id = :run_id"),
                    {"detail": detail, "run_id": run_id})
    session.flush()


def test_the_coruns_writes_store_the_text_the_dict_code_stored(db_session, api_settings) -> None:  # noqa: ANN001
    _, child = _judged(db_session, api_settings, (BASELINE_BUILD, COMMIT_BUILD))
    inputs = run_store.corun_inputs(child.id, session=db_session)
    judged = compare_runs(inputs.commit_result, inputs.baseline_result)
    assert _stored_text(db_session, child.id) == json.dumps({**judged.model_dump(mode="json"),
                                                              "build_change": BUILD_CHANGE})

    comparison = compare_runs(inputs.commit_result, inputs.baseline_result, {"c1": [0.0, 0.0, 1e-7]})
    assert run_store.store_corun_diffs(child.id, comparison=comparison, corun_record=RECORD, session=db_session)
    expected = _old_build_change({**comparison.model_dump(mode="json"), **EXTRA}, BUILD_CHANGE)
    assert _stored_text(db_session, child.id) == json.dumps(expected)

    run_store.add_attribution(child.id, {"c1": ROUNDING}, session=db_session)
    expected = _old_build_change({**expected, "attribution": {"c1": ROUNDING}}, BUILD_CHANGE)
    assert _stored_text(db_session, child.id) == json.dumps(expected)

    run_store.corun_given_up(child.id, "the co-run failed: boom", session=db_session)
    expected = {**expected, "corun": {"state": "given_up", "reason": "the co-run failed: boom"}}
    assert _stored_text(db_session, child.id) == json.dumps(expected)


def test_a_detail_stored_by_the_previous_code_is_read_and_added_to_as_before(db_session, api_settings) -> None:  # noqa: ANN001
    _, child = _judged(db_session, api_settings, (BASELINE_BUILD, COMMIT_BUILD))
    _store_text(db_session, child.id, STORED["judged"])
    assert run_store.corun_inputs(child.id, session=db_session).changed_ids == {"c1"}

    # An older release's detail (no figures, fewer case fields, a key this release does not know).
    _store_text(db_session, child.id, STORED["older_release"])
    assert run_store.corun_inputs(child.id, session=db_session) is None  # its changed case has its diffs
    run_store.add_attribution(child.id, {"c1": ROUNDING}, session=db_session)
    expected = _old_build_change({**json.loads(STORED["older_release"]), "attribution": {"c1": ROUNDING}}, BUILD_CHANGE)
    assert _stored_text(db_session, child.id) == json.dumps(expected)
    run_store.corun_given_up(child.id, "the co-run failed: boom", session=db_session)
    expected = {**expected, "corun": {"state": "given_up", "reason": "the co-run failed: boom"}}
    assert _stored_text(db_session, child.id) == json.dumps(expected)
    assert run_store.corun_final(child.id, session=db_session)


def test_a_nondeterminism_finding_stores_the_text_the_dict_code_stored(db_session, api_settings) -> None:  # noqa: ANN001
    baseline, child = _judged(db_session, api_settings, (BASELINE_BUILD, COMMIT_BUILD))
    check = RepeatCheck(runs=2, differing=1, first_divergent_step=3, baseline_runs=2, baseline_differing=0)
    record = CorunRecord(corun_seconds=1.25, corun_window=CorunWindow(**WINDOW), corun_phases={"load": 0.5})
    run_store.store_corun_nondeterminism(child.id, commit_checks={"c1": check}, finding=CorunFinding.model_validate(FINDING),
                                         corun_record=record, session=db_session)
    again = compare_runs(trajectories.run_result(session=db_session, run=runs.lookup(session=db_session, run_id=child.id)),
                         trajectories.run_result(session=db_session, run=runs.lookup(session=db_session, run_id=baseline.id)))
    expected = {**again.model_dump(mode="json"), "corun_seconds": 1.25, "corun_window": WINDOW,
                "corun_phases": {"load": 0.5}, "corun": FINDING, "build_change": BUILD_CHANGE}
    assert _stored_text(db_session, child.id) == json.dumps(expected)
