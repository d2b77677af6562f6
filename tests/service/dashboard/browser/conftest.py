"""Browser tests: Playwright driving Debian's Chromium (headless) against a live `optdrift serve`
on loopback, on a PostgreSQL database seeded from a real engine run (tests/service/dashboard/browser/engine_seed.py).

Skipped cleanly where /usr/bin/chromium or the playwright package is absent.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.service_fixtures import (
    API_TEST_REDIS, create_database, drop_database, free_port, start_process, stop_process, wait_http,
)

CHROMIUM = Path(os.environ.get("OPTDRIFT_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
# Screenshots go to a scratch folder, so a test run leaves the tree clean; to refresh the ones in
# docs/screenshots, run the browser tests with OPTDRIFT_SCREENSHOTS=docs/screenshots.
SCREENSHOTS = Path(os.environ.get("OPTDRIFT_SCREENSHOTS",
                                  Path(tempfile.gettempdir()) / "optdrift-screenshots")).resolve()

if not CHROMIUM.exists():
    pytest.skip(f"{CHROMIUM} is absent (apt-get install chromium)", allow_module_level=True)
pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra)")

pytestmark = pytest.mark.slow


@dataclass
class Dashboard:
    url: str
    database_url: str
    seeded: object
    engine: object


@pytest.fixture(scope="session")
def engine_run(build_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The seed's engine run, made once per test run: under pytest-xdist the browser files land on
    both workers, and each worker's session would otherwise make it again (the broken tree's failed
    build, which no cache keeps, and the co-run of the quick battery on two builds). The workers of
    one run share it through a file in the run's temporary folder, keyed by the run's id, so no
    later run (another checkout, other code) can read it."""
    from tests.service.dashboard.browser.engine_seed import run_engine

    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:  # one process: nothing to share
        return run_engine(build_cache_dir)
    shared = tmp_path_factory.getbasetemp().parent / f"engine-run-{run_id}.pickle"
    with open(shared.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits here while the first makes it
        if shared.exists():
            return pickle.loads(shared.read_bytes())
        made = run_engine(build_cache_dir)
        shared.write_bytes(pickle.dumps(made))
        return made


@pytest.fixture(scope="session")
def dashboard(engine_run, tmp_path_factory) -> Dashboard:
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from service.db.migrate import upgrade_to_head
    from tests.service.dashboard.browser.engine_seed import seed

    name = f"optdrift_dash_{os.getpid()}"
    database_url = create_database(name)
    upgrade_to_head(database_url)
    engine = create_engine(database_url)
    with Session(engine) as session:
        seeded = seed(session, engine_run)
        session.commit()
    engine.dispose()
    home = tmp_path_factory.mktemp("dash-home")
    port = free_port()
    # No maintenance loop: it would reap the seeded "running" run, whose worker does not exist.
    env = {"OPTDRIFT_HOME": str(home), "OPTDRIFT_DATABASE_URL": database_url,
           "OPTDRIFT_BROKER_URL": API_TEST_REDIS, "OPTDRIFT_MAINTENANCE_INTERVAL_S": "0",
           "OPTDRIFT_PUBLIC_URL": f"http://127.0.0.1:{port}"}
    server = start_process(["serve", "--port", str(port), "--no-worker"], env, home / "serve.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout_s=90)
        yield Dashboard(url=f"http://127.0.0.1:{port}", database_url=database_url, seeded=seeded,
                        engine=engine_run)
    finally:
        stop_process(server)
        print((home / "serve.log").read_text()[-3000:])
        drop_database(name)


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


class ConsoleWatch:
    """Collects console errors and uncaught page errors of one page."""

    def __init__(self, page) -> None:  # noqa: ANN001
        self.errors: list[str] = []
        page.on("console", lambda message: self.errors.append(f"console.{message.type}: {message.text}")
                if message.type == "error" else None)
        page.on("pageerror", lambda error: self.errors.append(f"page error: {error}"))


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.console_watch = ConsoleWatch(page)
    yield page
    context.close()


@pytest.fixture
def phone_page(browser):
    context = browser.new_context(viewport={"width": 390, "height": 844}, device_scale_factor=1,
                                  is_mobile=True, has_touch=True)
    page = context.new_page()
    page.console_watch = ConsoleWatch(page)
    yield page
    context.close()
