"""Issue 43, "No run can wedge a worker": real processes (`optdrift serve --no-worker`, `optdrift
worker` in its production prefork pool) on PostgreSQL and a throwaway Redis this test starts.

1. A tree whose build sleeps for ever (its own limit, 300 s, is far off): a cancel ends the run
   within seconds, its box killed; a SIGTERM to the worker ends the next such run within seconds,
   queued again for another worker, and the worker exits (worker/jobs/watchdog.py, worker/tasks.py).
2. A tree whose build wedges the task thread in open() on a FIFO planted in the build's scratch
   (the finding; nothing in Python interrupts that open): the worker is killed mid-run (kill -9),
   the reaper queues the run again once, the next worker wedges again and its watchdog ends the
   run `error` at the build phase's deadline (+ its grace) and ends the pool process; the run is
   never handed out again (the poison rule), its page says attempt 2 and why, and the same worker
   then completes a normal commit run.

The wedge is the finding's shape, injected into the worker (never into the API) by a
sitecustomize on its PYTHONPATH that makes Workspace.build open a FIFO in the job's folder when
the tree holds WEDGE_MARKER: no build code of the worker's own can be made to block like that any
more (the lead's safe opens), and the guarantee is for the next bug.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime

import httpx
import pytest

from tests.processes import matching, wait_gone
from tests.scenarios.test_faults import ThrowawayRedis
from tests.service_fixtures import (
    REPO_ROOT, create_database, drop_database, free_port, make_archive, start_process, stop_process, wait_http,
)

pytestmark = pytest.mark.slow
PROJECT = "wedge"
FINAL = ("done", "failed", "cancelled", "error")
WEDGE_MARKER = "WEDGE_THE_WORKER"
SLEEP_S = 313  # the sleeping build's `sleep` (an odd number its process is found by)
# How long past an event a run or a worker may take to show it: the watchdog ticks every 0.1 s and
# polls cancels every 1 s; the rest is a loaded two-core machine answering HTTP and PostgreSQL.
FEW_S = 6.0

CONFIG = '''[project]
adapter = "steady_adapter"
adapter_path = ["."]
battery = "battery.json"

[build]
kind = "command"
commands = [{command}]
library = "out.txt"
'''
ADAPTER = '''
import torch

from worker.adapters.base import HandedOverStates, ProjectAdapter


class Momentum(HandedOverStates):
    def init_states(self, case, param):
        return {"momentum_buffer": torch.zeros_like(param)}

    def step_states(self, case, param, grad, states, step):
        states["momentum_buffer"].mul_(0.9).add_(grad)
        param.sub_(case.hyper["lr"] * states["momentum_buffer"])


class SteadyAdapter(ProjectAdapter):
    name = "steady"

    def load(self, library):
        self.library = library

    def families(self):
        return {"32bit": Momentum()}
'''
BATTERY = json.dumps({"name": "tiny", "version": 1, "groups": [
    {"optimizers": ["momentum"], "sizes": [8], "steps": 2, "seeds": [0, 1]}]})
# In the worker only (OPTDRIFT_TEST_WEDGE=1; a kernel host's environment is an allowlist without it).
SITECUSTOMIZE = '''
import os

if os.environ.get("OPTDRIFT_TEST_WEDGE") == "1":
    from worker.jobs import workspace

    _build = workspace.Workspace.build

    def _wedging_build(self, job, policy):
        if (job.source_dir / "{marker}").exists():
            planted = self.root / "planted.fifo"
            os.mkfifo(planted)
            open(planted, "rb")  # no writer ever comes: blocked in open() for ever
        return _build(self, job, policy)

    workspace.Workspace.build = _wedging_build
'''.format(marker=WEDGE_MARKER)


def _tree(command: str, *extra: str) -> bytes:
    return make_archive({"optdrift.toml": CONFIG.format(command=json.dumps(command)), "battery.json": BATTERY,
                         "steady_adapter.py": ADAPTER, **{name: name for name in extra}})


SLEEPING = _tree(f"sleep {SLEEP_S}")
NORMAL = _tree("sh -c 'echo built > out.txt'")
WEDGING = _tree("sh -c 'echo built > out.txt'", WEDGE_MARKER)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    folder = tmp_path_factory.mktemp("wedged")
    (folder / "site").mkdir()
    (folder / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    redis_server = ThrowawayRedis(folder)
    db_name = f"optdrift_wedged_{os.getpid()}"
    port = free_port()
    env = {"OPTDRIFT_HOME": str(folder / "home"), "OPTDRIFT_DATABASE_URL": create_database(db_name),
           "OPTDRIFT_BROKER_URL": redis_server.url, "OPTDRIFT_PUBLIC_URL": f"http://127.0.0.1:{port}",
           "OPTDRIFT_BUILD_CACHE_DIR": str(folder / "build-cache"), "OPTDRIFT_FAST_ENGINE": "false",
           "OPTDRIFT_MAINTENANCE_INTERVAL_S": "1", "OPTDRIFT_HEARTBEAT_INTERVAL_S": "1",
           "OPTDRIFT_STALE_AFTER_S": "5", "OPTDRIFT_MAX_ATTEMPTS": "3", "OPTDRIFT_RETRY_BACKOFF_S": "1"}
    api = start_process(["serve", "--port", str(port), "--no-worker"], env, folder / "api.log")
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    workers: list = []
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=120)
        http.headers["Authorization"] = f"Bearer {(folder / 'home' / 'admin-token').read_text().strip()}"
        answer = http.post("/api/v1/projects", json={"name": PROJECT, "environments": ["cpu"]})
        assert answer.status_code == 201, answer.text
        yield {"http": http, "env": env, "folder": folder, "workers": workers}
    finally:
        for process in [*workers, api]:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        stop_process(api)
        http.close()
        redis_server.stop()
        for log in sorted(folder.glob("*.log")):
            print(f"--- {log.name}\n{log.read_text(errors='replace')[-20000:]}")
        drop_database(db_name)


def _worker(service: dict, name: str, *options: str, **settings: str):  # noqa: ANN202
    env = {**service["env"], **settings}
    process = start_process(["worker", "--loglevel", "INFO", *options], env, service["folder"] / f"{name}.log")
    service["workers"].append(process)
    return process


def _commit(http: httpx.Client, sha: str, tree: bytes) -> int:
    answer = http.post(f"/api/v1/projects/{PROJECT}/commits", data={"sha": sha},
                       files={"archive": ("t.tar.gz", tree, "application/gzip")})
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
        time.sleep(0.1)
    raise AssertionError(f"run {run_id}: not {what} within {timeout_s:g} s: {_run(http, run_id)}")


def _sleeping_box(timeout_s: float) -> None:
    """Until the sleeping build's `sleep` runs (in its box)."""
    deadline = time.monotonic() + timeout_s
    while not matching(f"^sleep {SLEEP_S}$") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert matching(f"^sleep {SLEEP_S}$"), f"the sleeping build did not start within {timeout_s:g} s"


