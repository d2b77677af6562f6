"""Issue 33, item 8: verify runs yield to commit runs, and one verify token cannot line up runs.

* Order (real processes: `optdrift serve --no-worker` and one `optdrift worker`, on PostgreSQL +
  Redis and on the embedded default's SQLite + filesystem broker): with no worker running, a base
  commit, two verify runs and then a commit run are submitted; a worker is started; the commit run
  submitted after the verify runs starts before both (its `started_at` is earlier).
* Cap (the API on PostgreSQL): a verify token with one run queued is refused a second with 429,
  Retry-After and a detail naming the run and what to do, spending no daily attempt; the run's end
  frees the token; another token is not held back. Ten concurrent requests of one token against a
  real server: one run.
* Re-queue (PostgreSQL, and Redis or the filesystem broker): a verify run whose worker died goes
  back on the verify queue (the reaper then the dispatcher, the maintenance loop's two steps), and so
  does a verify run a worker sends again after an optdrift failure.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import create_engine, func, select, text, update

from service.db.models import QUEUED, RUNNING, Run
from service.db.token_models import TokenRun
from service.domain import dispatch
from tests.service_fixtures import (
    API_TEST_REDIS, REPO_ROOT, create_database, drop_database, free_port, make_archive,
    start_process, stop_process, wait_http,
)

PROJECT = "fair"
# Its own Redis database: the shared ones are tests/service_fixtures.py's (3-6, 12-15), and
# test_bisect_service (7), test_external_project (8), test_background_yield (9),
# test_compose_processes (10) and test_hostile_corpus (11) run workers on theirs at the same time.
ORDER_REDIS = f"redis://127.0.0.1:6379/{os.environ.get('OPTDRIFT_TEST_FAIRNESS_REDIS_DB', '2')}"
FINAL = ("done", "failed", "cancelled", "error")


# ----------------------------------------------------------------------------- order, end to end
def _cli(env: dict[str, str], *args: str) -> str:
    answer = subprocess.run([sys.executable, "-m", "service.cli", *args], cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **env},
                            capture_output=True, text=True, timeout=120, check=True)
    return answer.stdout.strip().splitlines()[-1]


def _commit(http: httpx.Client, sha: str, parents: str | None = None) -> int:
    fields = {"sha": sha, **({"parents": parents} if parents else {})}
    answer = http.post(f"/api/v1/projects/{PROJECT}/commits", data=fields,
                       files={"archive": ("t.tar.gz", make_archive({"kernel.cpp": f"// {sha}\n"}))})
    assert answer.status_code == 201, answer.text
    return answer.json()["runs"][0]["id"]


def _verify(http: httpx.Client, token: str, serial: int) -> httpx.Response:
    return http.post(f"/api/v1/projects/{PROJECT}/verify", headers={"Authorization": f"Bearer {token}"},
                     data={"base": "base"},
                     files={"archive": ("t.tar.gz", make_archive({"kernel.cpp": f"// contributor {serial}\n"}))})


def _wait_final(http: httpx.Client, run_ids: list[int], timeout_s: float) -> dict[int, dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = {run_id: http.get(f"/api/v1/runs/{run_id}").json() for run_id in run_ids}
        if all(run["status"] in FINAL for run in runs.values()):
            return runs
        time.sleep(0.5)
    raise AssertionError(f"runs did not all end within {timeout_s} s: "
                         f"{ {run_id: run['status'] for run_id, run in runs.items()} }")


@pytest.fixture(params=["postgres-redis", "embedded-filesystem"])
def service(request, tmp_path: Path) -> Iterator[dict]:
    """`optdrift serve --no-worker` on the broker under test, a project whose builds fail at once
    (the test is about which run a worker takes, not what it does), and how to start a worker."""
    home = tmp_path / "home"
    env = {"OPTDRIFT_HOME": str(home), "OPTDRIFT_BUILD_CACHE_DIR": str(tmp_path / "build-cache"),
           "OPTDRIFT_MAINTENANCE_INTERVAL_S": "2", "OPTDRIFT_HEARTBEAT_INTERVAL_S": "2",
           # One attempt: a run's started_at is its first and only claim.
           "OPTDRIFT_MAX_ATTEMPTS": "1"}
    db_name = None
    if request.param == "postgres-redis":
        db_name = f"optdrift_fair_{os.getpid()}"
        env |= {"OPTDRIFT_DATABASE_URL": create_database(db_name), "OPTDRIFT_BROKER_URL": ORDER_REDIS}
        redis.Redis.from_url(ORDER_REDIS).flushdb()
    else:
        env |= {"OPTDRIFT_DATABASE_URL": "", "OPTDRIFT_BROKER_URL": ""}
    port = free_port()
    env["OPTDRIFT_PUBLIC_URL"] = f"http://127.0.0.1:{port}"
    processes = [start_process(["serve", "--port", str(port), "--no-worker"], env, tmp_path / "api.log")]
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=90)
        http.headers["Authorization"] = f"Bearer {(home / 'admin-token').read_text().strip()}"
        answer = http.post("/api/v1/projects", json={
            "name": PROJECT, "build_kind": "command", "build_command": "false", "adapter": "bundled",
            "default_battery": "quick", "environments": ["cpu"]})
        assert answer.status_code == 201, answer.text

        def start_worker() -> None:
            processes.append(start_process(["worker", "--loglevel", "INFO"], env, tmp_path / "worker.log"))

        yield {"http": http, "env": env, "start_worker": start_worker}
    finally:
        for process in reversed(processes):
            stop_process(process)
        http.close()
        for log in sorted(tmp_path.glob("*.log")):
            print(f"--- {log.name}\n{log.read_text()[-3000:]}")
        if db_name:
            drop_database(db_name)
            redis.Redis.from_url(ORDER_REDIS).flushdb()


@pytest.mark.slow
def test_a_commit_run_submitted_after_queued_verify_runs_starts_before_them(service) -> None:
    http = service["http"]
    base = _commit(http, "base")
    # Two contributors, one verify run each (a token may have one queued at a time).
    tokens = [_cli(service["env"], "token", "create", "--name", f"contributor-{i}", "--scope", "verify",
                   "--project", PROJECT) for i in range(2)]
    verify_runs = []
    for serial, token in enumerate(tokens):
        answer = _verify(http, token, serial)
        assert answer.status_code == 201, answer.text
        verify_runs.append(answer.json()["id"])
    ci = _commit(http, "ci", parents="base")
    assert all(http.get(f"/api/v1/runs/{run_id}").json()["status"] == "queued"
               for run_id in (base, *verify_runs, ci)), "no worker yet: every run waits"

    service["start_worker"]()
    runs = _wait_final(http, [base, *verify_runs, ci], timeout_s=240)
    started = {run_id: run["started_at"] for run_id, run in runs.items()}
    assert all(started.values()), started
    order = sorted(started, key=started.get)
    assert order.index(ci) < min(order.index(run_id) for run_id in verify_runs), (
        f"start order {order}: commit run {ci} (submitted last) must start before verify runs {verify_runs}")
    assert order[:2] == [base, ci] and order[2:] == verify_runs, order  # FIFO within each queue


# ----------------------------------------------------------------------------- the cap
def _world(session, settings) -> None:  # noqa: ANN001
    from service.domain import projects, submissions

    project = projects.create(session=session, name=PROJECT)
    submissions.submit_commit(session=session, settings=settings, project=project, sha="base",
                              parents=[], archive=make_archive({"kernel.cpp": "// base\n"}))
    session.flush()


def test_a_verify_token_with_a_run_queued_is_refused_a_second(api, api_settings, db_session) -> None:
    from service.domain import auth

    _world(db_session, api_settings)
    row, token = auth.create_token(session=db_session, name="contrib", scope="verify", project=PROJECT,
                                   daily_quota=10)
    _, other = auth.create_token(session=db_session, name="other", scope="verify", project=PROJECT,
                                 daily_quota=10)
    first = _verify(api, token, 1)
    assert first.status_code == 201, first.text
    run_id = first.json()["id"]

    refused = _verify(api, token, 2)
    assert refused.status_code == 429, refused.text
    detail = refused.json()["detail"]
    for phrase in (f"run {run_id} (queued)", "1 verify run(s) queued or running",
                   "OPTDRIFT_VERIFY_MAX_ACTIVE_PER_TOKEN", f"wait for run {run_id} to finish",
                   f"/api/v1/runs/{run_id}", "did not spend a daily verify attempt"):
        assert phrase in detail, (phrase, detail)
    # Not started: the whole verify run budget is left.
    assert int(refused.headers["retry-after"]) == int(api_settings.verify_max_run_s)
    spent = db_session.scalar(select(func.count()).select_from(TokenRun).where(TokenRun.token_id == row.id))
    assert spent == 1, "the refusal spent no daily attempt"

    # Another contributor is not held back by this one.
    assert _verify(api, other, 3).status_code == 201

    # Running: Retry-After is what is left of its budget.
    db_session.execute(update(Run).where(Run.id == run_id).values(
        status=RUNNING, started_at=func.now() - timedelta(seconds=100)))
    db_session.flush()
    running = _verify(api, token, 4)
    assert running.status_code == 429 and f"run {run_id} (running)" in running.json()["detail"]
    assert 0 < int(running.headers["retry-after"]) <= api_settings.verify_max_run_s - 99

    # The run ends: the token may verify again.
    db_session.execute(update(Run).where(Run.id == run_id).values(status="done", finished_at=func.now()))
    db_session.flush()
    again = _verify(api, token, 5)
    assert again.status_code == 201, again.text


def test_the_cap_is_a_setting(api, api_settings, db_session) -> None:
    from service.domain import auth

    _world(db_session, api_settings)
    api_settings.verify_max_active_per_token = 2
    _, token = auth.create_token(session=db_session, name="contrib", scope="verify", project=PROJECT,
                                 daily_quota=10)
    assert [_verify(api, token, serial).status_code for serial in range(3)] == [201, 201, 429]


def test_a_request_still_being_processed_counts_against_the_cap(api_settings, db_session) -> None:
    """A request holds a slot (committed) before its run exists: the next request of the token,
    which waited on the token's lock, sees it and is refused; a slot left by an API killed
    mid-request stops counting after PENDING_SLOT_S."""
    from service.domain import auth, verify_quota

    _, token = auth.create_token(session=db_session, name="contrib", scope="verify", project=None,
                                 daily_quota=10)
    principal = auth.authenticate(session=db_session, token=token)
    caps = {"default_quota": 10, "max_active": 1, "run_budget_s": api_settings.verify_max_run_s}
    slot = verify_quota.take_slot(session=db_session, principal=principal, **caps)
    db_session.commit()
    with pytest.raises(auth.QuotaExceeded) as refused:
        verify_quota.take_slot(session=db_session, principal=principal, **caps)
    assert "1 request(s) still being processed" in str(refused.value)
    assert refused.value.retry_after_s == verify_quota.PENDING_RETRY_AFTER_S
    later = slot.created_at + timedelta(seconds=verify_quota.PENDING_SLOT_S + 1)
    assert verify_quota.take_slot(session=db_session, principal=principal, now=later, **caps) is not None


@pytest.fixture
def server(tmp_path: Path) -> Iterator[dict]:
    """A real `optdrift serve --no-worker` on PostgreSQL, for concurrent requests."""
    name = f"optdrift_fair_cap_{os.getpid()}"
    database_url = create_database(name)
    port = free_port()
    home = tmp_path / "home"
    env = {"OPTDRIFT_HOME": str(home), "OPTDRIFT_DATABASE_URL": database_url,
           "OPTDRIFT_BROKER_URL": API_TEST_REDIS, "OPTDRIFT_PUBLIC_URL": f"http://127.0.0.1:{port}",
           "OPTDRIFT_MAINTENANCE_INTERVAL_S": "0"}
    process = start_process(["serve", "--port", str(port), "--no-worker"], env, tmp_path / "api.log")
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=90)
        http.headers["Authorization"] = f"Bearer {(home / 'admin-token').read_text().strip()}"
        assert http.post("/api/v1/projects", json={"name": PROJECT}).status_code == 201
        _commit(http, "base")
        yield {"http": http, "env": env, "database_url": database_url}
    finally:
        stop_process(process)
        http.close()
        drop_database(name)


def test_ten_concurrent_verify_requests_of_one_token_make_one_run(server) -> None:
    token = _cli(server["env"], "token", "create", "--name", "contrib", "--scope", "verify",
                 "--project", PROJECT, "--daily-quota", "100")
    barrier = threading.Barrier(10)
    answers: list[int] = []

    def attempt(serial: int) -> None:
        with httpx.Client(base_url=server["http"].base_url, timeout=60) as http:
            barrier.wait()
            answers.append(_verify(http, token, serial).status_code)

    threads = [threading.Thread(target=attempt, args=(serial,)) for serial in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(answers) == [201] + [429] * 9, answers
    engine = create_engine(server["database_url"])
    with engine.connect() as connection:
        verify_runs = connection.execute(text("SELECT count(*) FROM runs WHERE kind = 'verify'")).scalar()
    engine.dispose()
    assert verify_runs == 1


# ----------------------------------------------------------------------------- re-queue
def _queued_ids(settings, queue: str) -> list[int]:  # noqa: ANN001
    """The run ids of the task messages waiting on `queue` of the settings' broker."""
    if settings.uses_filesystem_broker:
        bodies = [json.loads(path.read_text()) for path in sorted((settings.broker_folder / "queue").iterdir())
                  if path.name.partition(".")[2] == f"{queue}.msg"]
    else:
        bodies = [json.loads(raw) for raw in redis.Redis.from_url(settings.broker_url).lrange(queue, 0, -1)]

    return [json.loads(base64.b64decode(body["body"]))[0][0] for body in bodies]


