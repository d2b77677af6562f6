"""Pull requests from forks, verified by the service itself (issue 44).

GitHub runs a fork's `pull_request` workflow without the repository's secrets, so the Action has no
optdrift token there (it skips: action.yml, "Pull request from a fork"). Instead GitHub sends the
project's GitHub App (or a repository webhook) a `pull_request` event, and this module:

1. authenticates the delivery: X-Hub-Signature-256 is `sha256=` + the hex HMAC-SHA256 of the raw
   body under OPTDRIFT_GITHUB_WEBHOOK_SECRET, compared in constant time before a byte is parsed;
2. keeps only opened / synchronize / reopened events of a registered repository whose head is a
   fork (a branch of the repository itself has the secrets: the Action submits it);
3. fetches the merge tree through the integration's own credential: GET the pull request (its
   current head and test merge commit), GET that merge commit (its parents must be the base tip
   and this head: GitHub recomputes the merge after each push, and an answer describing an older
   head is waited out), then the tarball of the merge commit's sha, a 302 to the download host,
   read with no credential and at most OPTDRIFT_MAX_UPLOAD_BYTES;
4. repacks it as the client packs a tree (GitHub wraps it in one `owner-repo-sha/` folder) and
   starts one verify run per registered environment, compared with the merge commit's first
   parent, the base branch's tip, whose run service/domain/baselines.py finds; the runs take the
   verify budget (OPTDRIFT_VERIFY_*) and a daily quota per fork (OPTDRIFT_VERIFY_DAILY_QUOTA head
   commits a UTC day);
5. records each run (GitHubPullRequestRun), so service/notify/hooks.py posts its check run on the
   PR's head and the PR comment, as for a commit run.

Why the merge tree and not the head's: the run is compared with the base tip, and only the merge
tree differs from it by exactly the pull request's change (a head behind the base would show the
base's own newer changes as the contributor's). It is the tree the Action verifies for a branch of
the repository itself (github.sha on pull_request is this merge commit). Why its sha and not
refs/pull/N/merge: the ref moves with every push and base change; the sha pins the tree whose
parents were checked.

Idempotent: a head sha already verified for the project starts nothing (a delivery GitHub repeats,
a reopened pull request, two projects' events racing on the unique key). Refusals the contributor
must act on (merge conflicts, the day's quota, a base never submitted) become a completed check run
`action_required` on the head, so the pull request says why nothing ran.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpx
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.core.archives import ArchiveError, extract_archive, pack_directory
from service.db.models import BUILDING, QUEUED, RUNNING, Project, Run
from service.db.notify_models import GitHubIntegration, GitHubPullRequestRun
from service.domain import runs as run_domain
from service.domain import submissions
from service.domain.errors import BadInputError, ConflictError, NotFoundError
from service.domain.storage import archive_limits
from service.notify import github
from service.settings import Settings

log = logging.getLogger(__name__)

EVENT_HEADER = "X-GitHub-Event"
DELIVERY_HEADER = "X-GitHub-Delivery"
SIGNATURE_HEADER = "X-Hub-Signature-256"
# GitHub caps a delivery at 25 MB; a pull_request event is tens of kilobytes (its body text is at
# most 65536 characters). More than this is not GitHub's.
MAX_EVENT_BYTES = 1024 * 1024
# The actions that give a pull request a new head (or bring it back); labels, edits, reviews don't.
VERIFIED_ACTIONS = ("opened", "synchronize", "reopened")
# How long a delivery waits for GitHub's merge commit of the new head (GitHub answers a delivery
# that takes over 10 s as failed; the merge is usually there within a second or two).
MERGE_WAIT_S = 6.0
MERGE_POLL_S = 1.0
DOWNLOAD_TIMEOUT_S = 60.0


class GitHubUnavailable(Exception):
    """GitHub's API or download host failed us (an answer we cannot use, a network error)."""


class SignatureError(Exception):
    """The delivery is not signed with the service's webhook secret (or no secret is set)."""


