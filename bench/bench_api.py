"""The API a load benchmark runs against: `optdrift serve --no-worker` on a fresh PostgreSQL
database and a flushed Redis db, on loopback, with project `bench` made by the admin token that
the first `serve` writes (every write needs a token). The database is dropped afterwards.

    with bench_api("redis://127.0.0.1:6379/12", "optdrift_bench") as api:
        httpx.post(f"{api.url}/api/v1/projects/bench/commits", headers=api.headers, ...)
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.service_fixtures import (  # noqa: E402
    create_database, drop_database, flush_redis, free_port, start_process, stop_process, wait_http,
)


@dataclass(frozen=True)
class BenchApi:
    url: str
    admin_token: str
    database_url: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}


@contextmanager
def bench_api(redis_url: str, database_prefix: str) -> Iterator[BenchApi]:
    name = f"{database_prefix}_{os.getpid()}"
    database_url = create_database(name)
    flush_redis(redis_url)
    url = f"http://127.0.0.1:{free_port()}"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            env = {"OPTDRIFT_HOME": tmp, "OPTDRIFT_DATABASE_URL": database_url, "OPTDRIFT_BROKER_URL": redis_url,
                   "OPTDRIFT_MAINTENANCE_INTERVAL_S": "0", "OPTDRIFT_PUBLIC_URL": url}
            server = start_process(["serve", "--port", url.rsplit(":", 1)[1], "--no-worker"], env,
                                   Path(tmp) / "api.log")
            try:
                wait_http(f"{url}/readyz", 90)
                api = BenchApi(url, (Path(tmp) / "admin-token").read_text().strip(), database_url)
                httpx.post(f"{url}/api/v1/projects", json={"name": "bench"}, headers=api.headers).raise_for_status()
                yield api
            finally:
                stop_process(server)
    finally:
        drop_database(name)
