"""Source archives: deterministic packing and safe extraction. Standard library only, because the
client (`optdrift submit`, no server packages installed) packs with the same code the service
checks and the worker extracts with.

Packing is deterministic (sorted names, zeroed owners and times, gzip mtime 0), so the same tree
always has the same sha256 and a resubmission is recognised by its digest.

git metadata is never extracted (issue 33): a `.git` folder or gitlink file, at any depth, is
accepted in an upload (a `tar czf` of a checkout has one; refusing it would only make people
re-pack), counted against the limits like every member, stored with the upload's bytes (its digest
is the sha256 of what was sent), and left out by `extract_archive`, which is the only way the API
(verify --patch) and the workers put a tree on disk. So no `.git/config`, hook or gitlink of a
submitted tree is ever on a disk where a tool could read it; the upload's answer says how many
members were left out (`ArchiveSummary.note`).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
import zlib
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


def is_git_metadata(parts: tuple[str, ...]) -> bool:
    """Whether a member lies in (or is) a `.git` folder or gitlink file at any depth. Any case:
    a case-insensitive filesystem (a macOS or Windows checkout of the tree) takes `.GIT` as `.git`."""
    return any(part.lower() == ".git" for part in parts)


@dataclass(frozen=True)
class ArchiveSummary:
    members: int  # every member, the left-out ones included (the limits count them all)
    left_out: tuple[str, ...]  # the git metadata members extraction leaves out

    @property
    def note(self) -> str | None:
        """A sentence for the uploader, or None when nothing is left out."""
        if not self.left_out:
            return None
        return (f"left out {len(self.left_out)} members of git metadata ({self.left_out[0]!r}"
                f"{' and more' if len(self.left_out) > 1 else ''}): optdrift never extracts `.git`,"
                " so a tree's git config and hooks never reach a disk; send the source without it "
                "(`optdrift submit` or `git archive`) to skip uploading it")


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


# tar framing around the file bytes: a 512-byte header per member (more with long names / pax
# records: allow 2), padding to 512, and the end-of-archive blocks.
_TAR_OVERHEAD_PER_MEMBER = 3 * 512
_TAR_OVERHEAD_FIXED = 20 * 512


class _CappedGunzip(io.RawIOBase):
    """A gzip stream that refuses to decompress past `cap` bytes: the decompression-bomb guard.

    The members' declared sizes are checked too, but a tar reader skipping over member data still
    decompresses it, and a crafted header can lie; counting the bytes that actually come out of
    the decompressor bounds the work whatever the headers say.
    """

    def __init__(self, data: bytes, cap: int):
        self._gzip = gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb")
        self._cap = cap
        self._produced = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # noqa: ANN001
        chunk = self._gzip.read(min(len(buffer), self._cap + 1 - self._produced))
        self._produced += len(chunk)
        if self._produced > self._cap:
            raise ArchiveError(f"archive decompresses to more than {self._cap} bytes "
                               "(a decompression bomb, or a tree over OPTDRIFT_MAX_EXTRACTED_BYTES)")
        buffer[:len(chunk)] = chunk
        return len(chunk)


def _open_stream(data: bytes, limits: ArchiveLimits) -> tarfile.TarFile:
    if data[:2] != b"\x1f\x8b":
        kind = "a zip file" if data[:4] == b"PK\x03\x04" else "not gzip data"
        raise ArchiveError(f"not a readable tar.gz archive: the upload is {kind}; "
                           "upload a gzip-compressed tar (`tar czf`)")
    cap = (limits.max_extracted_bytes + _TAR_OVERHEAD_FIXED
           + _TAR_OVERHEAD_PER_MEMBER * (limits.max_members + 1))
    stream = io.BufferedReader(_CappedGunzip(data, cap), buffer_size=1 << 16)
    try:
        # "r|": a forward-only stream, so nothing seeks back and memory stays bounded.
        return tarfile.open(fileobj=stream, mode="r|")
    except (EOFError, zlib.error) as exc:
        raise ArchiveError(f"archive is truncated or corrupt ({exc})") from exc
    except (tarfile.TarError, OSError) as exc:
        raise ArchiveError(f"not a readable tar.gz archive ({exc}); upload `tar czf` output") from exc


# Paths every filesystem the worker extracts onto can hold (NAME_MAX 255 bytes; PATH_MAX 4096
# including the extraction folder), and a depth pathlib's recursive mkdir handles: a 6000-character
# path broke the worker with RecursionError / ENAMETOOLONG after the API had accepted it.
MAX_MEMBER_PATH_BYTES = 1024
MAX_MEMBER_COMPONENT_BYTES = 255
MAX_MEMBER_DEPTH = 64


@dataclass
class _SeenNames:
    files: set[str]
    dirs: set[str]  # explicit directories and every parent of a member


def _check_name(name: str) -> tuple[str, ...]:
    if not name or "\x00" in name:
        raise ArchiveError(f"member {name!r} has an empty or NUL-containing name")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError as exc:  # tarfile maps undecodable bytes to lone surrogates
        raise ArchiveError(f"member {name.encode('utf-8', 'replace')[:200]!r} has a name that is not "
                           "valid UTF-8; rename it (source paths must be UTF-8)") from exc
    parts = Path(name).parts
    if len(encoded) > MAX_MEMBER_PATH_BYTES:
        raise ArchiveError(f"member {name[:80]!r}... has a {len(encoded)}-byte path; at most "
                           f"{MAX_MEMBER_PATH_BYTES} bytes are allowed")
    if len(parts) > MAX_MEMBER_DEPTH:
        raise ArchiveError(f"member {name[:80]!r}... is {len(parts)} folders deep; at most "
                           f"{MAX_MEMBER_DEPTH} are allowed")
    long_part = next((p for p in parts if len(p.encode("utf-8")) > MAX_MEMBER_COMPONENT_BYTES), None)
    if long_part is not None:
        raise ArchiveError(f"member {name[:80]!r} has a path component of {len(long_part.encode())} "
                           f"bytes; at most {MAX_MEMBER_COMPONENT_BYTES} are allowed")
    return parts


def _check_member(member: tarfile.TarInfo, seen: _SeenNames) -> None:
    name = member.name
    parts = _check_name(name)
    if name.startswith(("/", "\\")) or (parts and ":" in parts[0]) or ".." in parts:
        raise ArchiveError(f"member {name!r} escapes the archive root")
    if member.issym() or member.islnk():
        raise ArchiveError(f"member {name!r} is a link; source archives may not contain links")
    if not (member.isfile() or member.isdir()):
        raise ArchiveError(f"member {name!r} is not a regular file or directory")
    if member.mode & 0o6000:
        raise ArchiveError(f"member {name!r} has the setuid/setgid bit; source files never need it")
    normalised = "/".join(parts)
    if normalised in seen.files or (normalised in seen.dirs and not member.isdir()):
        raise ArchiveError(f"member {name!r} appears twice (or as both a file and a folder); a "
                           "second copy would silently replace the first")
    # `a` then `a/b`: extraction would need `a` to be a folder and a file at once.
    for depth in range(1, len(parts)):
        parent = "/".join(parts[:depth])
        if parent in seen.files:
            raise ArchiveError(f"member {name!r} lies under {parent!r}, which the archive has as a "
                               "file; a path cannot be both")
        seen.dirs.add(parent)
    (seen.dirs if member.isdir() else seen.files).add(normalised)


def _walk(tar: tarfile.TarFile, limits: ArchiveLimits, on_member=None) -> ArchiveSummary:  # noqa: ANN001
    """Check every member against the rules and limits; call `on_member` for each one extraction
    keeps (not git metadata)."""
    members = 0
    total = 0
    left_out: list[str] = []
    seen = _SeenNames(files=set(), dirs=set())
    try:
        for member in tar:
            members += 1
            if members > limits.max_members:
                raise ArchiveError(f"archive has more than {limits.max_members} members "
                                   "(OPTDRIFT_MAX_ARCHIVE_MEMBERS)")
            _check_member(member, seen)
            total += member.size
            if total > limits.max_extracted_bytes:
                raise ArchiveError(f"archive expands to more than {limits.max_extracted_bytes} bytes "
                                   "(OPTDRIFT_MAX_EXTRACTED_BYTES)")
            if is_git_metadata(Path(member.name).parts):
                left_out.append(member.name)
            elif on_member is not None:
                on_member(member)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise ArchiveError(f"archive is truncated or corrupt ({exc})") from exc
    if members == 0:
        raise ArchiveError("archive is empty")
    return ArchiveSummary(members=members, left_out=tuple(left_out))


def summarize_archive(data: bytes, limits: ArchiveLimits) -> ArchiveSummary:
    """Check a tar.gz without writing anything; return its member count and the git metadata
    extraction will leave out.

    Refuses what a source tree never needs and what could write outside the extraction folder:
    links, devices, fifos, absolute paths, `..` components, setuid bits, duplicate names, too
    many members, too many bytes (declared or actually decompressed).
    """
    with _open_stream(data, limits) as tar:
        return _walk(tar, limits)


def inspect_archive(data: bytes, limits: ArchiveLimits) -> int:
    """summarize_archive's member count."""
    return summarize_archive(data, limits).members


