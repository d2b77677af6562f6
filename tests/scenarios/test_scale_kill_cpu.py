"""`kill -9` of one of two live workers mid-run, on the embedded default (issue 19): the other
worker finishes the run exactly once.

bench/scale_kill.py does the work with real processes on loopback (the API, two `optdrift worker
--name` processes on SQLite + the folder broker, SIGKILL of the whole process tree of the worker
holding the run, the API's reaper re-queuing it on its missed heartbeats); this test runs it and
asserts what it read back from the database. tests/scenarios/test_faults.py kills the only worker (on
PostgreSQL + Redis) and starts a second one afterwards; here the second worker is alive and idle
all along, and must be the one that finishes the run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service_fixtures import REPO_ROOT, shared_build_cache

pytestmark = pytest.mark.slow


def test_kill_9_of_one_of_two_workers_mid_run(tmp_path: Path) -> None:
    result_file = tmp_path / "kill.json"
    bench = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "scale_kill.py"), "--config", "cpu=2", "--battery", "quick",
         "--build-cache", shared_build_cache(), "--logs", str(tmp_path / "logs"), "--json-out", str(result_file)],
        capture_output=True, text=True, timeout=1500)
    print(bench.stdout[-4000:], bench.stderr[-4000:])
    assert bench.returncode == 0, bench.stdout[-2000:]
    result = json.loads(result_file.read_text())
    killed, stored = result["killed"], result["stored"]
    assert killed["attempt"] == 1 and 0 < killed["cases_done"] < killed["cases_total"], killed  # mid-run
    assert stored["status"] == "done" and stored["attempt"] == 2, stored
    assert stored["verdicts"] == 1
    assert stored["trajectory_rows"] == stored["distinct_cases"] == stored["cases_total"] == killed["cases_total"]
    assert stored["duplicate_rows_in_db"] == 0 and stored["base_attempt"] == 1
    finisher = result["finished_by"]
    assert finisher["pid"] not in killed["pids"] and finisher["label"] in ("w0", "w1")
    assert finisher["label"] != killed["label"], (finisher, killed)
    assert all(result["checks"].values()), result["checks"]
