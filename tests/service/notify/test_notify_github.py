"""The GitHub notifier against a stand-in that validates every request against GitHub's official
OpenAPI description (tests/github_standin.py) and answers like GitHub, rate limits and 5xx
included. Real server on a port, real githubkit client, real database rows."""

from __future__ import annotations

import os

import time

import httpx
import pytest
from sqlalchemy import select

from service.db.notify_models import GitHubCheckRun, GitHubIntegration
from service.notify import conclusions
from service.notify.github_client import NotifyRetry
from service.notify.hooks import notify_run
from service.notify.report import comment_marker
from tests import github_standin
from tests.github_standin import GitHubStandin
from tests.notify_rows import finish_run, make_commit, make_project, make_run

TOKEN = "ghp_notifytesttoken0123456789abcdef"
SHA = "a1" * 20
# Short backoff so the retry tests take seconds; the rate-limit waits are GitHub's own numbers.
FAST_RETRY = NotifyRetry(attempts=3, backoff_s=0.05, max_wait_s=5.0)

# Skipped only off CI, where npm may be missing; in CI (.ci/run installs the description) a missing
# file fails these tests rather than hiding them.
pytestmark = pytest.mark.skipif(
    not github_standin.SPEC_PATH.exists() and not os.environ.get("CI"),
    reason=f"GitHub's OpenAPI description is not installed at {github_standin.SPEC_PATH} "
           "(.ci/run installs it: npm install --prefix .optdrift/npm @octokit/openapi@23.0.2)")


@pytest.fixture(scope="module")
def spec() -> dict:
    return github_standin.load_spec()


@pytest.fixture
def standin(spec):  # noqa: ANN001, ARG001
    with GitHubStandin(token=TOKEN) as server:
        server.state.pulls[SHA] = [(42, SHA, "open")]
        yield server
        assert server.state.violations == [], "requests that do not conform to GitHub's description"


@pytest.fixture
def integration(db_session, standin):  # noqa: ANN001
    project = make_project(db_session)
    row = GitHubIntegration(project_id=project.id, repository="octo/kernels", api_url=standin.url,
                            auth_kind="token", token=TOKEN, check_name="optdrift", pr_comments=True,
                            dashboard_url="https://optdrift.example.org")
    db_session.add(row)
    db_session.flush()
    return row


def _notify(db_session, api_settings, run) -> GitHubCheckRun:  # noqa: ANN001
    notify_run(session=db_session, run_id=run.id, settings=api_settings, retry=FAST_RETRY)
    return db_session.scalar(select(GitHubCheckRun).where(GitHubCheckRun.run_id == run.id))


def test_check_run_goes_in_progress_then_completed_and_the_pr_comment_is_edited_in_place(
        db_session, api_settings, standin, integration):  # noqa: ANN001
    commit = make_commit(db_session, integration_project(db_session, integration), SHA)
    cpu = make_run(db_session, commit, environment="cpu")
    row = _notify(db_session, api_settings, cpu)
    [created] = standin.state.calls("checks/create")
    assert created.body["status"] == "in_progress" and created.body["head_sha"] == SHA
    assert created.body["details_url"] == f"https://optdrift.example.org/runs/{cpu.id}"
    assert created.status == 201 and row.status == "in_progress"
    assert row.check_run_id > 2**32  # GitHub's ids are past 32 bits: stored whole (BigInteger)

    finish_run(db_session, cpu, outcome="changed")
    row = _notify(db_session, api_settings, cpu)
    [update] = standin.state.calls("checks/update")
    assert update.path.endswith(f"/check-runs/{row.check_run_id}")
    assert update.body["conclusion"] == "failure" and update.body["status"] == "completed"
    text = update.body["output"]["text"]
    assert "**adam · 32bit** — 2 case(s)" in text and "**adam · 8bit_blockwise** — 1 case(s)" in text
    assert "| `adam-wd-a1` | changed | 1 | – | farther from float64 |" in text
    assert "Not applicable on this device: 1" in update.body["output"]["summary"]
    [posted] = standin.state.calls("issues/create-comment")
    assert posted.path == "/repos/octo/kernels/issues/42/comments"
    assert posted.body["body"].startswith(comment_marker(commit.project.name))

    # The second environment's run of the same commit: the same comment, edited, never a second one.
    gpu = make_run(db_session, commit, environment="gpu.sm90", status="done")
    finish_run(db_session, gpu, outcome="unchanged", cases=[])
    _notify(db_session, api_settings, gpu)
    assert len(standin.state.calls("issues/create-comment")) == 1
    [edited] = standin.state.calls("issues/update-comment")
    [(comment_id, body)] = standin.state.comments[42].items()
    assert edited.path.endswith(f"/issues/comments/{comment_id}")
    assert "| gpu.sm90 | quick | unchanged" in body and "| cpu | quick | changed" in body
    # Nothing new to say: no request at all.
    before = len(standin.state.requests)
    _notify(db_session, api_settings, gpu)
    assert len(standin.state.requests) == before


