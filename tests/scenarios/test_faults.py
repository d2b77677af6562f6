"""Faults injected for real, on loopback, against a throwaway PostgreSQL cluster and a throwaway
Redis this test starts (never the shared 5432 / 6379 servers):

1. kill -9 of a Celery worker while its run is running -> the API's reaper re-queues the run, a
   second worker completes it once, no duplicate trajectory rows;
2. Redis stopped during a run and during submissions -> submissions still answer (queued,
   undispatched), the dispatcher re-sends after the restart, nothing lost;
3. PostgreSQL restarted -> the API answers 503 with Retry-After meanwhile and recovers; runs the
   worker was writing complete (the reaper re-queues an attempt that died on a failed write);
4. a kernel host that segfaults on one case -> that case `broken`, its run completes.

Prints the figures (runs submitted, faults injected, runs lost, duplicate rows) and asserts
runs lost = 0 and duplicate rows = 0.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.service_fixtures import REPO_ROOT, free_port, shared_build_cache, start_process

pytestmark = pytest.mark.slow
SEGV_CASE = "adam.32bit.fp32.lr=0.1.wd=0.1.open.n4097"
PG_BIN = Path(shutil.which("pg_ctl") or "/usr/local/bin/pg_ctl").parent


def _as_postgres(args: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else args


class ThrowawayPostgres:
    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="optdrift-faults-pg-", dir="/tmp"))
        self.data = self.base / "data"
        self.port = free_port()
        if os.geteuid() == 0:
            shutil.chown(self.base, "postgres", "postgres")
        subprocess.run(_as_postgres([str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust",
                                     "-U", "postgres"]), check=True, capture_output=True)
        self.start()
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute("CREATE DATABASE optdrift")
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/optdrift"

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        subprocess.run(_as_postgres([
            str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.base / "pg.log"), "-w",
            "-o", f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1", "start"]),
            check=True, capture_output=True)

    def stop(self, mode: str = "fast") -> None:
        subprocess.run(_as_postgres([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w",
                                     "stop"]), check=False, capture_output=True)

    def remove(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)


class ThrowawayRedis:
    """Append-only file, fsync on every write: a restart keeps the queued tasks (production Redis
    for optdrift must persist the same way; see docs/security/SERVICE.md, "Surviving faults")."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
             "--appendonly", "yes", "--appendfsync", "always", "--save", ""],
            stdout=open(self.folder / "redis.log", "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
        import redis

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                redis.Redis(port=self.port).ping()
                return
            except redis.ConnectionError:
                time.sleep(0.1)
        raise TimeoutError("throwaway redis did not start")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()  # SIGTERM: Redis flushes the append-only file and exits
            self.process.wait(timeout=30)


def _wait(predicate, timeout_s: float, what: str, step: float = 0.5):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise TimeoutError(f"{what} within {timeout_s:g} s")


@contextmanager
def _processes():
    started: list[subprocess.Popen] = []
    try:
        yield started
    finally:
        for process in started:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for process in started:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


def test_faults_lose_nothing(tmp_path: Path) -> None:
    if not shutil.which("redis-server") or not (PG_BIN / "initdb").exists():
        pytest.skip("needs redis-server and initdb/pg_ctl on PATH")
    postgres = ThrowawayPostgres()
    redis_server = ThrowawayRedis(tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    home = tmp_path / "home"
    env = {"OPTDRIFT_HOME": str(home), "OPTDRIFT_DATABASE_URL": postgres.url,
           "OPTDRIFT_BROKER_URL": redis_server.url, "OPTDRIFT_PUBLIC_URL": url,
           "OPTDRIFT_BUILD_CACHE_DIR": shared_build_cache(), "OPTDRIFT_MAINTENANCE_INTERVAL_S": "1",
           "OPTDRIFT_HEARTBEAT_INTERVAL_S": "1", "OPTDRIFT_STALE_AFTER_S": "8",
           "OPTDRIFT_MAX_ATTEMPTS": "4", "OPTDRIFT_TEST_HOST_FAULT": f"segv:{SEGV_CASE}"}
    faults: list[str] = []
    submitted: list[int] = []
    try:
        with _processes() as started:
            started.append(start_process(["serve", "--port", str(port), "--no-worker"], env, tmp_path / "api.log"))
            _wait(lambda: _ok(f"{url}/readyz"), 90, "the API did not become ready")
            token = (home / "admin-token").read_text().strip()
            api = httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {token}"})
            assert api.post("/api/v1/projects", json={"name": "faults"}).status_code == 201
            from service.core.archives import pack_directory

            archive = pack_directory(REPO_ROOT / "csrc")

            def submit(sha: str) -> dict:
                response = api.post("/api/v1/projects/faults/commits", data={"sha": sha},
                                    files={"archive": ("s.tar.gz", archive, "application/gzip")})
                assert response.status_code == 201, response.text
                submitted.append(response.json()["runs"][0]["id"])
                return response.json()["runs"][0]

            def run(run_id: int) -> dict:
                return api.get(f"/api/v1/runs/{run_id}").json()

            worker_one = start_process(["worker", "--loglevel", "INFO"], env, tmp_path / "worker1.log")
            started.append(worker_one)
            first = submit("c1")

            # 1. kill -9 the worker (its whole process group) while its run is running. At the
            # first stored case: the segfaulting case comes first, so its host's restart (~1 s)
            # still lies ahead. A later trigger raced the run's end once the one-by-one cases got
            # fast (81 of them in ~1.5 s): the run was done before the kill, nothing to re-queue.
            _wait(lambda: run(first["id"])["progress"]["cases_done"] >= 1, 600,
                  "the first run did not start running cases", step=0.05)
            os.killpg(worker_one.pid, signal.SIGKILL)
            worker_one.wait()
            at_kill = run(first["id"])
            assert at_kill["status"] == "running", \
                f"the first run was {at_kill['status']!r} at the kill, not running: the test lost its race"
            faults.append("kill -9 worker mid-run")
            started.append(start_process(["worker", "--loglevel", "INFO"], env, tmp_path / "worker2.log"))

            # 2. Redis down during submissions (and while the re-queued run waits / runs)
            redis_server.stop()
            faults.append("redis outage (during a re-queued run and two submissions)")
            during_outage = [submit(f"c{i}") for i in (2, 3)]
            assert all(r["status"] == "queued" and r["dispatched"] is False for r in during_outage)
            time.sleep(3)
            redis_server.start()

            # 3. PostgreSQL restarted while runs are running: 503 + Retry-After meanwhile
            _wait(lambda: any(run(i)["status"] == "running" for i in submitted), 600,
                  "no run was running before the PostgreSQL restart")
            # c4 waits in Redis behind the running run (prefetch 1): its task is likely delivered
            # while the database is down, which is the claim-retry path of worker.jobs.run.
            submit("c4")
            postgres.stop("fast")
            faults.append("postgresql restart (during a run)")
            answers = []
            for _ in range(6):
                response = api.get("/api/v1/projects/faults/commits")
                answers.append((response.status_code, response.headers.get("retry-after")))
                time.sleep(0.5)
            postgres.start()
            assert (503, "5") in answers, answers
            assert all(status == 503 for status, _ in answers), answers
            _wait(lambda: _ok(f"{url}/api/v1/projects"), 60, "the API did not recover after PostgreSQL")

            final = _wait(lambda: (lambda rs: rs if all(r["status"] in ("done", "failed", "cancelled")
                                                        for r in rs) else None)(
                [run(i) for i in submitted]), 900, "the runs did not all finish", step=2)
    finally:
        redis_server.stop()
        for log in ("api.log", "worker1.log", "worker2.log"):
            if (tmp_path / log).exists():
                print(f"--- {log}\n" + (tmp_path / log).read_text()[-3000:])
        rows = _rows(postgres)
        postgres.remove()

    faults.extend(f"kernel host segfault in run {run_id}" for run_id in submitted)
    lost = [r["id"] for r in final if r["status"] != "done"]
    duplicates = rows["duplicates"]
    print("\n| runs submitted | faults injected | runs lost | duplicate rows |\n|---:|---:|---:|---:|")
    print(f"| {len(submitted)} | {len(faults)} | {len(lost)} | {duplicates} |")
    print("faults:", "; ".join(faults))
    print("attempts per run:", {r["id"]: r["attempt"] for r in final})
    worker_logs = "".join((tmp_path / f"worker{i}.log").read_text() for i in (1, 2))
    print("claims retried through the database outage:", worker_logs.count("retrying in"),
          "; runs left to the reaper mid-outage:", worker_logs.count("the reaper will re-queue"))
    assert not lost, [(r["id"], r["status"], r["error"]) for r in final]
    assert duplicates == 0
    first_run = next(r for r in final if r["id"] == submitted[0])
    assert first_run["attempt"] >= 2, "the killed run was not re-queued by the reaper"
    for r in final:
        counts = rows["per_run"][r["id"]]
        assert counts["rows"] == r["progress"]["cases_total"] == counts["distinct_cases"]
        # exactly the segfaulting case is broken (case ids end in .s<seed>.t<steps>#<hash>)
        assert len(counts["broken"]) == 1 and counts["broken"][0].startswith(SEGV_CASE + "."), counts


def _ok(address: str) -> bool:
    try:
        return httpx.get(address, timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


def _rows(postgres: ThrowawayPostgres) -> dict:
    with psycopg.connect(postgres.url.replace("+psycopg", "")) as conn:
        duplicates = conn.execute(
            "SELECT count(*) FROM (SELECT run_id, case_id FROM trajectories GROUP BY run_id, case_id "
            "HAVING count(*) > 1) d").fetchone()[0]
        per_run = {}
        for run_id, rows, distinct in conn.execute(
                "SELECT run_id, count(*), count(DISTINCT case_id) FROM trajectories GROUP BY run_id"):
            broken = [row[0].split("#")[0] for row in conn.execute(
                "SELECT case_id FROM trajectories WHERE run_id = %s AND status = 'broken'", (run_id,))]
            per_run[run_id] = {"rows": rows, "distinct_cases": distinct, "broken": sorted(broken)}
    return {"duplicates": duplicates, "per_run": per_run}