def signature_of(secret: str, body: bytes) -> str:
    """X-Hub-Signature-256 as GitHub computes it over the raw body."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def check_signature(*, secret: str | None, body: bytes, header: str | None) -> None:
    if not secret:
        raise SignatureError("this service accepts no GitHub webhook deliveries: OPTDRIFT_GITHUB_WEBHOOK_SECRET "
                             "is not set (set it to the GitHub App's webhook secret)")
    if not header:
        raise SignatureError(f"the delivery has no {SIGNATURE_HEADER} header: set a secret on the GitHub App's "
                             "(or the repository's) webhook, the same as OPTDRIFT_GITHUB_WEBHOOK_SECRET")
    if not hmac.compare_digest(signature_of(secret, body).encode(), header.strip().encode()):
        raise SignatureError(f"{SIGNATURE_HEADER} does not match the body under this service's webhook secret: "
                             "the webhook's secret and OPTDRIFT_GITHUB_WEBHOOK_SECRET differ, or the body was changed")


@dataclass
class EventAnswer:
    """What the service did with a delivery (GitHub shows the answer in its delivery log)."""

    handled: bool
    reason: str
    status_code: int = 200
    run_ids: list[int] = field(default_factory=list)
    # Runs of an earlier head of the same pull request, asked to cancel (the new head supersedes them).
    superseded_run_ids: list[int] = field(default_factory=list)
    # The runs to send to workers once the caller committed.
    to_dispatch: list[int] = field(default_factory=list)

    def document(self) -> dict[str, Any]:
        return {"handled": self.handled, "reason": self.reason, "run_ids": self.run_ids,
                "superseded_run_ids": self.superseded_run_ids}


@dataclass(frozen=True)
class PullRequestEvent:
    action: str
    number: int
    repository: str  # the base repository, owner/name
    head_sha: str
    head_repository: str | None  # None: the fork was deleted
    head_is_fork: bool


def _field(document: Any, path: str) -> Any:
    node = document
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise BadInputError(f"the pull_request event has no `{path}`; is it a GitHub pull_request delivery?")
        node = node[part]
    return node


def parse_event(body: bytes) -> PullRequestEvent:
    """The fields used, each checked (the signature says GitHub sent it, not that it is well formed)."""
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise BadInputError(f"the delivery's body is not JSON ({exc}); send GitHub's application/json "
                            "content type (the webhook's 'Content type' setting)") from exc
    action, number = _field(document, "action"), _field(document, "pull_request.number")
    repository = _field(document, "repository.full_name")
    head_sha, head_repo = _field(document, "pull_request.head.sha"), _field(document, "pull_request.head.repo")
    if not isinstance(action, str) or not isinstance(number, int) or not 0 < number < 2**31:
        raise BadInputError(f"the pull_request event's `action` {str(action)[:40]!r} or `number` "
                            f"{str(number)[:40]!r} is not what GitHub sends")
    if not isinstance(repository, str) or repository.count("/") != 1 or len(repository) > 200:
        raise BadInputError(f"`repository.full_name` {str(repository)[:80]!r} is not owner/name")
    if not isinstance(head_sha, str) or len(head_sha) not in (40, 64) or \
            any(c not in "0123456789abcdef" for c in head_sha):
        raise BadInputError(f"`pull_request.head.sha` {str(head_sha)[:80]!r} is not a commit sha")
    if head_repo is not None and not (isinstance(head_repo, dict) and isinstance(head_repo.get("full_name"), str)):
        raise BadInputError("`pull_request.head.repo` is neither a repository nor null")
    return PullRequestEvent(action=action, number=number, repository=repository, head_sha=head_sha,
                            head_repository=head_repo["full_name"] if head_repo else None,
                            head_is_fork=bool(head_repo and head_repo.get("fork") is True))


@dataclass(frozen=True)
class MergeTree:
    merge_sha: str
    base_sha: str


class Refused(Exception):
    """The pull request cannot be verified now; `title` and the message go on a check run."""

    def __init__(self, title: str, message: str) -> None:
        super().__init__(message)
        self.title = title


class Stale(Exception):
    """The event describes a head the pull request no longer has, or a closed pull request."""


def merge_tree(gh, *, owner: str, repo: str, number: int, head_sha: str,  # noqa: ANN001
               wait_s: float = MERGE_WAIT_S, poll_s: float = MERGE_POLL_S) -> MergeTree:
    """The test merge commit GitHub made of `head_sha` into the base branch, checked by its parents."""
    deadline = time.monotonic() + wait_s
    while True:
        pull = gh.rest.pulls.get(owner, repo, number).json()
        if pull.get("state") != "open":
            raise Stale(f"pull request #{number} is {pull.get('state')}; nothing to verify")
        if pull["head"]["sha"] != head_sha:
            raise Stale(f"pull request #{number}'s head is now {pull['head']['sha']}, not {head_sha}: the "
                        "event for the newer head verifies it")
        if pull.get("mergeable") is False:
            raise Refused("merge conflicts: no merge tree to verify",
                          f"pull request #{number} does not merge cleanly into {pull['base']['ref']}, so GitHub "
                          "made no merge commit and optdrift has no tree to verify: resolve the conflicts and push")
        merge_sha = pull.get("merge_commit_sha")
        if pull.get("mergeable") is True and merge_sha:
            commit = gh.rest.repos.get_commit(owner, repo, merge_sha).json()
            parents = [parent["sha"] for parent in commit.get("parents") or []]
            if len(parents) == 2 and parents[1] == head_sha:
                return MergeTree(merge_sha=merge_sha, base_sha=parents[0])
        if time.monotonic() >= deadline:
            raise Refused("GitHub has not made the merge commit yet",
                          f"GitHub had not computed the merge commit of {head_sha} into the base branch within "
                          f"{wait_s:.0f} s: redeliver this event (the App's Advanced settings) or push again")
        time.sleep(poll_s)


def download_tarball(gh, *, api_url: str, owner: str, repo: str, sha: str, max_bytes: int) -> bytes:  # noqa: ANN001
    """The tar.gz of `sha`: GitHub answers the API request with a 302 to its download host, whose
    URL carries its own short-lived token; that host gets no credential of ours (the client that
    asks must not follow redirects). At most `max_bytes` are read."""
    answer = gh.rest.repos.download_tarball_archive(owner, repo, sha)
    location = answer.headers.get("location")
    if answer.status_code not in (301, 302, 303, 307, 308) or not location:
        raise RuntimeError(f"GET /repos/{owner}/{repo}/tarball/{sha} answered {answer.status_code} without a "
                           "Location to download from")
    chunks, size = [], 0
    with httpx.Client(timeout=DOWNLOAD_TIMEOUT_S, follow_redirects=True) as client, \
            client.stream("GET", urljoin(api_url, location)) as response:
        response.raise_for_status()
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > max_bytes:
                raise Refused("the tree is too large",
                              f"the tarball of {sha} is larger than this service's {max_bytes}-byte upload "
                              "limit (OPTDRIFT_MAX_UPLOAD_BYTES), the limit a submitted tree has")
            chunks.append(chunk)
    return b"".join(chunks)


def repack(data: bytes, *, settings: Settings) -> bytes:
    """GitHub's tarball as the client would have packed the tree: extracted with the archive limits
    and checks of every upload, its one wrapping folder removed, packed deterministically (so the
    same tree has the same digest as `optdrift submit` of a checkout)."""
    with tempfile.TemporaryDirectory(prefix="optdrift-pr-") as folder:
        try:
            extract_archive(data, Path(folder), archive_limits(settings))
        except ArchiveError as exc:
            raise Refused("the tree was refused", f"the merge tree's tarball: {exc}") from exc
        entries = list(Path(folder).iterdir())
        root = entries[0] if len(entries) == 1 and entries[0].is_dir() else Path(folder)
        return pack_directory(root)


def _today_heads(session: Session, fork: str) -> int:
    start = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    return session.scalar(select(func.count(func.distinct(GitHubPullRequestRun.head_sha))).where(
        func.lower(GitHubPullRequestRun.head_repository) == fork.lower(),
        GitHubPullRequestRun.created_at >= start)) or 0


def _post_refusal(gh, *, integration: GitHubIntegration, head_sha: str, refused: Refused,  # noqa: ANN001
                  details_url: str) -> None:
    owner, repo = integration.repository.split("/", 1)
    github.create_check_run(gh, owner=owner, repo=repo, name=f"{integration.check_name} (pull request)",
                            head_sha=head_sha, details_url=details_url, external_id=f"refused:{head_sha}",
                            output={"title": f"optdrift: {refused.title}", "summary": str(refused)},
                            conclusion="action_required")


def _supersede(session: Session, *, project: Project, event: PullRequestEvent, repository: str) -> list[int]:
    """Ask the runs of the pull request's earlier heads that have not finished to cancel."""
    earlier = session.scalars(select(Run).join(GitHubPullRequestRun, GitHubPullRequestRun.run_id == Run.id).where(
        GitHubPullRequestRun.project_id == project.id, GitHubPullRequestRun.repository == repository,
        GitHubPullRequestRun.pull_number == event.number, GitHubPullRequestRun.head_sha != event.head_sha,
        Run.status.in_((QUEUED, BUILDING, RUNNING)))).all()
    cancelled = []
    for run in earlier:
        try:
            run_domain.request_cancel(session=session, run_id=run.id)
            cancelled.append(run.id)
        except ConflictError:
            pass  # it finished meanwhile
    return cancelled