# prefork: production's pool (the job in a pool process, SIGTERM relayed to it); solo: `serve`'s
# embedded worker (the job in the process that gets the SIGTERM).
@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_cancel_and_sigterm_end_a_build_that_sleeps_within_seconds(service, pool: str) -> None:
    http = service["http"]
    worker = _worker(service, f"sleepy-worker-{pool}", "--pool", pool, OPTDRIFT_MAX_BUILD_S="300",
                     OPTDRIFT_WATCHDOG_SLACK_S="60", OPTDRIFT_WATCHDOG_GRACE_S="5")
    cancelled = _commit(http, f"sleeps-then-cancelled-{pool}", SLEEPING)
    _sleeping_box(timeout_s=180)
    assert http.post(f"/api/v1/runs/{cancelled}/cancel").status_code == 200
    asked = time.monotonic()
    run = _wait(http, cancelled, lambda run: run["status"] in FINAL, "ended by the cancel", timeout_s=60)
    took = time.monotonic() - asked
    assert (run["status"], run["error"]) == ("cancelled", "cancelled on request"), run
    assert took < FEW_S, f"the cancel took {took:.1f} s"
    assert not wait_gone(f"^sleep {SLEEP_S}$", timeout_s=FEW_S), "the build's box outlived the cancel"

    stopped = _commit(http, f"sleeps-then-sigterm-{pool}", SLEEPING)
    _sleeping_box(timeout_s=60)
    assert _run(http, stopped)["status"] == "building"
    os.kill(worker.pid, signal.SIGTERM)  # the worker's main process, as a supervisor stops it
    asked = time.monotonic()
    run = _wait(http, stopped, lambda run: run["status"] != "building", "given back", timeout_s=60)
    took = time.monotonic() - asked
    assert run["status"] == "queued" and "shut down mid-run" in run["error"], run
    assert run["attempt"] == 0, run  # the worker's going is not the run's failure
    assert took < FEW_S, f"the SIGTERM took {took:.1f} s to give the run back"
    worker.wait(timeout=FEW_S + 10)  # Celery's warm shutdown no longer waits for the build
    assert not wait_gone(f"^sleep {SLEEP_S}$", timeout_s=FEW_S)
    assert http.post(f"/api/v1/runs/{stopped}/cancel").json()["status"] == "cancelled"  # nothing left queued