def extract_archive(data: bytes, dest: Path, limits: ArchiveLimits) -> Path:
    """Check the whole archive first (nothing is written for a bad one), then extract it member by
    member with tarfile's `data` filter (a second line of defence against paths outside dest,
    links and special files), leaving out git metadata (is_git_metadata)."""
    inspect_archive(data, limits)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with _open_stream(data, limits) as tar:
        _walk(tar, limits, on_member=lambda member: tar.extract(member, dest, filter="data"))
    return dest


def root_file_and_names(data: bytes, name: str, limits: ArchiveLimits, *,
                        max_bytes: int = 1024 * 1024) -> tuple[str | None, set[str]]:
    """In one pass: the text of the file `name` at the archive's root (`./name` too; None when there
    is none) and the relative paths of every regular file extraction keeps (git metadata left out).
    The archive must have passed summarize_archive; `name` over `max_bytes` is an ArchiveError."""
    text, names = None, set()
    with _open_stream(data, limits) as tar:
        for member in tar:
            parts = Path(member.name).parts
            if not member.isfile() or is_git_metadata(parts):
                continue
            path = "/".join(parts).removeprefix("./")
            names.add(path)
            if path == name:
                if member.size > max_bytes:
                    raise ArchiveError(f"{name} is {member.size} bytes; at most {max_bytes} are allowed")
                handle = tar.extractfile(member)
                text = handle.read().decode("utf-8", errors="replace") if handle else None
    return text, names
