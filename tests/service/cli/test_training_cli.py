"""A run's training impact on the command line (issue 46, service/cli/training.py): `optdrift training`
asks for one or shows it, `--wait` follows it with progress; `submit --wait` prints it after the
verdict and its exit code stays the verdict's; `--no-training` skips it.

Against the real app on a port over the test's PostgreSQL session (tests/service_fixtures.py
live_api) and the test settings' real Redis broker. The worker's part (opening the job after the
co-run, its progress, its results) is written through service.run_store as worker/jobs/corun.py and
worker/jobs/training.py write it, between the client's polls: `time.sleep` called by the command's
thread is replaced by one step of that worker (the server thread is idle then, so the test's one
session is used by one thread at a time).
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from rich.console import Console
from typer.testing import CliRunner

from service import run_store
from service.cli import app as cli_app
from service.cli import client as client_module
from service.cli import training as cli_training
from service.cli.client import OptdriftClient
from service.cli.exit_codes import EXIT_CHANGED
from service.db.models import Commit, Project, Run, Verdict
from service.domain import projects
from tests.service.api.test_training_api import (
    add_run, add_verdict, changed_pair, finish_job, model_impact, store_cases,
)

MOVED = ["x", "y", "z"]


@pytest.fixture
def worker_steps(monkeypatch) -> Iterator[list[Callable[[], None]]]:  # noqa: ANN001
    """Steps the 'worker' takes, one per sleep of the command's polling loop (the last repeats)."""
    steps: list[Callable[[], None]] = []
    command_thread = threading.current_thread()
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if threading.current_thread() is not command_thread:
            return real_sleep(seconds)
        if not steps:
            raise AssertionError("the command polled more often than the test's worker has steps")
        (steps.pop(0) if len(steps) > 1 else steps[0])()
        return None

    monkeypatch.setattr(time, "sleep", sleep)
    yield steps


def _cli(live_api: str, *args: str):  # noqa: ANN202
    return CliRunner().invoke(cli_app, [*args, "--url", live_api])


