"""`submit --wait` / `verify` wait for the co-run detail of a changed verdict (issue 34, item 3).

After a changed verdict the worker co-runs the baseline build on the changed cases
(worker/jobs/corun.py): it stores each changed case's per-step |commit − baseline| into the
verdict, then the attribution (ulp, kind: worker/attribution/record.py) beside it. `--wait` used to
return at the verdict, so every changed row read `-` under max |Δ|, ulp and kind.

The server is a real `optdrift serve --no-worker` on the embedded default. The verdict and then
the co-run's detail are written into its database as the worker writes them (tests/service/cli/test_cli_contract.py
does the same for run endings); the CLI under test reads them over HTTP like any run. The last test
runs it all for real: `optdrift serve` with its worker, the bundled kernels and the decay-after-update
commit, `optdrift submit --wait` until the worker's co-run has filled in every changed row.
"""

from __future__ import annotations

from service.core.case_names import case_name

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service_fixtures import REPO_ROOT, free_port, shared_build_cache, start_process, stop_process, wait_http
from tests.service.cli.test_cli_contract import OPTDRIFT, SOURCE, write_tree

CHANGED = {  # case id -> (family, param_dtype): an fp32 case and an 8-bit one, as the decay reorder changes
    "adam.32bit.fp32.lr=0.001.wd=0.01.n4096#a1": ("32bit", "float32"),
    "adam.8bit_blockwise.fp32.lr=0.001.wd=0.01.n4096#b2": ("8bit_blockwise", "float32"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    home = tmp_path_factory.mktemp("wait-detail") / "home"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTDRIFT_")}
    env.update({"OPTDRIFT_HOME": str(home), "OPTDRIFT_MAINTENANCE_INTERVAL_S": "0"})
    log = open(home.parent / "serve.log", "wb")  # noqa: SIM115
    process = subprocess.Popen([str(OPTDRIFT), "serve", "--port", str(port), "--no-worker"],
                               cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/healthz", timeout_s=90)
        yield {"url": url, "home": home, "database_url": f"sqlite:///{home / 'optdrift.db'}"}
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=30)
        log.close()


def _session(server: dict):  # noqa: ANN202
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    return Session(create_engine(server["database_url"]))


def _client(server: dict):  # noqa: ANN202
    from service.cli.client import OptdriftClient

    return OptdriftClient(server["url"], token=(server["home"] / "admin-token").read_text().strip())


def _baseline_run(server: dict, project: str, tmp_path: Path) -> int:
    """A done run of the parent commit with its no-baseline verdict, as a worker leaves it."""
    from service.db.base import utcnow
    from service.db.models import Run, Verdict
    from service.core.results import RunComparison

    client = _client(server)
    client.ensure_project(project)
    answer = client.submit_commit(project=project, sha="parent", source_dir=write_tree(tmp_path / "parent", SOURCE))
    client.close()
    run_id = answer["runs"][0]["id"]
    with _session(server) as session:
        run = session.get(Run, run_id)
        run.status, run.finished_at = "done", utcnow()
        comparison = RunComparison(verdict="no-baseline", summary="NO-BASELINE: test", battery_digest="b")
        session.add(Verdict(run_id=run_id, outcome="no-baseline", detail=comparison.model_dump(mode="json"),
                            flagged=False, changed_cases=0))
        session.commit()
    return run_id


def _changed_verdict(server: dict, run_id: int, baseline_run_id: int) -> None:
    """The verdict as the run's worker stores it: changed cases, no co-run detail yet."""
    from service.db.base import utcnow
    from service.db.models import Run, Verdict
    from service.core.results import CaseComparison, RunComparison

    cases = [CaseComparison(case_id=case_id, optimizer="adam", verdict="changed", first_divergent_step=1,
                            family=family, param_dtype=dtype, direction="farther", final_direction="farther",
                            baseline_peak_ref64_distance=9.0e-06 if family == "32bit" else 3.66e4,
                            commit_peak_ref64_distance=1.3e-02 if family == "32bit" else 3.61e4)
             for case_id, (family, dtype) in CHANGED.items()]
    with _session(server) as session:
        run = session.get(Run, run_id)
        run.status, run.finished_at = "done", utcnow()
        comparison = RunComparison(verdict="changed", summary="CHANGED: test", battery_digest="b", cases=cases)
        session.add(Verdict(run_id=run_id, outcome="changed", detail=comparison.model_dump(mode="json"),
                            flagged=True, changed_cases=len(cases), first_divergent_step=1,
                            baseline_run_id=baseline_run_id))
        session.commit()


def _store_diffs(server: dict, run_id: int) -> None:
    """What worker/jobs/corun._store adds: every changed case's per-step |commit − baseline|."""
    from sqlalchemy import select

    from service.db.models import Verdict

    with _session(server) as session:
        verdict = session.scalar(select(Verdict).where(Verdict.run_id == run_id))
        cases = [{**case, "max_abs_diff_per_step": [2.5e-3, 1.25e-2]} if case["verdict"] == "changed" else case
                 for case in verdict.detail["cases"]]
        verdict.detail = {**verdict.detail, "cases": cases, "corun_seconds": 1.0}
        session.commit()


def _store_attribution(server: dict, run_id: int) -> None:
    """What worker/jobs/corun.py adds (run_store.add_attribution) beside the verdict."""
    from sqlalchemy import select

    from service.db.models import Verdict

    attribution = {case_id: {"class": "semantic", "variant": "decay_after_update", "label": "decay after update",
                             "first_step_ulps": 3.0, "peak_ulps": 41.0, "change_vs_baseline_distance": 1400.0,
                             "distance": 0.5, "reference_distance": 9e3} for case_id in CHANGED}
    with _session(server) as session:
        verdict = session.scalar(select(Verdict).where(Verdict.run_id == run_id))
        verdict.detail = {**verdict.detail, "attribution": attribution}
        session.commit()


def _submit_waiting(server: dict, project: str, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    """`optdrift submit --wait` of a child of `parent` (in a log: no terminal), and its run id."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTDRIFT_")}
    env.update({"OPTDRIFT_HOME": str(server["home"]), "COLUMNS": "260"})
    source = write_tree(tmp_path / "child", {**SOURCE, "variant.cpp": "decay after update"})
    waiting = subprocess.Popen([str(OPTDRIFT), "submit", "--project", project, "--commit", "child", "--parent",
                                "parent", "--source", str(source), "--url", server["url"], "--wait", "--no-training", *extra],
                               cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while True:
        commits = httpx.get(f"{server['url']}/api/v1/projects/{project}/commits").json()["data"]
        child = [c for c in commits if c["sha"] == "child" and c["runs"]]
        if child:
            return waiting, child[0]["runs"][0]["id"]
        assert time.monotonic() < deadline and waiting.poll() is None, waiting.communicate()
        time.sleep(0.2)


def _changed_rows(stdout: str, case_ids=CHANGED) -> dict[str, dict[str, str]]:  # noqa: ANN001
    """The changed-cases table's rows: case id -> column -> cell (rich's box drawing, one line a row);
    `case_ids=None`: every row whose verdict is changed."""
    lines = stdout.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.strip() == "changed cases"):]
    header = next(line for line in table if "max |Δ|" in line)
    columns = [cell.strip() for cell in header.strip("┃│ ").split("┃")]
    rows = {}
    for line in table:
        cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
        # cases are shown by name (service/core/case_names.py); rows are keyed back by case id
        names = {case_name(case_id): case_id for case_id in case_ids} if case_ids else {}
        if len(cells) == len(columns) and (cells[1] in names if case_ids else cells[2] == "changed"):
            rows[names.get(cells[1], cells[1])] = dict(zip(columns, cells))
    return rows


def test_submit_wait_waits_for_the_corun_detail_and_shows_its_progress(server: dict, tmp_path: Path) -> None:
    baseline = _baseline_run(server, "detail", tmp_path)
    waiting, run_id = _submit_waiting(server, "detail", tmp_path)
    _changed_verdict(server, run_id, baseline)
    time.sleep(4)  # the verdict is there; the detail is not: the CLI must still be waiting
    assert waiting.poll() is None, waiting.communicate()
    _store_diffs(server, run_id)
    time.sleep(3)  # the diffs are there, the attribution (ulp, kind) is not
    assert waiting.poll() is None, waiting.communicate()
    _store_attribution(server, run_id)
    stdout, stderr = waiting.communicate(timeout=60)
    assert waiting.returncode == 1, (stdout, stderr)  # changed: the detail never changes the exit code
    assert f"run {run_id}: waiting for the co-run's per-step |commit − baseline| (0 of 2 cases)" in stdout
    assert f"run {run_id}: waiting for the attribution (ulp, kind) of 2 changed cases" in stdout
    rows = _changed_rows(stdout)
    assert set(rows) == set(CHANGED), stdout
    for case_id, row in rows.items():
        assert float(row["max |Δ|"]) == pytest.approx(1.25e-2), (case_id, row)
        first, peak = (float(x) for x in row["ulp first / peak"].split(" / "))
        assert (first, peak) == (3.0, 41.0), row
        assert row["kind"].startswith("semantic: decay after update"), row
    assert "still coming" not in stderr


def test_a_detail_that_does_not_come_is_bounded_and_says_where_it_will_be(server: dict, tmp_path: Path) -> None:
    baseline = _baseline_run(server, "detail-late", tmp_path)
    waiting, run_id = _submit_waiting(server, "detail-late", tmp_path, "--detail-timeout", "3")
    _changed_verdict(server, run_id, baseline)
    began = time.monotonic()
    stdout, stderr = waiting.communicate(timeout=60)
    assert time.monotonic() - began < 30
    assert waiting.returncode == 1, (stdout, stderr)
    assert (f"run {run_id}: the co-run detail is still coming after 3 s (0 of 2 changed cases have their "
            "per-step |commit − baseline|") in " ".join(stderr.split())
    assert f"{server['url']}/runs/{run_id}" in stderr and "--no-detail" in stderr


def test_no_detail_reports_the_verdict_at_once(server: dict, tmp_path: Path) -> None:
    baseline = _baseline_run(server, "no-detail", tmp_path)
    waiting, run_id = _submit_waiting(server, "no-detail", tmp_path, "--no-detail")
    _changed_verdict(server, run_id, baseline)
    stdout, stderr = waiting.communicate(timeout=30)
    assert waiting.returncode == 1, (stdout, stderr)
    assert "waiting for the co-run" not in stdout + stderr
    assert all(row["max |Δ|"] == "-" for row in _changed_rows(stdout).values())


@pytest.mark.parametrize("command", ["submit", "verify", "retry"])
def test_help_names_the_flag_that_skips_the_detail(command: str) -> None:
    env = {**os.environ, "COLUMNS": "200"}
    result = subprocess.run([str(OPTDRIFT), command, "--help"], env=env, capture_output=True, text=True, timeout=60)
    assert "--no-detail" in result.stdout and "--detail-timeout" in result.stdout, result.stdout


@pytest.mark.slow
def test_submit_wait_of_the_decay_commit_through_a_real_worker_fills_every_changed_row(tmp_path: Path) -> None:
    from service.cli.client import OptdriftClient
    from worker.mutations import copy_tree, decay_after_update

    port, home = free_port(), tmp_path / "home"
    env = {"OPTDRIFT_HOME": str(home), "OPTDRIFT_BUILD_CACHE_DIR": shared_build_cache(),
           "OPTDRIFT_MAINTENANCE_INTERVAL_S": "2", "OPTDRIFT_HEARTBEAT_INTERVAL_S": "2",
           "OPTDRIFT_DATABASE_URL": "", "OPTDRIFT_BROKER_URL": "", "OPTDRIFT_PUBLIC_URL": ""}
    server = start_process(["serve", "--port", str(port)], env, tmp_path / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/readyz", timeout_s=90)
        client = OptdriftClient(url, token=(home / "admin-token").read_text().strip())
        client.ensure_project("e2e")
        base = client.submit_commit(project="e2e", sha="base", source_dir=REPO_ROOT / "csrc")
        client.wait([base["runs"][0]["id"]], timeout_s=900)
        buggy = decay_after_update(copy_tree(REPO_ROOT / "csrc", tmp_path / "buggy"))
        cli_env = {k: v for k, v in os.environ.items() if not k.startswith("OPTDRIFT_")}
        cli_env.update({"OPTDRIFT_HOME": str(home), "COLUMNS": "400"})
        result = subprocess.run([str(OPTDRIFT), "submit", "--project", "e2e", "--commit", "buggy", "--parent", "base",
                                 "--source", str(buggy), "--url", url, "--wait", "--no-training"], cwd=REPO_ROOT, env=cli_env,
                                capture_output=True, text=True, timeout=1200)
        assert result.returncode == 1, (result.stdout, result.stderr)
        assert "still coming" not in result.stderr, result.stderr
        rows = _changed_rows(result.stdout, None)
        assert rows, result.stdout
        for case_id, row in rows.items():  # a number in every changed row, never '-'
            assert float(row["max |Δ|"]) > 0, (case_id, row)
            assert row["kind"] != "-", (case_id, row)
        client.close()
    finally:
        stop_process(server)
        print((tmp_path / "serve.log").read_text()[-5000:])
