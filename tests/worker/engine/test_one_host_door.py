"""One way to open a kernel host (issue 48): every worker and service module opens a host of a
build through worker.engine.host_reserve.open_host, which alone constructs a KernelHost; what a
host is given (device, adapter and its folders, case timeout, deadline, compile cache) is then
decided in one place. Read from the source (the AST), so an alias or a call inside an expression
counts too."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
THE_DOOR = ("worker/engine/host_reserve.py", "open_host")
# KernelHost's own module builds a spare (`KernelHost.spare`: `cls(...)`) and names the class in its docs.
OWN_MODULE = "worker/engine/host/client.py"


def construction_sites(root: Path) -> list[tuple[str, str, int]]:
    """(module path, enclosing function, line) of each `KernelHost(...)` call under root's worker/
    and service/, the name as imported under any alias (`import ... as`) or reached as an attribute."""
    sites = []
    for folder in ("worker", "service"):
        for path in sorted((root / folder).rglob("*.py")):
            name = path.relative_to(root).as_posix()
            if name == OWN_MODULE:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=name)
            aliases = {"KernelHost"} | {alias.asname for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                                        for alias in node.names if alias.name == "KernelHost" and alias.asname}
            for function, node in _calls(tree):
                called = node.func
                if (isinstance(called, ast.Name) and called.id in aliases) or \
                        (isinstance(called, ast.Attribute) and called.attr == "KernelHost"):
                    sites.append((name, function, node.lineno))
    return sites


def _calls(tree: ast.AST, function: str = "<module>"):  # noqa: ANN202
    """(the innermost enclosing function's name, the call) for every call in `tree`."""
    for node in ast.iter_child_nodes(tree):
        inner = node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
        if isinstance(node, ast.Call):
            yield function, node
        yield from _calls(node, inner)


def test_a_kernel_host_is_constructed_only_in_host_reserve_open_host() -> None:
    sites = construction_sites(REPO_ROOT)
    assert [(path, function) for path, function, _ in sites] == [THE_DOOR], sites


def test_the_search_finds_a_construction_however_it_is_spelled(tmp_path: Path) -> None:
    probe = tmp_path / "worker" / "probe.py"
    probe.parent.mkdir(parents=True)
    (tmp_path / "service").mkdir()
    probe.write_text("from worker.engine.host import KernelHost as Host\nfrom worker.engine import host\n\n"
                     "def a():\n    with Host('lib', device='cpu') as h:\n        pass\n\n"
                     "def b():\n    return [host.KernelHost(x) for x in 'ab']\n\n"
                     "def c():\n    return KernelHost.start_together([])\n")
    assert construction_sites(tmp_path) == [("worker/probe.py", "a", 5), ("worker/probe.py", "b", 9)]
