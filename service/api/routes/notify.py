"""A project's notifications: its GitHub integration (check runs, PR comment) and its webhooks
with their delivery log. Admin only: the settings hold credentials (never returned)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response, status

from service.api.auth import AdminDep
from service.api.deps import SessionDep, SettingsDep
from service.api.params import MAX_ROW_ID
from service.domain import projects
from service.notify import config
from service.notify.schemas import (
    GitHubIntegrationPublic,
    GitHubIntegrationSet,
    WebhookCreate,
    WebhookDeliveriesPublic,
    WebhookDeliveryPublic,
    WebhookPublic,
    WebhooksPublic,
)

router = APIRouter(prefix="/projects/{project}", tags=["notifications"])
WebhookIdPath = Annotated[int, Path(ge=1, le=MAX_ROW_ID, description="a webhook id")]


@router.put("/github", response_model=GitHubIntegrationPublic)
def set_github(project: str, body: GitHubIntegrationSet, session: SessionDep, settings: SettingsDep,
               _principal: AdminDep) -> GitHubIntegrationPublic:
    row_project = projects.get_by_name(session=session, name=project)
    row = config.set_github(session=session, project=row_project, settings=body, service_settings=settings)
    session.commit()
    return config.github_public(session=session, project=row_project, row=row)


@router.get("/github", response_model=GitHubIntegrationPublic)
def read_github(project: str, session: SessionDep, _principal: AdminDep) -> GitHubIntegrationPublic:
    row_project = projects.get_by_name(session=session, name=project)
    row = config.get_github(session=session, project=row_project)
    return config.github_public(session=session, project=row_project, row=row)


@router.delete("/github", status_code=status.HTTP_204_NO_CONTENT)
def delete_github(project: str, session: SessionDep, _principal: AdminDep) -> Response:
    config.delete_github(session=session, project=projects.get_by_name(session=session, name=project))
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/webhooks", response_model=WebhookPublic, status_code=status.HTTP_201_CREATED)
def add_webhook(project: str, body: WebhookCreate, session: SessionDep, settings: SettingsDep,
                _principal: AdminDep):  # noqa: ANN201
    row = config.add_webhook(session=session, project=projects.get_by_name(session=session, name=project),
                             spec=body, settings=settings)
    session.commit()
    return row


@router.get("/webhooks", response_model=WebhooksPublic)
def list_webhooks(project: str, session: SessionDep, _principal: AdminDep) -> WebhooksPublic:
    rows = config.list_webhooks(session=session, project=projects.get_by_name(session=session, name=project))
    return WebhooksPublic(data=[WebhookPublic.model_validate(row, from_attributes=True) for row in rows])


@router.delete("/webhooks/{webhook_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_webhook(project: str, webhook_id: WebhookIdPath, session: SessionDep,
                   _principal: AdminDep) -> Response:
    config.delete_webhook(session=session, project=projects.get_by_name(session=session, name=project),
                          webhook_id=webhook_id)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/webhooks/{webhook_id}/deliveries", response_model=WebhookDeliveriesPublic)
def list_deliveries(project: str, webhook_id: WebhookIdPath, session: SessionDep, _principal: AdminDep,
                    limit: Annotated[int, Query(ge=1, le=500)] = 50) -> WebhookDeliveriesPublic:
    """The newest deliveries first: status code, attempts, the last error."""
    webhook = config.get_webhook(session=session, project=projects.get_by_name(session=session, name=project),
                                 webhook_id=webhook_id)
    rows = config.list_deliveries(session=session, webhook=webhook, limit=limit)
    return WebhookDeliveriesPublic(webhook_id=webhook.id, data=[
        WebhookDeliveryPublic.model_validate(row, from_attributes=True) for row in rows])
