"""A git repository of lion-pytorch (PyPI) as an optdrift project, for tests/scenarios/test_real_library_lion.py.

The library's files are not kept in this repository: they are copied from the installed
distribution (the [test] extra pins lion-pytorch==0.2.5), with its metadata as the tree's PKG-INFO
(what an sdist carries), then tests/fixtures/lion_project adds the project's optdrift.toml and
battery.json. The history, each commit exported with `git archive` (patches in commits/):

    base ── comment ──┬── decay     decay: weight decay applied after the sign update
                      └── mixup     mixup: the momentum is averaged with beta1 instead of beta2
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

# Not tests.service_fixtures' REPO_ROOT: that module needs psycopg, which the H200 script
# (bench/gpu/h200_lion_pytorch.sh) does not carry.
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "lion_project"
DISTRIBUTION = "lion-pytorch"
VERSION = "0.2.5"


@dataclass(frozen=True)
class Commit:
    name: str
    sha: str
    parent: str | None  # the parent's name
    tree: Path          # the commit's files, as `git archive` exports them


@dataclass
class LionHistory:
    repo: Path
    commits: dict[str, Commit] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Commit:
        return self.commits[name]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=ci", "-c", "user.email=ci@example.invalid", *args],
                          cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def copy_library(destination: Path) -> None:
    """The installed distribution's package files (no bytecode), its license and PKG-INFO."""
    distribution = importlib.metadata.distribution(DISTRIBUTION)
    if distribution.version != VERSION:
        raise RuntimeError(f"{DISTRIBUTION} {distribution.version} is installed; these tests patch {VERSION} "
                           f"(pip install '{DISTRIBUTION}=={VERSION}', as the [test] extra pins it)")
    for file in distribution.files or []:
        if file.parts[0] == "lion_pytorch" and file.suffix == ".py":
            target = destination / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file.locate(), target)
        elif file.name == "LICENSE":
            shutil.copyfile(file.locate(), destination / "LICENSE")
    (destination / "PKG-INFO").write_text(distribution.read_text("METADATA"))


def make_history(root: Path) -> LionHistory:
    repo = root / "repo"
    repo.mkdir(parents=True)
    copy_library(repo)
    for name in ("optdrift.toml", "battery.json"):
        shutil.copyfile(FIXTURE / name, repo / name)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", f"{DISTRIBUTION} {VERSION} with its optdrift.toml and battery")
    made = LionHistory(repo=repo)

    def record(name: str, parent: str | None) -> None:
        sha = _git(repo, "rev-parse", "HEAD")
        tree = root / "trees" / name
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", sha], cwd=repo, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        made.commits[name] = Commit(name=name, sha=sha, parent=parent, tree=tree)

    def commit_patch(name: str, parent: str, patch: str, message: str) -> None:
        _git(repo, "checkout", "-q", made.commits[parent].sha)
        _git(repo, "apply", str(FIXTURE / "commits" / patch))
        _git(repo, "commit", "-qam", message)
        record(name, parent)

    record("base", None)
    commit_patch("comment", "base", "0002-comment-only.patch", "Lion: say where the decay starts from")
    commit_patch("decay", "comment", "0003-decay-after-update.patch", "Lion: decay after the update")
    commit_patch("mixup", "comment", "0004-momentum-with-beta1.patch", "Lion: momentum with beta1")
    return made
