"""Where notifications start: `run_changed(run_id)` after a run starts, after its verdict is
stored (and its dependants'), after an acknowledgement, after the co-run adds the magnitudes.

It returns at once: the notification runs in a thread of its own, with its own database session,
after the caller's transaction committed — so a slow or failing GitHub never holds a run, a worker
slot or an API request, and never touches a verdict. Why a thread rather than a Celery task on the
run's queue: a task there waits behind every queued run (a worker takes one task at a time), so
"in progress" would appear only after the run finished, and the verdict after the whole queue.

`notify_run` is the work itself, state-driven and idempotent: it compares what GitHub and each
webhook were last sent with the run's state now and sends only the difference. Its failures are
recorded on the notification rows (github_check_runs.error, webhook_deliveries.error), scrubbed of
the credentials, and logged; they are never raised.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from service.db.models import ACTIVE_STATUSES, Run, Verdict
from service.db.notify_models import GitHubCheckRun, GitHubIntegration, GitHubPullRequestRun, Webhook
from service.core.training import TrainingImpact
from service.domain import training_impacts
from service.domain.dashboard_queries import run_page
from service.domain.redaction import clip, scrub
from service.notify import github, report
from service.notify.conclusions import conclusion_for, state_of
from service.notify.sealing import SecretsKeyError, unseal
from service.notify.webhooks import DeliveryPolicy, deliver, verdict_payload
from service.settings import Settings, get_settings

if TYPE_CHECKING:
    from service.notify.github_client import NotifyRetry

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 2000
# pg_advisory_xact_lock's key space for "editing this project's PR comments" (one at a time, so two
# environments finishing together cannot both post a first comment).
_COMMENT_LOCK_BASE = 0x6F7464_0000


def run_changed(run_id: int, *, settings: Settings | None = None,
                with_dependants: bool = False) -> threading.Thread | None:
    """Notify about `run_id` in the background (and, `with_dependants`, about the runs whose
    verdicts waited for it as their baseline and were stored with its own). Never raises."""
    try:
        thread = threading.Thread(target=_notify_in_own_session, args=(run_id, settings, with_dependants),
                                  name=f"optdrift-notify-{run_id}", daemon=True)
        thread.start()
        return thread
    except Exception:  # noqa: BLE001  (a notification must never fail its caller)
        log.exception("run %s: could not start its notification", run_id)
        return None


_engines: dict[str, object] = {}
_engines_lock = threading.Lock()


def _sessions(settings: Settings):  # noqa: ANN202
    """A session factory on the caller's database (its settings', which in tests differ from the
    process-wide get_settings()); one engine per URL, shared by the notification threads."""
    from sqlalchemy.orm import sessionmaker

    from service.db.session import make_engine

    url = settings.resolved_database_url
    with _engines_lock:
        if url not in _engines:
            _engines[url] = make_engine(url)
    return sessionmaker(bind=_engines[url], expire_on_commit=False)


def _notify_in_own_session(run_id: int, settings: Settings | None, with_dependants: bool) -> None:
    settings = settings or get_settings()
    try:
        with _sessions(settings)() as session:
            dependants = list(session.scalars(select(Verdict.run_id).where(
                Verdict.baseline_run_id == run_id))) if with_dependants else []
            for one in [run_id, *dependants]:
                notify_run(session=session, run_id=one, settings=settings)
                session.commit()
    except Exception:  # noqa: BLE001
        log.exception("run %s: notification failed", run_id)


def _run_url(base: str, run_id: int) -> str:
    return f"{base.rstrip('/')}/runs/{run_id}"


def notify_run(*, session: Session, run_id: int, settings: Settings,
               retry: NotifyRetry | None = None, delivery: DeliveryPolicy | None = None) -> None:
    """Send the run's current state to its project's GitHub integration and webhooks."""
    run = session.get(Run, run_id)
    if run is None:
        return
    target = github_target(session=session, run=run)
    # A verify run has no check or PR to report to, unless the service started it for a pull
    # request from a fork (service/notify/pull_requests.py); webhooks describe commit runs only.
    if target is None:
        return
    integration = session.scalar(select(GitHubIntegration).where(GitHubIntegration.project_id == run.project_id))
    if integration is not None:
        notify_github(session=session, run=run, integration=integration, settings=settings, retry=retry,
                      target=target)
    if run.kind != "commit":
        return
    webhooks = list(session.scalars(select(Webhook).where(Webhook.project_id == run.project_id,
                                                          Webhook.active.is_(True))))
    if webhooks:
        notify_webhooks(session=session, run=run, webhooks=webhooks, settings=settings, policy=delivery)


@dataclass(frozen=True)
class GitHubTarget:
    """Where a run's check run and PR comment go."""

    head_sha: str
    # The runs the one PR comment describes (the commit's runs, or the pull request head's).
    sibling_run_ids: list[int]
    # The pull requests to comment on; None: the open ones whose head is head_sha, asked of GitHub.
    pull_numbers: list[int] | None = None


