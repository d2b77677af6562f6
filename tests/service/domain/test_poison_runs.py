"""The poison-pill rule (service/domain/runs.py reap_stale, docs/security/SANDBOX.md "No run can wedge a worker"): a run whose worker
was lost mid-run is queued again once; the second lost worker makes it `error`, never handed to
another worker, its page and API saying why and how many attempts it took. Real PostgreSQL."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from service.api.presenters import run_public
from service.domain import projects, runs, submissions
from tests.service_fixtures import make_archive

LATER = timedelta(seconds=1000)  # every heartbeat is stale by then (stale_after_s=60)


def _run(session, settings, sha: str):  # noqa: ANN001, ANN202
    project = projects.ensure(session=session, name="poison")
    return submissions.submit_commit(session=session, settings=settings, project=project, sha=sha, parents=[],
                                     archive=make_archive({"a.cpp": sha})).runs[0]


def _lose_worker(session, run, worker: str):  # noqa: ANN001, ANN202
    """`worker` claims the run and dies: the reaper runs after its heartbeat went stale."""
    assert runs.claim(session=session, run_id=run.id, worker=worker)
    session.expire_all()  # the test's session keeps rows across commits; the reaper's never does
    answer = runs.reap_stale(session=session, stale_after_s=60, max_attempts=5,
                             now=datetime.now(timezone.utc) + LATER)
    session.refresh(run)
    return answer


def test_a_run_that_takes_down_two_workers_is_poison(db_session, api_settings) -> None:  # noqa: ANN001
    run = _run(db_session, api_settings, "a")
    assert _lose_worker(db_session, run, "w1") == ([run.id], [])
    assert (run.status, run.attempt, run.workers_lost) == ("queued", 1, 1)
    assert "queued again" in run.error
    assert _lose_worker(db_session, run, "w2") == ([], [run.id])
    assert (run.status, run.attempt, run.workers_lost) == ("error", 2, 2)
    assert "worker w2 stopped reporting" in run.error and "not handed to another worker" in run.error
    assert not runs.claim(session=db_session, run_id=run.id, worker="w3")  # a re-delivered task skips it
    shown = run_public(run)  # the API's answer (the run page shows the same row)
    assert shown.attempt == 2 and shown.workers_lost == 2 and "not handed to another worker" in shown.error
    # The operator may run it again on purpose: a fresh count of both.
    runs.retry(session=db_session, run_id=run.id)
    db_session.refresh(run)
    assert (run.status, run.attempt, run.workers_lost) == ("queued", 0, 0)


def test_one_lost_worker_after_spent_attempts_still_gives_up_at_max_attempts(db_session, api_settings) -> None:  # noqa: ANN001
    run = _run(db_session, api_settings, "b")
    for attempt in range(1, 5):  # four optdrift failures, retried (service.domain.runs.retry_later)
        assert runs.claim(session=db_session, run_id=run.id, worker=f"w{attempt}")
        db_session.expire_all()
        assert runs.retry_later(session=db_session, run_id=run.id, worker=f"w{attempt}", error="boom",
                                max_attempts=5, backoff_s=0) is not None
    assert _lose_worker(db_session, run, "w5") == ([], [run.id])
    assert (run.status, run.attempt, run.workers_lost) == ("error", 5, 1)
    assert "gave up after 5 attempts" in run.error
