"""Applying a contributor's patch (`verify --patch`) with a bound on what it may write.

A git binary patch stores zlib-compressed literals and deltas: a 6 MB patch inflated into a 1 GiB
file (API memory 2.26 GB, 20 s, 1 GiB in /tmp) before the old size check ran. Three layers now:

1. Before anything runs, the patch is scanned: every `literal N` declares the size it inflates
   to, and every `delta N` starts with the size of its result (decoded from its first bytes), so
   an oversized hunk is refused without inflating it.
2. `git apply` runs under `prlimit`: RLIMIT_FSIZE stops any file write past the per-file bound
   (SIGXFSZ), RLIMIT_AS bounds the inflate buffers, a timeout bounds the time.
3. The result is measured: per file growth and total growth against the settings.

git reads no configuration of the tree's (issue 33): a base archive could carry `.git/config` with
`[filter "x"] clean = <command>` and a `.gitattributes` using it, and `git apply` run in that tree
ran the command as the API's user. So git runs with a repository the service made itself, outside
the tree (GIT_DIR/GIT_WORK_TREE: nothing is discovered in or above the tree), no system or global
config, an empty HOME, an environment of only the variables set here (none of the API's GIT_*), and
an `info/attributes` that unsets every attribute with a conversion or a driver, which outranks any
`.gitattributes` in the tree. A filter, diff or merge driver named by the tree therefore has no
definition and nothing to run, and file bytes are written exactly as the patch says.
(The archives never bring `.git` onto disk either: service/core/archives.py leaves it out.)
"""

from __future__ import annotations

import base64
import functools
import re
import shutil
import subprocess
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from service.domain.errors import BadInputError

_BINARY_HUNK = re.compile(rb"^(literal|delta) (\d{1,20})$")
# git's own headroom: git, its libraries and the mmap of the patch; the inflate buffers come on top.
_GIT_ADDRESS_SPACE_BASE = 512 * 1024 * 1024
_GIT_TIMEOUT_S = 60
# Attributes of the service's own repository: info/attributes outranks every .gitattributes of the
# work tree, so a tree cannot turn on a filter/diff/merge driver, `ident`, eol or encoding
# conversions for the paths the patch touches.
_NEUTRAL_ATTRIBUTES = ("* -text -crlf -eol -filter -diff -merge -ident -working-tree-encoding "
                       "-whitespace -export-subst\n")


@dataclass(frozen=True)
class PatchLimits:
    max_file_bytes: int  # how much any one file may grow
    max_total_bytes: int  # how much the whole tree may grow


def _git_base85_line(line: bytes) -> bytes:
    """One line of a git binary hunk: a length character (A-Z: 1-26, a-z: 27-52 bytes), then
    base85 (the RFC 1924 alphabet, as Python's b85decode) in groups of five characters."""
    size_char = line[:1]
    if b"A" <= size_char <= b"Z":
        size = size_char[0] - ord("A") + 1
    elif b"a" <= size_char <= b"z":
        size = size_char[0] - ord("a") + 27
    else:
        raise ValueError("bad length character")
    return base64.b85decode(line[1:])[:size]


def _delta_result_size(data_lines: list[bytes]) -> int:
    """The result size a git delta declares: its header is two varints (source size, result size)
    at the start of the inflated delta, so only the first few bytes are inflated."""
    inflater = zlib.decompressobj()
    header = b""
    for line in data_lines:
        header += inflater.decompress(_git_base85_line(line), 32 - len(header))
        if len(header) >= 20 or inflater.eof:
            break
    sizes = []
    position = 0
    for _ in range(2):
        value, shift = 0, 0
        while True:
            if position >= len(header) or shift > 63:
                raise ValueError("truncated delta header")
            byte = header[position]
            position += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        sizes.append(value)
    return sizes[1]


def check_patch(patch: bytes, limits: PatchLimits) -> None:
    """Refuse a patch whose binary hunks declare more than the limits allow (BadInputError naming
    the file, the size and the setting). Text hunks carry their own bytes, so the patch size
    (OPTDRIFT_MAX_UPLOAD_BYTES) already bounds them."""
    lines = patch.split(b"\n")
    current_file = "?"
    total = 0
    index = 0
    while index < len(lines):
        line = lines[index].rstrip(b"\r")
        index += 1
        if line.startswith(b"diff --git "):
            current_file = line[len(b"diff --git "):].decode("utf-8", "replace")[:200]
            continue
        match = _BINARY_HUNK.match(line)
        if not match:
            continue
        kind, declared = match.group(1).decode(), int(match.group(2))
        data_lines = []
        while index < len(lines) and lines[index].rstrip(b"\r"):
            data_lines.append(lines[index].rstrip(b"\r"))
            index += 1
        if kind == "delta":
            try:
                declared = _delta_result_size(data_lines)
            except (ValueError, zlib.error) as exc:
                raise BadInputError(f"patch: the binary delta for {current_file} is corrupt ({exc}); "
                                    "regenerate it with `git diff --binary`") from exc
        if declared > limits.max_file_bytes:
            raise BadInputError(
                f"patch: the binary {kind} for {current_file} expands to {declared} bytes, over the "
                f"{limits.max_file_bytes}-byte limit per file (OPTDRIFT_MAX_PATCH_FILE_BYTES); "
                "leave large binary files out of the patch")
        total += declared
        if total > limits.max_total_bytes:
            raise BadInputError(
                f"patch: its binary hunks expand to more than {limits.max_total_bytes} bytes in all "
                "(OPTDRIFT_MAX_PATCH_EXPANDED_BYTES); leave large binary files out of the patch")


