"""A co-run that does not reproduce a stored trajectory is a finding of the run (issue 44, item 5).

After a changed verdict the worker re-runs the changed cases in fresh kernel hosts, the commit's
build and the baseline's (worker/jobs/corun.py). Kernels are deterministic in one environment, so
the re-run reproduces the stored digests; when it does not, the kernel does not reproduce itself.
That used to be a warning in the worker's log: the verdict still read changed, nothing was
remembered, and `submit --wait` polled for the per-step diffs that never came until
--detail-timeout (600 s) had passed.

The fixture is tests/fixtures/racy_project with RACY_PER_PROCESS: its open-stream case adds noise
from a seed drawn once per process, so the run's own repeats (one kernel host) agree and the case
reads changed against the deterministic baseline, while the co-run's host draws another seed.

- end to end through `optdrift serve` (its worker, the embedded default) and the CLI as action.yml
  calls it: `submit --wait` returns within seconds of the co-run with exit 5 and the finding; a
  verify run of the same tree reads the same verdict case by case; the case is remembered for the
  project (unsteady_cases) each time.
- `--wait` stops at once for a co-run that gave up (the server without a worker; the verdict
  written into its database as the worker writes it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.scenarios.test_wait_detail import _baseline_run, _changed_verdict, _session, _submit_waiting, server  # noqa: F401
from tests.service.cli.test_cli_contract import OPTDRIFT
from tests.service_fixtures import REPO_ROOT, free_port, shared_build_cache, start_process, stop_process, wait_http

FIXTURE = REPO_ROOT / "tests" / "fixtures" / "racy_project"
ADAPTER = "tools/racy_momentum.py"
OPEN = ".open."  # the racy case's id has it; the closed-stream case's does not
# Far above a run of this two-case battery and its co-run (tens of seconds), far below the default
# --detail-timeout (600 s) the old code waited out.
WITHIN_S = 300


def _tree(folder: Path, *, racy_per_process: bool) -> Path:
    shutil.copytree(FIXTURE, folder, ignore=shutil.ignore_patterns("__pycache__"))
    if racy_per_process:
        adapter = folder / ADAPTER
        adapter.write_text(adapter.read_text().replace("\nRACY_PER_PROCESS = False\n", "\nRACY_PER_PROCESS = True\n"))
    return folder


def _cli(home: Path, url: str, *args: str, timeout_s: float) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTDRIFT_")}
    env.update({"OPTDRIFT_HOME": str(home), "COLUMNS": "300"})
    began = time.monotonic()
    result = subprocess.run([str(OPTDRIFT), *args, "--url", url], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=timeout_s)
    return result, time.monotonic() - began


def _cases(http, run_id: int) -> dict[str, dict]:  # noqa: ANN001
    return {case["case_id"]: case for case in http.get(f"/api/v1/runs/{run_id}/cases").json()["data"]}


@pytest.mark.slow
def test_a_corun_that_does_not_reproduce_is_the_runs_finding_through_submit_and_verify(tmp_path: Path) -> None:
    import httpx
    from sqlalchemy import create_engine, text

    port, home = free_port(), tmp_path / "home"
    env = {"OPTDRIFT_HOME": str(home), "OPTDRIFT_BUILD_CACHE_DIR": shared_build_cache(),
           "OPTDRIFT_MAINTENANCE_INTERVAL_S": "2", "OPTDRIFT_HEARTBEAT_INTERVAL_S": "2",
           "OPTDRIFT_DATABASE_URL": "", "OPTDRIFT_BROKER_URL": "", "OPTDRIFT_PUBLIC_URL": ""}
    server_process = start_process(["serve", "--port", str(port)], env, tmp_path / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/readyz", timeout_s=90)
        token = (home / "admin-token").read_text().strip()
        http = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {token}"})
        assert http.post("/api/v1/projects", json={"name": "racy", "environments": ["cpu"]}).status_code == 201
        base = _tree(tmp_path / "base", racy_per_process=False)
        racy = _tree(tmp_path / "racy", racy_per_process=True)
        first, _ = _cli(home, url, "submit", "--project", "racy", "--commit", "base", "--source", str(base),
                        "--allow-no-baseline", "--wait", timeout_s=WITHIN_S)
        assert first.returncode == 0, (first.stdout, first.stderr)

        # The commit run, as action.yml calls it: --wait with the default --detail-timeout (600 s).
        commit, commit_s = _cli(home, url, "submit", "--project", "racy", "--commit", "racy", "--parent", "base",
                                "--source", str(racy), "--wait", timeout_s=WITHIN_S)
        assert commit.returncode == 5, (commit.stdout, commit.stderr)
        assert commit_s < WITHIN_S and "still coming" not in commit.stderr, (commit_s, commit.stderr)
        said = " ".join(commit.stdout.split())
        assert "nondeterministic: the co-run re-ran 1 case(s) and did not reproduce" in said, commit.stdout
        assert "(commit): from step 1, stored" in said, commit.stdout

        verify, verify_s = _cli(home, url, "verify", "--project", "racy", "--base", "base", "--source", str(racy),
                                timeout_s=WITHIN_S)
        assert verify.returncode == 5 and verify_s < WITHIN_S, (verify.stdout, verify.stderr)

        commit_run = http.get("/api/v1/projects/racy/commits/racy").json()["runs"][0]["id"]
        verify_run = int(verify.stdout.split("verify run ", 1)[1].split(":", 1)[0])
        verdicts = {run_id: http.get(f"/api/v1/runs/{run_id}").json()["verdict"] for run_id in (commit_run, verify_run)}
        cases = {run_id: _cases(http, run_id) for run_id in verdicts}
        for run_id, verdict in verdicts.items():
            assert verdict["outcome"] == "nondeterministic" and verdict["flagged"], verdict
            assert verdict["changed_cases"] == 0 and verdict["counts"]["nondeterministic"] == 1, verdict
            [found] = verdict["nondeterministic"]
            assert OPEN in found["case_id"] and found["nondeterminism"] == "introduced", found
            finding = verdict["detail"]["corun"]
            assert finding["state"] == "not_reproducible" and finding["not_reproduced"] == 1, finding
            [(case_id, sides)] = finding["cases"].items()
            assert case_id == found["case_id"] and set(sides) == {"commit"}, finding  # the baseline reproduced
            assert sides["commit"]["first_differing_step"] == 1
            assert sides["commit"]["stored_digest"] != sides["commit"]["rerun_digest"], sides
        # The same trees read the same verdict, case by case, as a commit run and as a verify run.
        by_case = [{case_id: (c["verdict"], c.get("nondeterminism")) for case_id, c in cases[run_id].items()}
                   for run_id in verdicts]
        assert by_case[0] == by_case[1], by_case
        # The same headline and counts; the repeat counts in the case's line may differ (the verify run
        # repeated the remembered case six times in its host before the co-run's re-run differed).
        assert verdicts[commit_run]["counts"] == verdicts[verify_run]["counts"]
        assert (verdicts[commit_run]["summary"].splitlines()[0] == verdicts[verify_run]["summary"].splitlines()[0]
                == "NONDETERMINISTIC: 1 nondeterministic, 1 unchanged of 2 cases"), verdicts

        # The flaky-case memory: remembered by both co-runs (the verify run repeated it, as every run does).
        engine = create_engine(f"sqlite:///{home / 'optdrift.db'}")
        with engine.connect() as connection:
            rows = connection.execute(text("SELECT case_id, times_seen FROM unsteady_cases")).all()
        engine.dispose()
        assert len(rows) == 1 and OPEN in rows[0][0] and rows[0][1] == 2, rows
        http.close()
    finally:
        stop_process(server_process)
        print((tmp_path / "serve.log").read_text()[-6000:])


def test_wait_stops_at_once_for_a_corun_that_gave_up(server: dict, tmp_path: Path) -> None:  # noqa: F811
    from service import run_store

    baseline = _baseline_run(server, "gave-up", tmp_path)
    waiting, run_id = _submit_waiting(server, "gave-up", tmp_path)  # the default --detail-timeout: 600 s
    _changed_verdict(server, run_id, baseline)
    time.sleep(3)
    assert waiting.poll() is None, waiting.communicate()  # the detail may still come: it waits
    with _session(server) as session:
        run_store.corun_given_up(run_id, "no per-step diffs: the baseline no longer builds (test)", session=session)
    began = time.monotonic()
    stdout, stderr = waiting.communicate(timeout=60)
    assert time.monotonic() - began < 15, (stdout, stderr)
    assert waiting.returncode == 1, (stdout, stderr)  # changed: giving up never changes the exit code
    assert f"run {run_id}: no co-run detail will come: no per-step diffs: the baseline no longer builds" in \
        " ".join(stdout.split()), stdout
    assert "still coming" not in stderr
