"""On-demand verification (POST /projects/{p}/verify): a contributor's tree or patch against a commit
of the project, as a verify run under its token's quota."""

from __future__ import annotations

from contextlib import suppress
from typing import Annotated

from fastapi import APIRouter, File, Form, Header, HTTPException, Response, UploadFile, status
from sqlalchemy.exc import SQLAlchemyError

from service.api.auth import VerifyDep
from service.api.deps import SessionDep, SettingsDep
from service.api.presenters import run_public
from service.api.schemas import RunPublic
from service.api.uploads import ARCHIVE_NOTE_HEADER, read_limited
from service.domain import dispatch, projects, submissions, verify_quota
from service.domain.errors import BadInputError, ConflictError, NotFoundError

router = APIRouter(prefix="/projects/{project}", tags=["verify"])

# The caller's fault: the attempt is refused and its quota slot stays spent.
_CLIENT_ERRORS = (BadInputError, NotFoundError, ConflictError)


def _is_client_error(exc: Exception) -> bool:
    return isinstance(exc, _CLIENT_ERRORS) or (
        isinstance(exc, HTTPException) and 400 <= exc.status_code < 500)


@router.post("/verify", response_model=RunPublic, status_code=status.HTTP_201_CREATED)
def verify(
    project: str,
    session: SessionDep,
    settings: SettingsDep,
    response: Response,
    principal: VerifyDep,
    base: Annotated[str, Form(description="sha or release tag to compare with")],
    battery: Annotated[str | None, Form(description="a built-in battery (quick, standard, ci) or a "
                                                    "JSON file's path relative to the tree")] = None,
    environment: Annotated[str | None, Form(description="one of the project's environments")] = None,
    archive: Annotated[UploadFile | None, File(description="a source tree as tar.gz")] = None,
    patch: Annotated[UploadFile | None, File(description="a git diff against `base` (-p1)")] = None,
    idempotency_key: Annotated[str | None, Header()] = None,
) -> RunPublic:
    """A contributor's on-demand run: their tree (or a patch on a known commit) against `base`.
    The answer's `report_url` shows status, progress and the verdict. Each attempt of a verify
    token, refused ones included, spends one of its daily runs; a repeated Idempotency-Key none.
    A verify token may have OPTDRIFT_VERIFY_MAX_ACTIVE_PER_TOKEN runs queued or running at once
    (429 beyond it, spending nothing); verify runs start only when no commit run waits."""
    project_row = projects.get_by_name(session=session, name=project)
    earlier = submissions.existing_run_for_key(session=session, project=project_row,
                                               key=idempotency_key)
    if earlier is not None:
        response.status_code = status.HTTP_200_OK
        return run_public(earlier)
    slot = verify_quota.take_slot(session=session, principal=principal,
                                  default_quota=settings.verify_daily_quota,
                                  max_active=settings.verify_max_active_per_token,
                                  run_budget_s=settings.verify_max_run_s)
    slot_id = slot.id if slot is not None else None
    session.commit()  # the slot counts for concurrent requests from here on
    try:
        submission = submissions.submit_verify(
            session=session, settings=settings, project=project_row, base=base,
            archive=read_limited(archive, settings=settings, field="archive"),
            patch=read_limited(patch, settings=settings, field="patch"),
            battery=battery, environment=environment, idempotency_key=idempotency_key,
        )
        for run_id in submission.new_run_ids:
            verify_quota.fill_slot(session=session, principal=principal, slot_id=slot_id,
                                   run_id=run_id)
        if slot_id is not None and not submission.new_run_ids:  # a concurrent twin made the run
            verify_quota.release_slot(session=session, slot_id=slot_id)
        session.commit()
    except Exception as exc:
        session.rollback()
        if slot_id is not None:
            # Bookkeeping only: if it fails too (the database went away), the caller still gets
            # the original error.
            with suppress(SQLAlchemyError):
                if _is_client_error(exc):
                    verify_quota.reject_slot(session=session, slot_id=slot_id,
                                             reason=str(getattr(exc, "detail", None) or exc))
                else:
                    verify_quota.release_slot(session=session, slot_id=slot_id)
                session.commit()
        raise
    dispatch.dispatch_runs(session=session, settings=settings, run_ids=submission.to_dispatch)
    run = submission.runs[0]
    session.refresh(run)
    if not submission.created:
        response.status_code = status.HTTP_200_OK
    if submission.archive_note:
        response.headers[ARCHIVE_NOTE_HEADER] = submission.archive_note
    if submission.patch_layout:  # which folder the patch was taken relative to; the CLI prints it
        response.headers["Optdrift-Patch-Layout"] = submission.patch_layout
    return run_public(run)
