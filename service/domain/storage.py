"""The content-addressed source store: each archive lives once, at <store>/<ab>/<digest>.tar.gz."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from sqlalchemy.orm import Session

from service.db.models import SourceArchive
from service.domain.archives import ArchiveLimits, inspect_archive, sha256_hex
from service.settings import Settings

_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class UnknownSourceError(LookupError):
    pass


def archive_limits(settings: Settings) -> ArchiveLimits:
    return ArchiveLimits(
        max_members=settings.max_archive_members, max_extracted_bytes=settings.max_extracted_bytes
    )


def archive_path(*, settings: Settings, digest: str) -> Path:
    if not _DIGEST.match(digest):
        raise UnknownSourceError(f"{digest!r} is not a sha256 hex digest (64 lowercase hex digits)")
    return settings.resolved_store_dir / digest[:2] / f"{digest}.tar.gz"


def store_archive(*, session: Session, settings: Settings, data: bytes) -> SourceArchive:
    """Validate and store an archive (once), returning its row. Raises ArchiveError on bad input
    before anything is written."""
    members = inspect_archive(data, archive_limits(settings))
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
        row = SourceArchive(digest=digest, size_bytes=len(data), member_count=members)
        session.add(row)
        session.flush()
    return row


def get_archive(*, session: Session, settings: Settings, digest: str) -> tuple[SourceArchive, Path]:
    path = archive_path(settings=settings, digest=digest)
    row = session.get(SourceArchive, digest)
    if row is None or not path.exists():
        raise UnknownSourceError(f"no source archive with digest {digest}; upload it first")
    return row, path