def _file_sizes(tree: Path) -> dict[str, int]:
    return {str(path.relative_to(tree)): path.stat().st_size
            for path in tree.rglob("*") if path.is_file() and not path.is_symlink()}


@functools.cache
def _tool(name: str) -> str:
    """The absolute path of a helper, resolved once on the API's own PATH (never the tree's)."""
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"`{name}` is not installed on the API host (or not on its PATH); "
                           f"`verify --patch` applies patches with it: install it (apt-get install "
                           f"{'util-linux' if name == 'prlimit' else name})")
    return path


def isolated_git_env(*, scratch: Path, tree: Path) -> dict[str, str]:
    """The whole environment for a git command on `tree`: a fresh repository made in `scratch`
    (a folder of the service's, outside `tree`) and nothing else git reads config from."""
    git_dir = scratch / "git-dir"
    home = scratch / "home"
    home.mkdir()
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),  # empty: no ~/.gitconfig, no ~/.config/git/{config,attributes}
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_ATTR_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
        "LC_ALL": "C",
    }
    # --template= : an empty repository, no sample hooks copied in (none would run; less to read).
    subprocess.run([_tool("git"), "init", "--quiet", "--bare", "--template=", str(git_dir)],
                   env=env, cwd=scratch, check=True, capture_output=True, timeout=_GIT_TIMEOUT_S)
    (git_dir / "info").mkdir(exist_ok=True)
    (git_dir / "info" / "attributes").write_text(_NEUTRAL_ATTRIBUTES)
    return {**env, "GIT_DIR": str(git_dir), "GIT_WORK_TREE": str(tree)}


def apply_patch_bounded(*, tree: Path, patch_file: Path, limits: PatchLimits) -> None:
    """`git apply -p1` in `tree` with the writes bounded and no configuration of the tree's read
    (isolated_git_env); BadInputError if it does not apply or grows the tree past the limits."""
    check_patch(patch_file.read_bytes(), limits)
    before = _file_sizes(tree)
    # No write may end past the largest base file plus the per-file growth: SIGXFSZ stops it there.
    fsize = max(before.values(), default=0) + limits.max_file_bytes
    address_space = _GIT_ADDRESS_SPACE_BASE + 2 * fsize
    command = [_tool("prlimit"), f"--fsize={fsize}", f"--as={address_space}", "--",
               _tool("git"), "apply", "--whitespace=nowarn", "-p1", str(patch_file.resolve())]
    with tempfile.TemporaryDirectory(prefix="optdrift-git-") as scratch:
        env = isolated_git_env(scratch=Path(scratch), tree=tree.resolve())
        try:
            result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                                    timeout=_GIT_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise BadInputError(f"patch took more than {_GIT_TIMEOUT_S} s to apply; send a smaller one") from exc
    if result.returncode in (-25, 128 + 25):  # SIGXFSZ: a write passed RLIMIT_FSIZE
        raise BadInputError(
            f"patch writes a file past {fsize} bytes (OPTDRIFT_MAX_PATCH_FILE_BYTES per file); "
            "leave large files out of the patch")
    if result.returncode != 0:
        raise BadInputError(f"patch does not apply to the base commit: {result.stderr.strip()[:2000]}")
    after = _file_sizes(tree)
    growth = 0
    for name, size in after.items():
        grown = size - before.get(name, 0)
        if grown > limits.max_file_bytes:
            raise BadInputError(
                f"patch grows {name[:200]} by {grown} bytes, over the {limits.max_file_bytes}-byte "
                "limit per file (OPTDRIFT_MAX_PATCH_FILE_BYTES)")
        growth += max(grown, 0)
    if growth > limits.max_total_bytes:
        raise BadInputError(
            f"patch grows the tree by {growth} bytes, over the {limits.max_total_bytes}-byte limit "
            "(OPTDRIFT_MAX_PATCH_EXPANDED_BYTES)")
