from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Header, Response, UploadFile, status

from service.api.auth import VerifyDep
from service.api.deps import SessionDep, SettingsDep
from service.api.presenters import run_public
from service.api.schemas import RunPublic
from service.api.uploads import read_limited
from service.domain import auth, projects, queueing, submissions

router = APIRouter(prefix="/projects/{project}", tags=["verify"])


@router.post("/verify", response_model=RunPublic, status_code=status.HTTP_201_CREATED)
def verify(
    project: str,
    session: SessionDep,
    settings: SettingsDep,
    response: Response,
    principal: VerifyDep,
    base: Annotated[str, Form(description="sha or release tag to compare with")],
    battery: Annotated[str | None, Form()] = None,
    environment: Annotated[str | None, Form()] = None,
    archive: Annotated[UploadFile | None, File(description="a source tree as tar.gz")] = None,
    patch: Annotated[UploadFile | None, File(description="a git diff against `base` (-p1)")] = None,
    idempotency_key: Annotated[str | None, Header()] = None,
) -> RunPublic:
    """A contributor's on-demand run: their tree (or a patch on a known commit) against `base`.
    The answer's `report_url` shows status, progress and the verdict."""
    project_row = projects.get_by_name(session=session, name=project)
    auth.check_verify_quota(session=session, principal=principal,
                            default_quota=settings.verify_daily_quota)
    submission = submissions.submit_verify(
        session=session, settings=settings, project=project_row, base=base,
        archive=read_limited(archive, settings=settings, field="archive"),
        patch=read_limited(patch, settings=settings, field="patch"),
        battery=battery, environment=environment, idempotency_key=idempotency_key,
    )
    for run_id in submission.new_run_ids:
        auth.record_run(session=session, principal=principal, run_id=run_id)
    session.commit()
    queueing.dispatch_runs(session=session, settings=settings, run_ids=submission.new_run_ids)
    run = submission.runs[0]
    session.refresh(run)
    if not submission.created:
        response.status_code = status.HTTP_200_OK
    return run_public(run)
