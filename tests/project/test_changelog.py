"""The changelog and the version (docs/RELEASES.md): every change to a public surface since the last
release has a fragment in changelog.d/, every fragment is one towncrier reads, and CHANGELOG.md's
newest entry is the version in pyproject.toml.

The last release is the commit that last changed pyproject.toml's `version = ` line. The surface
check reads committed history only; it is skipped, never passed, where that history is not all
there (a shallow clone)."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
SURFACES: dict[str, list[str]] = PYPROJECT["tool"]["optdrift"]["public-surfaces"]
TOWNCRIER = PYPROJECT["tool"]["towncrier"]
FRAGMENTS = REPO_ROOT / TOWNCRIER["directory"]
SECTIONS = {section["path"]: section["name"] for section in TOWNCRIER["section"]}
TYPES = [kind["directory"] for kind in TOWNCRIER["type"]]
# <issue or +slug>.<type>[.<counter>].md
FRAGMENT_NAME = re.compile(r"(?P<ref>\d+|\+[\w-]+)\.(?P<type>[a-z]+)(\.\d+)?\.md")
# A commit that touches a surface file and changes nothing users see says so in its message.
NO_CHANGELOG = re.compile(r"^Changelog:\s*none\b", re.IGNORECASE | re.MULTILINE)
RELEASE_HEADING = re.compile(r"^## (\d+\.\d+\.\d+\S*) \((\d{4}-\d{2}-\d{2})\)$", re.MULTILINE)


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _fragments() -> list[Path]:
    return sorted(path for path in FRAGMENTS.rglob("*") if path.is_file() and path.name != ".gitkeep")


def surface_of(path: str) -> str | None:
    """The public surface (its changelog.d folder) a repository path belongs to, or None."""
    for surface, patterns in SURFACES.items():
        if any(fnmatch.fnmatchcase(path, pattern) for pattern in patterns):
            return surface
    return None


def release_commit(repo: Path) -> str | None:
    """The commit that last changed the `version = ` line of pyproject.toml (the last release)."""
    return _git(repo, "log", "-1", "--format=%H", "-G", r"^version = ", "--", "pyproject.toml").strip() or None


def unrecorded_changes(repo: Path, since: str) -> dict[str, list[str]]:
    """Per surface, '<sha> <subject>: <files>' of each commit after `since` that changed a file of the
    surface, when no fragment was added to the surface's folder since then. Commits whose message
    has a `Changelog: none` line are not counted."""
    log = _git(repo, "log", "--no-merges", "--format=%x00%H%x01%B%x01", "--name-only", f"{since}..HEAD")
    changed: dict[str, list[str]] = {}
    for record in filter(None, log.split("\0")):
        sha, message, files = record.split("\x01")
        if NO_CHANGELOG.search(message):
            continue
        touched: dict[str, list[str]] = {}
        for path in filter(None, files.split("\n")):
            surface = surface_of(path)
            if surface is not None:
                touched.setdefault(surface, []).append(path)
        for surface, paths in touched.items():
            subject = message.strip().splitlines()[0][:80] if message.strip() else ""
            changed.setdefault(surface, []).append(f"{sha[:10]} {subject}: {', '.join(paths)}")
    added = _git(repo, "diff", "--name-only", "--diff-filter=A", f"{since}..HEAD", "--", TOWNCRIER["directory"])
    recorded = {Path(path).relative_to(TOWNCRIER["directory"]).parts[0] for path in added.split()
                if len(Path(path).relative_to(TOWNCRIER["directory"]).parts) == 2}
    return {surface: commits for surface, commits in changed.items() if surface not in recorded}


def test_every_public_surface_change_since_the_release_has_a_fragment() -> None:
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout: the check reads the history since the last release")
    if _git(REPO_ROOT, "rev-parse", "--is-shallow-repository").strip() == "true":
        pytest.skip("the clone is shallow, so the commits since the last release may be missing: fetch the "
                    "full history (git fetch --unshallow; actions/checkout's fetch-depth: 0) to run this check")
    since = release_commit(REPO_ROOT)
    if since is None:
        pytest.skip("no commit in this clone changes pyproject.toml's version line: the release commit is "
                    "not in its history")
    missing = unrecorded_changes(REPO_ROOT, since)
    assert not missing, (
        f"changes to public surfaces since the last release ({since[:10]}, version {VERSION}) with no "
        f"fragment in {TOWNCRIER['directory']}/<surface>/ (docs/RELEASES.md, 'Changelog fragments'); add one, "
        "or put 'Changelog: none (why)' in a commit's message when users see no change:\n"
        + "\n".join(f"  {surface}/: {commit}" for surface, commits in missing.items() for commit in commits))


def test_the_check_finds_a_surface_change_without_a_fragment(tmp_path: Path) -> None:
    """The check itself, on a throwaway repository: a surface change fails it, a fragment in the
    surface's folder or a `Changelog: none` line satisfies it, a fragment elsewhere does not."""
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              check=True, capture_output=True, text=True).stdout

    def commit(files: dict[str, str], message: str) -> None:
        for name, text in files.items():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            (repo / name).write_text(text)
        git("add", *files)
        git("commit", "-q", "-m", message)

    git("init", "-q", "-b", "main")
    commit({"pyproject.toml": 'version = "1.0.0"\n', "service/cli/main.py": "a\n"}, "first")
    commit({"pyproject.toml": 'version = "1.1.0"\n'}, "Release 1.1.0")
    commit({"service/cli/main.py": "b\n"}, "cli: a new option")
    since = release_commit(repo)
    assert since == git("rev-parse", "HEAD~1").strip()
    assert list(unrecorded_changes(repo, since)) == ["cli"]
    commit({"changelog.d/config/1.feature.md": "x\n"}, "a fragment of another surface")
    assert list(unrecorded_changes(repo, since)) == ["cli"]
    commit({"changelog.d/cli/1.feature.md": "x\n"}, "the fragment")
    assert unrecorded_changes(repo, since) == {}
    commit({"service/api/routes/runs.py": "c\n"}, "runs: a comment\n\nChangelog: none (a comment)")
    assert unrecorded_changes(repo, since) == {}
    commit({"service/api/routes/runs.py": "d\n"}, "runs: a new field")
    assert list(unrecorded_changes(repo, since)) == ["rest-api"]


