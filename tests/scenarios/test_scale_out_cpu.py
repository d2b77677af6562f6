"""Scale-out on one queue (issue 19, the CPU part): several Celery workers consume the same
environment's queue, and each run is taken once.

Real processes on loopback: the API, and two `optdrift worker` processes with their own node names,
on PostgreSQL + Redis and on the embedded default (SQLite + the filesystem broker, the second worker
started separately from the same home). Five commits of the bundled kernels are submitted at once:
the base, its decay-after-update child (flagged, so its co-run is queued on `cpu.corun`), and three
descendants with the child's tree. What must hold:

* every run ends `done` with its verdict, on its first attempt (nobody took it a second time);
* every run stored each case once (no duplicate trajectory rows) and a single verdict;
* both workers took runs (the queue is shared, not owned by the first worker);
* the flagged commit's co-run (its own task on `cpu.corun`, recorded with its worker and window)
  held no run back: no run queued before the co-run started was still waiting when it ended.
"""

from __future__ import annotations

import tempfile
import time
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from service.cli.client import OptdriftClient
from tests.service_fixtures import (
    E2E_REDIS, REPO_ROOT, create_database, drop_database, flush_redis, free_port,
    shared_build_cache, start_process, stop_process, wait_http,
)
from worker.mutations import comment_only, copy_tree, decay_after_update

pytestmark = pytest.mark.slow
DESCENDANTS = 3


def _submit_history(client: OptdriftClient, tmp: Path) -> dict[str, int]:
    base = REPO_ROOT / "csrc"
    buggy = decay_after_update(copy_tree(base, tmp / "buggy"))
    # The descendants share one tree (one build, cached), so the workers' time goes to batteries.
    descendant = comment_only(copy_tree(buggy, tmp / "descendant"))
    history = [("base", [], base), ("buggy", ["base"], buggy)]
    parent = "buggy"
    for index in range(DESCENDANTS):
        history.append((f"d{index}", [parent], descendant))
        parent = f"d{index}"
    return {sha: client.submit_commit(project="scale", sha=sha, parents=parents, source_dir=tree)["runs"][0]["id"]
            for sha, parents, tree in history}


def _assert_each_run_taken_once(client: OptdriftClient, database_url: str, ids: dict[str, int]) -> None:
    runs = {sha: run for sha, run in zip(ids, client.wait(list(ids.values()), timeout_s=900))}
    for sha, run in runs.items():
        assert run["status"] == "done", (sha, run["status"], run.get("error"))
        assert run["verdict"] is not None, sha
    assert runs["buggy"]["verdict"]["outcome"] == "changed"
    assert {runs[f"d{i}"]["verdict"]["outcome"] for i in range(DESCENDANTS)} == {"unchanged"}

    engine = create_engine(database_url)
    with engine.connect() as connection:
        run_list = ",".join(str(run_id) for run_id in ids.values())
        rows = connection.execute(text(
            f"SELECT id, attempt, worker, cases_total, started_at FROM runs WHERE id IN ({run_list})")).all()
        duplicates = connection.execute(text(
            "SELECT run_id, case_id, count(*) FROM trajectories GROUP BY run_id, case_id HAVING count(*) > 1"
        )).all()
        stored = dict(connection.execute(text(
            "SELECT run_id, count(*) FROM trajectories GROUP BY run_id")).all())
        verdicts = dict(connection.execute(text("SELECT run_id, count(*) FROM verdicts GROUP BY run_id")).all())
    engine.dispose()

    assert not duplicates, f"cases stored twice: {duplicates[:5]}"
    for run_id, attempt, _worker, cases_total, _started in rows:
        assert attempt == 1, f"run {run_id} was taken {attempt} times"
        assert stored[run_id] == cases_total > 0, (run_id, stored.get(run_id), cases_total)
        assert verdicts[run_id] == 1, run_id
    workers = {worker for _, _, worker, _, _ in rows}
    assert len(workers) >= 2, f"one worker took every run: {workers}"

    # The flagged commit's co-run (queue cpu.corun) ran on one worker once its diffs are stored;
    # no run waited through it: a run queued before the co-run started had started before it ended.
    deadline = time.monotonic() + 300
    while not (window := client.http.get(f"/api/v1/runs/{ids['buggy']}").json()["verdict"]["detail"]
               .get("corun_window")) and time.monotonic() < deadline:
        time.sleep(1)
    assert window, "the co-run stored its diffs and records when and where it ran (corun_window)"
    start, end = (datetime.fromisoformat(window[key]) for key in ("started_at", "finished_at"))
    created = {run["id"]: _aware(run["created_at"]) for run in runs.values()}
    held = [run_id for run_id, _, _, _, started in rows
            if created[run_id] < start and _aware(started) > end]
    assert not held, f"runs {held} waited for the co-run {window}"


