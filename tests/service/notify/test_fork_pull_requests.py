"""Pull requests from forks (issue 44): GitHub's signed pull_request delivery to the real API starts
verify runs of the pull request's merge tree, fetched by the service through its GitHub App from the
stand-in (tests/github_standin.py: every REST request checked against GitHub's description; the
tarball's 302 leads to a download host of another origin), and the runs' check runs and PR comment
go to the fork's head and the pull request. The contributor sends nothing and holds no token.

The runs are finished as the other notifier tests finish them (tests/notify_rows.finish_run writes
the verdict rows; no worker), then notified through service.notify.hooks.notify_run, the function
the worker's result path calls.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import hmac
import io
import json
import os
import tarfile
import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr
from sqlalchemy import select

from service.db.models import Commit, Run
from service.db.notify_models import GitHubCheckRun, GitHubIntegration, GitHubPullRequestRun
from service.domain import projects, submissions
from service.domain.storage import get_archive
from service.notify.github_client import NotifyRetry
from service.notify.hooks import notify_run
from service.notify.report import comment_marker
from tests import github_standin
from tests.github_standin import GitHubStandin
from tests.notify_rows import finish_run
from tests.service_fixtures import make_archive

pytestmark = pytest.mark.skipif(
    not github_standin.SPEC_PATH.exists() and not os.environ.get("CI"),
    reason=f"GitHub's OpenAPI description is not installed at {github_standin.SPEC_PATH} (.ci/run installs it)")

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "action_events" / "pull_request_fork.json"
SECRET = "whsec-github-app-webhook-secret-0123456789"
# Another App than test_notify_github.py's: githubkit caches JWTs and installation tokens by app id
# for the process, and that test counts its token requests.
APP_ID = "987654"
BASE, HEAD, HEAD_PARENT, MERGE = "b1" * 20, "d2" * 20, "d1" * 20, "e3" * 20
FAST_RETRY = NotifyRetry(attempts=2, backoff_s=0.05, max_wait_s=1.0)
MERGE_TREE = {"csrc/adam.cu": "adam v1\n", "csrc/lion.cu": "lion v2: clamp before the sign\n",
              "README.md": "kernels\n"}


def event(**overrides: str) -> dict:
    text = FIXTURE.read_text()
    for name, value in {"BASE": BASE, "HEAD": HEAD, "HEAD_PARENT": HEAD_PARENT, "MERGE": MERGE, **overrides}.items():
        text = text.replace(f"@{name}@", value)
    return json.loads(text)


def github_tarball(files: dict[str, str], sha: str) -> bytes:
    """What GitHub's download host serves: the tree in one `owner-repo-sha7/` folder, with git
    archive's pax header naming the commit."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.PAX_FORMAT,
                      pax_headers={"comment": sha}) as tar:
        root = f"my-org-my-kernels-{sha[:7]}"
        for folder in (root, f"{root}/csrc"):
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, text in files.items():
            info = tarfile.TarInfo(f"{root}/{name}")
            info.size, info.mode = len(text.encode()), 0o644
            tar.addfile(info, io.BytesIO(text.encode()))
    return buffer.getvalue()


