"""A repository's first-parent history and the source tree of each commit, read with git itself.

git through subprocess, not GitPython or pygit2: the bisection needs five plumbing commands
(rev-parse, merge-base --is-ancestor, log --first-parent, cat-file --batch-check, archive), GitPython
runs the same git processes underneath, and pygit2 brings libgit2 binaries into the client install
(`pip install optdrift`), which otherwise needs only httpx, typer, rich and pydantic.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

FIELD, RECORD = "\x1f", "\x1e"


class GitError(RuntimeError):
    """A git command failed or the repository does not hold what was asked; the message says
    which input and what to do."""


@dataclass(frozen=True)
class HistoryCommit:
    sha: str
    first_parent: str | None
    subject: str
    # git's object id of the source folder at this commit (None: the folder is absent there).
    tree: str | None


def _git(repo: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], input=stdin.encode() if stdin else None,
                              capture_output=True, check=False)
    except FileNotFoundError as exc:
        raise GitError("git is not installed (or not on PATH); bisect reads the history with it") from exc


def _text(result: subprocess.CompletedProcess) -> str:
    return result.stdout.decode(errors="replace")


def check_repository(repo: Path) -> Path:
    if not Path(repo).is_dir():
        raise GitError(f"--repo {repo} is not a folder; pass the path of a git clone of the project")
    result = _git(repo, "rev-parse", "--show-toplevel")
    if result.returncode != 0:
        raise GitError(f"--repo {repo} is not a git repository ({result.stderr.decode().strip()}); "
                       "pass the path of a git clone of the project")
    return Path(_text(result).strip())


def resolve(repo: Path, rev: str, option: str) -> str:
    """The full sha of `rev` (a sha, a prefix, a tag, a branch), or GitError naming `option`."""
    result = _git(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}")
    if result.returncode != 0 or not _text(result).strip():
        raise GitError(f"{option} {rev}: no such commit in {repo}; check the sha (`git log --oneline` "
                       "lists them) or fetch it (`git fetch`)")
    return _text(result).strip()


def first_parent_chain(repo: Path, good: str, bad: str, source: str) -> list[HistoryCommit]:
    """Good, then every commit on bad's first-parent line after it, bad last (full shas in, the
    source folder's tree of each). GitError when good is not on that line."""
    if good == bad:
        raise GitError(f"--good and --bad are the same commit ({good[:12]}); give the last commit known "
                       "good and a later one that changed")
    if _git(repo, "merge-base", "--is-ancestor", good, bad).returncode != 0:
        raise GitError(f"--good {good[:12]} is not an ancestor of --bad {bad[:12]}; swapped? The good "
                       "commit must come before the bad one in its history")
    result = _git(repo, "log", "--first-parent", "--reverse", f"--format=%H{FIELD}%P{FIELD}%s{RECORD}",
                  f"{good}..{bad}")
    if result.returncode != 0:
        raise GitError(f"git log {good[:12]}..{bad[:12]} failed: {result.stderr.decode().strip()}")
    rows = []
    for record in _text(result).split(RECORD):
        if record.strip():
            sha, parents, subject = record.strip("\n").split(FIELD, 2)
            rows.append((sha, (parents.split() or [None])[0], subject))
    if not rows or rows[0][1] != good:
        raise GitError(f"--good {good[:12]} is an ancestor of --bad {bad[:12]} only through a merged "
                       "branch, not on bad's first-parent line; pick a good commit from "
                       f"`git log --first-parent {bad[:12]}`")
    good_row = _git(repo, "log", "-1", f"--format=%P{FIELD}%s", good)
    good_parents, good_subject = _text(good_row).strip("\n").split(FIELD, 1)
    rows.insert(0, (good, (good_parents.split() or [None])[0], good_subject))
    trees = source_trees(repo, [sha for sha, _, _ in rows], source)
    return [HistoryCommit(sha, parent, subject, tree) for (sha, parent, subject), tree in zip(rows, trees)]


def _tree_spec(sha: str, source: str) -> str:
    folder = source.strip("/")
    return f"{sha}^{{tree}}" if folder in ("", ".") else f"{sha}:{folder}"


def source_trees(repo: Path, shas: list[str], source: str) -> list[str | None]:
    """The object id of folder `source` at each commit, in one git call (None where it is absent
    or is not a folder)."""
    result = _git(repo, "cat-file", "--batch-check", stdin="".join(f"{_tree_spec(sha, source)}\n" for sha in shas))
    lines = _text(result).splitlines()
    out: list[str | None] = []
    for line in lines:
        parts = line.split()
        out.append(parts[0] if len(parts) == 3 and parts[1] == "tree" else None)
    if len(out) != len(shas):
        raise GitError(f"git cat-file answered {len(out)} lines for {len(shas)} commits: "
                       f"{result.stderr.decode().strip()}")
    return out


def export_tree(repo: Path, sha: str, source: str, dest: Path) -> Path:
    """Folder `source` at commit `sha`, written to `dest` (its contents at dest's top)."""
    result = _git(repo, "archive", "--format=tar", _tree_spec(sha, source))
    if result.returncode != 0:
        raise GitError(f"git archive {sha[:12]} {source} failed: {result.stderr.decode().strip()}")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(result.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def first_parent_ancestry(repo: Path, sha: str, limit: int) -> list[str]:
    """The first-parent ancestors of `sha` in the clone holding `repo`, nearest first, at most
    `limit` (what `optdrift submit` sends, so that the service finds the nearest submitted one
    however many commits were never submitted). A shallow clone gives what it has; GitError when
    `repo` is no git clone or does not hold `sha`."""
    result = _git(repo, "rev-list", "--first-parent", f"--max-count={limit + 1}", "--end-of-options", sha)
    if result.returncode != 0:
        raise GitError(f"git rev-list {sha[:12]} in {repo} failed: {' '.join(result.stderr.decode().split())}")
    return _text(result).split()[1:]
