"""Issue 34, item 4: nondeterminism with memory and blame (docs/ENGINE.md, Nondeterminism).

The fixture tree tests/fixtures/racy_project is SGD momentum in torch; with RACY = True its
open-stream case adds noise seeded from os.urandom at every step (a race's effect, on any number of
cores), its closed-stream case stays deterministic and is judged as usual.

- `optdrift check` (both builds at hand): a commit that makes the case racy is blamed ("introduced",
  exit 5); a case racy in the baseline too is shown, not blamed (the run reads on the other case).
- End to end through a real service and worker (PostgreSQL + Redis): the same racy patch as a
  commit run and as verify runs gets the same verdict and wording each time, and the case is
  remembered for the project (unsteady_cases) and so repeated in every later run.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import create_engine, text

from service.core.results import RepeatCheck
from tests.service_fixtures import (
    E2E_REDIS, create_database, drop_database, free_port, make_archive, start_process, stop_process, wait_http,
)

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "racy_project"
ADAPTER = "tools/racy_momentum.py"
OPEN = ".open."  # the racy case's id has it; the closed-stream case's does not
INTRODUCED = "became nondeterministic in this commit"
PRE_EXISTING = "nondeterministic before this commit too"


def _tree(folder: Path, *, racy: bool) -> Path:
    shutil.copytree(FIXTURE, folder)
    if racy:
        adapter = folder / ADAPTER
        adapter.write_text(adapter.read_text().replace("\nRACY = False\n", "\nRACY = True\n"))
    return folder


def _check(source: Path, baseline: Path, json_out: Path) -> tuple[int, dict]:
    import json

    from service.cli.check import run_check

    code = run_check(source, baseline, device="cpu", json_out=json_out)
    return code, json.loads(json_out.read_text())["comparison"]


def test_the_racy_fixture_never_reproduces_itself(tmp_path: Path) -> None:
    """The fixture is what the other tests need: its open case differs run to run (from step 1),
    its closed case never does (the kernel host run UNSTEADY_RUNS times each, no early stop)."""
    from worker import pipeline

    tree = _tree(tmp_path / "racy", racy=True)
    job = pipeline.prepare(tree)
    built = pipeline.build(job, pipeline.Policy(device="cpu", cache_dir=tmp_path / "cache", cuda_archs=[]))
    assert built.ok, built.error
    digests: dict[str, set[tuple[str, ...]]] = {}
    for _ in range(4):
        ran = pipeline.run(job, built, pipeline.Policy(device="cpu", cuda_archs=[], fast_engine=False))
        for result in ran.results:
            digests.setdefault(result.case.case_id, set()).add(tuple(result.trajectory.digests))
    for case_id, seen in digests.items():
        assert len(seen) == (4 if OPEN in case_id else 1), (case_id, len(seen))


def test_a_remembered_case_is_repeated_whatever_its_baseline_says(tmp_path: Path) -> None:
    """A case of `unsteady` runs UNSTEADY_RUNS times in all (a steady one: all of them), stopping at
    the first repeat that differs (the racy one: 2); with its baseline's own digests, it is
    repeated all the same, where a case not remembered is not repeated at all."""
    from worker import pipeline

    job = pipeline.prepare(_tree(tmp_path / "racy", racy=True))
    built = pipeline.build(job, pipeline.Policy(device="cpu", cache_dir=tmp_path / "cache", cuda_archs=[]))
    policy = pipeline.Policy(device="cpu", cuda_archs=[], fast_engine=False)
    first = pipeline.run(job, built, policy)
    own = {r.case.case_id: r.trajectory.digests for r in first.results}
    closed, racy = sorted(own, key=lambda case_id: OPEN in case_id)
    assert all(r.repeat_check is None for r in first.results)
    again = pipeline.run(job, built, policy, baseline_digests={closed: own[closed]}, unsteady={closed, racy})
    checks = {r.case.case_id: r.repeat_check for r in again.results}
    assert checks[closed] == RepeatCheck(runs=pipeline.UNSTEADY_RUNS, differing=0)
    assert checks[racy].runs == 2 and checks[racy].differing == 1 and checks[racy].first_divergent_step == 1
    plain = pipeline.run(job, built, policy, baseline_digests={closed: own[closed]})
    assert next(r for r in plain.results if r.case.case_id == closed).repeat_check is None


def test_a_commit_that_introduces_a_race_is_blamed_and_flagged(tmp_path: Path) -> None:
    code, comparison = _check(_tree(tmp_path / "commit", racy=True), _tree(tmp_path / "base", racy=False),
                              tmp_path / "out.json")
    assert code == 5 and comparison["verdict"] == "nondeterministic", comparison["summary"]
    racy = next(c for c in comparison["cases"] if OPEN in c["case_id"])
    assert racy["nondeterminism"] == "introduced", racy
    # The baseline reproduced itself every time it was asked to: UNSTEADY_RUNS runs, none differing.
    assert racy["repeat_check"]["baseline_runs"] == 6 and racy["repeat_check"]["baseline_differing"] == 0
    assert INTRODUCED in comparison["summary"] and "not a change against the baseline" not in comparison["summary"]
    assert comparison["figures"]["nondeterministic_introduced"] == 1


def test_a_case_racy_in_the_baseline_too_is_shown_not_blamed(tmp_path: Path) -> None:
    code, comparison = _check(_tree(tmp_path / "commit", racy=True), _tree(tmp_path / "base", racy=True),
                              tmp_path / "out.json")
    # The run reads on the other case (unchanged): the race is the baseline's, not this commit's.
    assert code == 0 and comparison["verdict"] == "unchanged", comparison["summary"]
    racy = next(c for c in comparison["cases"] if OPEN in c["case_id"])
    assert racy["verdict"] == "nondeterministic" and racy["nondeterminism"] == "pre-existing", racy
    # The baseline's repeats stop at the first one that differs: 2 runs.
    assert racy["repeat_check"]["baseline_runs"] == 2 and racy["repeat_check"]["baseline_differing"] == 1
    assert PRE_EXISTING in comparison["summary"] and INTRODUCED not in comparison["summary"]
    assert comparison["figures"]["nondeterministic_pre_existing"] == 1


def test_blame_reads_introduced_only_when_the_baseline_never_differs() -> None:
    assert RepeatCheck(runs=2, differing=1, baseline_runs=6, baseline_differing=0).origin == "introduced"
    assert RepeatCheck(runs=2, differing=1, baseline_runs=2, baseline_differing=1).origin == "pre-existing"
    assert RepeatCheck(runs=2, differing=1).origin is None  # not blamed: today's wording and verdict
    assert RepeatCheck(runs=6, differing=0, baseline_runs=6, baseline_differing=0).origin is None


# ----------------------------------------------------------------------------- end to end
PROJECT = "racy"
FINAL = ("done", "failed", "cancelled", "error")


def _archive(*, racy: bool, marker: str) -> bytes:
    files = {str(path.relative_to(FIXTURE)): path.read_text() for path in FIXTURE.rglob("*")
             if path.is_file() and "__pycache__" not in path.parts}
    if racy:
        files[ADAPTER] = files[ADAPTER].replace("\nRACY = False\n", "\nRACY = True\n")
    return make_archive({**files, "marker.txt": marker})


def _verdict(http: httpx.Client, run_id: int) -> dict:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        run = http.get(f"/api/v1/runs/{run_id}").json()
        if run["status"] in FINAL and run.get("verdict"):
            assert run["status"] == "done", run
            return run["verdict"]
        time.sleep(0.3)
    raise AssertionError(f"run {run_id} has no verdict: {http.get(f'/api/v1/runs/{run_id}').json()}")


@pytest.fixture
def service(tmp_path: Path) -> Iterator[dict]:
    home, port = tmp_path / "home", free_port()
    db_name = f"optdrift_nondeterminism_{os.getpid()}"
    env = {"OPTDRIFT_HOME": str(home), "OPTDRIFT_BUILD_CACHE_DIR": str(tmp_path / "build-cache"),
           "OPTDRIFT_PUBLIC_URL": f"http://127.0.0.1:{port}", "OPTDRIFT_DATABASE_URL": create_database(db_name),
           "OPTDRIFT_BROKER_URL": E2E_REDIS, "OPTDRIFT_HEARTBEAT_INTERVAL_S": "2"}
    redis.Redis.from_url(E2E_REDIS).flushdb()
    processes = [start_process(["serve", "--port", str(port), "--no-worker"], env, tmp_path / "api.log")]
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=90)
        http.headers["Authorization"] = f"Bearer {(home / 'admin-token').read_text().strip()}"
        answer = http.post("/api/v1/projects", json={"name": PROJECT, "environments": ["cpu"]})
        assert answer.status_code == 201, answer.text
        processes.append(start_process(["worker", "--loglevel", "INFO"], env, tmp_path / "worker.log"))
        yield {"http": http, "database_url": env["OPTDRIFT_DATABASE_URL"]}
    finally:
        for process in reversed(processes):
            stop_process(process)
        http.close()
        for log in sorted(tmp_path.glob("*.log")):
            print(f"--- {log.name}\n{log.read_text()[-4000:]}")
        drop_database(db_name)
        redis.Redis.from_url(E2E_REDIS).flushdb()


@pytest.mark.slow
def test_the_same_racy_patch_gets_one_verdict_as_a_commit_run_and_as_verify_runs(service) -> None:
    http = service["http"]

    def commit(sha: str, *, racy: bool, parents: str | None = None) -> int:
        answer = http.post(f"/api/v1/projects/{PROJECT}/commits",
                           data={"sha": sha, **({"parents": parents} if parents else {})},
                           files={"archive": ("t.tar.gz", _archive(racy=racy, marker=sha))})
        assert answer.status_code == 201, answer.text
        return answer.json()["runs"][0]["id"]

    def verify(marker: str) -> int:
        answer = http.post(f"/api/v1/projects/{PROJECT}/verify", data={"base": "base"},
                           files={"archive": ("t.tar.gz", _archive(racy=True, marker=marker))})
        assert answer.status_code == 201, answer.text
        return answer.json()["id"]

    _verdict(http, commit("base", racy=False))
    verdicts = [_verdict(http, commit("racy", racy=True, parents="base"))]
    verdicts += [_verdict(http, verify(f"contributor-{n}")) for n in range(2)]
    for verdict in verdicts:
        assert verdict["outcome"] == "nondeterministic" and verdict["flagged"], verdict
        [racy] = verdict["nondeterministic"]
        assert OPEN in racy["case_id"] and racy["nondeterminism"] == "introduced", racy
        assert INTRODUCED in verdict["summary"], verdict["summary"]
    # One wording for one change, whichever way it was run and however often.
    assert len({verdict["summary"] for verdict in verdicts}) == 1, [v["summary"] for v in verdicts]

    engine = create_engine(service["database_url"])
    with engine.connect() as connection:
        rows = connection.execute(text("SELECT case_id, times_seen FROM unsteady_cases")).all()
    engine.dispose()
    assert len(rows) == 1 and OPEN in rows[0][0] and rows[0][1] == 3, rows

    # Racy in its baseline too: shown, not blamed; the run reads on the other case.
    later = _verdict(http, commit("later", racy=True, parents="racy"))
    assert later["outcome"] == "unchanged" and not later["flagged"], later
    assert [c["nondeterminism"] for c in later["nondeterministic"]] == ["pre-existing"]
    assert PRE_EXISTING in later["summary"], later["summary"]


def test_the_cli_report_shows_the_blame() -> None:
    from rich.console import Console

    from service.cli.report import changed_cases_table

    cases = [{"case_id": "momentum.a", "verdict": "nondeterministic", "nondeterminism": "introduced",
              "message": "1 of 1 repeats differ"},
             {"case_id": "momentum.b", "verdict": "nondeterministic", "nondeterminism": "pre-existing"}]
    console = Console(record=True, width=300)
    console.print(changed_cases_table([{"id": 7, "verdict": {"detail": {"cases": cases}}}]))
    shown = console.export_text()
    assert "nondeterministic (introduced)" in shown and "nondeterministic (pre-existing)" in shown, shown
