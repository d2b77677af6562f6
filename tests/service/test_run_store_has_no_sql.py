"""service/run_store.py is a set of one-session operations over the domain (issue 48): it opens a
session and calls service.domain, and writes no query of its own. Read from its syntax tree: no
SQLAlchemy statement (select, update, delete, insert, a dialect's insert) is imported or built, and
no session is asked to run one (execute, scalar, scalars, query, get)."""

from __future__ import annotations

import ast
from pathlib import Path

RUN_STORE = Path(__file__).resolve().parents[2] / "service" / "run_store.py"
STATEMENTS = {"select", "update", "delete", "insert"}
SESSION_QUERIES = {"execute", "scalar", "scalars", "query", "get"}


def sql_of_its_own(source: str) -> list[str]:
    """Each place the module writes SQL itself, as 'line N: what', in line order."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sqlalchemy"):
            for alias in node.names:
                if alias.name in STATEMENTS or (node.module or "").startswith("sqlalchemy.dialects"):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
        elif isinstance(node, ast.Call):
            function = node.func
            name = function.id if isinstance(function, ast.Name) else getattr(function, "attr", None)
            if name in STATEMENTS:
                found.append((node.lineno, f"{name}(...)"))
            elif (isinstance(function, ast.Attribute) and name in SESSION_QUERIES
                  and isinstance(function.value, ast.Name) and function.value.id == "session"):
                found.append((node.lineno, f"session.{name}(...)"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_run_store_writes_no_sql_of_its_own() -> None:
    assert sql_of_its_own(RUN_STORE.read_text()) == []


def test_the_check_finds_sql_written_in_place() -> None:
    source = ("from sqlalchemy import select, update\n"
              "from sqlalchemy.dialects.postgresql import insert as pg_insert\n"
              "def f(session):\n"
              "    session.execute(update(Run).values(a=1))\n"
              "    return session.scalar(select(Verdict)), session.get(Run, 1)\n")
    assert sql_of_its_own(source) == [
        "line 1: from sqlalchemy import select", "line 1: from sqlalchemy import update",
        "line 2: from sqlalchemy.dialects.postgresql import insert", "line 4: session.execute(...)",
        "line 4: update(...)", "line 5: select(...)", "line 5: session.get(...)", "line 5: session.scalar(...)"]