def integration_project(db_session, integration):  # noqa: ANN001, ANN201
    from service.db.models import Project

    return db_session.get(Project, integration.project_id)


@pytest.mark.parametrize("state", conclusions.STATES)
def test_every_state_maps_to_a_conclusion_github_accepts(spec, state):  # noqa: ANN001
    body = spec["paths"]["/repos/{owner}/{repo}/check-runs/{check_run_id}"]["patch"]["requestBody"]
    allowed = body["content"]["application/json"]["schema"]["properties"]["conclusion"]["enum"]
    assert conclusions.conclusion_for(state).conclusion in allowed
    # stale is GitHub's to set, never ours
    assert conclusions.conclusion_for(state).conclusion != "stale"


def test_acknowledging_turns_the_check_to_success(db_session, api_settings, standin, integration):  # noqa: ANN001
    from service.domain import verdict_store

    run = make_run(db_session, make_commit(db_session, integration_project(db_session, integration), SHA))
    finish_run(db_session, run, outcome="changed")
    _notify(db_session, api_settings, run)
    verdict_store.acknowledge(session=db_session, run=run, note="intended reorder", by="maintainer")
    _notify(db_session, api_settings, run)
    conclusions_sent = [c.body["conclusion"] for c in standin.state.calls("checks/create")]
    assert conclusions_sent == ["failure"]  # completed at once: its start was never announced
    [update] = standin.state.calls("checks/update")
    assert update.body["conclusion"] == "success"
    assert "acknowledged" in update.body["output"]["title"]


@pytest.mark.parametrize("status, headers, message", [
    # primary limit: remaining 0, wait until the reset time (epoch seconds)
    (403, lambda: {"x-ratelimit-remaining": "0", "x-ratelimit-reset": str(int(time.time()) + 2)},
     "API rate limit exceeded"),
    # secondary limit: Retry-After seconds
    (429, lambda: {"retry-after": "1"}, "You have exceeded a secondary rate limit"),
    (403, lambda: {"retry-after": "1"}, "You have exceeded a secondary rate limit"),
])
def test_rate_limit_answers_are_waited_out_as_their_headers_say(
        db_session, api_settings, standin, integration, status, headers, message):  # noqa: ANN001
    run = make_run(db_session, make_commit(db_session, integration_project(db_session, integration), SHA))
    sent_headers = headers()
    asked_s = (float(sent_headers["retry-after"]) if "retry-after" in sent_headers
               else int(sent_headers["x-ratelimit-reset"]) - time.time())
    standin.fail_next("checks/create", status, sent_headers, message)
    row = _notify(db_session, api_settings, run)
    first, second = standin.state.calls("checks/create")
    assert (first.status, second.status) == (status, 201)
    # The wait GitHub asked for, less 0.05 s for the clocks (the reset is whole seconds: ≥ asked - 1).
    waited = second.at - first.at
    assert waited >= (asked_s - 1 if "x-ratelimit-reset" in sent_headers else asked_s) - 0.05
    assert row.error is None and row.status == "in_progress"


def test_a_rate_limit_longer_than_the_cap_is_not_slept_through(db_session, api_settings, standin, integration):  # noqa: ANN001
    run = make_run(db_session, make_commit(db_session, integration_project(db_session, integration), SHA))
    standin.fail_next("checks/create", 403, {"x-ratelimit-remaining": "0",
                                             "x-ratelimit-reset": str(int(time.time()) + 3600)})
    started = time.monotonic()
    row = _notify(db_session, api_settings, run)
    assert time.monotonic() - started < 3
    assert len(standin.state.calls("checks/create")) == 1
    assert "RateLimitExceeded" in row.error and row.attempts == 1


def test_server_errors_are_retried_and_a_failure_never_touches_the_verdict(
        db_session, api_settings, standin, integration):  # noqa: ANN001
    run = make_run(db_session, make_commit(db_session, integration_project(db_session, integration), SHA))
    verdict = finish_run(db_session, run, outcome="changed")
    # Two 502s then success: retried with backoff, completed.
    standin.fail_next("checks/create", 502)
    standin.fail_next("checks/create", 502)
    row = _notify(db_session, api_settings, run)
    assert [c.status for c in standin.state.calls("checks/create")] == [502, 502, 201]
    assert row.conclusion == "failure" and row.error is None

    # A GitHub that keeps failing (3 attempts, all 503) and echoes the token: recorded, scrubbed.
    run2 = make_run(db_session, make_commit(db_session, integration_project(db_session, integration), "b2" * 20))
    verdict2 = finish_run(db_session, run2, outcome="broken")
    for _ in range(3):
        standin.fail_next("checks/create", 503, message=f"upstream down for {TOKEN}")
    row2 = _notify(db_session, api_settings, run2)
    assert row2.error and TOKEN not in row2.error and "[redacted]" in row2.error
    db_session.refresh(verdict2)
    db_session.refresh(run2)
    assert (verdict2.outcome, verdict2.flagged, run2.status) == ("broken", True, "done")
    assert (verdict.outcome, verdict.flagged) == ("changed", True)
    # The next notification of the run sends its state again (the error is not final).
    row2 = _notify(db_session, api_settings, run2)
    assert row2.error is None and row2.conclusion == "failure"


