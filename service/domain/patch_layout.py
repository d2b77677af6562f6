"""Which folder a `verify --patch` diff is relative to.

A contributor runs `git diff` from the repository root (paths `kernels/cpu/adam.cpp`), or with
`--relative=kernels` (paths `cpu/adam.cpp`); the stored tree is whatever the project submits: the
repository root (with optdrift.toml and its `build.source_dir`) or the source folder alone
(`--source kernels`). Either patch must apply to either tree, so the patch is tried as given, then
with its common leading folder removed, then inside the tree's `build.source_dir`; the answer
says which one applied.

The paths are rewritten in the patch's header lines rather than passed to git as -p/--directory,
so the one bounded `git apply -p1` (service/domain/patches.py) stays the only way a patch is applied.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path, PurePosixPath

from service.domain.errors import BadInputError
from service.domain.patches import PatchLimits, apply_patch_bounded

_NOT_APPLYING = "patch does not apply"
# Extended git header lines that carry a path without git's a/ or b/ side prefix.
_PATH_HEADERS = (b"rename from ", b"rename to ", b"copy from ", b"copy to ")
_DIFF_GIT = re.compile(rb"^diff --git a/(\S+) b/(\S+)$")


def _is_file_header(lines: list[bytes], index: int) -> bool:
    """`--- a/x` directly followed by `+++ b/x` and a hunk or the end of the header: a header,
    not a removed line that happens to start with two dashes."""
    return (lines[index].startswith(b"--- ") and index + 1 < len(lines)
            and lines[index + 1].startswith(b"+++ ")
            and (index + 2 >= len(lines) or lines[index + 2].startswith((b"@@", b"diff ", b"GIT binary"))))


def patch_paths(patch: bytes) -> list[str]:
    """The file paths a git-style patch names, without git's a/ and b/ (what -p1 sees)."""
    paths: list[str] = []
    lines = patch.split(b"\n")
    for index, line in enumerate(lines):
        match = _DIFF_GIT.match(line.rstrip(b"\r"))
        if match:
            paths += [part.decode("utf-8", "replace") for part in match.groups()]
        elif _is_file_header(lines, index):
            for header in (line, lines[index + 1]):
                name = header[4:].split(b"\t")[0].rstrip(b"\r")
                if name != b"/dev/null" and b"/" in name:
                    paths.append(name.split(b"/", 1)[1].decode("utf-8", "replace"))
    return paths


def _rewrite(patch: bytes, change) -> bytes:  # noqa: ANN001  (change: bytes path -> bytes path)
    """The patch with every header path passed through `change` (hunk lines untouched)."""
    lines = patch.split(b"\n")
    out: list[bytes] = []
    skip_next = False
    for index, line in enumerate(lines):
        if skip_next:  # the `+++` line of a header already rewritten
            skip_next = False
            continue
        body = line.rstrip(b"\r")
        ending = line[len(body):]
        match = _DIFF_GIT.match(body)
        if match:
            out.append(b"diff --git a/" + change(match.group(1)) + b" b/" + change(match.group(2)) + ending)
            continue
        if _is_file_header(lines, index):
            for header in (line, lines[index + 1]):
                marker, rest = header[:4], header[4:]
                name, tab, tail = rest.partition(b"\t")
                if name.rstrip(b"\r") != b"/dev/null" and b"/" in name:
                    side, path = name.split(b"/", 1)
                    name = side + b"/" + change(path)
                out.append(marker + name + tab + tail)
            skip_next = True
            continue
        for prefix in _PATH_HEADERS:
            if body.startswith(prefix):
                line = prefix + change(body[len(prefix):]) + ending
                break
        out.append(line)
    return b"\n".join(out)


def _common_leading_folder(paths: list[str]) -> str | None:
    firsts = {PurePosixPath(path).parts[0] for path in paths if len(PurePosixPath(path).parts) > 1}
    if len(firsts) == 1 and all(len(PurePosixPath(path).parts) > 1 for path in paths):
        return firsts.pop()
    return None


def _configured_source_dir(tree: Path) -> str | None:
    """build.source_dir of the tree's optdrift.toml, when it names a folder inside the tree."""
    try:
        config = tomllib.loads((tree / "optdrift.toml").read_text())
        source_dir = str(config.get("build", {}).get("source_dir", ".")).strip("/")
    except (OSError, ValueError, AttributeError):
        return None
    path = PurePosixPath(source_dir)
    if source_dir in ("", ".") or path.is_absolute() or ".." in path.parts:
        return None
    return source_dir


def apply_patch_any_root(*, tree: Path, patch_file: Path, limits: PatchLimits) -> str:
    """Apply the patch to `tree` as given, else relative to the other root; return a sentence
    saying which layout applied. BadInputError (naming what was tried) when none does."""
    patch = patch_file.read_bytes()
    try:
        apply_patch_bounded(tree=tree, patch_file=patch_file, limits=limits)
        return "patch applied as given"
    except BadInputError as exc:
        if not str(exc).startswith(_NOT_APPLYING):
            raise  # refused for its size or content: another layout would not change that
        first_error = exc

    paths = patch_paths(patch)
    alternatives: list[tuple[str, bytes]] = []
    leading = _common_leading_folder(paths)
    if leading is not None:
        strip = leading.encode() + b"/"
        alternatives.append((
            f"patch applied with its leading folder '{leading}/' removed (a repository-root diff; "
            "the stored tree is that folder)",
            _rewrite(patch, lambda path: path[len(strip):] if path.startswith(strip) else path)))
    source_dir = _configured_source_dir(tree)
    if source_dir is not None and not all(path.startswith(source_dir + "/") for path in paths):
        inside = source_dir.encode() + b"/"
        alternatives.append((
            f"patch applied inside '{source_dir}/' (a diff relative to the source folder, "
            "build.source_dir of optdrift.toml)",
            _rewrite(patch, lambda path: inside + path)))

    for sentence, rewritten in alternatives:
        candidate = patch_file.with_name(patch_file.name + ".rewritten")
        candidate.write_bytes(rewritten)
        try:
            apply_patch_bounded(tree=tree, patch_file=candidate, limits=limits)
            return sentence
        except BadInputError as exc:
            if not str(exc).startswith(_NOT_APPLYING):
                raise
    tried = "as given" + "".join(f"; {sentence.split(' (')[0].removeprefix('patch applied ')}"
                                 for sentence, _ in alternatives)
    raise BadInputError(f"{first_error} (tried: {tried}); make the diff with `git diff` from the "
                        "repository root or from the source folder, against the base commit")
