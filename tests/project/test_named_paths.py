"""Every repository path named in the docs and in the code's docstrings and comments exists.

Where it looks: ``README.md``, the reference pages ``docs/*.md`` and ``docs/security/*.md`` (not
the dated notes under ``docs/perf-log/`` and ``docs/log/``: a log records what was true on its
date, and a path it names may since have moved), and the docstrings and ``#`` comments of every
Python file of ``service/``, ``worker/``, ``tests/``, ``bench/`` and ``migrations/``.

What counts as a repository path (the rule): a word that starts with one of the repository's
top-level folders (``service/``, ``worker/``, ``tests/``, ``docs/``, ``bench/``, ``csrc/``,
``migrations/``, ``docker/``, ``changelog.d/``) and is not itself the tail of a longer path, so
``bitsandbytes/csrc/ops.cu`` (another repository), ``/tmp/tests/x.py``, ``~/.cache/...`` and
``$OPTDRIFT_HOME/worker/...`` are not ours. Left out as well: URLs (``https://…/tests/x.py``),
and placeholders and patterns (a path holding ``<``, ``{``, ``*``, ``…`` or ``...``).
A module's attribute may be named the Python way,
``worker/battery.make_case`` (``worker/battery.py`` must define ``make_case``). A trailing ``:123`` (line number) is dropped; a trailing
``::name`` on a test path (``tests/<file>.py::<test>``) names a test, and that function (or
``Class::test``) must be defined in the file too.

When it fails: correct the reference to the real path, or drop the claim that names something
that no longer exists. Never create a file to satisfy it.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TOP_FOLDERS = ("service", "worker", "tests", "docs", "bench", "csrc", "migrations", "docker", "changelog.d")
PYTHON_FOLDERS = ("service", "worker", "tests", "bench", "migrations")

# A path: a top-level folder, a slash, then path characters. The look-behind keeps out the tail of
# a longer path (another repository's, an absolute or home path, a variable's) and URLs.
PATH = re.compile(
    r"(?<![\w/.~$@:-])"
    r"((?:" + "|".join(re.escape(f) for f in TOP_FOLDERS) + r")/[\w./+-]*)"
    r"((?:::[\w\[\]-]+)+)?"
)
PLACEHOLDER = re.compile(r"[<{*…]|\.\.\.")


def markdown_sources() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")),
            *sorted((REPO_ROOT / "docs" / "security").glob("*.md"))]


def python_sources() -> list[Path]:
    return [p for folder in PYTHON_FOLDERS for p in sorted((REPO_ROOT / folder).rglob("*.py"))]


def python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every docstring and comment of a Python file."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                found.append((body[0].lineno, body[0].value.value))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
    return found


def named_paths(text: str) -> list[tuple[str, str | None]]:
    """(path, test name or None) for every repository path the text names."""
    found = []
    for match in PATH.finditer(text):
        path, test = match.group(1), match.group(2)
        end = match.end()
        if end < len(text) and PLACEHOLDER.match(text[end:]) or PLACEHOLDER.search(path):
            continue
        path = re.sub(r"(:\d+)+$", "", path).rstrip(".,;:)-")
        found.append((path, test[2:] if test else None))
    return found


def defines_name(path: Path, name: str) -> bool:
    """Whether the module defines ``name`` at its top level (a def, a class, an assignment, an import)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name.split(".")[0]) == name for a in node.names):
            return True
    return False


def defines_test(path: Path, name: str) -> bool:
    """Whether the file defines the function ``name`` (or ``Class::function``), parametrize ids dropped."""
    parts = [re.sub(r"\[.*", "", p) for p in name.split("::")]
    tree = ast.parse(path.read_text())
    scope: list[ast.stmt] = tree.body
    for part in parts:
        match = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      and n.name == part), None)
        if match is None:
            return False
        scope = match.body
    return True


def missing_paths() -> list[str]:
    problems = []
    sources: list[tuple[Path, list[tuple[int, str]]]] = []
    for md in markdown_sources():
        sources.append((md, list(enumerate(md.read_text().splitlines(), start=1))))
    for py in python_sources():
        sources.append((py, python_prose(py.read_text())))
    for source, chunks in sources:
        where = source.relative_to(REPO_ROOT).as_posix()
        for line, text in chunks:
            for path, test in named_paths(text):
                target = REPO_ROOT / path
                module, _, attribute = path.rpartition(".")
                if not target.exists() and attribute.isidentifier() and (REPO_ROOT / f"{module}.py").is_file():
                    if not defines_name(REPO_ROOT / f"{module}.py", attribute):
                        problems.append(f"{where}:{line}: {module}.py does not define {attribute}")
                elif not target.exists():
                    problems.append(f"{where}:{line}: {path} does not exist")
                elif test and target.is_file() and path.endswith(".py") and not defines_test(target, test):
                    problems.append(f"{where}:{line}: {path}::{test} is not defined there")
    return problems


def test_named_paths_exist() -> None:
    problems = missing_paths()
    assert not problems, f"{len(problems)} named paths do not exist:\n" + "\n".join(problems)


def test_the_rule_reads_paths_and_skips_what_is_not_ours() -> None:
    text = ("see `service/core/results.py`, tests/engine/test_x.py::test_y, bitsandbytes/csrc/ops.cu, "
            "/tmp/tests/a.py, $OPTDRIFT_HOME/worker/x, https://h/docs/a.md, docs/<name>.md, bench/*.py")
    assert named_paths(text) == [("service/core/results.py", None), ("tests/engine/test_x.py", "test_y")]


if __name__ == "__main__":
    for problem in missing_paths():
        print(problem)
