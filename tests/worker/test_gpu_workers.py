"""GPU worker planning, the presence beat of real Celery worker processes on PostgreSQL + Redis,
and the API's `waiting_for` on a queued run whose environment class has no live worker.

No GPU is needed: the supervisor takes nvidia-smi's listing as input, and a worker touches CUDA
only inside a kernel host when a run arrives (none does here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from service.db.worker_presence import WorkerPresence
from service.domain import workers
from tests.service_fixtures import API_TEST_REDIS, flush_redis, make_archive
from worker.gpu_workers import environment_class, plan_workers

REPO_ROOT = Path(__file__).resolve().parents[2]
TWO_H200 = "0, 9.0, NVIDIA H200\n1, 9.0, NVIDIA H200\n"


# ----------------------------------------------------------------------------- planning
def test_environment_class_names_the_compute_capability():
    assert environment_class("9.0") == "gpu.sm90"
    assert environment_class("8.6") == "gpu.sm86"
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        environment_class("hopper")


def test_plan_one_worker_per_selected_gpu():
    plans = plan_workers(TWO_H200, "all")
    assert [(p.index, p.environment, p.name) for p in plans] == [
        ("0", "gpu.sm90", "NVIDIA H200"), ("1", "gpu.sm90", "NVIDIA H200")]
    assert [p.index for p in plan_workers(TWO_H200, "1")] == ["1"]
    assert [p.index for p in plan_workers(TWO_H200, "1,0,1")] == ["1", "0"]
    with pytest.raises(ValueError, match="this host has 0, 1"):
        plan_workers(TWO_H200, "0,3")
    with pytest.raises(RuntimeError, match="no GPU"):
        plan_workers("", "all")


# ----------------------------------------------------------------------------- presence (domain)
def test_presence_beat_liveness_and_waiting_for(db_session):
    workers.beat(session=db_session, name="w1:1", environment="gpu.sm90", detail={"pid": 1})
    workers.beat(session=db_session, name="w2:2", environment="cpu")
    assert [w.name for w in workers.live_workers(session=db_session, environment="gpu.sm90")] == ["w1:1"]
    # A worker that stopped beating ages out.
    row = db_session.get(WorkerPresence, "w1:1")
    row.seen_at = datetime.now(timezone.utc) - timedelta(seconds=workers.PRESENCE_STALE_S + 1)
    db_session.commit()
    assert workers.live_workers(session=db_session, environment="gpu.sm90") == []
    workers.beat(session=db_session, name="w1:1", environment="gpu.sm90")
    assert len(workers.live_workers(session=db_session, environment="gpu.sm90")) == 1
    workers.leave(session=db_session, name="w1:1")
    assert workers.live_workers(session=db_session, environment="gpu.sm90") == []


def test_api_says_a_queued_run_waits_for_a_live_worker(api, db_session):  # noqa: ANN001
    created = api.post("/api/v1/projects", json={"name": "gpuproj", "environments": ["gpu.sm90"]})
    assert created.status_code == 201, created.text
    answer = api.post("/api/v1/projects/gpuproj/commits", data={"sha": "c1"},
                      files={"archive": ("s.tar.gz", make_archive({"ops.cpp": "//\n"}), "application/gzip")})
    assert answer.status_code == 201, answer.text
    run = answer.json()["runs"][0]
    assert run["environment"] == "gpu.sm90" and run["status"] == "queued"
    assert run["waiting_for"].startswith("no live worker serves environment gpu.sm90; start a worker with "
                                         "OPTDRIFT_WORKER_ENVIRONMENT=gpu.sm90")
    # A live worker of another class changes nothing; one of this class clears it.
    workers.beat(session=db_session, name="cpu-worker:1", environment="cpu")
    assert api.get(f"/api/v1/runs/{run['id']}").json()["waiting_for"] is not None
    workers.beat(session=db_session, name="gpu-worker:1", environment="gpu.sm90")
    assert api.get(f"/api/v1/runs/{run['id']}").json()["waiting_for"] is None


# ----------------------------------------------------------------------------- real processes
def _presence_rows(url: str, environment: str) -> list[WorkerPresence]:
    engine = create_engine(url)
    try:
        with Session(engine) as session:
            return list(session.scalars(select(WorkerPresence).where(WorkerPresence.environment == environment)))
    finally:
        engine.dispose()


def _wait_rows(url: str, environment: str, count: int, timeout_s: float = 90.0) -> list[WorkerPresence]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = _presence_rows(url, environment)
        if len(rows) == count:
            return rows
        time.sleep(0.5)
    raise AssertionError(f"expected {count} presence rows for {environment}, have {len(_presence_rows(url, environment))}")


def test_supervisor_starts_one_celery_worker_per_gpu_with_its_device_and_queue(pg_url, tmp_path):
    flush_redis(API_TEST_REDIS)
    environment = "gpu.sm90"
    for row in _presence_rows(pg_url, environment):  # leftovers of an earlier failed run
        pytest.fail(f"stale presence row {row.name}")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OPTDRIFT_DATABASE_URL": pg_url,
           "OPTDRIFT_BROKER_URL": API_TEST_REDIS, "OPTDRIFT_HOME": str(tmp_path / "home")}
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO); "
            "from worker.gpu_workers import run_gpu_workers; "
            f"sys.exit(run_gpu_workers('all', worker_args=['--pool', 'solo', '--loglevel', 'INFO'], listing={TWO_H200!r}))")
    log = open(tmp_path / "supervisor.log", "wb")  # noqa: SIM115
    supervisor = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rows = _wait_rows(pg_url, environment, 2)
        assert sorted(r.detail["cuda_visible_devices"] for r in rows) == ["0", "1"]
        assert {r.detail["device"] for r in rows} == {"cuda"}
        assert all("-gpu" in r.name for r in rows)  # distinct Celery node names per GPU
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=90) == 0
        # Clean shutdown removes the rows at once (no waiting for them to age out).
        assert _presence_rows(pg_url, environment) == []
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
            supervisor.wait()
        log.close()
        print((tmp_path / "supervisor.log").read_text()[-3000:])


def test_a_run_waiting_for_the_worker_serve_started_says_it_is_starting(api, db_session):  # noqa: ANN001
    """`optdrift serve` starts its own worker (issue 34: the demo said "no live worker ... start one"
    while that worker was still importing torch). Until the worker beats, the run waits for it; past
    the grace period without a beat, the message says that worker has not reported in."""
    created = api.post("/api/v1/projects", json={"name": "embedded", "environments": ["cpu"]})
    assert created.status_code == 201, created.text
    answer = api.post("/api/v1/projects/embedded/commits", data={"sha": "c1"},
                      files={"archive": ("s.tar.gz", make_archive({"ops.cpp": "//\n"}), "application/gzip")})
    assert answer.status_code == 201, answer.text
    run_id = answer.json()["runs"][0]["id"]
    try:
        workers.embedded_worker_started(environment="cpu")
        waiting = api.get(f"/api/v1/runs/{run_id}").json()["waiting_for"]
        assert waiting.startswith("the worker `optdrift serve` started for queue cpu is starting"), waiting
        assert "start one" not in waiting
        workers.embedded_worker_started(environment="cpu",
                                        started_at=time.monotonic() - workers.EMBEDDED_WORKER_GRACE_S - 1)
        waiting = api.get(f"/api/v1/runs/{run_id}").json()["waiting_for"]
        assert waiting.startswith("no live worker for queue cpu: the worker `optdrift serve` started has not "
                                  "reported in"), waiting
        # its beat clears it, as any worker's does
        workers.beat(session=db_session, name="embedded:1", environment="cpu")
        assert api.get(f"/api/v1/runs/{run_id}").json()["waiting_for"] is None
    finally:
        workers.embedded_worker_stopped()