def github_target(*, session: Session, run: Run) -> GitHubTarget | None:
    if run.kind == "commit" and run.commit is not None:
        return GitHubTarget(head_sha=run.commit.sha, sibling_run_ids=list(session.scalars(
            select(Run.id).where(Run.commit_id == run.commit_id).order_by(Run.id))))
    link = session.scalar(select(GitHubPullRequestRun).where(GitHubPullRequestRun.run_id == run.id))
    if link is None:
        return None
    siblings = session.scalars(select(GitHubPullRequestRun.run_id).where(
        GitHubPullRequestRun.project_id == link.project_id, GitHubPullRequestRun.head_sha == link.head_sha)
        .order_by(GitHubPullRequestRun.run_id))
    return GitHubTarget(head_sha=link.head_sha, sibling_run_ids=list(siblings), pull_numbers=[link.pull_number])


def _state(run: Run) -> str | None:
    verdict = run.verdict
    return state_of(run_status=run.status, outcome=verdict.outcome if verdict else None,
                    acknowledged=bool(verdict and verdict.acknowledged))


def notify_webhooks(*, session: Session, run: Run, webhooks: list[Webhook], settings: Settings,
                    policy: DeliveryPolicy | None = None) -> None:
    state = _state(run)
    subscribed = [hook for hook in webhooks if state in (hook.events or [])]
    if not subscribed:
        return
    page = run_page(session=session, run_id=run.id)
    document = verdict_payload(event=state, project=run.project.name, page=page,
                               run_url=_run_url(settings.resolved_public_url, run.id))
    for hook in subscribed:
        try:
            deliver(session=session, webhook=hook, run_id=run.id, event=state, document=document,
                    policy=policy, settings=settings)
        except Exception:  # noqa: BLE001  (one receiver's failure must not stop the others)
            log.exception("webhook %s: delivering %s for run %s failed", hook.id, state, run.id)


def describe_error(exc: Exception) -> str:
    """What failed, for a person: the request, GitHub's status and its message when it answered."""
    response = getattr(exc, "response", None)
    request = getattr(exc, "request", None)
    if response is not None and request is not None:
        try:
            message = response.json().get("message")
        except Exception:  # noqa: BLE001  (not JSON: GitHub's HTML error pages, a proxy's)
            message = response.text[:300]
        return (f"{type(exc).__name__}: {request.method} {request.url.path} answered "
                f"{response.status_code}: {message}")
    return f"{type(exc).__name__}: {exc}"


def _record_errors(row: GitHubCheckRun, errors: list[Exception], integration: GitHubIntegration,
                   settings: Settings) -> None:
    try:
        secrets = tuple(s for s in (unseal(integration.token, settings), unseal(integration.private_key, settings))
                        if s)
    except SecretsKeyError:
        secrets = ()  # nothing was decrypted, so no error text can hold a credential
    row.attempts += 1
    text = "; ".join(describe_error(exc) for exc in errors)
    row.error = clip(scrub(text, secrets), MAX_ERROR_CHARS)
    log.warning("run %s: GitHub notification failed (%s)", row.run_id, row.error)


def notify_github(*, session: Session, run: Run, integration: GitHubIntegration, settings: Settings,
                  retry: NotifyRetry | None = None, target: GitHubTarget | None = None) -> None:
    target = target or github_target(session=session, run=run)
    if target is None:
        return
    row = session.scalar(select(GitHubCheckRun).where(GitHubCheckRun.run_id == run.id))
    if row is None:
        row = GitHubCheckRun(run_id=run.id, attempts=0, comment_ids=[])
        session.add(row)
        session.flush()
    state = _state(run)
    if state is None and (run.status not in ACTIVE_STATUSES or row.check_run_id is not None):
        return  # queued, or already shown in progress
    errors: list[Exception] = []
    try:
        # githubkit is imported here, not with this module: workers import it at start.
        from service.notify.github_client import make_client

        with make_client(integration, retry=retry, settings=settings) as gh:
            _send_github(session=session, gh=gh, run=run, row=row, state=state, target=target,
                         integration=integration, settings=settings, errors=errors)
    except Exception as exc:  # noqa: BLE001  (recorded; never the run's or the verdict's concern)
        errors.append(exc)
    if errors:
        _record_errors(row, errors, integration, settings)
    else:
        row.error = None
    session.flush()


