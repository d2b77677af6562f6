"""Work after a verdict never holds a run back (issues 14 and 18): the kernel timing task, like the
baseline co-run, finds runs waiting for its environment and puts itself back on the co-run queue
instead of taking the worker. Real PostgreSQL (a database of its own), real Redis, the task body
in a fresh process as a worker runs it."""

from __future__ import annotations

import os
import subprocess
import sys

import redis

from service.db.migrate import upgrade_to_head
from service.db.session import make_engine
from service.domain import projects, runs, submissions
from service.settings import Settings
from tests.service_fixtures import REPO_ROOT, create_database, drop_database, flush_redis, make_archive

BROKER = "redis://127.0.0.1:6379/9"


def _task_in_a_worker_process(run_id: int, env: dict[str, str]) -> str:
    code = f"from worker.tasks import time_kernels_task; print(time_kernels_task.run({run_id}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_kernel_timing_yields_to_waiting_runs_and_is_queued_again(tmp_path) -> None:
    name = f"optdrift_yield_{os.getpid()}"
    url = create_database(name)
    flush_redis(BROKER)
    try:
        upgrade_to_head(url)
        settings = Settings(home=tmp_path, database_url=url, broker_url=BROKER)
        engine = make_engine(url)
        from sqlalchemy.orm import Session

        with Session(engine) as session:
            project = projects.ensure(session=session, name="p")
            finished, waiting = (submissions.submit_commit(
                session=session, settings=settings, project=project, sha=sha, parents=parents,
                archive=make_archive({"a.cpp": sha})).runs[0] for sha, parents in (("a", []), ("b", ["a"])))
            assert runs.claim(session=session, run_id=finished.id, worker="w")
            runs.set_status(session=session, run_id=finished.id, worker="w", status="done", battery_hash="h")
            session.commit()
            finished_id, waiting_id = finished.id, waiting.id
        env = {"OPTDRIFT_HOME": str(tmp_path), "OPTDRIFT_DATABASE_URL": url, "OPTDRIFT_BROKER_URL": BROKER,
               "OPTDRIFT_WORKER_ENVIRONMENT": "cpu", "OPTDRIFT_SPEED_BUDGET_S": "60",
               "OPTDRIFT_CORUN_RETRY_S": "30"}
        broker = redis.Redis.from_url(BROKER)
        before = broker.llen("cpu.corun")

        # Run b is queued for `cpu`: the timing of run a steps aside and is on cpu.corun again.
        assert _task_in_a_worker_process(finished_id, env) == "yielded"
        assert broker.llen("cpu.corun") == before + 1

        # Once nothing waits, the task does its work (here: nothing to time on a fake source).
        with Session(engine) as session:
            assert runs.claim(session=session, run_id=waiting_id, worker="w")
            session.commit()
        assert _task_in_a_worker_process(finished_id, env) != "yielded"
        engine.dispose()
    finally:
        drop_database(name)
