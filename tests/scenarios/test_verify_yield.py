"""Issue 33, item 8: a verify token cannot delay CI's commit runs by more than one case. A verify run
that is already running when a commit run of its environment arrives stops between cases, is
queued again (its stored cases deleted, its attempt not counted, its page saying why) and starts
over once the commit run has started (worker/jobs/run.py CommitRunsFirst).

Real processes: `optdrift serve --no-worker` and one `optdrift worker`, on PostgreSQL + Redis and on
the embedded default's SQLite + filesystem broker. The
tree is our own: a `command` build that writes a file, a battery of CASES small momentum cases in
the tree, and an adapter in the tree (`adapter_path = ["."]`) that pauses PAUSE_S in each case's
open, so the verify run takes CASES x PAUSE_S; the commit trees pause not at all. The one-case
engine (OPTDRIFT_FAST_ENGINE=false) reports each case as it ends: the yield's granularity is what
the run reports (a wave on the fast engine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import create_engine, text

from tests.service_fixtures import (
    REPO_ROOT, create_database, drop_database, free_port, make_archive, start_process, stop_process, wait_http,
)

PROJECT = "yield"
# Its own Redis database (tests/scenarios/test_verify_fairness.py lists who uses which).
REDIS_URL = f"redis://127.0.0.1:6379/{os.environ.get('OPTDRIFT_TEST_VERIFY_YIELD_REDIS_DB', '1')}"
FINAL = ("done", "failed", "cancelled", "error")
CASES = 30
PAUSE_S = 0.5

ADAPTER = '''
import time

import torch

from worker.adapters.base import HandedOverStates, ProjectAdapter

PAUSE_S = {pause}


class PausingMomentum(HandedOverStates):
    def init_states(self, case, param):
        time.sleep(PAUSE_S)  # a slow case: what makes the verify run long
        return {{"momentum_buffer": torch.zeros_like(param)}}

    def step_states(self, case, param, grad, states, step):
        states["momentum_buffer"].mul_(0.9).add_(grad)
        param.sub_(case.hyper["lr"] * states["momentum_buffer"])


class PausingAdapter(ProjectAdapter):
    name = "pausing"

    def load(self, library):
        self.library = library

    def families(self):
        return {{"32bit": PausingMomentum()}}
'''
CONFIG = '''[project]
adapter = "pausing_adapter"
adapter_path = ["."]
battery = "battery.json"

[build]
kind = "command"
commands = ["sh -c 'echo built > out.txt'"]
library = "out.txt"
'''
BATTERY = json.dumps({"name": "pausing", "version": 1, "groups": [
    {"optimizers": ["momentum"], "sizes": [8], "steps": 2, "seeds": list(range(CASES))}]})


def _tree(pause_s: float, marker: str) -> bytes:
    return make_archive({"optdrift.toml": CONFIG, "battery.json": BATTERY, "marker.txt": marker,
                         "pausing_adapter.py": ADAPTER.format(pause=pause_s)})


def _cli(env: dict[str, str], *args: str) -> str:
    answer = subprocess.run([sys.executable, "-m", "service.cli", *args], cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **env},
                            capture_output=True, text=True, timeout=120, check=True)
    return answer.stdout.strip().splitlines()[-1]


def _commit(http: httpx.Client, sha: str, parents: str | None = None) -> int:
    fields = {"sha": sha, **({"parents": parents} if parents else {})}
    answer = http.post(f"/api/v1/projects/{PROJECT}/commits", data=fields,
                       files={"archive": ("t.tar.gz", _tree(0, sha))})
    assert answer.status_code == 201, answer.text
    return answer.json()["runs"][0]["id"]


def _run(http: httpx.Client, run_id: int) -> dict:
    answer = http.get(f"/api/v1/runs/{run_id}")
    assert answer.status_code == 200, answer.text
    return answer.json()


def _wait(http: httpx.Client, run_id: int, until, what: str, timeout_s: float) -> dict:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = _run(http, run_id)
        if until(run):
            return run
        assert run["status"] not in FINAL or until(run), f"run {run_id} ended before {what}: {run}"
        time.sleep(0.2)
    raise AssertionError(f"run {run_id}: not {what} within {timeout_s} s: {_run(http, run_id)}")


@pytest.fixture(params=["postgres-redis", "embedded-filesystem"])
def service(request, tmp_path: Path) -> Iterator[dict]:
    home = tmp_path / "home"
    port = free_port()
    env = {"OPTDRIFT_HOME": str(home), "OPTDRIFT_BUILD_CACHE_DIR": str(tmp_path / "build-cache"),
           "OPTDRIFT_PUBLIC_URL": f"http://127.0.0.1:{port}", "OPTDRIFT_MAINTENANCE_INTERVAL_S": "2",
           "OPTDRIFT_HEARTBEAT_INTERVAL_S": "2", "OPTDRIFT_FAST_ENGINE": "false",
           # One attempt: a yield that spent one would show as attempt 2.
           "OPTDRIFT_MAX_ATTEMPTS": "1"}
    db_name = None
    if request.param == "postgres-redis":
        db_name = f"optdrift_verify_yield_{os.getpid()}"
        env |= {"OPTDRIFT_DATABASE_URL": create_database(db_name), "OPTDRIFT_BROKER_URL": REDIS_URL}
        redis.Redis.from_url(REDIS_URL).flushdb()
        database_url = env["OPTDRIFT_DATABASE_URL"]
    else:  # the embedded default: SQLite in the home, the folder broker
        env |= {"OPTDRIFT_DATABASE_URL": "", "OPTDRIFT_BROKER_URL": ""}
        database_url = f"sqlite:///{home / 'optdrift.db'}"
    processes = [start_process(["serve", "--port", str(port), "--no-worker"], env, tmp_path / "api.log")]
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=90)
        http.headers["Authorization"] = f"Bearer {(home / 'admin-token').read_text().strip()}"
        answer = http.post("/api/v1/projects", json={"name": PROJECT, "environments": ["cpu"]})
        assert answer.status_code == 201, answer.text
        processes.append(start_process(["worker", "--loglevel", "INFO"], env, tmp_path / "worker.log"))
        yield {"http": http, "env": env, "database_url": database_url}
    finally:
        for process in reversed(processes):
            stop_process(process)
        http.close()
        for log in sorted(tmp_path.glob("*.log")):
            print(f"--- {log.name}\n{log.read_text()[-4000:]}")
        if db_name:
            drop_database(db_name)
            redis.Redis.from_url(REDIS_URL).flushdb()


@pytest.mark.slow
def test_a_running_verify_run_yields_to_a_commit_run_and_finishes_afterwards(service) -> None:
    http, env = service["http"], service["env"]
    base = _commit(http, "base")
    _wait(http, base, lambda run: run["status"] == "done", "done", timeout_s=300)

    token = _cli(env, "token", "create", "--name", "contributor", "--scope", "verify", "--project", PROJECT)
    answer = http.post(f"/api/v1/projects/{PROJECT}/verify", headers={"Authorization": f"Bearer {token}"},
                       data={"base": "base"}, files={"archive": ("t.tar.gz", _tree(PAUSE_S, "contributor"))})
    assert answer.status_code == 201, answer.text
    verify = answer.json()["id"]
    _wait(http, verify, lambda run: run["status"] == "running" and run["progress"]["cases_done"] >= 2,
          "running with cases stored", timeout_s=300)

    engine = create_engine(service["database_url"])

    def stored_cases() -> tuple[int, int]:
        with engine.connect() as connection:
            return tuple(connection.execute(text(
                "SELECT count(*), count(DISTINCT case_id) FROM trajectories WHERE run_id = :run"),
                {"run": verify}).one())

    ci = _commit(http, "ci", parents="base")
    submitted = time.monotonic()
    seen: list[dict] = []  # the verify run as its page showed it while the commit run went first
    stored_while_queued: list[tuple[int, int]] = []

    def look() -> None:
        seen.append(_run(http, verify))
        if seen[-1]["status"] == "queued":
            stored_while_queued.append(stored_cases())

    while _run(http, ci)["status"] == "queued" and time.monotonic() - submitted < CASES * PAUSE_S * 4:
        look()
        time.sleep(0.2)
    ci_started = _wait(http, ci, lambda run: run["started_at"], "started", timeout_s=300)
    waited_s = time.monotonic() - submitted
    for _ in range(10):  # the verify run's page while the commit run runs
        look()
        time.sleep(0.1)
    ci_run = _wait(http, ci, lambda run: run["status"] in FINAL, "finished", timeout_s=300)
    verify_run = _wait(http, verify, lambda run: run["status"] in FINAL, "finished", timeout_s=600)

    # The commit run started while the verify run still had most of its cases to run, and before it ended.
    assert datetime.fromisoformat(ci_started["started_at"]) < datetime.fromisoformat(verify_run["finished_at"])
    assert waited_s < CASES * PAUSE_S / 2, f"the commit run waited {waited_s:.1f} s for a worker"
    assert ci_run["status"] == "done", ci_run

    # The verify run went back to queued, its page saying why, then ran again in full.
    queued = [run for run in seen if run["status"] == "queued"]
    assert queued, f"the verify run never went back to queued: {[run['status'] for run in seen]}"
    note = queued[-1]["error"] or ""
    assert "yielded to 1 commit run(s) waiting for cpu" in note and "Queued again on the verify queue" in note, note
    assert queued[-1]["progress"]["cases_done"] == 0 and queued[-1]["started_at"] is None, queued[-1]
    assert set(stored_while_queued) == {(0, 0)}, f"cases stored while queued again: {stored_while_queued}"
    assert verify_run["status"] == "done", verify_run
    assert verify_run["progress"] == {"cases_done": CASES, "cases_total": CASES}, verify_run["progress"]
    assert verify_run["attempt"] == 1, "yielding spends no attempt"
    assert verify_run["error"] is None, verify_run["error"]
    assert datetime.fromisoformat(verify_run["started_at"]) > datetime.fromisoformat(ci_started["started_at"])

    rows, distinct = stored_cases()
    engine.dispose()
    assert rows == distinct == CASES, (rows, distinct)


# ----------------------------------------------------------------------------- the domain, on PostgreSQL
def test_requeue_yielded_gives_the_attempt_back_and_deletes_the_cases_only_for_its_owner(
        db_session, api_settings) -> None:
    from sqlalchemy import func, select, update

    from service.db.models import Run, Trajectory
    from service.domain import runs, trajectories
    from tests.service.domain.test_db_runs import _commit_run, _result

    run = _commit_run(db_session, api_settings, "verifysha", [])
    db_session.execute(update(Run).where(Run.id == run.id).values(kind="verify"))
    assert runs.claim(session=db_session, run_id=run.id, worker="w")
    trajectories.store_case_result(session=db_session, run_id=run.id, case_index=0,
                                   result=_result(["d"], last_nonfinite=0))
    assert runs.heartbeat(session=db_session, run_id=run.id, worker="w", cases_done=1)

    assert not runs.requeue_yielded(session=db_session, run_id=run.id, worker="someone else", note="no")
    assert runs.requeue_yielded(session=db_session, run_id=run.id, worker="w", note="yielded to 1 commit run(s)")
    db_session.expire_all()
    row = db_session.get(Run, run.id)
    assert (row.status, row.attempt, row.worker, row.started_at, row.cases_done, row.dispatched_at, row.error) == (
        "queued", 0, None, None, 0, None, "yielded to 1 commit run(s)")
    assert db_session.scalar(select(func.count()).select_from(Trajectory).where(Trajectory.run_id == run.id)) == 0

    # A cancel asked for while it ran: not queued again (the worker cancels it instead).
    assert runs.claim(session=db_session, run_id=run.id, worker="w")
    db_session.execute(update(Run).where(Run.id == run.id).values(cancel_requested=True))
    assert not runs.requeue_yielded(session=db_session, run_id=run.id, worker="w", note="no")
    db_session.expire_all()
    assert db_session.get(Run, run.id).status == "building"


def test_a_verify_run_yields_only_to_commit_runs_sent_after_it_started(db_session, api_settings) -> None:
    """queued_count as CommitRunsFirst asks it: commit runs only, handed to the broker after the
    verify run started (one already waiting then was not on the queue the worker took from) and
    at least the grace ago."""
    from datetime import timedelta, timezone

    from sqlalchemy import update

    from service.db.models import Run
    from service.domain import runs
    from tests.service.domain.test_db_runs import _commit_run

    now = datetime.now(timezone.utc)
    started = now - timedelta(seconds=60)
    commit = _commit_run(db_session, api_settings, "c1", [])
    other_verify = _commit_run(db_session, api_settings, "v2", [])
    db_session.execute(update(Run).where(Run.id == other_verify.id).values(
        kind="verify", dispatched_at=now - timedelta(seconds=30)))

    def waiting(dispatched_at) -> int:  # noqa: ANN001
        db_session.execute(update(Run).where(Run.id == commit.id).values(dispatched_at=dispatched_at))
        return runs.queued_count(session=db_session, environment="cpu", kind="commit",
                                 dispatched_after=started, dispatched_before=now - timedelta(seconds=2))

    assert waiting(now - timedelta(seconds=30)) == 1           # arrived while the verify run ran
    assert waiting(started - timedelta(seconds=1)) == 0        # was waiting before it started
    assert waiting(now - timedelta(seconds=1)) == 0            # within the grace: being taken
    assert waiting(now + timedelta(seconds=20)) == 0           # a retry's countdown still running
    assert waiting(None) == 0                                  # never handed to the broker
    assert runs.queued_count(session=db_session, environment="cpu") == 2  # the co-runs' count: every kind