def verify_for_project(*, session: Session, settings: Settings, integration: GitHubIntegration,
                       event: PullRequestEvent, delivery_id: str, retry=None,  # noqa: ANN001
                       merge_wait_s: float = MERGE_WAIT_S) -> EventAnswer:
    """Start the verify runs of one project for the event's head, or say why not."""
    project = session.get(Project, integration.project_id)
    started = session.scalars(select(GitHubPullRequestRun.run_id).where(
        GitHubPullRequestRun.project_id == project.id, GitHubPullRequestRun.head_sha == event.head_sha)).all()
    if started:
        return EventAnswer(False, f"{project.name}: head {event.head_sha} is already verified by run(s) "
                                  f"{', '.join(map(str, sorted(started)))}; nothing new started")
    # githubkit is imported here, not with this module (as in hooks.py).
    from githubkit.exception import GitHubException

    from service.notify.github_client import make_client

    owner, repo = integration.repository.split("/", 1)
    details_url = f"{(integration.dashboard_url or settings.resolved_public_url).rstrip('/')}/projects/{project.name}"
    with make_client(integration, retry=retry, settings=settings, follow_redirects=False) as gh:
        try:
            if _today_heads(session, event.head_repository) >= settings.verify_daily_quota:
                raise Refused("the fork's daily quota is spent",
                              f"{event.head_repository} had {settings.verify_daily_quota} head commits verified "
                              "today (OPTDRIFT_VERIFY_DAILY_QUOTA, UTC days): push again tomorrow, or a maintainer "
                              "runs `optdrift verify` for it")
            tree = merge_tree(gh, owner=owner, repo=repo, number=event.number, head_sha=event.head_sha,
                              wait_s=merge_wait_s)
            archive = repack(download_tarball(gh, api_url=integration.api_url.rstrip("/") + "/", owner=owner,
                                              repo=repo, sha=tree.merge_sha, max_bytes=settings.max_upload_bytes),
                             settings=settings)
            runs = []
            for environment in project.environments:
                try:
                    submission = submissions.submit_verify(session=session, settings=settings, project=project,
                                                           base=tree.base_sha, archive=archive,
                                                           environment=environment)
                except NotFoundError as exc:
                    raise Refused("the base commit was never submitted",
                                  f"{exc}: the merge commit's first parent {tree.base_sha} (the base branch's "
                                  "tip) is what the change is compared with; the Action on the base branch's push "
                                  "submits it. Once it has, redeliver this event or push again") from exc
                except BadInputError as exc:
                    raise Refused("the tree was refused", str(exc)) from exc
                runs.extend(submission.runs)
        except Refused as refused:
            _post_refusal(gh, integration=integration, head_sha=event.head_sha, refused=refused,
                          details_url=details_url)
            return EventAnswer(False, f"{project.name}: {refused}")
        except Stale as stale:
            return EventAnswer(False, f"{project.name}: {stale}")
        except (GitHubException, httpx.HTTPError, RuntimeError) as exc:
            from service.notify.hooks import describe_error

            raise GitHubUnavailable(describe_error(exc)) from exc
    for run in runs:
        session.add(GitHubPullRequestRun(
            project_id=project.id, run_id=run.id, environment=run.environment, repository=integration.repository,
            pull_number=event.number, head_sha=event.head_sha, head_repository=event.head_repository,
            merge_sha=tree.merge_sha, base_sha=tree.base_sha, delivery_id=delivery_id))
    session.flush()
    ids = [run.id for run in runs]
    return EventAnswer(True, f"{project.name}: verifying the merge tree {tree.merge_sha} of head {event.head_sha} "
                             f"against base {tree.base_sha} in run(s) {', '.join(map(str, ids))}",
                       status_code=202, run_ids=ids, to_dispatch=ids)