def signed(body: bytes, *, delivery: str | None = None, event_name: str = "pull_request",
           secret: str = SECRET) -> dict[str, str]:
    """GitHub's headers, the signature computed here as GitHub's docs say (not with the service's code)."""
    return {"Content-Type": "application/json", "User-Agent": "GitHub-Hookshot/a1b2c3d",
            "X-GitHub-Event": event_name, "X-GitHub-Delivery": delivery or str(uuid.uuid4()),
            "X-GitHub-Hook-Installation-Target-Type": "integration",
            "X-Hub-Signature-256": "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()}


@pytest.fixture(scope="module")
def app_key() -> tuple[str, str]:
    """One App key for the process (this module and tests/service/notify/test_github_loop.py, which
    takes these fixtures): githubkit caches the App's JWT and installation token by app id."""
    return _app_keypair()


@functools.lru_cache(maxsize=1)
def _app_keypair() -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    return private, public


@pytest.fixture
def standin(app_key):  # noqa: ANN001
    with GitHubStandin(app_id=APP_ID, app_public_key=app_key[1]) as server:
        server.state.pull_details[8] = {"head_sha": HEAD, "base_ref": "main", "state": "open", "mergeable": True,
                                        "merge_commit_sha": MERGE}
        server.state.commit_parents[MERGE] = [BASE, HEAD]
        server.state.tarballs[MERGE] = github_tarball(MERGE_TREE, MERGE)
        yield server
        assert server.state.violations == [], "requests that do not conform to GitHub's description"


@pytest.fixture
def world(db_session, api_settings, standin, app_key):  # noqa: ANN001
    """A project registering my-org/my-kernels through its GitHub App, main's tip BASE submitted."""
    project = projects.create(session=db_session, name="my-kernels", environments=["cpu", "gpu.sm90"])
    submissions.submit_commit(session=db_session, settings=api_settings, project=project, sha=BASE, parents=[],
                              archive=make_archive({"csrc/adam.cu": "adam v1\n", "csrc/lion.cu": "lion v1\n"}))
    db_session.add(GitHubIntegration(project_id=project.id, repository="my-org/my-kernels", api_url=standin.url,
                                     auth_kind="app", app_id=APP_ID, private_key=app_key[0], check_name="optdrift",
                                     pr_comments=True, dashboard_url="https://optdrift.example.org"))
    db_session.flush()
    return project


@pytest.fixture
def github_client(db_session, api_settings):  # noqa: ANN001, ANN201
    """The API as GitHub reaches it: no Authorization header at all."""
    from fastapi.testclient import TestClient

    from service.api.main import create_app
    from service.db.session import get_session
    from service.settings import get_settings

    settings = api_settings.model_copy(update={"github_webhook_secret": SecretStr(SECRET)})
    app = create_app()
    app.dependency_overrides[get_session] = lambda: db_session
    app.dependency_overrides[get_settings] = lambda: settings
    with TestClient(app) as client:
        client.settings = settings
        yield client


def deliver(client, document: dict, **headers: str):  # noqa: ANN001, ANN201
    body = json.dumps(document).encode()
    return client.post("/api/v1/github/events", content=body, headers={**signed(body), **headers})


def pr_runs(db_session, project) -> list[Run]:  # noqa: ANN001
    return list(db_session.scalars(select(Run).where(Run.project_id == project.id, Run.kind == "verify")
                                   .order_by(Run.id)))


def test_a_signed_fork_event_verifies_the_merge_tree_and_reports_on_the_pull_request(
        db_session, api_settings, standin, world, github_client):  # noqa: ANN001
    answer = deliver(github_client, event())
    assert answer.status_code == 202, answer.text
    runs = pr_runs(db_session, world)
    assert [r.environment for r in runs] == ["cpu", "gpu.sm90"] and answer.json()["run_ids"] == [r.id for r in runs]
    base = db_session.scalar(select(Commit).where(Commit.project_id == world.id, Commit.sha == BASE))
    assert all(r.base_commit_id == base.id and r.commit_id is None and r.status == "queued" for r in runs)
    # The tree is the merge commit's, repacked as the client packs a checkout: GitHub's wrapping
    # folder gone, so optdrift.toml and the sources sit at the root where the worker looks.
    _, path = get_archive(session=db_session, settings=api_settings, digest=runs[0].source_digest, project=world)
    with tarfile.open(path) as tar:
        files = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    assert files == MERGE_TREE
    links = db_session.scalars(select(GitHubPullRequestRun).order_by(GitHubPullRequestRun.run_id)).all()
    assert [(l.pull_number, l.head_sha, l.merge_sha, l.base_sha, l.head_repository) for l in links] == \
        [(8, HEAD, MERGE, BASE, "outside-contributor/my-kernels")] * 2
    # Fetched through the App's installation token (githubkit may reuse one it already holds); the
    # download host got no credential of ours.
    fetches = [r for r in standin.state.requests if not r.operation_id.startswith("apps/")]
    assert [r.operation_id for r in fetches] == ["pulls/get", "repos/get-commit", "repos/download-tarball-archive"]
    assert all(r.authorization.endswith(standin.state.installation_token) for r in fetches)
    assert standin.state.codeload_requests == [(f"/my-org/my-kernels/legacy.tar.gz/{MERGE}", None)]

    # The worker starts the cpu run: the check run goes in progress on the fork's head.
    cpu, gpu = runs
    cpu.status = "building"
    db_session.flush()
    notify_run(session=db_session, run_id=cpu.id, settings=github_client.settings, retry=FAST_RETRY)
    [created] = standin.state.calls("checks/create")
    assert created.body["head_sha"] == HEAD and created.body["status"] == "in_progress"
    assert created.body["name"] == "optdrift (cpu)" and created.path == "/repos/my-org/my-kernels/check-runs"
    # It ends changed: the check fails, and the pull request gets the comment.
    finish_run(db_session, cpu, outcome="changed")
    notify_run(session=db_session, run_id=cpu.id, settings=github_client.settings, retry=FAST_RETRY)
    [update] = standin.state.calls("checks/update")
    assert update.body["conclusion"] == "failure"
    [posted] = standin.state.calls("issues/create-comment")
    assert posted.path == "/repos/my-org/my-kernels/issues/8/comments"
    assert posted.body["body"].startswith(comment_marker("my-kernels")) and f"`{HEAD[:12]}`" in posted.body["body"]
    # The other environment: its own check run on the head, the same comment edited in place.
    gpu.status = "done"
    finish_run(db_session, gpu, outcome="unchanged", cases=[])
    notify_run(session=db_session, run_id=gpu.id, settings=github_client.settings, retry=FAST_RETRY)
    assert [c.body["conclusion"] for c in standin.state.calls("checks/create")[1:]] == ["success"]
    assert len(standin.state.calls("issues/create-comment")) == 1
    [(_, body)] = standin.state.comments[8].items()
    assert "| cpu | quick | changed" in body and "| gpu.sm90 | quick | unchanged" in body
    rows = db_session.scalars(select(GitHubCheckRun).where(GitHubCheckRun.run_id.in_([cpu.id, gpu.id]))).all()
    assert {(r.conclusion, r.error) for r in rows} == {("failure", None), ("success", None)}


def test_an_unsigned_or_wrongly_signed_delivery_is_refused(db_session, standin, world, github_client):  # noqa: ANN001
    body = json.dumps(event()).encode()
    unsigned = {k: v for k, v in signed(body).items() if k != "X-Hub-Signature-256"}
    other_secret = signed(body, secret="not-the-service-secret-0123456789")
    tampered = signed(body)  # signed, then the body changed: the head swapped for another commit
    changed = body.replace(HEAD.encode(), ("f" * 40).encode())
    answers = [github_client.post("/api/v1/github/events", content=body, headers=unsigned),
               github_client.post("/api/v1/github/events", content=body, headers=other_secret),
               github_client.post("/api/v1/github/events", content=changed, headers=tampered)]
    assert [a.status_code for a in answers] == [401, 401, 401]
    assert "X-Hub-Signature-256" in answers[0].json()["detail"]
    assert "does not match" in answers[1].json()["detail"]
    assert pr_runs(db_session, world) == [] and standin.state.requests == []


def test_no_secret_configured_refuses_every_delivery(db_session, api_settings, standin, world):  # noqa: ANN001
    from fastapi.testclient import TestClient

    from service.api.main import create_app
    from service.db.session import get_session
    from service.settings import get_settings

    app = create_app()
    app.dependency_overrides[get_session] = lambda: db_session
    app.dependency_overrides[get_settings] = lambda: api_settings  # no github_webhook_secret
    with TestClient(app) as client:
        answer = deliver(client, event())
    assert answer.status_code == 401 and "OPTDRIFT_GITHUB_WEBHOOK_SECRET" in answer.json()["detail"]
    assert pr_runs(db_session, world) == []


def test_the_same_head_delivered_twice_makes_one_run_per_environment(
        db_session, standin, world, github_client):  # noqa: ANN001
    document = event()
    body = json.dumps(document).encode()
    headers = signed(body, delivery="72d3162e-cc78-11e3-81ab-4c9367dc0958")
    first = github_client.post("/api/v1/github/events", content=body, headers=headers)
    again = github_client.post("/api/v1/github/events", content=body, headers=headers)  # GitHub's redelivery
    reopened = deliver(github_client, {**document, "action": "reopened"})  # another delivery, the same head
    assert [a.status_code for a in (first, again, reopened)] == [202, 200, 200]
    runs = pr_runs(db_session, world)
    assert len(runs) == 2
    assert again.json()["handled"] is False and "already verified" in again.json()["reason"]
    assert len(standin.state.calls("repos/download-tarball-archive")) == 1


def test_a_new_head_supersedes_the_runs_of_the_previous_one(db_session, standin, world, github_client):  # noqa: ANN001
    assert deliver(github_client, event()).status_code == 202
    first = pr_runs(db_session, world)
    new_head, new_merge = "d3" * 20, "e4" * 20
    standin.state.pull_details[8].update(head_sha=new_head, merge_commit_sha=new_merge)
    standin.state.commit_parents[new_merge] = [BASE, new_head]
    standin.state.tarballs[new_merge] = github_tarball({**MERGE_TREE, "csrc/lion.cu": "lion v3\n"}, new_merge)
    answer = deliver(github_client, event(HEAD=new_head, HEAD_PARENT=HEAD, MERGE=new_merge))
    assert answer.status_code == 202 and sorted(answer.json()["superseded_run_ids"]) == [r.id for r in first]
    for run in first:
        db_session.refresh(run)
    assert {r.status for r in first} == {"cancelled"}
    assert len(pr_runs(db_session, world)) == 4


def test_events_that_are_not_a_forks_new_head_start_nothing(db_session, standin, world, github_client):  # noqa: ANN001
    same_repo = copy.deepcopy(event())
    same_repo["pull_request"]["head"]["repo"] = copy.deepcopy(same_repo["pull_request"]["base"]["repo"])
    not_a_fork = copy.deepcopy(event())
    not_a_fork["pull_request"]["head"]["repo"]["fork"] = False
    unknown = copy.deepcopy(event())
    unknown["repository"]["full_name"] = "someone-else/kernels"
    deleted_fork = copy.deepcopy(event())
    deleted_fork["pull_request"]["head"]["repo"] = None
    cases = {
        "itself: its workflow has the repository's secrets": (same_repo, "pull_request"),
        "is not a fork": (not_a_fork, "pull_request"),
        "no project registers repository 'someone-else/kernels'": (unknown, "pull_request"),
        "head repository was deleted": (deleted_fork, "pull_request"),
        "gives the pull request no new head": ({**event(), "action": "labeled"}, "pull_request"),
        "pull_request events only": (event(), "issues"),
        "pong": ({"zen": "Keep it logically awesome.", "hook_id": 1}, "ping"),
    }
    for reason, (document, event_name) in cases.items():
        body = json.dumps(document).encode()
        answer = github_client.post("/api/v1/github/events", content=body, headers=signed(body, event_name=event_name))
        assert answer.status_code == 200 and answer.json()["handled"] is False, (reason, answer.text)
        assert reason in answer.json()["reason"], (reason, answer.text)
    assert pr_runs(db_session, world) == [] and standin.state.requests == []


def test_a_merge_conflict_is_a_check_run_that_asks_for_action(db_session, standin, world, github_client):  # noqa: ANN001
    standin.state.pull_details[8].update(mergeable=False, merge_commit_sha=None)
    answer = deliver(github_client, event())
    assert answer.status_code == 200 and "does not merge cleanly" in answer.json()["reason"]
    [check] = standin.state.calls("checks/create")
    assert check.body["head_sha"] == HEAD and check.body["conclusion"] == "action_required"
    assert check.body["output"]["title"] == "optdrift: merge conflicts: no merge tree to verify"
    assert pr_runs(db_session, world) == []


def test_a_base_never_submitted_is_a_check_run_that_asks_for_action(db_session, standin, world, github_client):  # noqa: ANN001
    other_base = "c0" * 20
    standin.state.commit_parents[MERGE] = [other_base, HEAD]
    answer = deliver(github_client, event())
    assert answer.status_code == 200 and other_base in answer.json()["reason"]
    [check] = standin.state.calls("checks/create")
    assert check.body["conclusion"] == "action_required" and "never submitted" in check.body["output"]["title"]
    assert pr_runs(db_session, world) == []


def test_a_tarball_past_the_upload_limit_is_not_read_past_it(db_session, standin, world, github_client):  # noqa: ANN001
    limit = github_client.settings.max_upload_bytes
    standin.state.tarballs[MERGE] = os.urandom(limit + 4096)
    answer = deliver(github_client, event())
    assert answer.status_code == 200 and f"{limit}-byte upload limit" in answer.json()["reason"]
    assert standin.state.calls("checks/create")[0].body["conclusion"] == "action_required"
    assert pr_runs(db_session, world) == []


def test_the_forks_daily_quota_bounds_the_heads_verified(db_session, standin, world, github_client):  # noqa: ANN001
    github_client.settings.verify_daily_quota = 1
    assert deliver(github_client, event()).status_code == 202
    new_head, new_merge = "d3" * 20, "e4" * 20
    standin.state.pull_details[8].update(head_sha=new_head, merge_commit_sha=new_merge)
    standin.state.commit_parents[new_merge] = [BASE, new_head]
    standin.state.tarballs[new_merge] = github_tarball(MERGE_TREE, new_merge)
    answer = deliver(github_client, event(HEAD=new_head, HEAD_PARENT=HEAD, MERGE=new_merge))
    assert answer.status_code == 200 and "had 1 head commits verified today" in answer.json()["reason"]
    assert len(pr_runs(db_session, world)) == 2
