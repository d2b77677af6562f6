"""Run lifecycle, trajectory storage and verdicts on the real PostgreSQL (rolled back per test)."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone

from sqlalchemy import func, select

from service.db.models import Trajectory
from service.domain import projects, runs, submissions, trajectories, verdict_store
from service.core.results import CaseResult, CaseSpec, Trajectory as TrajectoryModel
from tests.service_fixtures import make_archive

# Values a rounding store would damage: 0.1+0.2 (not 0.3), a subnormal, -0.0, inf, nan.
AWKWARD = [0.1 + 0.2, 5e-324, -0.0, math.inf, math.nan, 1.0000000000000002]


def _case(case_id: str = "adam-1") -> CaseSpec:
    return CaseSpec(case_id=case_id, optimizer="adam", hyper={"lr": 0.1, "weight_decay": 0.1},
                    seed=0, size=8, steps=len(AWKWARD))


def _result(digests: list[str], case_id: str = "adam-1", status: str = "ok",
            last_nonfinite: int = 2**40) -> CaseResult:
    n = len(digests)
    return CaseResult(case=_case(case_id), status=status, trajectory=TrajectoryModel(
        ref64_max_abs=AWKWARD[:n], ref64_max_rel=[float(i) for i in range(n)],
        nonfinite_count=[0] * (n - 1) + [last_nonfinite], digests=digests))


def _commit_run(session, settings, sha, parents):  # noqa: ANN001, ANN202
    project = projects.ensure(session=session, name="p")
    return submissions.submit_commit(session=session, settings=settings, project=project, sha=sha,
                                     parents=parents, archive=make_archive({"a.cpp": sha})).runs[0]


def _finish(session, run, digests):  # noqa: ANN001, ANN202
    assert runs.claim(session=session, run_id=run.id, worker="w")
    trajectories.store_case_result(session=session, run_id=run.id, case_index=0,
                                   result=_result(digests, last_nonfinite=0))
    runs.set_status(session=session, run_id=run.id, worker="w", status="done", battery_hash="h")
    session.refresh(run)


def test_claim_is_exclusive_and_reclaim_is_refused(db_session, api_settings):  # noqa: ANN001
    run = _commit_run(db_session, api_settings, "a", [])
    assert runs.claim(session=db_session, run_id=run.id, worker="w1") is True
    assert runs.claim(session=db_session, run_id=run.id, worker="w2") is False
    assert runs.set_status(session=db_session, run_id=run.id, worker="w2", status="done") is False
    db_session.refresh(run)
    assert (run.status, run.worker, run.attempt) == ("building", "w1", 1)


def test_trajectory_round_trip_is_bit_exact_and_idempotent(db_session, api_settings):  # noqa: ANN001
    run = _commit_run(db_session, api_settings, "a", [])
    digests = [f"{i:032x}" for i in range(len(AWKWARD))]
    for _ in range(2):  # a re-run of the case replaces, never duplicates
        trajectories.store_case_result(session=db_session, run_id=run.id, case_index=0,
                                       result=_result(digests))
    assert db_session.scalar(select(func.count()).select_from(Trajectory)
                             .where(Trajectory.run_id == run.id)) == 1
    row = trajectories.list_rows(session=db_session, run_id=run.id)[0]
    assert len(row.series_data) == 8 * len(AWKWARD) * 3  # float64, float64, int64 per step
    back = trajectories.row_to_case_result(row).trajectory
    for stored, original in zip(back.ref64_max_abs, AWKWARD):
        assert (math.isnan(stored) and math.isnan(original)) or \
            (stored == original and math.copysign(1, stored) == math.copysign(1, original))
    assert back.nonfinite_count[-1] == 2**40 and back.digests == digests


def test_reaper_requeues_then_gives_up_as_an_optdrift_error(db_session, api_settings):  # noqa: ANN001
    run = _commit_run(db_session, api_settings, "a", [])
    later = datetime.now(timezone.utc) + timedelta(seconds=1000)
    for attempt in (1, 2):
        assert runs.claim(session=db_session, run_id=run.id, worker=f"w{attempt}")
        requeued, failed = runs.reap_stale(session=db_session, stale_after_s=60, max_attempts=2,
                                           now=later)
        db_session.refresh(run)
        if attempt == 1:
            assert (requeued, failed, run.status, run.dispatched_at) == ([run.id], [], "queued", None)
        else:
            # A lost worker is optdrift's failure, never the commit's: `error`, not `failed`; the
            # second lost worker also makes it poison (tests/service/domain/test_poison_runs.py).
            assert (requeued, failed, run.status) == ([], [run.id], "error")
            assert "not handed to another worker" in run.error
    # A fresh heartbeat is never reaped.
    other = _commit_run(db_session, api_settings, "b", [])
    runs.claim(session=db_session, run_id=other.id, worker="w")
    assert runs.reap_stale(session=db_session, stale_after_s=60, max_attempts=2) == ([], [])


def test_verdict_waits_for_parent_then_flags_and_acknowledge_clears(db_session, api_settings):  # noqa: ANN001
    parent = _commit_run(db_session, api_settings, "a", [])
    child = _commit_run(db_session, api_settings, "b", ["a"])
    _finish(db_session, child, ["x1", "x2", "x3"])
    assert verdict_store.evaluate_with_dependants(session=db_session, run=child) is None  # parent pending
    _finish(db_session, parent, ["x1", "y2", "y3"])
    parent_verdict = verdict_store.evaluate_with_dependants(session=db_session, run=parent)
    assert parent_verdict.outcome == "no-baseline" and parent_verdict.flagged is False
    db_session.refresh(child)
    assert child.verdict is not None, "finishing the parent must compute the waiting child's verdict"
    assert (child.verdict.outcome, child.verdict.flagged, child.verdict.first_divergent_step,
            child.verdict.baseline_run_id) == ("changed", True, 2, parent.id)
    acknowledged = verdict_store.acknowledge(session=db_session, run=child, note="intended", by="me")
    assert acknowledged.flagged is False and acknowledged.acknowledged is True


def test_run_api_serves_trajectories_csv_and_cancel(api, db_session, api_settings):  # noqa: ANN001
    run = _commit_run(db_session, api_settings, "a", [])
    db_session.commit()
    trajectories.store_case_result(session=db_session, run_id=run.id, case_index=0,
                                   result=_result(["d1", "d2"]))
    db_session.commit()
    body = api.get(f"/api/v1/runs/{run.id}/trajectories/adam-1").json()
    assert body["series"]["ref64_max_abs"] == [0.30000000000000004, 5e-324]
    csv_lines = api.get(f"/api/v1/runs/{run.id}/trajectories.csv").text.splitlines()
    # Columns after the nonfinite count: the quantized families' step figures (empty for a 32-bit case).
    assert csv_lines[0].split(",")[-3:] == ["quant_ref_steps", "quant_ref_max_abs", "digest"], csv_lines[0]
    assert csv_lines[1] == "adam-1,ok,1,0.30000000000000004,0.0,,0,,,d1"
    cancelled = api.post(f"/api/v1/runs/{run.id}/cancel").json()
    assert cancelled["status"] == "cancelled"
    assert api.post(f"/api/v1/runs/{run.id}/cancel").status_code == 409
    assert api.get(f"/api/v1/runs/{run.id}/trajectories/nope").status_code == 404


def test_an_optdrift_failure_is_retried_with_backoff_then_error_and_retry_requeues(db_session, api_settings):  # noqa: ANN001
    import pytest

    from service.domain.errors import ConflictError

    run = _commit_run(db_session, api_settings, "flaky", [])
    delays = []
    for attempt in (1, 2, 3):
        assert runs.claim(session=db_session, run_id=run.id, worker="w")
        delays.append(runs.retry_later(session=db_session, run_id=run.id, worker="w",
                                       error="fetching the source failed: 401", max_attempts=3, backoff_s=10))
        db_session.refresh(run)
    assert delays == [10, 20, None]  # doubling backoff, then given up
    assert run.status == "error" and run.attempt == 3
    assert "not the commit's" in run.error and "gave up after 3 attempts" in run.error
    retried = runs.retry(session=db_session, run_id=run.id)
    assert (retried.status, retried.attempt, retried.dispatched_at) == ("queued", 0, None)
    assert runs.claim(session=db_session, run_id=run.id, worker="w")  # claimable again
    with pytest.raises(ConflictError, match="only a run that ended in `error`"):
        runs.retry(session=db_session, run_id=run.id)


def test_a_baseline_corun_yields_to_queued_runs_of_its_environment(db_session, api_settings):  # noqa: ANN001
    """issue 14: the co-run (per-step |commit - baseline|) is off the critical path: between cases
    it asks whether runs wait for its environment (worker/jobs/corun.py), and stops if so."""
    import pytest

    from worker.jobs.yielding import CorunYielded
    from worker.battery import load_battery
    from worker.engine.corun import corun_battery

    waiting = _commit_run(db_session, api_settings, "waiting", [])
    assert runs.queued_count(session=db_session, environment="cpu") == 1
    assert runs.queued_count(session=db_session, environment="gpu.sm90") == 0
    assert runs.claim(session=db_session, run_id=waiting.id, worker="w")
    assert runs.queued_count(session=db_session, environment="cpu") == 0

    asked = []

    def yield_now() -> None:
        asked.append(True)
        raise CorunYielded("1 run waiting")

    with pytest.raises(CorunYielded):
        corun_battery(load_battery("quick"), "/nonexistent/commit.so", "/nonexistent/baseline.so",
                      device="cpu", between_cases=yield_now)
    assert asked == [True]  # asked before the first case, so no kernel host was started


def test_results_are_stored_in_batches_with_their_progress_and_a_lost_run_stops(db_session, api_settings,  # noqa: ANN001
                                                                                 monkeypatch):
    import threading
    from types import SimpleNamespace

    import pytest

    from service.db.models import Run
    from service.run_store import ClaimedRun, RunLost
    from worker.jobs.run import StoredResults
    from worker.jobs.watchdog import Watchdog

    run = _commit_run(db_session, api_settings, "a", [])
    assert runs.claim(session=db_session, run_id=run.id, worker="w")
    monkeypatch.setattr(StoredResults, "BATCH", 3)
    monkeypatch.setattr(StoredResults, "FLUSH_AFTER_S", 3600.0)  # only a full batch (or flush()) writes
    stored = StoredResults(ClaimedRun(db_session, run_id=run.id, worker="w"),
                           beat=SimpleNamespace(lost=threading.Event()),
                           guard=Watchdog(label="run under test", grace_s=1.0))  # never started: never stops
    digests = [f"{i:032x}" for i in range(len(AWKWARD))]

    def rows() -> int:
        return db_session.scalar(select(func.count()).select_from(Trajectory).where(Trajectory.run_id == run.id))

    def progress() -> int:
        return db_session.scalar(select(Run.cases_done).where(Run.id == run.id)) or 0

    seen = []
    # Case 0 answered twice (a re-run, as the repeat check makes): its last result stays.
    for position, index in enumerate([0, 1, 0, 2, 3, 4, 5]):
        stored.add(index, _result(digests, case_id=f"c{index}", status="broken" if position == 2 else "ok"))
        seen.append((rows(), progress()))
    # Written when a batch of 3 fills (results 3 and 6), progress equal to the rows each time.
    assert seen == [(0, 0), (0, 0), (2, 2), (2, 2), (2, 2), (5, 5), (5, 5)]
    stored.flush()
    assert (rows(), progress(), len(stored)) == (6, 6, 6)
    by_case = {row.case_id: row for row in trajectories.list_rows(session=db_session, run_id=run.id)}
    assert by_case["c0"].status == "broken"

    # Taken away (the reaper gave the run to another worker): the next batch is not written.
    db_session.execute(Run.__table__.update().where(Run.id == run.id).values(worker="other"))
    db_session.commit()
    stored.add(7, _result(digests, case_id="c6"))
    with pytest.raises(RunLost):
        stored.flush()
    assert rows() == 6, sorted(r.case_id for r in trajectories.list_rows(session=db_session, run_id=run.id))