def test_a_run_that_wedges_workers_ends_error_is_not_sent_again_and_the_worker_goes_on(service) -> None:
    http = service["http"]
    # Build phase deadline: 8 s (OPTDRIFT_MAX_BUILD_S) + 1 s of slack; then 2 s of grace.
    wedge_env = {"PYTHONPATH": f"{service['folder'] / 'site'}{os.pathsep}{REPO_ROOT}", "OPTDRIFT_TEST_WEDGE": "1",
                 "OPTDRIFT_MAX_BUILD_S": "8", "OPTDRIFT_WATCHDOG_SLACK_S": "1", "OPTDRIFT_WATCHDOG_GRACE_S": "2"}
    deadline_s, grace_s = 8 + 1, 2
    first = _worker(service, "wedged-worker-1", **wedge_env)
    wedging = _commit(http, "wedges", WEDGING)
    _wait(http, wedging, lambda run: run["status"] == "building", "building", timeout_s=180)
    time.sleep(1.0)  # blocked in open() by now, well before its deadline
    os.killpg(first.pid, signal.SIGKILL)  # the worker dies mid-run (kill -9 of its process group)
    first.wait()
    assert _run(http, wedging)["status"] == "building"

    second = _worker(service, "wedged-worker-2", **wedge_env)
    # The reaper queues it again (its first lost worker), the second worker takes it and wedges.
    again = _wait(http, wedging, lambda run: run["attempt"] == 2 and run["status"] == "building",
                  "taken by the second worker", timeout_s=120)
    assert again["workers_lost"] == 1, again
    ended = _wait(http, wedging, lambda run: run["status"] in FINAL, "ended by the watchdog",
                  timeout_s=deadline_s + grace_s + 60)
    took = (datetime.fromisoformat(ended["finished_at"]) - datetime.fromisoformat(ended["started_at"])).total_seconds()
    assert ended["status"] == "error", ended
    assert "build phase passed the watchdog's deadline of 9 s" in ended["error"], ended["error"]
    assert "stayed blocked 2 s after its boxes were killed" in ended["error"], ended["error"]
    assert "not handed to another" in ended["error"], ended["error"]
    assert deadline_s <= took < deadline_s + grace_s + FEW_S, f"ended {took:.1f} s after it started"

    # Never handed out again: the re-delivered task finds it final; the maintenance loop leaves it.
    time.sleep(5)
    still = _run(http, wedging)
    assert (still["status"], still["attempt"]) == ("error", 2), still
    page = http.get(f"/runs/{wedging}")
    assert page.status_code == 200
    assert "(attempt 2, 1 worker(s) lost mid-run)" in page.text and "passed the watchdog&#39;s deadline" in page.text

    # The pool process the watchdog ended was replaced: the worker goes on with a normal commit run.
    assert second.poll() is None, "the worker's main process should have survived its pool process"
    normal = _commit(http, "normal", NORMAL)
    done = _wait(http, normal, lambda run: run["status"] in FINAL, "finished", timeout_s=300)
    assert done["status"] == "done", done
    assert "run %d: its thread is still blocked" % wedging in (service["folder"] / "wedged-worker-2.log").read_text()
