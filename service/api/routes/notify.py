"""A project's notifications: its GitHub integration (check runs, PR comment) and its webhooks
with their delivery log. Admin only: the settings hold credentials (never returned)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response, status
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from service.api.auth import AdminDep
from service.api.deps import SessionDep, SettingsDep
from service.api.params import MAX_ROW_ID
from service.domain import dispatch, projects
from service.domain.errors import BadInputError
from service.notify import config, pull_requests
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


# GitHub's webhook deliveries (issue 44): no token, a signature. The App's (or the repository's)
# webhook URL is https://OPTDRIFT_HOST/api/v1/github/events with OPTDRIFT_GITHUB_WEBHOOK_SECRET
# as its secret (docs/INTEGRATIONS.md, "Pull requests from forks").
events_router = APIRouter(tags=["notifications"])


@events_router.post("/github/events", status_code=status.HTTP_200_OK)
async def github_event(request: Request, session: SessionDep, settings: SettingsDep) -> JSONResponse:
    """A GitHub webhook delivery, authenticated by X-Hub-Signature-256 (401 otherwise). A
    pull_request event (opened, synchronize, reopened) from a fork of a registered repository
    starts verify runs of its merge tree (202); everything else is answered 200 with why nothing
    was done. The same head delivered again starts nothing."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > pull_requests.MAX_EVENT_BYTES:
            return JSONResponse({"detail": f"a GitHub event is at most {pull_requests.MAX_EVENT_BYTES} bytes "
                                           "here; this is not a pull_request delivery"}, status_code=413)
    try:
        pull_requests.check_signature(
            secret=settings.github_webhook_secret.get_secret_value() if settings.github_webhook_secret else None,
            body=bytes(body), header=request.headers.get(pull_requests.SIGNATURE_HEADER))
    except pull_requests.SignatureError as exc:
        return JSONResponse({"detail": str(exc)}, status_code=status.HTTP_401_UNAUTHORIZED)

    def handle() -> pull_requests.EventAnswer:
        answer = pull_requests.handle_delivery(
            session=session, settings=settings, event_name=request.headers.get(pull_requests.EVENT_HEADER),
            delivery_id=request.headers.get(pull_requests.DELIVERY_HEADER), body=bytes(body))
        session.commit()
        # After the commit: a worker must never see a run whose row is not committed yet.
        dispatch.dispatch_runs(session=session, settings=settings, run_ids=answer.to_dispatch)
        return answer

    try:
        answer = await run_in_threadpool(handle)
    except BadInputError:
        session.rollback()
        raise  # 422 with what was wrong (service/api/main.py)
    except pull_requests.GitHubUnavailable as exc:  # GitHub's delivery log shows this answer
        session.rollback()
        return JSONResponse({"detail": f"optdrift could not fetch the pull request from GitHub: {str(exc)[:500]}; "
                                       "redeliver the event once GitHub answers"},
                            status_code=status.HTTP_502_BAD_GATEWAY)
    return JSONResponse(answer.document(), status_code=answer.status_code)
