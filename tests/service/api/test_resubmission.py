"""Re-submitting a commit (CI re-running a job) answers with every environment's run of that commit,
through the real API and the `optdrift submit` command called as action.yml calls it (issue 44: the
repeated submission answered with the first environment's run only, so a change flagged in another
environment turned a red job green on re-run)."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from service.cli import app as cli_app
from service.core.results import CaseComparison, RunComparison
from service.db.base import utcnow
from service.db.models import Run, Verdict
from tests.service_fixtures import make_archive

ENVIRONMENTS = {2: ["cpu", "cpu+fma"], 3: ["cpu", "cpu+fma", "gpu.sm90"]}
SOURCE = {"csrc/ops.cpp": "// adam\nint step() { return 1; }\n"}
# Made once: a commit's source is the same bytes each time (gzip stamps the time it packs).
ARCHIVE = make_archive(SOURCE)


def _submit(api, project: str, sha: str, key: str | None):  # noqa: ANN001, ANN202
    return api.post(f"/api/v1/projects/{project}/commits", data={"sha": sha},
                    headers={"Idempotency-Key": key} if key else {},
                    files={"archive": ("s.tar.gz", ARCHIVE, "application/gzip")})


def _finish(session, run_id: int, outcome: str) -> None:  # noqa: ANN001
    """What a worker writes at the end of a run: `done` and its verdict."""
    run = session.get(Run, run_id)
    run.status, run.finished_at = "done", utcnow()
    case = CaseComparison(case_id="adam-fp32-a1", optimizer="adam",
                          verdict="changed" if outcome == "changed" else "unchanged",
                          first_divergent_step=1 if outcome == "changed" else None)
    comparison = RunComparison(verdict=outcome, summary=f"{outcome.upper()}: test", battery_digest="b",
                               cases=[case])
    session.add(Verdict(run_id=run_id, outcome=outcome, detail=comparison.model_dump(mode="json"),
                        flagged=outcome == "changed", changed_cases=int(outcome == "changed")))
    session.commit()


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("key", ["keyed", None])
def test_a_repeated_submission_answers_with_every_environments_run(api, db_session, count: int,
                                                                   key: str | None) -> None:  # noqa: ANN001
    project = f"resubmit{count}{key or ''}"
    assert api.post("/api/v1/projects", json={"name": project, "environments": ENVIRONMENTS[count],
                                              "allow_unserved": True}).status_code == 201
    first = _submit(api, project, "c1", key and f"{project}:c1:")
    assert first.status_code == 201, first.text
    runs = [(run["id"], run["environment"]) for run in first.json()["runs"]]
    assert [environment for _, environment in runs] == ENVIRONMENTS[count]

    # While they are queued: the same runs again, none made twice.
    again = _submit(api, project, "c1", key and f"{project}:c1:")
    assert again.status_code == 200 and again.json()["created"] is False
    assert [(run["id"], run["environment"]) for run in again.json()["runs"]] == runs
    assert {run["status"] for run in again.json()["runs"]} == {"queued"}
    made = db_session.scalar(select(func.count()).select_from(Run).where(Run.id.in_([i for i, _ in runs])))
    total = db_session.scalar(select(func.count()).select_from(Run).where(Run.project_id == db_session.get(
        Run, runs[0][0]).project_id))
    assert made == total == count

    # Once they are done: the same runs with their verdicts, the changed one among them.
    _finish(db_session, runs[0][0], "unchanged")
    for run_id, _ in runs[1:]:
        _finish(db_session, run_id, "changed" if run_id == runs[1][0] else "unchanged")
    done = _submit(api, project, "c1", key and f"{project}:c1:")
    assert done.status_code == 200
    assert [(run["id"], run["status"], run["verdict"]["outcome"]) for run in done.json()["runs"]] == [
        (run_id, "done", "changed" if run_id == runs[1][0] else "unchanged") for run_id, _ in runs]


@pytest.mark.parametrize("count", [2, 3])
def test_re_running_a_red_job_stays_red(live_api, admin_token, db_session, monkeypatch, tmp_path,
                                        count: int) -> None:  # noqa: ANN001
    """`optdrift submit --wait --format json` as action.yml runs it: `cpu` unchanged and `cpu+fma`
    changed exit 1, the first time and every time the job is re-run."""
    monkeypatch.setenv("OPTDRIFT_TOKEN", admin_token)
    runner = CliRunner()
    project = f"rerun{count}"
    created = runner.invoke(cli_app, ["project", "create", project, "--url", live_api, "--allow-unserved",
                                      *[arg for environment in ENVIRONMENTS[count]
                                        for arg in ("--environment", environment)]])
    assert created.exit_code == 0, created.output
    for name, text in SOURCE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    args = ["submit", "--project", project, "--commit", "c1", "--source", str(tmp_path / "csrc"), "--ref",
            "refs/heads/main", "--url", live_api, "--format", "json"]

    first = runner.invoke(cli_app, args)
    assert first.exit_code == 0, first.output
    run_ids = [run["id"] for run in json.loads(first.stdout)["runs"]]
    assert len(run_ids) == count
    _finish(db_session, run_ids[0], "unchanged")
    _finish(db_session, run_ids[1], "changed")  # cpu+fma
    for run_id in run_ids[2:]:
        _finish(db_session, run_id, "unchanged")

    for attempt in range(2):  # the job run, then re-run
        waited = runner.invoke(cli_app, [*args, "--wait"])
        assert waited.exit_code == 1, (attempt, waited.output)
        report = json.loads(waited.stdout)
        assert report["exit_code"] == 1
        assert sorted(run["id"] for run in report["runs"]) == sorted(run_ids)


def test_a_repeated_submission_queues_again_each_environments_errored_run(api, db_session) -> None:  # noqa: ANN001
    """An `error` (optdrift's failure) in any environment is run again by the re-run job, not only
    in the environment whose run carries the idempotency key."""
    assert api.post("/api/v1/projects", json={"name": "errored", "environments": ENVIRONMENTS[2],
                                              "allow_unserved": True}).status_code == 201
    cpu_run, fma_run = (run["id"] for run in _submit(api, "errored", "c1", "errored:c1:").json()["runs"])
    _finish(db_session, cpu_run, "unchanged")
    run = db_session.get(Run, fma_run)
    run.status, run.error, run.finished_at = "error", "lost worker", utcnow()
    db_session.commit()
    again = _submit(api, "errored", "c1", "errored:c1:")
    assert [(r["id"], r["status"]) for r in again.json()["runs"]] == [(cpu_run, "done"), (fma_run, "queued")]