def handle_delivery(*, session: Session, settings: Settings, event_name: str | None, delivery_id: str | None,
                    body: bytes, retry=None, merge_wait_s: float = MERGE_WAIT_S) -> EventAnswer:  # noqa: ANN001
    """One authenticated delivery (check_signature first). The caller commits, then dispatches."""
    if event_name == "ping":
        return EventAnswer(False, "pong: deliveries reach optdrift and their signature checks out")
    if event_name != "pull_request":
        return EventAnswer(False, f"optdrift acts on pull_request events only, not {str(event_name)[:40]!r}")
    event = parse_event(body)
    if event.action not in VERIFIED_ACTIONS:
        return EventAnswer(False, f"action {event.action[:40]!r} gives the pull request no new head; "
                                  f"optdrift verifies on {', '.join(VERIFIED_ACTIONS)}")
    integrations = [row for row in session.scalars(select(GitHubIntegration).order_by(GitHubIntegration.id))
                    if row.repository.lower() == event.repository.lower()]
    if not integrations:
        return EventAnswer(False, f"no project registers repository {event.repository!r}; register it with "
                                  "PUT /api/v1/projects/NAME/github")
    if event.head_repository is None:
        return EventAnswer(False, f"pull request #{event.number}'s head repository was deleted; nothing to fetch")
    if event.head_repository.lower() == event.repository.lower():
        return EventAnswer(False, f"pull request #{event.number} is a branch of {event.repository} itself: its "
                                  "workflow has the repository's secrets, so the optdrift Action submits it")
    if not event.head_is_fork:
        return EventAnswer(False, f"pull request #{event.number}'s head repository {event.head_repository!r} is not "
                                  f"a fork of {event.repository!r}; only forks are verified")
    answers = []
    for integration in integrations:
        # Each project in a savepoint: a refusal after some environment's run was made keeps none.
        savepoint = session.begin_nested()
        try:
            answer = verify_for_project(session=session, settings=settings, integration=integration, event=event,
                                        delivery_id=delivery_id or "", retry=retry, merge_wait_s=merge_wait_s)
        except IntegrityError:
            # A concurrent delivery of the same head won the unique key: that one runs it.
            savepoint.rollback()
            answers.append(EventAnswer(False, f"head {event.head_sha} is being verified by a concurrent delivery"))
            continue
        except BaseException:
            savepoint.rollback()
            raise
        if answer.handled:
            savepoint.commit()
            project = session.get(Project, integration.project_id)
            answer.superseded_run_ids = _supersede(session, project=project, event=event,
                                                   repository=integration.repository)
        else:
            savepoint.rollback()
        answers.append(answer)
    return EventAnswer(
        handled=any(a.handled for a in answers), reason="; ".join(a.reason for a in answers),
        status_code=202 if any(a.handled for a in answers) else 200,
        run_ids=[i for a in answers for i in a.run_ids],
        superseded_run_ids=[i for a in answers for i in a.superseded_run_ids],
        to_dispatch=[i for a in answers for i in a.to_dispatch])
