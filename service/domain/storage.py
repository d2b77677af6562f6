"""The content-addressed source store: each archive lives once, at <store>/<ab>/<digest>.tar.gz.

Digests are public (runs and commits show them); the source is not. So a digest names a source
only for the projects it was uploaded by or for (SourceArchiveProject, one row per project), and
for any other project it is answered exactly like a digest that was never uploaded
(UnknownSourceError, 404), so a request cannot even learn that another project has it. Two projects
uploading identical bytes each get their row; the bytes are stored once.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.db.models import Project, SourceArchive, SourceArchiveProject
from service.core.archives import ArchiveLimits, sha256_hex, summarize_archive
from service.settings import Settings

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class UnknownSourceError(LookupError):
    pass


@dataclass(frozen=True)
class StoredArchive:
    row: SourceArchive
    # For the uploader: what extraction will leave out (git metadata), None when nothing.
    note: str | None

    @property
    def digest(self) -> str:
        return self.row.digest


def archive_limits(settings: Settings) -> ArchiveLimits:
    return ArchiveLimits(
        max_members=settings.max_archive_members, max_extracted_bytes=settings.max_extracted_bytes
    )


def archive_path(*, settings: Settings, digest: str) -> Path:
    if not _DIGEST.match(digest):
        raise UnknownSourceError(f"{digest!r} is not a sha256 hex digest (64 lowercase hex digits)")
    return settings.resolved_store_dir / digest[:2] / f"{digest}.tar.gz"


def _unknown(digest: str) -> UnknownSourceError:
    # One sentence for "never uploaded" and "uploaded by another project": existence never leaks.
    return UnknownSourceError(f"no source archive with digest {digest} for this project; upload it "
                              "first (for this project)")


def store_archive(*, session: Session, settings: Settings, data: bytes, project: Project
                  ) -> StoredArchive:
    """Validate and store an archive (once), record that `project` uploaded it, and return its
    row with the note for the uploader. Raises ArchiveError on bad input before anything is
    written."""
    summary = summarize_archive(data, archive_limits(settings))
    digest = sha256_hex(data)
    path = archive_path(settings=settings, digest=digest)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a reader never sees half an archive under its digest.
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".part")
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    row = session.get(SourceArchive, digest)
    if row is None:
        row = SourceArchive(digest=digest, size_bytes=len(data), member_count=summary.members)
        if not _added(session, row):  # a concurrent upload of the same bytes stored it first
            row = session.get(SourceArchive, digest)
    if session.get(SourceArchiveProject, (digest, project.id)) is None:
        _added(session, SourceArchiveProject(digest=digest, project_id=project.id))
    return StoredArchive(row=row, note=summary.note)


def _added(session: Session, row: object) -> bool:
    """Insert `row` in a savepoint; False when a concurrent transaction inserted its key first."""
    try:
        with session.begin_nested():
            session.add(row)
        return True
    except IntegrityError:
        return False


def get_archive(*, session: Session, settings: Settings, digest: str, project: Project
                ) -> tuple[SourceArchive, Path]:
    """The archive `digest` as `project` may use it: UnknownSourceError (the same sentence) when
    it was never uploaded or was uploaded only by other projects."""
    path = archive_path(settings=settings, digest=digest)
    row = session.get(SourceArchive, digest)
    if (row is None or not path.exists()
            or session.get(SourceArchiveProject, (digest, project.id)) is None):
        raise _unknown(digest)
    return row, path


def get_archive_for_worker(*, session: Session, settings: Settings, digest: str
                           ) -> tuple[SourceArchive, Path]:
    """The archive `digest` whichever project uploaded it: for GET /sources/{digest}, which only
    worker (and admin) tokens reach; workers build every project's runs."""
    path = archive_path(settings=settings, digest=digest)
    row = session.get(SourceArchive, digest)
    if row is None or not path.exists():
        raise UnknownSourceError(f"no source archive with digest {digest}; upload it first")
    return row, path
