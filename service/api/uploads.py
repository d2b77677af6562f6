"""Reading an uploaded file with the configured size limit (413 before it is all in memory)."""

from __future__ import annotations

from fastapi import HTTPException, UploadFile, status

from service.settings import Settings

# A response header for the uploader: what extraction leaves out of the archive (its `.git`), so a
# client can say it without the answer's schema changing.
ARCHIVE_NOTE_HEADER = "Optdrift-Archive-Note"


def read_limited(upload: UploadFile | None, *, settings: Settings, field: str) -> bytes | None:
    if upload is None:
        return None
    data = upload.file.read(settings.max_upload_bytes + 1)
    if len(data) > settings.max_upload_bytes:
        raise HTTPException(
            status.HTTP_413_CONTENT_TOO_LARGE,
            f"`{field}` is larger than the {settings.max_upload_bytes}-byte upload limit "
            "(OPTDRIFT_MAX_UPLOAD_BYTES)",
        )
    return data


def split_list(value: str | None) -> list[str]:
    """`a,b c` -> ["a", "b", "c"]: form fields carry lists as comma/space separated text."""
    if not value:
        return []
    return [item for item in value.replace(",", " ").split() if item]