@pytest.fixture(params=["redis", "filesystem"])
def broker_settings(request, api_settings):
    if request.param == "filesystem":
        api_settings.broker_url = ""
    return api_settings


def test_a_reaped_verify_run_goes_back_on_the_verify_queue(api, broker_settings, db_session) -> None:
    from service.domain import auth, runs

    settings = broker_settings
    _world(db_session, settings)
    _, token = auth.create_token(session=db_session, name="contrib", scope="verify", project=PROJECT,
                                 daily_quota=10)
    answer = _verify(api, token, 1)
    assert answer.status_code == 201, answer.text
    run_id = answer.json()["id"]
    assert run_id in _queued_ids(settings, "cpu.verify")
    assert run_id not in _queued_ids(settings, "cpu")
    _drain(settings)

    # A worker took it, then stopped heart-beating: the maintenance loop's reaper and dispatcher.
    db_session.execute(update(Run).where(Run.id == run_id).values(
        status=RUNNING, attempt=1, worker="gone", heartbeat_at=func.now() - timedelta(hours=1)))
    db_session.flush()
    requeued, _failed = runs.reap_stale(session=db_session, stale_after_s=settings.stale_after_s,
                                        max_attempts=settings.max_attempts)
    assert requeued == [run_id]
    assert run_id in dispatch.dispatch_pending(session=db_session, settings=settings)
    assert _queued_ids(settings, "cpu.verify") == [run_id]
    assert run_id not in _queued_ids(settings, "cpu")  # (the base commit's run is sent there)


def test_a_verify_run_sent_again_after_an_optdrift_failure_keeps_its_queue(api, broker_settings, db_session) -> None:
    from service.domain import auth
    from service import run_store

    settings = broker_settings
    _world(db_session, settings)
    _, token = auth.create_token(session=db_session, name="contrib", scope="verify", project=PROJECT,
                                 daily_quota=10)
    run_id = _verify(api, token, 1).json()["id"]
    _drain(settings)
    db_session.execute(update(Run).where(Run.id == run_id).values(status=QUEUED, dispatched_at=None))
    db_session.flush()
    run_store.send_again(run_id, settings=settings, delay=0.0, session=db_session)
    assert _queued_ids(settings, "cpu.verify") == [run_id]
    assert _queued_ids(settings, "cpu") == []


def _drain(settings) -> None:  # noqa: ANN001
    if settings.uses_filesystem_broker:
        for path in (settings.broker_folder / "queue").iterdir():
            path.unlink()
    else:
        redis.Redis.from_url(settings.broker_url).flushdb()
