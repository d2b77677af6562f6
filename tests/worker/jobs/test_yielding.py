"""A job beside the runs that yields to waiting runs is queued again, written once
(worker/jobs/yielding.py queued_again) for the three jobs that yield: the baseline co-run, a build
variant's environment attribution and the training impact. Each task body runs as a worker runs it
(a fresh process, real PostgreSQL in a database of its own, real Redis); its job stops as it does
when `yield_to_runs` finds a run waiting (the job's own work, builds and kernels, replaced by that
stop). The job's row, if it has one, is `queued` again, not the worker's, and its task waits on its
environment's co-run queue to start after corun_retry_s."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest
import redis
from sqlalchemy.orm import Session

from service.broker.queueing import CORUN_TASK_NAME, ENVIRONMENT_ATTRIBUTION_TASK_NAME, TRAINING_TASK_NAME
from service.db.environment_models import EnvironmentAttribution
from service.db.session import make_engine
from service.db.training_models import TrainingImpactJob
from service.domain import runs
from service.settings import Settings
from tests.service.test_run_store import _commit_run
from tests.service_fixtures import REPO_ROOT, flush_redis, migrated_database

BROKER = "redis://127.0.0.1:6379/2"  # its own db: the other tests with one use 7-11
RETRY_S = 45.0

# The three task bodies, each job's work replaced by the stop yield_to_runs raises.
WORKER = """
import json, sys
from service.settings import get_settings
from worker.jobs import corun, environment_attribution, training
from worker.jobs.yielding import CorunYielded

def runs_wait(**_):
    raise CorunYielded("1 run(s) waiting for cpu")

corun.record_baseline_diffs = environment_attribution.attribute_environments = runs_wait
training.measure_training_impact = runs_wait
run_id, attribution_id, job_id = map(int, sys.argv[1:])
settings = get_settings()
print(json.dumps([corun.record_and_tell(run_id, settings),
                  environment_attribution.attribute_and_store(attribution_id, settings),
                  training.train_and_store(job_id, settings)]))
"""


def _waiting_tasks(broker: redis.Redis, queue: str) -> list[tuple[str, list, datetime]]:
    """(task name, arguments, when it may start) of each message on `queue`, first sent first."""
    found = []
    for raw in broker.lrange(queue, 0, -1):  # newest first
        message = json.loads(raw)
        args = json.loads(base64.b64decode(message["body"]))[0]
        found.append((message["headers"]["task"], args, datetime.fromisoformat(message["headers"]["eta"])))
    return found[::-1]


@pytest.fixture
def database_of_its_own() -> Iterator[str]:
    """A database the worker process commits to (the tests' shared one is rolled back per test)."""
    with migrated_database(f"optdrift_yielding_{os.getpid()}") as url:
        yield url


def _jobs_beside_a_run(url: str, settings: Settings) -> tuple[int, int, int]:
    """A done run against its done baseline, with an environment attribution and a training impact
    of the pair queued: (run id, attribution id, training job id)."""
    engine = make_engine(url)
    with Session(engine) as session:
        baseline, run = _commit_run(session, settings, "a", []), _commit_run(session, settings, "b", ["a"])
        for finished in (baseline, run):
            assert runs.claim(session=session, run_id=finished.id, worker="w")
            runs.set_status(session=session, run_id=finished.id, worker="w", status="done", battery_hash="h")
        attribution = EnvironmentAttribution(project_id=run.project_id, run_a_id=baseline.id, run_b_id=run.id,
                                             environment_a="cpu", environment_b="cpu+fma")
        job = TrainingImpactJob(project_id=run.project_id, run_id=run.id, baseline_run_id=baseline.id,
                                model_set="quick", environment="cpu")
        session.add_all([attribution, job])
        session.commit()
        ids = (run.id, attribution.id, job.id)
    engine.dispose()
    return ids


def test_each_job_that_yields_is_queued_again_on_its_co_run_queue(database_of_its_own, tmp_path) -> None:  # noqa: ANN001
    url = database_of_its_own
    flush_redis(BROKER)
    ids = _jobs_beside_a_run(url, Settings(home=tmp_path, database_url=url, broker_url=BROKER))
    env = {"OPTDRIFT_HOME": str(tmp_path), "OPTDRIFT_DATABASE_URL": url, "OPTDRIFT_BROKER_URL": BROKER,
           "OPTDRIFT_WORKER_ENVIRONMENT": "cpu", "OPTDRIFT_CORUN_RETRY_S": str(RETRY_S)}
    sent = datetime.now(timezone.utc)
    done = subprocess.run([sys.executable, "-c", WORKER, *map(str, ids)], cwd=REPO_ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["yielded", "yielded", "yielded"]

    # The rows the jobs claimed are queued again, nobody's.
    engine = make_engine(url)
    with Session(engine) as session:
        for row in (session.get(EnvironmentAttribution, ids[1]), session.get(TrainingImpactJob, ids[2])):
            assert (row.status, row.worker, row.started_at) == ("queued", None, None)
    engine.dispose()

    # Each task on its environment's co-run queue (the attribution on its variant's), after the retry delay.
    broker = redis.Redis.from_url(BROKER)
    queued = {queue: _waiting_tasks(broker, queue) for queue in ("cpu.corun", "cpu--fma.corun")}
    assert {queue: [(task, args) for task, args, _ in tasks] for queue, tasks in queued.items()} == {
        "cpu.corun": [(CORUN_TASK_NAME, [ids[0]]), (TRAINING_TASK_NAME, [ids[2]])],
        "cpu--fma.corun": [(ENVIRONMENT_ATTRIBUTION_TASK_NAME, [ids[1]])]}
    for tasks in queued.values():
        for _, _, eta in tasks:
            assert sent + timedelta(seconds=RETRY_S) <= eta <= datetime.now(timezone.utc) + timedelta(seconds=RETRY_S)