def test_an_unreachable_github_is_recorded_not_raised(db_session, api_settings, integration):  # noqa: ANN001
    from tests.service_fixtures import free_port

    integration.api_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    run = make_run(db_session, make_commit(db_session, integration_project(db_session, integration), SHA))
    finish_run(db_session, run, outcome="changed")
    row = _notify(db_session, api_settings, run)
    assert row.error and "Request" in row.error and row.check_run_id is None


def test_github_app_auth_signs_a_jwt_and_uses_the_installation_token(db_session, api_settings, spec):  # noqa: ANN001, ARG001
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                    serialization.NoEncryption()).decode()
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    with GitHubStandin(app_id="123456", app_public_key=public_pem) as standin:
        project = make_project(db_session)
        db_session.add(GitHubIntegration(project_id=project.id, repository="octo/kernels", api_url=standin.url,
                                         auth_kind="app", app_id="123456", private_key=private_pem,
                                         check_name="optdrift", pr_comments=False))
        run = make_run(db_session, make_commit(db_session, project, SHA))
        row = _notify(db_session, api_settings, run)
        assert standin.state.violations == []
        assert [r.operation_id for r in standin.state.requests] == [
            "apps/get-repo-installation", "apps/create-installation-access-token", "checks/create"]
        assert standin.state.requests[-1].authorization.endswith(standin.state.installation_token)
        assert row.error is None and row.status == "in_progress"


def test_the_standin_refuses_requests_that_do_not_conform(standin):  # noqa: ANN001
    """The validator itself: a conclusion GitHub does not know, an unknown operation, a bad query."""
    headers = {"Authorization": f"token {TOKEN}", "X-GitHub-Api-Version": "2022-11-28"}
    bad = httpx.post(f"{standin.url}/repos/o/r/check-runs", headers=headers,
                     json={"name": "x", "head_sha": SHA, "conclusion": "passed"})
    missing = httpx.post(f"{standin.url}/repos/o/r/check-runs", headers=headers, json={"name": "x"})
    unknown = httpx.post(f"{standin.url}/repos/o/r/check-suns", headers=headers, json={})
    query = httpx.get(f"{standin.url}/repos/o/r/issues/1/comments?per_page=many", headers=headers)
    assert [r.status_code for r in (bad, missing, unknown, query)] == [422] * 4
    found = "\n".join(standin.state.violations)
    assert "body conclusion: 'passed' is not one of" in found
    assert "'head_sha' is a required property" in found
    assert "no such operation" in found and "per_page='many'" in found
    standin.state.violations.clear()  # expected here; the fixture asserts none elsewhere


def test_the_hook_notifies_from_its_own_thread_and_session_after_the_commit(pg_engine, api_settings, standin):  # noqa: ANN001
    """What the worker and the API call: run_changed returns at once; the thread reads the
    committed run with its own session and commits what it sent."""
    from sqlalchemy import delete
    from sqlalchemy.orm import Session

    from service.db.models import Project, SourceArchive
    from service.notify import hooks

    with Session(pg_engine, expire_on_commit=False) as session:
        project = make_project(session)
        session.add(GitHubIntegration(project_id=project.id, repository="octo/kernels", api_url=standin.url,
                                      auth_kind="token", token=TOKEN, check_name="optdrift", pr_comments=True))
        run = make_run(session, make_commit(session, project, SHA))
        finish_run(session, run, outcome="changed")
        session.commit()
    try:
        thread = hooks.run_changed(run.id, settings=api_settings, with_dependants=True)
        thread.join(timeout=30)
        assert not thread.is_alive()
        with Session(pg_engine) as session:
            row = session.scalar(select(GitHubCheckRun).where(GitHubCheckRun.run_id == run.id))
            assert (row.conclusion, row.error) == ("failure", None) and len(row.comment_ids) == 1
        assert [c.body["conclusion"] for c in standin.state.calls("checks/create")] == ["failure"]
    finally:
        with Session(pg_engine) as session:
            session.execute(delete(Project).where(Project.id == project.id))
            session.execute(delete(SourceArchive).where(SourceArchive.digest == "e" * 64))
            session.commit()


def test_a_token_that_may_not_create_checks_still_comments(db_session, api_settings, standin, integration):  # noqa: ANN001
    """GitHub keeps check runs to Apps: a personal token's 403 is recorded (not retried, not a rate
    limit) and the PR comment goes out all the same."""
    run = make_run(db_session, make_commit(db_session, integration_project(db_session, integration), SHA),
                   status="done")
    finish_run(db_session, run, outcome="changed")
    standin.fail_next("checks/create", 403, message="Resource not accessible by personal access token")
    row = _notify(db_session, api_settings, run)
    assert [c.status for c in standin.state.calls("checks/create")] == [403]
    assert len(standin.state.calls("issues/create-comment")) == 1
    assert "answered 403: Resource not accessible by personal access token" in row.error
    assert row.check_run_id is None and row.comment_ids
