"""docker-compose.yml, run without Docker: each service's command with its environment, as
processes on this machine against the real PostgreSQL and Redis, and two commits submitted
through the API to a verdict.

What stands in for Docker, and nothing else: the hostnames postgres, redis and api become
127.0.0.1 (the API on a free port, Redis db 10, a fresh database owned by the compose file's
user), each volume a folder of this test (the builds volume the tests' shared build cache), and
the GPU worker a CPU worker (OPTDRIFT_WORKER_ENVIRONMENT cpu, OPTDRIFT_WORKER_DEVICE cpu, no
CUDA_VISIBLE_DEVICES: this machine has no GPU). The worker's token is provisioned by the api
service's own command, into the volume the worker mounts as its home: no token is handed over
by the test (issue 15: without it every run failed fetching its source with 401)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import psycopg
import pytest
import yaml

from service.cli.client import OptdriftClient
from tests.service_fixtures import (
    PG_ADMIN_URL, REPO_ROOT, drop_database, flush_redis, free_port, shared_build_cache, wait_http,
)
from worker.mutations import copy_tree, decay_after_update

pytestmark = pytest.mark.slow

COMPOSE = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
REDIS_DB = "redis://127.0.0.1:6379/10"  # its own db: other tests run workers on 11-14 at the same time
# A battery small enough for a CPU in seconds that still shows the decay-after-update change.
SMOKE_BATTERY = {"name": "compose-smoke", "version": 1, "groups": [
    {"optimizers": ["adam"], "sizes": [4097], "steps": 5, "points": [{"lr": 0.1, "weight_decay": 0.1}]}]}


def _database_as_compose_user(name: str) -> None:
    """The database and role the compose file names (trust authentication: the password is moot)."""
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute("DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'optdrift') THEN "
                     "CREATE ROLE optdrift LOGIN PASSWORD 'optdrift'; END IF; END $$")
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}" OWNER optdrift')


class Host:
    """Docker's part: names to addresses, volumes to folders."""

    def __init__(self, tmp: Path, database: str, port: int):
        self.tmp, self.database, self.port = tmp, database, port
        self.volumes = {"builds": Path(shared_build_cache())}

    def volume(self, name: str) -> Path:
        if name not in self.volumes:
            self.volumes[name] = self.tmp / "volumes" / name
            self.volumes[name].mkdir(parents=True)
        return self.volumes[name]

    def mounts(self, service: dict) -> list[tuple[str, Path]]:
        """(container path, host folder), the longest container path first."""
        pairs = [(entry.split(":")[1], self.volume(entry.split(":")[0])) for entry in service.get("volumes", [])]
        return sorted(pairs, key=lambda pair: -len(pair[0]))

    def translate(self, text: str, service: dict) -> str:
        text = text.replace("@postgres:5432/optdrift", f"@127.0.0.1:5432/{self.database}")
        text = text.replace("redis://redis:6379/0", REDIS_DB)
        text = text.replace("http://api:8000", f"http://127.0.0.1:{self.port}")
        text = re.sub(r"--port 8000\b", f"--port {self.port}", text)
        text = text.replace("--host 0.0.0.0", "--host 127.0.0.1")
        for container_path, folder in self.mounts(service):
            text = re.sub(rf"(?<![\w/-]){re.escape(container_path)}(?=/|\b|$)", str(folder), text)
        return text

    def start(self, name: str, *, overrides: dict[str, str | None] | None = None) -> subprocess.Popen:
        service = COMPOSE["services"][name]
        env = {key: value for key, value in os.environ.items() if not key.startswith("OPTDRIFT_")}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # `optdrift` as in the image
        env["PYTHONPATH"] = str(REPO_ROOT)
        for key, value in (service.get("environment") or {}).items():
            env[key] = self.translate(str(value), service)
        for key, value in (overrides or {}).items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        command = service["command"]
        argv = ([*command[:2], self.translate(command[2], service)] if command[:2] == ["sh", "-c"]
                else [self.translate(word, service) for word in command])
        log = (self.tmp / f"{name}.log").open("wb")
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp,
                                start_new_session=True)


def _stop(process: subprocess.Popen | None) -> None:
    if process is None or process.poll() is not None:
        return
    os.killpg(process.pid, 15)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="the api service chowns the worker token to uid 10001, as "
                                              "root does in its container")
def test_compose_services_as_processes_reach_a_verdict(tmp_path: Path) -> None:
    services = COMPOSE["services"]
    worker_name = next(name for name in services if name.startswith("worker"))
    database = f"optdrift_compose_{os.getpid()}"
    _database_as_compose_user(database)
    flush_redis(REDIS_DB)
    host = Host(tmp_path, database, free_port())
    url = f"http://127.0.0.1:{host.port}"
    api = worker = None
    try:
        api = host.start("api")
        wait_http(f"{url}/readyz", timeout_s=120)
        # The api service wrote the workers' token where the worker's home is, as the compose file says.
        worker_home = dict(host.mounts(services[worker_name]))["/data"]
        token_file = worker_home / "worker-token"
        assert token_file.is_file() and token_file.stat().st_mode & 0o777 == 0o600
        assert token_file.stat().st_uid == 10001
        worker_env = services[worker_name]["environment"]
        assert worker_env["OPTDRIFT_HOME"] == "/data" and "OPTDRIFT_WORKER_TOKEN" not in worker_env
        worker = host.start(worker_name, overrides={"OPTDRIFT_WORKER_ENVIRONMENT": "cpu",
                                                    "OPTDRIFT_WORKER_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": None})

        admin = subprocess.run(["optdrift", "token", "create", "--name", "test-admin", "--scope", "admin"],
                               capture_output=True, text=True, check=True,
                               env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                                    "OPTDRIFT_DATABASE_URL": host.translate(worker_env["OPTDRIFT_DATABASE_URL"], {}),
                                    "OPTDRIFT_HOME": str(tmp_path / "admin-home")}).stdout.strip()
        client = OptdriftClient(url, token=admin)
        client.ensure_project("compose")
        with tempfile.TemporaryDirectory() as scratch:
            base = copy_tree(REPO_ROOT / "csrc", Path(scratch) / "base")
            (base / "smoke.json").write_text(json.dumps(SMOKE_BATTERY))
            buggy = decay_after_update(copy_tree(base, Path(scratch) / "buggy"))
            ids = []
            for sha, parents, tree in (("c-base", [], base), ("c-buggy", ["c-base"], buggy)):
                answer = client.submit_commit(project="compose", sha=sha, parents=parents, source_dir=tree,
                                              battery="smoke.json")
                ids.append(answer["runs"][0]["id"])
        runs = client.wait(ids, timeout_s=300)
        assert [run["status"] for run in runs] == ["done", "done"], [(r["status"], r["error"]) for r in runs]
        assert runs[0]["verdict"]["outcome"] == "no-baseline"
        assert runs[1]["verdict"]["outcome"] == "changed" and runs[1]["verdict"]["flagged"]
        # The worker took them as the compose file's worker, with the token it was given.
        assert all(run["worker"] for run in runs)
        assert httpx.get(f"{url}/metrics").status_code == 200
        client.close()
    finally:
        _stop(worker)
        _stop(api)
        for name in ("api", worker_name):
            log = tmp_path / f"{name}.log"
            if log.exists():
                print(f"--- {name}.log ---\n{log.read_text(errors='replace')[-4000:]}")
        drop_database(database)
        shutil.rmtree(tmp_path / "volumes", ignore_errors=True)
