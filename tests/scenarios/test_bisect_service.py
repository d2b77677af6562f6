"""`optdrift bisect` through the service: a real API process, a real Celery worker, PostgreSQL and
Redis (db 7), on a short history of the fixture repository (tests/service/cli/test_bisect.py make_history):
7 commits after good, Adam's decay ordering at 2, AdEMAMix's at 5, a README-only commit at 4; a
worker running two runs at once (a round's midpoints go together).

Then the same bisection again, narrowed with --case: every commit it needs has a stored run, so it
submits nothing; and a --case that matches no case is a one-line error, exit 2.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
from typer.testing import CliRunner

from service.cli import app
from service.cli.client import OptdriftClient
from tests.service_fixtures import (
    create_database, drop_database, flush_redis, free_port, shared_build_cache, start_process, stop_process,
    wait_http,
)
from tests.service.cli.test_bisect import History, make_history

REDIS = "redis://127.0.0.1:6379/7"  # its own db: other service tests run workers on 8 and 10-14
PROJECT = "bisect"
ADAM_AT, ADEMAMIX_AT = 2, 5
runner = CliRunner()
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bisect-service")
    name = f"optdrift_bisect_{os.getpid()}"
    env = {"OPTDRIFT_HOME": str(tmp / "home"), "OPTDRIFT_DATABASE_URL": create_database(name),
           "OPTDRIFT_BROKER_URL": REDIS, "OPTDRIFT_BUILD_CACHE_DIR": shared_build_cache(),
           "OPTDRIFT_MAINTENANCE_INTERVAL_S": "2", "OPTDRIFT_HEARTBEAT_INTERVAL_S": "2"}
    flush_redis(REDIS)
    port = free_port()
    env["OPTDRIFT_PUBLIC_URL"] = url = f"http://127.0.0.1:{port}"
    api = start_process(["serve", "--port", str(port), "--no-worker"], env, tmp / "api.log")
    worker = None
    try:
        wait_http(f"{url}/readyz", timeout_s=90)
        worker = start_process(["worker", "--concurrency", "2", "--loglevel", "INFO"], env, tmp / "worker.log")
        token = (tmp / "home" / "admin-token").read_text().strip()
        OptdriftClient(url, token=token).ensure_project(PROJECT)
        yield url, token
    finally:
        if worker is not None:
            # Its own session (start_process): the group is the worker and its pool children. A warm
            # shutdown would wait for a co-run the test no longer needs.
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        stop_process(api)
        for log in ("api.log", "worker.log"):
            if (tmp / log).exists():
                print((tmp / log).read_text()[-3000:])
        drop_database(name)
        flush_redis(REDIS)


@pytest.fixture(scope="module")
def short_history(tmp_path_factory) -> History:
    return make_history(tmp_path_factory.mktemp("bisect-repo"), commits_after_good=7, adam_at=ADAM_AT,
                        ademamix_at=ADEMAMIX_AT)


def _bisect(url: str, token: str, history: History, *extra: str):  # noqa: ANN202
    return runner.invoke(app, ["bisect", "--repo", str(history.repo), "--good", history.shas[0],
                               "--bad", history.shas[-1], "--project", PROJECT, "--url", url,
                               "--format", "json", *extra], env={"OPTDRIFT_TOKEN": token})


def test_bisect_through_the_service_then_again_from_stored_runs(service, short_history) -> None:
    url, token = service
    result = _bisect(url, token, short_history)
    assert result.exit_code == 0, result.stderr + result.stdout
    document = json.loads(result.stdout)
    by_optimizer = {f["optimizer"]: f for f in document["findings"]}
    assert set(by_optimizer) == {"adam", "ademamix"}, document
    assert by_optimizer["adam"]["first_changed"] == short_history.shas[ADAM_AT]
    assert by_optimizer["ademamix"]["first_changed"] == short_history.shas[ADEMAMIX_AT]
    assert all(f["exact"] and f["first_divergent_step"] == 1 for f in by_optimizer.values())
    tested = {t["sha"]: t for t in document["tested"]}
    assert not set(tested) & short_history.outside_source
    # One submission per tested commit (good and bad included), each a new run on the worker.
    assert document["builds"] == len(tested) and all(t["run_id"] for t in tested.values())
    # 6 candidate commits: at most ceil(log2 6) = 3 midpoints per change, sharing the first.
    assert document["candidate_commits"] == 6
    assert len(tested) - 2 <= 2 * 3 - 1, document["tested"]
    # Progress while it waited: the CI-log lines of service.cli.report (no terminal here).
    assert "round 1:" in result.stderr and re.search(r"^run \d+: (queued|running|done)", result.stderr, re.M)

    # Again, narrowed to Adam's case: the service has a run of every commit it asks for.
    again = _bisect(url, token, short_history, "--case", "adam.*")
    assert again.exit_code == 0, again.stderr + again.stdout
    narrowed = json.loads(again.stdout)
    assert [f["first_changed"] for f in narrowed["findings"]] == [short_history.shas[ADAM_AT]]
    assert narrowed["builds"] == 0 and all(t["how"].startswith("stored run") for t in narrowed["tested"])

    nothing = _bisect(url, token, short_history, "--case", "sgd*")
    assert nothing.exit_code == 2
    # After the progress lines (both ends came from stored runs), one error line.
    last = nothing.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --case 'sgd*' matches none of the 3 cases"), nothing.stderr


def test_unknown_project_is_exit_2(service, short_history) -> None:
    url, token = service
    result = runner.invoke(app, ["bisect", "--repo", str(short_history.repo), "--good", short_history.shas[0],
                                 "--bad", short_history.shas[-1], "--project", "nope", "--url", url],
                           env={"OPTDRIFT_TOKEN": token})
    assert result.exit_code == 2 and "404" in result.stderr and "nope" in result.stderr, result.stderr