def _aware(moment: datetime | str) -> datetime:
    from datetime import timezone

    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment)
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _stop_and_show(processes: list, logs: Path) -> None:
    for process in reversed(processes):
        stop_process(process)
    for log in sorted(logs.glob("*.log")):
        print(f"--- {log.name}\n{log.read_text()[-3000:]}")


def _env(home: Path, **extra: str) -> dict[str, str]:
    return {"OPTDRIFT_HOME": str(home), "OPTDRIFT_BUILD_CACHE_DIR": shared_build_cache(),
            "OPTDRIFT_MAINTENANCE_INTERVAL_S": "2", "OPTDRIFT_HEARTBEAT_INTERVAL_S": "2", **extra}


def test_two_workers_one_queue_postgres_redis(tmp_path: Path) -> None:
    name = f"optdrift_scale_{__import__('os').getpid()}"
    database_url = create_database(name)
    flush_redis(E2E_REDIS)
    port = free_port()
    env = _env(tmp_path / "home", OPTDRIFT_DATABASE_URL=database_url, OPTDRIFT_BROKER_URL=E2E_REDIS,
               OPTDRIFT_PUBLIC_URL=f"http://127.0.0.1:{port}")
    processes = [start_process(["serve", "--port", str(port), "--no-worker"], env, tmp_path / "api.log")]
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=90)
        for index in range(2):
            processes.append(start_process(["worker", "--name", f"scale{index}"], env, tmp_path / f"w{index}.log"))
        client = OptdriftClient(f"http://127.0.0.1:{port}",
                                token=(tmp_path / "home" / "admin-token").read_text().strip())
        client.ensure_project("scale")
        with tempfile.TemporaryDirectory() as tmp:
            ids = _submit_history(client, Path(tmp))
        _assert_each_run_taken_once(client, database_url, ids)
        client.close()
    finally:
        _stop_and_show(processes, tmp_path)
        drop_database(name)


def test_two_workers_one_queue_embedded_default(tmp_path: Path) -> None:
    port = free_port()
    home = tmp_path / "home"
    env = _env(home)
    for key in ("OPTDRIFT_DATABASE_URL", "OPTDRIFT_BROKER_URL", "OPTDRIFT_PUBLIC_URL"):
        env[key] = ""
    processes = [start_process(["serve", "--port", str(port)], env, tmp_path / "serve.log")]
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=90)
        # A second worker joins the first (the one `serve` started) from the same home, no settings.
        processes.append(start_process(["worker", "--name", "second"], env, tmp_path / "second.log"))
        client = OptdriftClient(f"http://127.0.0.1:{port}", token=(home / "admin-token").read_text().strip())
        client.ensure_project("scale")
        with tempfile.TemporaryDirectory() as tmp:
            ids = _submit_history(client, Path(tmp))
        _assert_each_run_taken_once(client, f"sqlite:///{home / 'optdrift.db'}", ids)
        client.close()
    finally:
        _stop_and_show(processes, tmp_path)
