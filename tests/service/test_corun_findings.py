"""How a co-run that stores no diffs ends (issue 44, item 5), on the real PostgreSQL, each test in a
transaction rolled back (tests/service/test_run_store.py's runs and helpers).

A re-run that does not reproduce the stored trajectory makes the case nondeterministic by the rule
every run is judged with (service.core.verdicts.compare_runs on the stored trajectories, the co-run's
re-run one more repeat on the case's row), so judging the stored rows again reads the same verdict;
the detail is final then, and for a co-run that gave up: nothing more is co-run or waited for."""

from __future__ import annotations

from sqlalchemy import select

from service import run_store
from service.cli.client import corun_detail
from service.core.results import RepeatCheck
from service.core.verdict_detail import CorunFinding, CorunRecord
from service.core.verdicts import compare_runs
from service.db.models import Run, Verdict
from service.domain import trajectories
from tests.service.test_run_store import _judged_pair
from worker.jobs.corun import co_run_repeat
from worker.jobs.pair import NotReproduced, not_reproduced_cases

FOUND = NotReproduced(first_differing_step=3, stored_digest="9", rerun_digest="7", rerun_status="ok")
FINDING = {"state": "not_reproducible", "not_reproduced": 1, "cases": {"c1": {"commit": FOUND.as_json()}}}


def _verdict(session, run_id: int) -> Verdict:  # noqa: ANN001
    return session.scalar(select(Verdict).where(Verdict.run_id == run_id).execution_options(populate_existing=True))


def test_a_rerun_that_does_not_reproduce_makes_the_case_nondeterministic(db_session, api_settings) -> None:  # noqa: ANN001
    baseline, child = _judged_pair(db_session, api_settings)
    before = _verdict(db_session, child.id)
    assert (before.outcome, before.changed_cases) == ("changed", 1)

    check = co_run_repeat(None, FOUND, baseline_reproduced=True)
    comparison = run_store.store_corun_nondeterminism(child.id, commit_checks={"c1": check},
                                                      finding=CorunFinding.model_validate(FINDING),
                                                      corun_record=CorunRecord(corun_seconds=2.0), session=db_session)
    verdict = _verdict(db_session, child.id)
    assert comparison.verdict == verdict.outcome == "nondeterministic"
    assert verdict.flagged and verdict.changed_cases == 0 and verdict.first_divergent_step is None
    assert verdict.detail["counts"] == {"unchanged": 1, "nondeterministic": 1}
    assert verdict.detail["figures"]["nondeterministic_introduced"] == 1  # the headline counts it
    assert verdict.detail["summary"].startswith("NONDETERMINISTIC"), verdict.detail["summary"]
    case = next(c for c in verdict.detail["cases"] if c["case_id"] == "c1")
    assert case["verdict"] == "nondeterministic" and case["nondeterminism"] == "introduced"
    assert case["repeat_check"] == {"runs": 2, "differing": 1, "first_divergent_step": 3,
                                    "baseline_runs": 2, "baseline_differing": 0}
    assert verdict.detail["corun"] == FINDING and verdict.detail["corun_seconds"] == 2.0
    assert verdict.baseline_run_id == baseline.id

    # The re-run is on the case's stored row: judging the stored trajectories again, as any later
    # judgement does, reads the same verdict.
    again = compare_runs(trajectories.run_result(session=db_session, run=db_session.get(Run, child.id)),
                         trajectories.run_result(session=db_session, run=db_session.get(Run, baseline.id)))
    assert again.model_dump(mode="json") == {k: v for k, v in verdict.detail.items()
                                             if k not in ("corun", "corun_seconds")}
    # Final: nothing is co-run again, and the CLI's --wait has nothing to wait for.
    assert run_store.corun_inputs(child.id, session=db_session) is None
    assert run_store.corun_final(child.id, session=db_session)
    state = corun_detail({"status": "done", "verdict": {"baseline_run_id": baseline.id, "detail": verdict.detail}})
    assert state.complete and state.final_state == "not_reproducible"


def test_a_corun_that_gives_up_says_so_and_is_final(db_session, api_settings) -> None:  # noqa: ANN001
    baseline, child = _judged_pair(db_session, api_settings)
    answer = {"status": "done", "verdict": {"baseline_run_id": baseline.id,
                                            "detail": _verdict(db_session, child.id).detail}}
    assert not corun_detail(answer).complete  # the diffs may still come: --wait waits
    assert not run_store.corun_final(child.id, session=db_session)
    run_store.corun_given_up(child.id, "no per-step diffs: the baseline no longer builds", session=db_session)
    verdict = _verdict(db_session, child.id)
    assert verdict.outcome == "changed"  # giving up changes nothing judged
    assert verdict.detail["corun"] == {"state": "given_up", "reason": "no per-step diffs: the baseline no longer builds"}
    assert run_store.corun_inputs(child.id, session=db_session) is None
    assert run_store.corun_final(child.id, session=db_session)
    # Said once: giving up again (another failure) keeps the first reason.
    run_store.corun_given_up(child.id, "the co-run failed", session=db_session)
    assert _verdict(db_session, child.id).detail["corun"]["reason"] == "no per-step diffs: the baseline no longer builds"
    answer["verdict"]["detail"] = verdict.detail
    assert corun_detail(answer).complete


def test_a_repeat_check_gains_the_corun_rerun_and_its_blame() -> None:
    stored = RepeatCheck(runs=6, differing=0)  # a remembered case the run repeated, all agreeing in one host
    assert co_run_repeat(stored, FOUND, baseline_reproduced=True) == RepeatCheck(
        runs=7, differing=1, first_divergent_step=3, baseline_runs=2, baseline_differing=0)
    both = co_run_repeat(None, FOUND, baseline_reproduced=False)
    assert both.origin == "pre-existing" and (both.baseline_runs, both.baseline_differing) == (2, 1)


def test_the_cases_not_reproduced_name_the_first_differing_step_and_both_digests() -> None:
    from service.core.results import RunResult
    from tests.service.test_run_store import _result

    def run(*results) -> RunResult:  # noqa: ANN002
        return RunResult(battery_name="b", battery_version=1, battery_digest="d", cases=list(results))

    stored = run(_result("same", ["1", "2", "3"]), _result("racy", ["1", "2", "3"]))
    rerun = run(_result("same", ["1", "2", "3"]), _result("racy", ["1", "5", "6"]))
    assert not_reproduced_cases(rerun, stored) == {
        "racy": NotReproduced(first_differing_step=2, stored_digest="2", rerun_digest="5", rerun_status="ok")}
    assert not_reproduced_cases(stored, stored) == {}
