"""docs/EXTENDING.md stays true: the files it says a change touches exist, and its list of files
holding a per-optimizer table is exact.

- Every repository path the page names exists (the rule of tests/project/test_named_paths.py).
- Every file between the page's "per-optimizer tables" markers names every optimizer of
  worker/battery.py OPTIMIZER_HYPER_DEFAULTS: a Python file as a quoted string ("adam"), a C++ file
  as a word in any case (`adam_step`, `AdamGroup`; not `adamw`), so a new optimizer missing from one of them fails here.
- No file of service/, worker/ or csrc/ outside that list names them all: a new per-optimizer
  table is listed on the page, or this fails (the list is what a new optimizer must touch).
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.project.test_named_paths import REPO_ROOT, named_paths

PAGE = REPO_ROOT / "docs" / "EXTENDING.md"
BEGIN = "<!-- per-optimizer tables:"
END = "<!-- end of per-optimizer tables -->"
PYTHON_FOLDERS = ("service", "worker")
CPP_SUFFIXES = {".h", ".cpp", ".cu", ".cuh"}


def optimizer_names() -> list[str]:
    from worker.battery import OPTIMIZER_HYPER_DEFAULTS

    return list(OPTIMIZER_HYPER_DEFAULTS)


def names_in(path: Path, names: list[str]) -> set[str]:
    """The optimizer names the file spells: quoted in Python; in C++ in any case, with no letter
    before it and no lower-case letter after it (CamelCase: `AdamGroup`)."""
    text = path.read_text()
    if path.suffix == ".py":
        return {n for n in names if re.search(rf"[\"']{n}[\"']", text)}
    return {n for n in names if re.search(rf"(?<![A-Za-z])(?i:{n})(?![a-z])", text)}


def listed_tables() -> list[str]:
    text = PAGE.read_text()
    section = text[text.index(BEGIN):text.index(END)]
    return re.findall(r"`([^`]+)`", section.split("-->", 1)[1])


def candidate_files() -> list[Path]:
    found = [p for folder in PYTHON_FOLDERS for p in (REPO_ROOT / folder).rglob("*.py")]
    found += [p for p in (REPO_ROOT / "csrc").rglob("*") if p.suffix in CPP_SUFFIXES]
    return sorted(found)


def test_every_path_the_page_names_exists() -> None:
    missing = [p for p, _ in named_paths(PAGE.read_text()) if not (REPO_ROOT / p).exists()]
    assert not missing, f"docs/EXTENDING.md names paths that do not exist: {missing}"


def test_every_listed_table_names_every_optimizer() -> None:
    names = optimizer_names()
    listed = listed_tables()
    assert len(listed) >= 9, listed  # the markers hold the list; an empty parse proves nothing
    problems = {path: sorted(set(names) - names_in(REPO_ROOT / path, names)) for path in listed}
    problems = {path: absent for path, absent in problems.items() if absent}
    assert not problems, f"files docs/EXTENDING.md lists as per-optimizer tables lack: {problems}"


def test_no_per_optimizer_table_is_left_off_the_page() -> None:
    names = optimizer_names()
    listed = set(listed_tables())
    unlisted = [p.relative_to(REPO_ROOT).as_posix() for p in candidate_files()
                if names_in(p, names) == set(names) and p.relative_to(REPO_ROOT).as_posix() not in listed]
    assert not unlisted, ("these files name every optimizer but docs/EXTENDING.md's per-optimizer list "
                          f"leaves them off: {unlisted}")