def test_every_surface_is_a_changelog_section_and_every_pattern_names_files() -> None:
    assert set(SURFACES) <= set(SECTIONS), "each surface's fragments need a towncrier section of that folder"
    tracked = _git(REPO_ROOT, "ls-files").split() if (REPO_ROOT / ".git").exists() else []
    for surface, patterns in SURFACES.items():
        for pattern in patterns:
            # A pattern that matches nothing would make the check pass for a file it misspells.
            assert any(fnmatch.fnmatchcase(path, pattern) for path in tracked) or list(REPO_ROOT.glob(pattern)), (
                f"[tool.optdrift.public-surfaces] {surface}: {pattern!r} names no file")
    releases = (REPO_ROOT / "docs" / "RELEASES.md").read_text()
    for surface in SECTIONS:
        assert f"`{surface}/`" in releases, f"docs/RELEASES.md does not name the changelog folder {surface}/"


def test_every_fragment_has_a_known_folder_and_type_and_towncrier_renders_them() -> None:
    for path in _fragments():
        relative = path.relative_to(FRAGMENTS)
        assert len(relative.parts) == 2 and relative.parts[0] in SECTIONS, (
            f"{relative}: a fragment lies in one of the folders {sorted(SECTIONS)}")
        name = FRAGMENT_NAME.fullmatch(relative.name)
        assert name and name["type"] in TYPES, f"{relative}: named <issue>.<type>.md with a type of {TYPES}"
        assert path.read_text().strip(), f"{relative} is empty"
    draft = subprocess.run([sys.executable, "-m", "towncrier", "build", "--draft", "--version", "9.9.9"],
                           cwd=REPO_ROOT, capture_output=True, text=True)
    assert draft.returncode == 0, draft.stdout + draft.stderr
    assert "## 9.9.9" in draft.stdout
    for path in _fragments():
        first_words = " ".join(path.read_text().split()[:6])
        assert first_words in " ".join(draft.stdout.split()), f"{path.name} is not in towncrier's draft"


def test_the_changelogs_newest_entry_is_the_version_and_the_first_is_0_1_0() -> None:
    text = (REPO_ROOT / "CHANGELOG.md").read_text()
    assert TOWNCRIER["start_string"].strip() in text, "towncrier writes new entries after its start marker"
    versions = [match[0] for match in RELEASE_HEADING.findall(text)]
    assert versions[0] == VERSION, (f"CHANGELOG.md's newest entry is {versions[0]}, pyproject.toml says {VERSION}: "
                                    "a release builds the changelog in the commit that bumps the version")
    assert versions[-1] == "0.1.0" and len(set(versions)) == len(versions)
    keys = [_release_key(version) for version in versions]
    assert keys == sorted(keys, reverse=True), f"entries newest first: {versions}"


def test_the_docs_pin_the_action_to_this_release() -> None:
    """The Action installs the client from its own tree: docs that show `uses:` name the release tag."""
    pins = []
    for doc in [*sorted((REPO_ROOT / "docs").glob("*.md")), REPO_ROOT / "action.yml", REPO_ROOT / "README.md"]:
        pins += [(doc.name, ref) for ref in re.findall(r"optdrift/optdrift@([\w.\-]+)", doc.read_text())]
    assert pins, "docs/RELEASES.md shows how to pin the Action"
    assert all(ref == f"v{VERSION}" for _, ref in pins), pins


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def test_the_deprecated_aliases_live_out_their_window() -> None:
    """The deprecation rule: an alias of a moved module (service/core/moved.py) works for at least one
    minor release after the release that shipped it (0.2.0), and goes no earlier than REMOVED_IN. A
    release that reaches REMOVED_IN removes the shims (with a `removal` fragment) or moves it on."""
    from service.core.moved import MOVED, REMOVED_IN

    shipped_in = (0, 2, 0)
    assert _release_key(REMOVED_IN)[:2] > shipped_in[:2], f"REMOVED_IN {REMOVED_IN}: at least one minor release after 0.2.0"
    for old in MOVED:
        shim = REPO_ROOT / (old.replace(".", "/") + ".py")
        if _release_key(VERSION) < _release_key(REMOVED_IN):
            assert shim.is_file(), f"{old} goes in {REMOVED_IN} at the earliest, and this is {VERSION}"
        else:
            assert not shim.is_file(), (f"{VERSION} reached {old}'s REMOVED_IN ({REMOVED_IN}): remove the shim with a "
                                        "`removal` fragment, or move REMOVED_IN on (docs/RELEASES.md, 'Deprecation')")
