"""Fixtures for the service tests (loaded from tests/conftest.py via `pytest_plugins`).

API tests run against the real PostgreSQL: a fresh database per test session
(`optdrift_test_<pid>`), migrated with `alembic upgrade head`, one rolled-back transaction per
test (routes' commits become savepoints), the app's session and settings dependencies overridden.
End-to-end tests start real processes (uvicorn, Celery worker) against real Redis (db 13) or the
embedded default.
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psycopg
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def code_path() -> str:
    """This checkout first, then whatever the test's own PYTHONPATH holds (the GPU machine installs
    the service's packages into a folder named there, not into the interpreter)."""
    return os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))


PG_ADMIN_URL = os.environ.get("OPTDRIFT_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/test")
PG_HOST_URL = PG_ADMIN_URL.rsplit("/", 1)[0]
# Redis databases of the tests that share one: per pytest-xdist worker (.ci/run runs the suite on
# two), so one worker's flush never empties the other's queue. The tests with a database of their
# own (7-11) run in one file each, which xdist keeps on one worker (--dist loadfile).
_XDIST_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_SHARED_DBS = [(14, 13), (15, 12), (6, 5), (4, 3)]  # (API tests, end to end) per worker
if _XDIST_WORKER >= len(_SHARED_DBS):
    raise RuntimeError(f"tests/service_fixtures.py has Redis databases for {len(_SHARED_DBS)} xdist workers; "
                       f"run with -n {len(_SHARED_DBS)} or fewer")
API_TEST_REDIS = f"redis://127.0.0.1:6379/{_SHARED_DBS[_XDIST_WORKER][0]}"
E2E_REDIS = f"redis://127.0.0.1:6379/{_SHARED_DBS[_XDIST_WORKER][1]}"


def create_database(name: str) -> str:
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{PG_HOST_URL.replace('postgresql://', 'postgresql+psycopg://')}/{name}"


def drop_database(name: str) -> None:
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def migrated_database(name: str) -> Iterator[str]:
    """A new database at the schema's head, dropped afterwards: for a process that commits (the
    tests' shared database is rolled back per test)."""
    from service.db.migrate import upgrade_to_head

    url = create_database(name)
    try:
        upgrade_to_head(url)
        yield url
    finally:
        drop_database(name)


def flush_redis(url: str) -> None:
    import redis

    redis.Redis.from_url(url).flushdb()


def make_archive(files: dict[str, bytes | str], *, links: dict[str, str] | None = None) -> bytes:
    """A tar.gz with the given files (and symlinks name -> target), for bad-input tests."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, content in files.items():
            data = content.encode() if isinstance(content, str) else content
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o755 if data.startswith(b"#!") else 0o644  # a script stays executable
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return buffer.getvalue()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    with migrated_database(f"optdrift_test_{os.getpid()}") as url:
        yield url


@pytest.fixture(scope="session")
def pg_engine(pg_url: str):
    from sqlalchemy import create_engine

    engine = create_engine(pg_url)
    yield engine
    engine.dispose()


@pytest.fixture
def db_session(pg_engine):
    from sqlalchemy.orm import Session

    connection = pg_engine.connect()
    transaction = connection.begin()
    session = Session(bind=connection, join_transaction_mode="create_savepoint",
                      expire_on_commit=False)
    yield session
    session.close()
    transaction.rollback()
    connection.close()


@pytest.fixture
def api_settings(tmp_path: Path, pg_url: str):
    from service.settings import Settings

    flush_redis(API_TEST_REDIS)
    return Settings(home=tmp_path / "home", database_url=pg_url, broker_url=API_TEST_REDIS,
                    maintenance_interval_s=0, max_upload_bytes=256 * 1024)


@pytest.fixture
def admin_token(db_session) -> str:
    """An admin API token in the test's transaction (rolled back with it)."""
    from service.domain.auth import create_token

    _, token = create_token(session=db_session, name="test-admin", scope="admin")
    return token


@pytest.fixture
def api(db_session, api_settings, admin_token):
    from fastapi.testclient import TestClient

    from service.api.main import create_app
    from service.db.session import get_session
    from service.settings import get_settings

    app = create_app()
    app.dependency_overrides[get_session] = lambda: db_session
    app.dependency_overrides[get_settings] = lambda: api_settings
    # Authenticated as admin by default; tests of the scopes pass their own headers.
    with TestClient(app, headers={"Authorization": f"Bearer {admin_token}"}) as client:
        yield client


@pytest.fixture
def live_api(db_session, api_settings):  # noqa: ANN001, ANN201
    """The real app on a port (uvicorn in a thread) over the test's database session, for commands
    that speak HTTP: yields its URL."""
    import threading
    import time

    import uvicorn

    from service.api.main import create_app
    from service.db.session import get_session
    from service.settings import get_settings

    app = create_app()
    app.dependency_overrides[get_session] = lambda: db_session
    app.dependency_overrides[get_settings] = lambda: api_settings
    port = free_port()
    # One worker thread at a time uses the test's session (uvicorn serves requests in turn here).
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


# ----------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


def start_process(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "wb")  # noqa: SIM115  (closed with the process)
    return subprocess.Popen([sys.executable, "-m", "service.cli", *args], cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": code_path(), **env},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def shared_build_cache() -> str:
    return os.environ.get("OPTDRIFT_BUILD_CACHE", str(REPO_ROOT / ".optdrift" / "test-build-cache"))
