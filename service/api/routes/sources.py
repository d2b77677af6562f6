"""Source archives by content digest: uploading one for a project, and a worker fetching a run's tree
(worker and admin tokens only)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Response, UploadFile
from fastapi.responses import FileResponse

from service.api.auth import SubmitDep, WorkerDep
from service.api.deps import SessionDep, SettingsDep
from service.api.schemas import SourcePublic
from service.api.uploads import ARCHIVE_NOTE_HEADER, read_limited
from service.domain import projects, storage
from service.domain.auth import SUBMIT
from service.core.archives import ArchiveError, summarize_archive
from service.domain.errors import BadInputError, NotFoundError

router = APIRouter(prefix="/sources", tags=["sources"])


@router.post("", response_model=SourcePublic)
def upload_source(
    session: SessionDep, settings: SettingsDep, response: Response,
    archive: Annotated[UploadFile, File()], principal: SubmitDep,
    project: Annotated[str | None, Form(description=(
        "the project the archive is for; only that project's commits may name its digest. "
        "Default: the token's project (required for a token of no one project)"))] = None,
) -> SourcePublic:
    """Store an archive once; submit commits of `project` with its `digest` afterwards. Another
    project's commits cannot name the digest (404) until that project uploads the same bytes."""
    project_name = project or principal.project
    data = read_limited(archive, settings=settings, field="archive")
    try:
        if not project_name:
            # What is wrong with the archive first (it would be refused for any project).
            summarize_archive(data, storage.archive_limits(settings))
            raise BadInputError("name the project the archive is for in the `project` form field: "
                                f"token {principal.name!r} is not limited to one project, and a "
                                "source digest is usable only by the projects that uploaded it")
        # A token of one project may upload only for that project (403 otherwise, as on its routes).
        principal.require(SUBMIT, project=project_name)
        project_row = projects.get_by_name(session=session, name=project_name)
        stored = storage.store_archive(session=session, settings=settings, data=data,
                                       project=project_row)
    except ArchiveError as exc:
        raise BadInputError(f"source archive rejected: {exc}") from exc
    session.commit()
    if stored.note:
        response.headers[ARCHIVE_NOTE_HEADER] = stored.note
    row = stored.row
    return SourcePublic(digest=row.digest, size_bytes=row.size_bytes, member_count=row.member_count)


@router.get("/{digest}", response_class=FileResponse)
def download_source(digest: str, session: SessionDep, settings: SettingsDep,
                    _principal: WorkerDep) -> FileResponse:
    """The archive bytes (workers fetch sources here; they may run on other hosts). Source code is
    more private than results: a worker (or admin) token is needed even when reads are public."""
    try:
        _, path = storage.get_archive_for_worker(session=session, settings=settings, digest=digest)
    except storage.UnknownSourceError as exc:
        raise NotFoundError(str(exc)) from exc
    return FileResponse(path, media_type="application/gzip", filename=f"{digest}.tar.gz")
