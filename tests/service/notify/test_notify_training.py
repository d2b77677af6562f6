"""The training impact on GitHub (issue 46): the check run's summary and the PR comment carry a
"Training impact" line per model x configuration once the job is done (worst first), "measuring
(k/n runs)" while it runs, why when it failed; a job that moves on is sent again, an unchanged one
is not; and the hook the job calls at its end (service.run_store.training_impact_finished) notifies
from its own thread and session.

Against the GitHub stand-in that checks every request against GitHub's OpenAPI description
(tests/github_standin.py), real githubkit client, real PostgreSQL rows; the job's rows written
through service.run_store as worker/jobs/training.py writes them."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select

from service import run_store
from service.db.notify_models import GitHubCheckRun, GitHubIntegration
from service.notify.hooks import notify_run
from tests import github_standin
from tests.github_standin import GitHubStandin
from tests.service.api.test_training_api import add_run, add_verdict, finish_job, make_project, model_impact
from tests.service.notify.test_notify_github import FAST_RETRY, SHA, TOKEN

pytestmark = pytest.mark.skipif(
    not github_standin.SPEC_PATH.exists() and not __import__("os").environ.get("CI"),
    reason=f"GitHub's OpenAPI description is not installed at {github_standin.SPEC_PATH} (.ci/run installs it)")


@pytest.fixture
def standin():  # noqa: ANN201
    github_standin.load_spec()
    with GitHubStandin(token=TOKEN) as server:
        server.state.pulls[SHA] = [(42, SHA, "open")]
        yield server
        assert server.state.violations == [], "requests that do not conform to GitHub's description"


def _changed_run(session, standin, name: str):  # noqa: ANN001, ANN202
    """A project with a GitHub integration; its commit SHA's cpu run changed against a baseline run."""
    project = make_project(session, name)
    session.add(GitHubIntegration(project_id=project.id, repository="octo/kernels", api_url=standin.url,
                                  auth_kind="token", token=TOKEN, check_name="optdrift", pr_comments=True,
                                  dashboard_url="https://optdrift.example.org"))
    baseline = add_run(session, project, "1" * 40, ["d", "e", "f"])
    run = add_run(session, project, SHA, ["x", "y", "z"])
    add_verdict(session, run, baseline)
    session.flush()
    return run


def _notify(session, settings, run) -> None:  # noqa: ANN001
    notify_run(session=session, run_id=run.id, settings=settings, retry=FAST_RETRY)


def _sent(standin) -> tuple[str, str]:  # noqa: ANN001
    """The check run's last summary and the PR comment's body as GitHub holds them."""
    checks = standin.state.calls("checks/create") + standin.state.calls("checks/update")
    [(_, body)] = standin.state.comments[42].items()
    return checks[-1].body["output"]["summary"], body


def test_the_check_and_comment_show_the_training_impact_as_it_goes(db_session, api_settings, standin) -> None:  # noqa: ANN001
    run = _changed_run(db_session, standin, "trained-gh")
    _notify(db_session, api_settings, run)
    summary, comment = _sent(standin)
    assert "Training impact" not in summary and "Training impact" not in comment

    job_id, _ = run_store.open_training_impact(run.id, model_set="quick", session=db_session)
    run_store.claim_training_impact(job_id, worker="w1", session=db_session)
    run_store.training_impact_progress(job_id, done=12, total=36, phase="training", session=db_session)
    _notify(db_session, api_settings, run)
    summary, comment = _sent(standin)
    assert "- Training impact: measuring (12/36 runs)" in summary
    assert "- Training impact: measuring (12/36 runs)" in comment

    finish_job(db_session, job_id, [model_impact("within_floor", model="transformer"),
                                    model_impact("beyond_noise", relative_shift=0.0412)])
    _notify(db_session, api_settings, run)
    summary, comment = _sent(standin)
    for text in (summary, comment):
        lines = [line for line in text.splitlines() if line.startswith("- Training impact")]
        assert lines == [
            "- Training impact · mlp · adam · 32bit · fp32 · lr=0.1 · wd=0.1: beyond seed noise: final loss "
            "+4.12 % (95 % CI +2.06 % … +6.18 %) over 6 seeds; parameters differ from step 1",
            "- Training impact · transformer · adam · 32bit · fp32 · lr=0.1 · wd=0.1: within the one-ulp floor: "
            "final loss +1.23 % (95 % CI +0.615 % … +1.85 %) over 6 seeds; parameters differ from step 1"]
    assert len(standin.state.calls("issues/create-comment")) == 1  # one comment, edited in place
    row = db_session.scalar(select(GitHubCheckRun).where(GitHubCheckRun.run_id == run.id))
    assert row.error is None

    # Nothing new to say: no request at all.
    before = len(standin.state.requests)
    _notify(db_session, api_settings, run)
    assert len(standin.state.requests) == before


def test_a_failed_job_says_why_and_a_not_needed_one_says_nothing(db_session, api_settings, standin) -> None:  # noqa: ANN001
    run = _changed_run(db_session, standin, "trained-gh-failed")
    job_id, _ = run_store.open_training_impact(run.id, model_set="quick", session=db_session)
    run_store.finish_training_impact(job_id, error="the baseline no longer builds | see its log", session=db_session)
    _notify(db_session, api_settings, run)
    summary, comment = _sent(standin)
    assert "- Training impact: not measured: the baseline no longer builds \\| see its log" in comment
    assert "- Training impact: not measured:" in summary


def test_the_job_end_hook_notifies_from_its_own_thread_and_session(pg_engine, api_settings, standin) -> None:  # noqa: ANN001
    """worker/jobs/training.py's end: run_store.training_impact_finished(job_id, settings) returns at
    once; the notifier's thread reads the committed job with its own session."""
    from sqlalchemy import delete
    from sqlalchemy.orm import Session

    from service.db.models import Project, SourceArchive
    from tests.service.api.test_training_api import SOURCE

    with Session(pg_engine, expire_on_commit=False) as session:
        run = _changed_run(session, standin, "trained-gh-hook")
        project_id = run.project_id
        job_id, _ = run_store.open_training_impact(run.id, model_set="quick", session=session)
        finish_job(session, job_id, [model_impact("within_noise")])
        session.commit()
    try:
        with Session(pg_engine) as session:
            run_store.training_impact_finished(job_id, api_settings, session=session)
        [thread] = [t for t in threading.enumerate() if t.name == f"optdrift-notify-{run.id}"]
        thread.join(timeout=30)
        assert not thread.is_alive()
        summary, comment = _sent(standin)
        assert "- Training impact · mlp · adam · 32bit · fp32 · lr=0.1 · wd=0.1: beyond the floor, within seed " \
               "noise" in summary
        assert "beyond the floor, within seed noise" in comment
        # A job that is gone: nothing to notify, and no error for the worker.
        with Session(pg_engine) as session:
            run_store.training_impact_finished(10**9, api_settings, session=session)
    finally:
        with Session(pg_engine) as session:
            session.execute(delete(Project).where(Project.id == project_id))
            session.execute(delete(SourceArchive).where(SourceArchive.digest == SOURCE))
            session.commit()
