"""Source archives: deterministic packing and safe extraction. Standard library only, because the
client (`optdrift submit`, no server packages installed) packs with the same code the service
checks and the worker extracts with.

Packing is deterministic (sorted names, zeroed owners and times, gzip mtime 0), so the same tree
always has the same sha256 and a resubmission is recognised by its digest.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from dataclasses import dataclass
from pathlib import Path

# Never shipped: VCS metadata, byte code and build outputs change without the source changing.
EXCLUDED_NAMES = {".git", ".hg", "__pycache__", ".venv", "build", ".pytest_cache"}
EXCLUDED_SUFFIXES = (".pyc", ".so", ".o")


class ArchiveError(ValueError):
    """The archive is unusable; the message names the member and the rule it broke."""


@dataclass(frozen=True)
class ArchiveLimits:
    max_members: int = 20_000
    max_extracted_bytes: int = 512 * 1024 * 1024


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack_directory(source_dir: Path) -> bytes:
    """A reproducible tar.gz of every regular file under source_dir (paths relative to it)."""
    source_dir = Path(source_dir)
    if not source_dir.is_dir():
        raise ArchiveError(f"{source_dir} is not a directory: pass the source tree to submit")
    files = sorted(
        path for path in source_dir.rglob("*")
        if path.is_file() and not path.is_symlink()
        and not any(part in EXCLUDED_NAMES for part in path.relative_to(source_dir).parts)
        and not path.name.endswith(EXCLUDED_SUFFIXES)
    )
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            data = path.read_bytes()
            info = tarfile.TarInfo(path.relative_to(source_dir).as_posix())
            info.size = len(data)
            info.mode = 0o755 if path.stat().st_mode & 0o111 else 0o644
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=6) as gz:
        gz.write(tar_bytes.getvalue())
    return out.getvalue()


def inspect_archive(data: bytes, limits: ArchiveLimits) -> int:
    """Check a tar.gz without writing anything; return its member count.

    Refuses what a source tree never needs and what could write outside the extraction folder:
    links, devices, absolute paths, `..` components, too many members, too many bytes.
    """
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise ArchiveError(f"not a readable tar.gz archive ({exc}); upload `tar czf` output") from exc
    members = 0
    total = 0
    with tar:
        try:
            for member in tar:
                members += 1
                if members > limits.max_members:
                    raise ArchiveError(f"archive has more than {limits.max_members} members")
                name = member.name
                parts = Path(name).parts
                if name.startswith(("/", "\\")) or (parts and ":" in parts[0]) or ".." in parts:
                    raise ArchiveError(f"member {name!r} escapes the archive root")
                if member.issym() or member.islnk():
                    raise ArchiveError(f"member {name!r} is a link; source archives may not contain links")
                if not (member.isfile() or member.isdir()):
                    raise ArchiveError(f"member {name!r} is not a regular file or directory")
                total += member.size
                if total > limits.max_extracted_bytes:
                    raise ArchiveError(
                        f"archive expands to more than {limits.max_extracted_bytes} bytes"
                    )
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise ArchiveError(f"archive is truncated or corrupt ({exc})") from exc
    if members == 0:
        raise ArchiveError("archive is empty")
    return members


def extract_archive(data: bytes, dest: Path, limits: ArchiveLimits) -> Path:
    """Check, then extract with tarfile's `data` filter (a second line of defence against paths
    outside dest, links and special files)."""
    inspect_archive(data, limits)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(dest, filter="data")
    return dest
