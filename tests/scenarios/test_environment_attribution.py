"""A build variant's change, attributed, for real (issue 36): the bundled kernels at one commit built
by the worker's gcc as it is (`cpu`), with `-ffp-contract=off` (`cpu+nocontract`: identical digests on
x86-64 without FMA instructions) and with `-mfma` (`cpu+fma`: gcc contracts `a*b+c` into one
rounding and Adam moves from step 1). One Celery worker serves all three; PostgreSQL and Redis are
real, builds shared with the other scenarios through the digest-keyed build cache.

The variant that changes nothing opens no attribution job and reads unchanged; the one that moves
Adam is attributed by the worker (worker/jobs/environment_attribution.py) while `optdrift compare
--run` waits for it, and reads, through the API, the CLI and the dashboard: changed from step 1,
rounding-level, "looks like FMA contraction" naming -mfma and the ulps."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.cli.client import OptdriftClient, pack_directory
from tests.service_fixtures import (
    E2E_REDIS, REPO_ROOT, create_database, drop_database, flush_redis, free_port, shared_build_cache, start_process,
    stop_process, wait_http,
)
from tests.worker.test_environment_variants import VARIANTS

pytestmark = pytest.mark.slow
SHA = "f" * 40
# A rounding-level change may reach, in ulps of the case's scale, the first divergent step's
# allowance (8 for float32) plus 2 per later step (worker/attribution/analysis.py rounding_allowance):
# a contraction that rounds once less per multiply-add stays well inside it.
FIRST_STEP_ULPS_FLOAT32, ULPS_PER_STEP = 8.0, 2.0


def _cli(*args: str, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO_ROOT, timeout=timeout_s)


def _rows(database_url: str) -> list[tuple]:
    from sqlalchemy import create_engine, text

    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            return list(connection.execute(text(
                "SELECT environment_a, environment_b, status, changed_cases FROM environment_attributions")))
    finally:
        engine.dispose()


def test_a_variant_that_changes_nothing_and_one_that_contracts_adam(tmp_path: Path) -> None:
    name = f"optdrift_envattr_{os.getpid()}"
    database_url = create_database(name)
    flush_redis(E2E_REDIS)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTDRIFT_")}
    env["COLUMNS"] = "400"  # one line per row: the label is matched whole
    env.update({"OPTDRIFT_HOME": str(tmp_path / "home"), "OPTDRIFT_DATABASE_URL": database_url,
                "OPTDRIFT_BROKER_URL": E2E_REDIS, "OPTDRIFT_PUBLIC_URL": url, "PYTHONPATH": str(REPO_ROOT),
                "OPTDRIFT_BUILD_CACHE_DIR": shared_build_cache(), "OPTDRIFT_BUILD_VARIANTS": json.dumps(VARIANTS),
                "OPTDRIFT_MAINTENANCE_INTERVAL_S": "2", "OPTDRIFT_HEARTBEAT_INTERVAL_S": "2"})
    api = start_process(["serve", "--port", str(port), "--no-worker"], env, tmp_path / "api.log")
    worker = None
    try:
        wait_http(f"{url}/readyz", timeout_s=90)
        worker = start_process(["worker", "--loglevel", "INFO"], env, tmp_path / "worker.log")
        token = (tmp_path / "home" / "admin-token").read_text().strip()
        client = OptdriftClient(url, token=token)
        client.ensure_project("attr", environments=["cpu", "cpu+nocontract", "cpu+fma"], default_battery="quick")
        runs = client._check(client.http.post("/api/v1/projects/attr/commits", data={
            "sha": SHA, "environments": "cpu,cpu+nocontract", "release_tag": "v1"},
            files={"archive": ("s.tar.gz", pack_directory(REPO_ROOT / "csrc"), "application/gzip")}))["runs"]
        finished = client.wait([r["id"] for r in runs], timeout_s=900)
        assert all(r["status"] == "done" for r in finished), [(r["environment"], r.get("error")) for r in finished]

        def compare(b: str) -> dict:
            answer = client.http.get("/api/v1/projects/attr/environment-comparison",
                                     params={"commit": SHA, "a": "cpu", "b": b})
            assert answer.status_code == 200, answer.text
            return answer.json()

        # Another flag, another build, the same digests at every step: unchanged, and no job.
        same = compare("cpu+nocontract")
        assert same["same_build"] is False and same["comparison"]["verdict"] == "unchanged"
        assert same["attribution_status"] == "none" and _rows(database_url) == []

        env["OPTDRIFT_TOKEN"] = token
        upgrade = _cli("compare", "--project", "attr", "--commit", SHA, "--env", "cpu", "--env", "cpu+fma", "--run",
                       "--timeout", "900", "--detail-timeout", "900", "--url", url, env=env, timeout_s=1900)
        assert upgrade.returncode == 1, upgrade.stdout + upgrade.stderr
        assert f"running {SHA[:12]} in cpu+fma" in upgrade.stderr
        assert "waiting for the attribution of" in upgrade.stderr, upgrade.stderr
        assert "looks like FMA contraction: rounding-level" in upgrade.stdout, upgrade.stdout
        assert "cpu+fma builds with -mfma, cpu without" in upgrade.stdout
        assert _rows(database_url) == [("cpu", "cpu+fma", "done", _rows(database_url)[0][3])]

        moved = compare("cpu+fma")
        assert moved["comparison"]["verdict"] == "changed" and moved["attribution_status"] == "done"
        adam = [c for c in moved["comparison"]["cases"] if c["optimizer"] == "adam" and c["family"] == "32bit"
                and c["param_dtype"] == "float32"]
        assert adam and all(c["verdict"] == "changed" and c["first_divergent_step"] == 1 for c in adam), adam
        # Every changed case has its per-step max |B - A|, zero before step 1 has nothing to be.
        assert all(c["max_abs_diff_per_step"] and c["max_abs_diff_per_step"][0] > 0 for c in adam)
        analysed = [c for c in adam if c["attribution"]["class"] != "unknown"]  # the others are sampled out
        assert analysed, [c["attribution"] for c in adam]
        for case in analysed:
            call, steps = case["attribution"], len(case["max_abs_diff_per_step"])
            assert (call["class"], call["looks_like"]) == ("rounding-level", "fma-contraction"), call
            assert call["evidence"]["flags"] == ["-mfma"] and "-mfma" in call["label"]
            assert 0 < case["max_ulps"] <= FIRST_STEP_ULPS_FLOAT32 + ULPS_PER_STEP * (steps - 1), case["max_ulps"]
            assert math.isfinite(call["evidence"]["first_step_ulps"])
        print("cpu+fma against cpu: " + "; ".join(f"{c['case_id']} {c['max_ulps']} ulps" for c in analysed))

        page = client.http.get("/projects/attr/environments").text
        assert "looks like FMA contraction, -mfma" in page
        client.close()
    finally:
        for process in (worker, api):
            if process is not None:
                stop_process(process)
        if (tmp_path / "worker.log").exists():
            print((tmp_path / "worker.log").read_text()[-5000:])
        drop_database(name)
