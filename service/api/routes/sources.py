from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, UploadFile
from fastapi.responses import FileResponse

from service.api.auth import SubmitDep, WorkerDep
from service.api.deps import SessionDep, SettingsDep
from service.api.schemas import SourcePublic
from service.api.uploads import read_limited
from service.domain import storage
from service.domain.archives import ArchiveError
from service.domain.errors import BadInputError, NotFoundError

router = APIRouter(prefix="/sources", tags=["sources"])


@router.post("", response_model=SourcePublic)
def upload_source(
    session: SessionDep, settings: SettingsDep, archive: Annotated[UploadFile, File()],
    _principal: SubmitDep,
) -> SourcePublic:
    """Store an archive once; submit commits with its `digest` afterwards."""
    data = read_limited(archive, settings=settings, field="archive")
    try:
        row = storage.store_archive(session=session, settings=settings, data=data)
    except ArchiveError as exc:
        raise BadInputError(f"source archive rejected: {exc}") from exc
    session.commit()
    return SourcePublic(digest=row.digest, size_bytes=row.size_bytes, member_count=row.member_count)


@router.get("/{digest}", response_class=FileResponse)
def download_source(digest: str, session: SessionDep, settings: SettingsDep,
                    _principal: WorkerDep) -> FileResponse:
    """The archive bytes (workers fetch sources here; they may run on other hosts). Source code is
    more private than results: a worker (or admin) token is needed even when reads are public."""
    try:
        _, path = storage.get_archive(session=session, settings=settings, digest=digest)
    except storage.UnknownSourceError as exc:
        raise NotFoundError(str(exc)) from exc
    return FileResponse(path, media_type="application/gzip", filename=f"{digest}.tar.gz")
