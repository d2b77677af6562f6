"""The worker's one door to the database (service/run_store.py), on the real PostgreSQL, each test in
a transaction rolled back at its end (the store's functions take the test's session). What a job
reads comes back as plain values; every write is the owning worker's only; a batch of results and
its progress commit together or not at all."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from service import run_store
from service.core.project_config import config_defaults
from service.core.results import CaseResult, CaseSpec, Trajectory as TrajectoryModel
from service.core.verdict_detail import CorunRecord
from service.core.verdicts import compare_runs
from service.db.models import Base, Run, Trajectory, Verdict
from service.domain import kernel_speed, projects, runs, submissions, workers
from tests.service_fixtures import make_archive


def _case(case_id: str) -> CaseSpec:
    return CaseSpec(case_id=case_id, optimizer="adam", hyper={"lr": 0.1}, seed=0, size=8, steps=3)


def _result(case_id: str, digests: list[str]) -> CaseResult:
    return CaseResult(case=_case(case_id), status="ok", trajectory=TrajectoryModel(
        ref64_max_abs=[0.1, 0.2, 0.3], ref64_max_rel=[0.0, 1.0, 2.0], nonfinite_count=[0, 0, 0], digests=digests))


def _commit_run(session, settings, sha: str, parents: list[str]) -> Run:  # noqa: ANN001
    project = projects.ensure(session=session, name="p")
    return submissions.submit_commit(session=session, settings=settings, project=project, sha=sha,
                                     parents=parents, archive=make_archive({"a.cpp": sha})).runs[0]


def _claimed(session, run: Run, worker: str = "w") -> run_store.ClaimedRun:  # noqa: ANN001
    assert run_store.claim(run.id, worker=worker, session=session)
    return run_store.ClaimedRun(session, run_id=run.id, worker=worker)


def _rows(session, run_id: int) -> int:  # noqa: ANN001
    return session.scalar(select(func.count()).select_from(Trajectory).where(Trajectory.run_id == run_id))


def test_a_job_reads_plain_values_never_rows(db_session, api_settings) -> None:  # noqa: ANN001
    run = _commit_run(db_session, api_settings, "a", [])
    claimed = _claimed(db_session, run)
    facts = run_store.run_facts(run.id, session=db_session)
    assert facts == claimed.run
    assert (facts.id, facts.kind, facts.status, facts.worker, facts.environment) == (run.id, "commit", "building",
                                                                                    "w", "cpu")
    assert facts.source_digest == run.source_digest and facts.started_at is not None
    project = run_store.project_facts(run.project_id, session=db_session)
    assert project == claimed.project and project.name == "p"
    for value in (facts, project):
        assert not isinstance(value, Base)
    # What the pipeline reads of a project (optdrift.toml's defaults) reads the same off the values.
    row = projects.ensure(session=db_session, name="p")
    assert config_defaults(project) == config_defaults(row)
    assert run_store.run_facts(10**9, session=db_session) is None


def test_a_batch_and_its_progress_commit_together_and_only_for_the_owner(db_session, api_settings) -> None:  # noqa: ANN001
    run = _commit_run(db_session, api_settings, "a", [])
    claimed = _claimed(db_session, run)
    assert claimed.record(build_digest="d" * 64, build_cached=True, environment_detail={"build_ok": True})
    claimed.start_cases(3)
    claimed.store_batch([(0, _result("c0", ["1", "2", "3"])), (1, _result("c1", ["1", "2", "3"]))], cases_done=2)
    db_session.refresh(run)
    assert (run.status, run.cases_total, run.cases_done, _rows(db_session, run.id)) == ("running", 3, 2, 2)
    assert run.build_digest == "d" * 64 and run.environment_detail == {"build_ok": True}

    # Another worker's view of the same run writes nothing: no rows, no progress, RunLost.
    stranger = run_store.ClaimedRun(db_session, run_id=run.id, worker="other")
    with pytest.raises(run_store.RunLost):
        stranger.store_batch([(2, _result("c2", ["1", "2", "3"]))], cases_done=3)
    assert not stranger.record(build_log="theirs")
    db_session.refresh(run)
    assert (run.cases_done, _rows(db_session, run.id), run.build_log) == (2, 2, None)
    assert not run_store.heartbeat(run.id, worker="other", session=db_session)
    assert run_store.heartbeat(run.id, worker="w", session=db_session)

    claimed.finish({"adapter": "bundled"})
    db_session.refresh(run)
    assert run.status == "done" and run.finished_at is not None
    assert run_store.judge(run.id, worker="w", settings=api_settings, session=db_session) == []
    assert db_session.scalar(select(Verdict).where(Verdict.run_id == run.id)) is not None


def test_a_claim_is_exclusive_and_a_cancel_is_honoured_at_a_checkpoint(db_session, api_settings) -> None:  # noqa: ANN001
    run = _commit_run(db_session, api_settings, "a", [])
    claimed = _claimed(db_session, run)
    assert not run_store.claim(run.id, worker="w2", session=db_session)
    assert not claimed.cancel_if_asked()
    runs.request_cancel(session=db_session, run_id=run.id)
    assert claimed.cancel_if_asked()
    db_session.refresh(run)
    assert (run.status, run.error) == ("cancelled", "cancelled on request")


def test_a_failure_is_retried_later_then_ends_in_error(db_session, api_settings) -> None:  # noqa: ANN001
    settings = api_settings.model_copy(update={"max_attempts": 2, "retry_backoff_s": 30.0})
    run = _commit_run(db_session, settings, "a", [])
    _claimed(db_session, run, "w1")
    before = datetime.now(timezone.utc)
    assert run_store.retry_later(run.id, worker="w1", error="boom", settings=settings, session=db_session)
    db_session.refresh(run)
    assert (run.status, run.worker) == ("queued", None) and "boom" in run.error and "retrying in 30 s" in run.error
    # Marked as handed out when the broker will hand it out: after its backoff.
    assert run.dispatched_at >= before + timedelta(seconds=29)
    _claimed(db_session, run, "w2")
    assert not run_store.retry_later(run.id, worker="w2", error="boom again", settings=settings, session=db_session)
    db_session.refresh(run)
    assert run.status == "error" and "gave up after 2 attempts" in run.error


def test_a_verify_run_gives_way_its_cases_deleted_or_is_cancelled(db_session, api_settings) -> None:  # noqa: ANN001
    run = _commit_run(db_session, api_settings, "a", [])
    claimed = _claimed(db_session, run)
    claimed.start_cases(1)
    claimed.store_batch([(0, _result("c0", ["1", "2", "3"]))], cases_done=1)
    assert run_store.give_way(run.id, worker="other", note="n", settings=api_settings, session=db_session) == "lost"
    assert run_store.give_way(run.id, worker="w", note="yielded to 1 commit run", settings=api_settings,
                              session=db_session) == "yielded"
    db_session.refresh(run)
    assert (run.status, run.attempt, run.error, _rows(db_session, run.id)) == ("queued", 0,
                                                                               "yielded to 1 commit run", 0)
    assert run.dispatched_at is not None  # sent again at once

    _claimed(db_session, run)
    db_session.execute(Run.__table__.update().where(Run.id == run.id).values(cancel_requested=True))
    db_session.commit()  # (a savepoint of the test's transaction: the store's rollback keeps it)
    assert run_store.give_way(run.id, worker="w", note="n", settings=api_settings, session=db_session) == "cancelled"


def _judged_pair(session, settings) -> tuple[Run, Run]:  # noqa: ANN001
    """A baseline run and its child whose case c1 changed (c0 did not), both done and judged."""
    baseline = _commit_run(session, settings, "a", [])
    child = _commit_run(session, settings, "b", ["a"])
    for run, c1_digests in ((baseline, ["1", "2", "3"]), (child, ["1", "2", "9"])):
        claimed = _claimed(session, run)
        claimed.start_cases(2)
        claimed.store_batch([(0, _result("c0", ["1", "2", "3"])), (1, _result("c1", c1_digests))], cases_done=2)
        claimed.record(battery_hash="h")
        claimed.finish({})
        run_store.judge(run.id, worker="w", settings=settings, session=session)
    return baseline, child


def test_the_corun_reads_its_inputs_and_adds_diffs_and_attribution_beside_the_verdict(db_session,  # noqa: ANN001
                                                                                       api_settings) -> None:
    baseline, child = _judged_pair(db_session, api_settings)
    assert run_store.corun_environment(baseline.id, session=db_session) is None  # no baseline of its own
    assert run_store.corun_environment(child.id, session=db_session) == "cpu"
    inputs = run_store.corun_inputs(child.id, session=db_session)
    assert inputs.changed_ids == {"c1"} and inputs.baseline.id == baseline.id and inputs.project.name == "p"
    assert [c.case.case_id for c in inputs.commit_result.cases] == ["c0", "c1"]
    assert inputs.commit_result.cases[1].trajectory.digests == ["1", "2", "9"]

    comparison = compare_runs(inputs.commit_result, inputs.baseline_result, {"c1": [0.0, 0.0, 0.5]})
    assert run_store.store_corun_diffs(child.id, comparison=comparison, corun_record=CorunRecord(corun_seconds=1.5),
                                       session=db_session)
    verdict = db_session.scalar(select(Verdict).where(Verdict.run_id == child.id))
    assert verdict.detail["corun_seconds"] == 1.5
    changed = next(c for c in verdict.detail["cases"] if c["case_id"] == "c1")
    assert changed["max_abs_diff_per_step"] == [0.0, 0.0, 0.5]
    # The diffs are there now: nothing left to co-run.
    assert run_store.corun_inputs(child.id, session=db_session) is None

    run_store.add_attribution(child.id, {"c1": {"kind": "rounding"}}, session=db_session)
    db_session.refresh(verdict)
    assert verdict.detail["attribution"] == {"c1": {"kind": "rounding"}} and verdict.detail["corun_seconds"] == 1.5

    # A comparison whose outcome differs from the stored one is refused, and nothing changes.
    unchanged = compare_runs(inputs.baseline_result, inputs.baseline_result)
    assert unchanged.verdict != verdict.outcome
    assert not run_store.store_corun_diffs(child.id, comparison=unchanged, corun_record=CorunRecord(corun_seconds=9.0),
                                           session=db_session)
    db_session.refresh(verdict)
    assert verdict.detail["corun_seconds"] == 1.5


def test_timings_are_stored_whole_or_not_at_all_and_noted_on_the_run(db_session, api_settings) -> None:  # noqa: ANN001
    run = _commit_run(db_session, api_settings, "a", [])
    timing = {"kernel": "adam_step", "optimizer": "adam", "family": "32bit", "param_dtype": "float32",
              "size": 1024, "samples_s": [1e-5, 1.1e-5, 1.2e-5], "copy_samples_s": [1e-6, 1e-6, 1e-6],
              "bytes_moved": 4096}
    assert run_store.store_timings(run.id, {"device": "cpu", "timings": [timing]}, session=db_session) == 1
    broken = {k: v for k, v in timing.items() if k != "kernel"}
    with pytest.raises(KeyError):
        run_store.store_timings(run.id, {"device": "gpu", "timings": [timing, broken]}, session=db_session)
    stored = kernel_speed.rows(session=db_session, run_id=run.id)
    assert [(row.kernel, row.device) for row in stored] == [("adam_step", "cpu")]

    db_session.execute(Run.__table__.update().where(Run.id == run.id).values(environment_detail={"build_ok": True}))
    db_session.flush()
    run_store.note_on_run(run.id, "kernel_speed", "1 kernel timing", session=db_session)
    db_session.refresh(run)
    assert run.environment_detail == {"build_ok": True, "kernel_speed": "1 kernel timing"}


def test_presence_and_the_count_of_waiting_runs(db_session, api_settings) -> None:  # noqa: ANN001
    run_store.presence_beat(name="node:1", environment="cpu", detail={"pid": 1}, session=db_session)
    assert [w.name for w in workers.live_workers(session=db_session, environment="cpu")] == ["node:1"]
    run_store.presence_leave(name="node:1", session=db_session)
    assert workers.live_workers(session=db_session, environment="cpu") == []

    run = _commit_run(db_session, api_settings, "a", [])
    assert run_store.queued_count(environment="cpu", session=db_session) == 1
    assert run_store.queued_count(environment="cpu", kind="verify", session=db_session) == 0
    _claimed(db_session, run)
    assert run_store.queued_count(environment="cpu", session=db_session) == 0


def test_retry_database_waits_out_an_outage_and_gives_up_after_its_deadline(monkeypatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(run_store.time, "sleep", slept.append)
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise OperationalError("SELECT 1", {}, Exception("server closed the connection"))
        return "claimed"

    assert run_store.retry_database(flaky, what="claiming") == "claimed"
    assert slept == [0.5, 1.0]  # backoff doubling

    def down() -> None:
        raise OperationalError("SELECT 1", {}, Exception("down"))

    with pytest.raises(OperationalError):
        run_store.retry_database(down, what="claiming", give_up_after_s=0.0)
    assert slept == [0.5, 1.0]  # past its deadline it raises without waiting again