def _send_github(*, session: Session, gh, run: Run, row: GitHubCheckRun, state: str | None,  # noqa: ANN001
                 target: GitHubTarget, integration: GitHubIntegration, settings: Settings,
                 errors: list[Exception]) -> None:
    """The check run, then the PR comment: each attempted whatever became of the other (a plain
    token may comment but not create checks, which GitHub keeps to Apps); failures go to `errors`."""
    owner, repo = integration.repository.split("/", 1)
    base = integration.dashboard_url or settings.resolved_public_url
    run_url = _run_url(base, run.id)
    name = f"{integration.check_name} ({run.environment})"
    if state is None:
        row.check_run_id = github.create_check_run(
            gh, owner=owner, repo=repo, name=name, head_sha=target.head_sha, details_url=run_url,
            external_id=str(run.id),
            output=report.in_progress_output(environment=run.environment, battery=run.battery, run_url=run_url))
        row.status = "in_progress"
        return
    page = run_page(session=session, run_id=run.id)
    sized = sum(1 for case in page.changed if case.max_abs_diff is not None)
    training = training_of(session=session, run_id=run.id)
    sent_state = (f"{state}|changed={len(page.changed)}|sized={sized}|allowed={bool(run.allow_no_baseline)}"
                  f"{_training_state(training)}")
    if row.sent_state == sent_state and row.error is None:
        return
    conclusion = conclusion_for(state, no_baseline_allowed=bool(run.allow_no_baseline))
    output = report.check_output(page=page, conclusion=conclusion, run_url=run_url, training=training)
    try:
        if row.check_run_id is None:
            row.check_run_id = github.create_check_run(
                gh, owner=owner, repo=repo, name=name, head_sha=target.head_sha, details_url=run_url,
                external_id=str(run.id), output=output, conclusion=conclusion.conclusion)
        else:
            github.complete_check_run(gh, owner=owner, repo=repo, check_run_id=row.check_run_id,
                                      conclusion=conclusion.conclusion, details_url=run_url, output=output)
        row.status, row.conclusion = "completed", conclusion.conclusion
    except Exception as exc:  # noqa: BLE001
        errors.append(exc)
    if integration.pr_comments:
        try:
            row.comment_ids = _update_pr_comments(session=session, gh=gh, run=run, target=target, owner=owner,
                                                  repo=repo, base=base)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    row.sent_state = sent_state


def training_of(*, session: Session, run_id: int) -> TrainingImpact | None:
    """The run's latest training-impact job without its loss curves (the text needs its figures)."""
    row = training_impacts.latest_for_run(session=session, run_id=run_id)
    return None if row is None else training_impacts.view(row, curves=False)


def _training_state(training: TrainingImpact | None) -> str:
    """What of the training impact the check and comment show, for sent_state: a job that finishes
    (or moves on while shown as measuring) is sent again, an unchanged one is not."""
    if training is None:
        return ""
    counted = f":{training.progress.runs_done}/{training.progress.runs_total}" \
        if training.status in ("queued", "running") else ""
    return f"|training={training.id}:{training.status}{counted}"


def _update_pr_comments(*, session: Session, gh, run: Run, target: GitHubTarget, owner: str,  # noqa: ANN001
                        repo: str, base: str) -> list[int]:
    numbers = target.pull_numbers
    if numbers is None:
        numbers = github.pull_requests_at(gh, owner=owner, repo=repo, sha=target.head_sha)
    if not numbers:
        return []
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"),
                        {"key": _COMMENT_LOCK_BASE + run.project_id})
    items = []
    for sibling_id in target.sibling_run_ids:
        page = run_page(session=session, run_id=sibling_id)
        state = _state(page.run)
        conclusion = conclusion_for(state, no_baseline_allowed=bool(page.run.allow_no_baseline)) if state else None
        items.append(report.CommentRun(page=page, conclusion=conclusion, run_url=_run_url(base, sibling_id),
                                       training=training_of(session=session, run_id=sibling_id)))
    body = report.pr_comment(project=run.project.name, sha=target.head_sha, runs=items)
    marker = report.comment_marker(run.project.name)
    return [github.upsert_comment(gh, owner=owner, repo=repo, number=number, marker=marker, body=body)
            for number in numbers]
