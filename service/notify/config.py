"""A project's notification settings: its GitHub integration and its webhooks (keyword-only
domain functions; the routes are service/api/routes/notify.py)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import Project, Run
from service.db.notify_models import AUTH_APP, GitHubCheckRun, GitHubIntegration, Webhook, WebhookDelivery
from service.domain.errors import BadInputError, NotFoundError
from service.notify.sealing import seal
from service.notify.schemas import (
    GitHubIntegrationPublic,
    GitHubIntegrationSet,
    NotifyErrorPublic,
    WebhookCreate,
)
from service.settings import Settings

RECENT_ERRORS = 10


def set_github(*, session: Session, project: Project, settings: GitHubIntegrationSet,
               service_settings: Settings) -> GitHubIntegration:
    """Create or replace the project's integration, its credential encrypted (sealing.py). The
    credential of the other auth kind is cleared, so a switch from token to App leaves no stale
    token behind."""
    problem = settings.credentials_problem()
    if problem is not None:
        raise BadInputError(problem)
    row = session.scalar(select(GitHubIntegration).where(GitHubIntegration.project_id == project.id))
    if row is None:
        row = GitHubIntegration(project_id=project.id)
        session.add(row)
    app = settings.auth == AUTH_APP
    row.repository = settings.repository
    row.api_url = str(settings.api_url).rstrip("/")
    row.auth_kind = settings.auth
    row.token = None if app else seal(settings.token.get_secret_value().strip(), service_settings)
    row.app_id = settings.app_id if app else None
    row.private_key = seal(settings.private_key.get_secret_value(), service_settings) if app else None
    row.installation_id = settings.installation_id if app else None
    row.check_name = settings.check_name
    row.pr_comments = settings.pr_comments
    row.dashboard_url = str(settings.dashboard_url).rstrip("/") if settings.dashboard_url else None
    session.flush()
    return row


def get_github(*, session: Session, project: Project) -> GitHubIntegration:
    row = session.scalar(select(GitHubIntegration).where(GitHubIntegration.project_id == project.id))
    if row is None:
        raise NotFoundError(f"project {project.name} has no GitHub integration; set one with "
                            f"PUT /api/v1/projects/{project.name}/github")
    return row


def delete_github(*, session: Session, project: Project) -> None:
    session.delete(get_github(session=session, project=project))
    session.flush()


def github_public(*, session: Session, project: Project, row: GitHubIntegration) -> GitHubIntegrationPublic:
    errors = session.scalars(
        select(GitHubCheckRun).join(Run, Run.id == GitHubCheckRun.run_id)
        .where(Run.project_id == project.id, GitHubCheckRun.error.is_not(None))
        .order_by(GitHubCheckRun.updated_at.desc()).limit(RECENT_ERRORS))
    return GitHubIntegrationPublic(
        project=project.name, repository=row.repository, api_url=row.api_url, auth=row.auth_kind,
        has_token=bool(row.token), app_id=row.app_id, has_private_key=bool(row.private_key),
        installation_id=row.installation_id, check_name=row.check_name, pr_comments=row.pr_comments,
        dashboard_url=row.dashboard_url,
        recent_errors=[NotifyErrorPublic(run_id=e.run_id, error=e.error, attempts=e.attempts,
                                         updated_at=e.updated_at) for e in errors])


def add_webhook(*, session: Session, project: Project, spec: WebhookCreate, settings: Settings) -> Webhook:
    """A new webhook, its secret encrypted (sealing.py)."""
    problem = spec.secret_problem()
    if problem is not None:
        raise BadInputError(problem)
    row = Webhook(project_id=project.id, url=str(spec.url), secret=seal(spec.secret.get_secret_value(), settings),
                  events=list(dict.fromkeys(spec.events)), payload_format=spec.payload_format, active=True)
    session.add(row)
    session.flush()
    return row


def list_webhooks(*, session: Session, project: Project) -> list[Webhook]:
    return list(session.scalars(select(Webhook).where(Webhook.project_id == project.id).order_by(Webhook.id)))


def get_webhook(*, session: Session, project: Project, webhook_id: int) -> Webhook:
    row = session.get(Webhook, webhook_id)
    if row is None or row.project_id != project.id:
        raise NotFoundError(f"project {project.name} has no webhook {webhook_id}; "
                            f"GET /api/v1/projects/{project.name}/webhooks lists them")
    return row


def delete_webhook(*, session: Session, project: Project, webhook_id: int) -> None:
    session.delete(get_webhook(session=session, project=project, webhook_id=webhook_id))
    session.flush()


def list_deliveries(*, session: Session, webhook: Webhook, limit: int) -> list[WebhookDelivery]:
    return list(session.scalars(select(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook.id)
                                .order_by(WebhookDelivery.id.desc()).limit(limit)))
