"""The import contracts of pyproject.toml's [tool.importlinter], checked by import-linter's own
command: the seams between the API process, the command and the worker are written down once
(issue 35), not rediscovered by each reader. tests/project/test_layering.py keeps what import-linter cannot
say (what a fresh interpreter actually loads)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _lint_imports() -> subprocess.CompletedProcess:
    command = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if command is None:
        pytest.skip("import-linter is not installed (the test extra has it)")
    return subprocess.run([command, "--no-cache"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def test_every_import_contract_is_kept() -> None:
    done = _lint_imports()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "BROKEN" not in done.stdout and "KEPT" in done.stdout


def module_cycles(graph) -> list[list[str]]:  # noqa: ANN001
    """Groups of modules that import each other in a circle (strongly connected components of the
    import graph, imports inside functions included), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_module_imports_itself_in_a_circle() -> None:
    """import-linter's acyclic_siblings contract judges packages as wholes (worker.engine and
    worker.adapters still lean on each other, issue 35's next steps); this is the module-level rule:
    no two modules of ours import each other, directly or around a loop, not even inside a function
    (the late imports that used to hide the cycles between the command's modules, the worker's tasks
    and their jobs, and the fast engine and its prepared inputs)."""
    grimp = pytest.importorskip("grimp")
    cycles = module_cycles(grimp.build_graph("service", "worker"))
    assert cycles == [], cycles


def test_the_cycle_finder_finds_a_cycle() -> None:
    class Graph:
        modules = {"a", "b", "c", "d"}
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

        def find_modules_directly_imported_by(self, module: str) -> set[str]:
            return self.edges.get(module, set())

    assert module_cycles(Graph()) == [["a", "b", "c"]]
