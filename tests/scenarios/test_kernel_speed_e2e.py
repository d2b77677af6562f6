"""The kernels' own speed end to end on the CPU path: a real `serve` (embedded default: SQLite and
the filesystem broker) with its real worker, which runs a one-case battery and, after the verdict,
times every bundled kernel in a kernel host (a task of its own; OPTDRIFT_SPEED_BUDGET_S turns it on
for this CPU worker) and stores the samples with the run; the API, the CLI and the dashboard show them against the baseline's.
(A project's `kernel_speed = false` and the budget's defaults: tests/service/domain/test_kernel_speed.py.)

The speed verdict is not asserted: wall-clock timings on this shared CPU are not stable between
runs (tests/service/domain/test_kernel_speed.py says why); the noise model is tested on synthetic samples.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from service.cli.client import OptdriftClient
from tests.service_fixtures import REPO_ROOT, free_port, shared_build_cache, start_process, stop_process, wait_http

BATTERY = {"name": "tiny", "version": 1, "groups": [{"optimizers": ["adam"], "sizes": [64], "steps": 2}]}


def _tree(root: Path) -> Path:
    """The bundled csrc (built once, shared: its digest is the folder's) with a one-case battery."""
    shutil.copytree(REPO_ROOT / "csrc", root / "csrc")
    (root / "tiny.json").write_text(json.dumps(BATTERY))
    (root / "optdrift.toml").write_text('[project]\nbattery = "tiny.json"\n[build]\nsource_dir = "csrc"\n')
    return root


def test_a_worker_times_the_kernels_and_the_service_shows_them(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"OPTDRIFT_BUILD_CACHE_DIR": shared_build_cache(), "OPTDRIFT_HOME": str(tmp_path / "home"),
           "OPTDRIFT_MAINTENANCE_INTERVAL_S": "2", "OPTDRIFT_HEARTBEAT_INTERVAL_S": "2",
           "OPTDRIFT_SPEED_BUDGET_S": "120", "OPTDRIFT_SPEED_SIZES": "[4096]", "OPTDRIFT_SPEED_REPEATS": "5",
           "OPTDRIFT_DATABASE_URL": "", "OPTDRIFT_BROKER_URL": "", "OPTDRIFT_PUBLIC_URL": ""}
    server = start_process(["serve", "--port", str(port)], env, tmp_path / "serve.log")
    try:
        wait_http(f"{url}/readyz", timeout_s=90)
        token = (tmp_path / "home" / "admin-token").read_text().strip()
        client = OptdriftClient(url, token=token)
        client.ensure_project("speedy")
        tree = _tree(tmp_path / "tree")
        ids = {}
        for sha, parents in (("base", []), ("child", ["base"])):
            ids[sha] = client.submit_commit(project="speedy", sha=sha, parents=parents, source_dir=tree)["runs"][0]["id"]
        finished = dict(zip(ids, client.wait(list(ids.values()), timeout_s=600)))
        for sha, run in finished.items():
            assert run["status"] == "done", (sha, run["error"])

        # the timing is a task of its own, queued after each run's verdict: wait for both
        deadline = time.monotonic() + 300
        while not all(client.speed(ids[sha])["note"] for sha in ids) and time.monotonic() < deadline:
            time.sleep(1)
        speed = client.speed(ids["child"])
        assert speed["baseline_run_id"] == ids["base"] and speed["device"] == "cpu"
        assert len(speed["kernels"]) == 24 and all(k["error"] is None and k["samples"] == 5 for k in speed["kernels"])
        assert speed["verdict"] in ("same", "slower", "faster")
        assert {k["verdict"] for k in speed["kernels"]} <= {"same", "slower", "faster"}
        assert all(k["ratio_low"] <= k["ratio"] <= k["ratio_high"] for k in speed["kernels"])
        assert client.speed(ids["base"])["verdict"] == "no-baseline"
        assert speed["note"].startswith("24 kernel timings on cpu in ")  # the worker's note on the run

        # the CLI: the same document; the exit code ignores speed unless --fail-on-slowdown
        cli_env = {**os.environ, "OPTDRIFT_TOKEN": token, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "200"}  # a wide log
        shown = subprocess.run([sys.executable, "-m", "service.cli", "speed", str(ids["child"]), "--format", "json",
                                "--url", url], capture_output=True, text=True, env=cli_env, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout) == speed
        strict = subprocess.run([sys.executable, "-m", "service.cli", "speed", str(ids["child"]), "--fail-on-slowdown",
                                 "--url", url], capture_output=True, text=True, env=cli_env, timeout=60)
        assert strict.returncode == (6 if speed["verdict"] == "slower" else 0), strict.stderr
        assert "adam/8bit_blockwise" in strict.stdout and f"run {ids['child']} kernel speed" in strict.stdout

        page = client.http.get(f"/runs/{ids['child']}/speed").text
        assert page.count('data-kernel="') == 24 and f'href="/runs/{ids["base"]}/speed"' in page
        client.close()
    finally:
        stop_process(server)
        print((tmp_path / "serve.log").read_text()[-5000:])