def test_training_asks_for_one_then_shows_it_worst_first(live_api, db_session, admin_token, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("OPTDRIFT_TOKEN", admin_token)
    baseline, run = changed_pair(db_session)

    asked = _cli(live_api, "training", str(run.id))
    assert asked.exit_code == 0, asked.output
    assert f"run {run.id}: asked for its training impact against run {baseline.id} (quick model set): queued" \
        in asked.output
    shown = _cli(live_api, "training", str(run.id), "--format", "json")
    assert shown.exit_code == 0, shown.output
    job = json.loads(shown.stdout)
    assert (job["status"], job["progress"]["runs_total"]) == ("queued", 36)

    finish_job(db_session, job["id"], [model_impact("within_floor", model="transformer"),
                                       model_impact("beyond_noise", relative_shift=0.0412)])
    done = _cli(live_api, "training", str(run.id))
    # A beyond-noise verdict exits 0: the training verdict never changes an exit code.
    assert done.exit_code == 0, done.output
    lines = done.output.strip().splitlines()
    assert lines[0] == f"run {run.id}: training impact against run {baseline.id} (quick model set on cpu):"
    assert lines[1].split()[:3] == ["beyond_noise", "mlp", "·"]  # worst first
    assert "beyond seed noise: final loss +4.12 % (95 % CI +2.06 % … +6.18 %) over 6 seeds; parameters differ " \
           "from step 1" in lines[1]
    assert lines[2].split()[:2] == ["within_floor", "transformer"] and "within the one-ulp floor" in lines[2]

    lean = json.loads(_cli(live_api, "training", str(run.id), "--format", "json").stdout)
    assert [result["curves"] for result in lean["results"]] == [None, None]
    full = json.loads(_cli(live_api, "training", str(run.id), "--format", "json", "--curves").stdout)
    assert len(full["results"][0]["curves"]["commit"]) == 6


def test_training_refusals_are_one_line_and_exit_2(live_api, db_session, admin_token, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("OPTDRIFT_TOKEN", admin_token)
    _, run = changed_pair(db_session)
    itself = _cli(live_api, "training", str(run.id), "--baseline", str(run.id))
    assert itself.exit_code == 2 and "not itself" in itself.output
    assert len(itself.output.strip().splitlines()) == 1
    bad_set = _cli(live_api, "training", str(run.id), "--model-set", "huge")
    assert bad_set.exit_code == 2 and "--model-set huge: use quick or standard" in bad_set.output
    missing = _cli(live_api, "training", "999999")
    assert missing.exit_code == 2 and "999999" in missing.output
    monkeypatch.setenv("OPTDRIFT_TOKEN", "not-a-token")
    refused = _cli(live_api, "training", str(run.id))
    assert refused.exit_code == 2 and "401" in refused.output


def test_training_wait_follows_the_job_with_progress_lines(live_api, db_session, admin_token, monkeypatch,  # noqa: ANN001
                                                           worker_steps) -> None:
    monkeypatch.setenv("OPTDRIFT_TOKEN", admin_token)
    _, run = changed_pair(db_session)
    job = OptdriftClient(live_api, token=admin_token).request_training(run.id)

    worker_steps += [
        lambda: run_store.claim_training_impact(job["id"], worker="w1", session=db_session),
        lambda: run_store.training_impact_progress(job["id"], done=12, total=36, phase="training", session=db_session),
        lambda: finish_job(db_session, job["id"], [model_impact("within_noise")]),
    ]
    followed = _cli(live_api, "training", str(run.id), "--wait")
    assert followed.exit_code == 0, followed.output
    out = followed.output
    # No terminal: a line per change of phase, then the verdicts.
    for line in (f"run {run.id}: training impact queued", f"run {run.id}: training impact starting",
                 f"run {run.id}: training impact training, 12/36 runs", "within_noise"):
        assert line in out, out
    assert out.index("12/36 runs") < out.index("beyond the floor, within seed noise")

    # A failed job: its reason, how to ask again, exit 4.
    run_store.finish_training_impact(job["id"], error="the baseline no longer builds", session=db_session)
    failed = _cli(live_api, "training", str(run.id), "--wait")
    assert failed.exit_code == 4
    assert "failed: the baseline no longer builds; ask again with `optdrift training " in failed.output


def _submitted_changed_run(live_api: str, db_session, tmp_path, project: str) -> tuple[list[str], Run]:  # noqa: ANN001
    """`optdrift submit` of commit c1, then its run finished as a worker leaves it: changed against a
    baseline run of the project, its co-run detail (per-step |Δ| and the attribution) stored."""
    projects.create(session=db_session, name=project)
    db_session.flush()
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "ops.cpp").write_text("// adam\n")
    args = ["submit", "--project", project, "--commit", "c1" * 20, "--source", str(tmp_path / "csrc"),
            "--no-ancestry", "--url", live_api]
    submitted = CliRunner().invoke(cli_app, args)
    assert submitted.exit_code == 0, submitted.output
    project_row = db_session.query(Project).filter_by(name=project).one()
    run = db_session.query(Run).join(Commit, Run.commit_id == Commit.id).filter(Commit.sha == "c1" * 20).one()
    baseline = add_run(db_session, project_row, "b" * 40, ["d", "e", "f"])
    store_cases(db_session, run.id, MOVED)
    run.status, run.battery_hash, run.environment_detail = "done", "b" * 64, {"battery_version": 1}
    db_session.flush()
    verdict = add_verdict(db_session, run, baseline)
    detail = dict(verdict.detail)
    detail["cases"] = [{**case, "max_abs_diff_per_step": [1e-7] * 3} if case["verdict"] == "changed" else case
                       for case in detail["cases"]]
    detail["attribution"] = {}
    verdict.detail = detail
    db_session.commit()
    return args, run


def test_submit_wait_prints_the_training_impact_after_the_verdict(live_api, db_session, admin_token, tmp_path,  # noqa: ANN001
                                                                  monkeypatch, worker_steps) -> None:
    monkeypatch.setenv("OPTDRIFT_TOKEN", admin_token)
    args, run = _submitted_changed_run(live_api, db_session, tmp_path, "trained-submit")
    opened: list[int] = []

    def open_job() -> None:  # worker/jobs/corun.py record_and_tell -> follow_ups.send_training_impact
        opened.append(run_store.open_training_impact(run.id, model_set="quick", session=db_session)[0])

    worker_steps += [
        open_job,
        lambda: run_store.claim_training_impact(opened[0], worker="w1", session=db_session),
        lambda: run_store.training_impact_progress(opened[0], done=30, total=36, phase="training", session=db_session),
        lambda: finish_job(db_session, opened[0], [model_impact("within_floor", model="transformer"),
                                                   model_impact("diverged")]),
    ]
    waited = CliRunner().invoke(cli_app, [*args, "--wait"])
    # The trajectory verdict's exit code, whatever the training impact says.
    assert waited.exit_code == EXIT_CHANGED, waited.output
    out = waited.output
    assert out.index("optdrift verdict") < out.index(f"run {run.id}: training impact training, 30/36 runs")
    block = out[out.index(f"run {run.id}: training impact against run"):].splitlines()
    assert block[1].split()[:2] == ["diverged", "mlp"] and "NaN loss in 2 of 6 commit runs" in block[1]
    assert block[2].split()[:2] == ["within_floor", "transformer"]

    # --format json: the jobs in the document, under the run's id; the progress on stderr.
    as_json = CliRunner().invoke(cli_app, [*args, "--wait", "--format", "json"])
    assert as_json.exit_code == EXIT_CHANGED, as_json.output
    document = json.loads(as_json.stdout)
    assert document["exit_code"] == EXIT_CHANGED
    assert [r["figures"]["verdict"] for r in document["training"][str(run.id)]["results"]] == [
        "within_floor", "diverged"]

    # --no-training: no wait, no block; the same exit code.
    skipped = CliRunner().invoke(cli_app, [*args, "--wait", "--no-training"])
    assert skipped.exit_code == EXIT_CHANGED and "training impact" not in skipped.output


def test_submit_wait_says_when_no_job_opens_and_when_it_is_still_going(live_api, db_session, admin_token,  # noqa: ANN001
                                                                      tmp_path, monkeypatch, worker_steps) -> None:
    monkeypatch.setenv("OPTDRIFT_TOKEN", admin_token)
    args, run = _submitted_changed_run(live_api, db_session, tmp_path, "trained-none")
    # The worker has it off: nothing opens, and the wait ends once the co-run is that long done.
    monkeypatch.setattr(client_module, "TRAINING_OPENS_WITHIN_S", 0.0)
    worker_steps.append(lambda: None)
    none = CliRunner().invoke(cli_app, [*args, "--wait"])
    assert none.exit_code == EXIT_CHANGED, none.output
    assert f"run {run.id}: training impact: none was opened" in none.output
    assert f"`optdrift training {run.id}`" in none.output

    job_id, _ = run_store.open_training_impact(run.id, model_set="quick", session=db_session)
    going = CliRunner().invoke(cli_app, [*args, "--wait", "--training-timeout", "0"])
    assert going.exit_code == EXIT_CHANGED, going.output
    assert f"run {run.id}: training impact: still measuring (queued" in going.output
    assert job_id


def test_progress_at_a_terminal_is_a_live_bar(live_api, db_session, admin_token, worker_steps) -> None:  # noqa: ANN001
    """At a terminal the wait is rich's progress bar (runs done of runs total), not lines."""
    _, run = changed_pair(db_session)
    client = OptdriftClient(live_api, token=admin_token)
    job = client.request_training(run.id)
    worker_steps += [
        lambda: run_store.claim_training_impact(job["id"], worker="w1", session=db_session),
        lambda: run_store.training_impact_progress(job["id"], done=18, total=36, phase="training", session=db_session),
        lambda: finish_job(db_session, job["id"], [model_impact("identical")]),
    ]
    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=120)
    state = client.run(run.id)
    verdict = db_session.query(Verdict).filter_by(run_id=run.id).one()
    assert verdict.baseline_run_id is not None
    state["verdict"]["detail"]["cases"] = [{**case, "max_abs_diff_per_step": [1e-7]} for case in
                                           state["verdict"]["detail"]["cases"]]
    state["verdict"]["detail"]["attribution"] = {}
    jobs, still_going = cli_training.follow(client, [state], terminal, timeout_s=60)
    assert still_going == [] and jobs[run.id]["status"] == "done"
    drawn = screen.getvalue()
    # A bar redrawn in place (cursor moves), its runs-done-of-total column, and no log lines.
    assert "\x1b[2K" in drawn and f"run {run.id} training impact" in drawn and "18/36" in drawn
    assert f"run {run.id}: training impact" not in drawn
