"""service/core/outcomes.py is the one home of a run's outcomes: the Literal equals its keys, its
values are the ones CI, GitHub and the pages already depend on (stored and scripted: never to
change by a refactor), every surface reads it, and no surface keeps a table of its own."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from service.core import outcomes
from service.core.results import RunComparison, RunVerdictName

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_the_literal_is_the_tables_keys() -> None:
    assert set(typing.get_args(RunVerdictName)) == set(outcomes.NAMES)
    assert len(outcomes.NAMES) == len(outcomes.OUTCOMES)  # no name twice
    assert typing.get_args(RunComparison.model_fields["verdict"].annotation) == typing.get_args(RunVerdictName)


# What each outcome was before the table: exit codes (scripts branch on them), GitHub conclusions
# (required checks), badge classes (the stylesheet), the stored `flagged`. Written out here on
# purpose: a change to the table must be a change to this test too.
BEFORE = {
    #  name:             flagged, exit, exit once acknowledged, conclusion, badge class
    "broken": (True, 3, 3, "failure", "broken"),
    "nondeterministic": (True, 5, 5, "failure", "nondeterministic"),
    "changed": (True, 1, 0, "failure", "changed"),
    "no-baseline": (False, 7, 7, "failure", "neutral"),
    "unchanged": (False, 0, 0, "success", "unchanged"),
}


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_each_outcome_keeps_its_values(name: str) -> None:
    row = outcomes.BY_NAME[name]
    assert (row.flagged, row.exit_code, row.acknowledged_exit_code, row.conclusion, row.badge_class) == BEFORE[name]
    assert row.fails_gate == (row.exit_code != outcomes.EXIT_OK) == (row.conclusion == outcomes.FAILURE)
    assert row.filter_label == name  # the overview's selector shows the stored word


def test_exit_codes_and_their_precedence() -> None:
    assert (outcomes.EXIT_OK, outcomes.EXIT_CHANGED, outcomes.EXIT_USAGE, outcomes.EXIT_BROKEN,
            outcomes.EXIT_OPTDRIFT_ERROR, outcomes.EXIT_NONDETERMINISTIC, outcomes.EXIT_NO_BASELINE,
            outcomes.EXIT_NOT_BUILDABLE) == (0, 1, 2, 3, 4, 5, 7, 8)
    assert outcomes.EXIT_PRECEDENCE == (4, 3, 5, 1, 7, 8, 0)
    assert outcomes.NAMES == ("broken", "nondeterministic", "changed", "no-baseline", "unchanged")
    assert outcomes.exit_code("no-baseline", no_baseline_allowed=True) == 0
    assert outcomes.exit_code("changed", acknowledged=True) == 0
    with pytest.raises(ValueError, match="known: broken, nondeterministic"):
        outcomes.exit_code("flaky")


def test_the_old_names_of_the_exit_codes_still_import() -> None:
    from service.cli import check, common, exit_codes, main

    for module in (exit_codes, common, main):
        assert (module.EXIT_OK, module.EXIT_CHANGED, module.EXIT_USAGE, module.EXIT_BROKEN, module.EXIT_OPTDRIFT_ERROR,
                module.EXIT_NONDETERMINISTIC, module.EXIT_NO_BASELINE,
                module.EXIT_NOT_BUILDABLE) == (0, 1, 2, 3, 4, 5, 7, 8)
    assert (check.EXIT_OK, check.EXIT_CHANGED, check.EXIT_USAGE, check.EXIT_BROKEN, check.EXIT_OPTDRIFT_ERROR,
            check.EXIT_NONDETERMINISTIC, check.EXIT_NOT_BUILDABLE) == (0, 1, 2, 3, 4, 5, 8)
    # `check` and `compare` have no submission that could allow a missing baseline: it passes there.
    # One table for both (service/cli/common.py), derived from the outcomes' own.
    expected = {"unchanged": 0, "no-baseline": 0, "changed": 1, "broken": 3, "nondeterministic": 5}
    from service.cli import compare
    assert check.EXIT_BY_VERDICT is compare.EXIT_BY_VERDICT is common.EXIT_BY_VERDICT
    assert common.EXIT_BY_VERDICT == expected


def test_the_worker_decides_no_exit_code_and_prints_nothing_of_check() -> None:
    """`optdrift check`'s work (worker/check.py) returns plain results: its exit codes and tables are
    the command's (service/cli/check.py)."""
    from worker import check

    assert not [name for name in vars(check) if name.startswith("EXIT_") or name.startswith("print_")]
    source = Path(check.__file__).read_text()
    assert "rich" not in source and "print(" not in source


@pytest.mark.parametrize(("run", "code"), [
    ({"status": "done", "verdict": {"outcome": "unchanged"}}, 0),
    ({"status": "done", "verdict": {"outcome": "changed"}}, 1),
    ({"status": "done", "verdict": {"outcome": "changed", "acknowledged": True}}, 0),
    ({"status": "done", "verdict": {"outcome": "broken", "acknowledged": True}}, 3),
    ({"status": "done", "verdict": {"outcome": "nondeterministic", "acknowledged": True}}, 5),
    ({"status": "done", "verdict": {"outcome": "no-baseline"}}, 7),
    ({"status": "done", "verdict": {"outcome": "no-baseline", "no_baseline_allowed": True}}, 0),
    ({"status": "failed", "verdict": None, "error": "build failed"}, 3),
    ({"status": "error", "verdict": None}, 4),
    ({"status": "done", "verdict": None}, 0),
])
def test_the_command_reads_the_table_for_a_runs_exit_code(run: dict, code: int) -> None:
    from service.cli.main import run_exit_code

    assert run_exit_code(run) == code


def test_github_reads_the_table() -> None:
    from service.notify.conclusions import conclusion_for

    for row in outcomes.OUTCOMES:
        assert (conclusion_for(row.name).conclusion, conclusion_for(row.name).title) == (row.conclusion, row.check_title)
    assert conclusion_for("no-baseline", no_baseline_allowed=True).conclusion == "neutral"
    assert conclusion_for("acknowledged").conclusion == "success"
    assert conclusion_for("error").conclusion == "action_required"


def test_the_actions_verdict_output_reads_the_table() -> None:
    from service.notify.action_outputs import _BY_EXIT_CODE

    assert _BY_EXIT_CODE == {1: "changed", 2: "bad-input", 3: "broken", 4: "error", 5: "nondeterministic",
                             7: "no-baseline"}


def test_the_dashboard_reads_the_table() -> None:
    from service.dashboard import wording
    from service.domain.dashboard_queries import VERDICT_FILTERS, badge
    from service.domain.verdict_store import FLAGGING_OUTCOMES

    stylesheet = (REPO_ROOT / "service/dashboard/static/dashboard.css").read_text()
    for row in outcomes.OUTCOMES:
        assert callable(getattr(wording, row.page_sentence)), row.page_sentence
        assert wording._VERDICT_SENTENCES[row.name] is getattr(wording, row.page_sentence)
        if row.name != "changed":  # a changed badge says its direction: changed-farther, -closer, -same
            shown = badge(status="done", outcome=row.name)
            assert (shown.text, shown.css, shown.title) == (row.badge_text, row.badge_class, row.badge_title)
            assert f".badge-{row.badge_class} " in stylesheet, f"no colour for .badge-{row.badge_class}"
    assert badge(status="done", outcome="no-baseline").text == "no baseline"
    assert badge(status="done", outcome="broken", acknowledged=True).text == "broken (acknowledged)"
    assert badge(status="done", outcome="changed", directions={"farther": 2}).css == "changed-farther"
    assert VERDICT_FILTERS == ("unchanged", "changed", "broken", "nondeterministic", "no-baseline", "running",
                               "error", "flagged")
    assert FLAGGING_OUTCOMES == ("changed", "broken", "nondeterministic")


def test_the_table_reads_the_standard_library_alone() -> None:
    """The Action's output helper and the kernel box read it; pyproject's contract says the same
    for our own packages, this for third-party ones."""
    tree = ast.parse((REPO_ROOT / "service/core/outcomes.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "dataclasses"}


# ----------------------------------------------------------------------------- stray literals
# A literal naming three or more outcomes is a table of them; a comparison of an `outcome` (or a
# notifier's `state`) with a literal name asks about one. Either belongs to outcomes.py. The places
# that keep such words for a reason of their own, each with it:
ALLOWED_TABLES = {
    ("service/core/outcomes.py", "the table itself"),
    ("service/core/results.py", "RunVerdictName: the Literal pydantic validates with; tested equal to the table"),
    # The case verdicts (results.py CaseVerdict: unchanged, changed, broken, new, not_applicable,
    # nondeterministic) are a case's, not a run's, and share three words with the outcomes:
    ("service/cli/report.py", "the cases a run's table lists (case verdicts)"),
    ("service/domain/acknowledgements.py", "the cases an acknowledgement covers (case verdicts)"),
    ("service/domain/bisection.py", "a case's differing verdicts, by which a bisection step is judged"),
    ("worker/sensitivity/results.py", "the verdicts by which a mutant counts as caught"),
    # Other vocabularies that reuse the words:
    ("service/notify/schemas.py", "webhook event names (with error): stored in subscriptions"),
    ("service/notify/webhooks.py", "webhook event names (with error): stored in subscriptions"),
    ("service/api/release_schemas.py", "a release matrix cell's state (with no-data, first)"),
}
# The stored data's migrations (migrations/versions) keep the words they wrote: they lie outside
# the folders searched (service/, worker/).


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _asked_about(node: ast.AST) -> str | None:
    """What a comparison's left side names: outcome, x.outcome, x.get("outcome"), x["outcome"]."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        first = node.args[0]
        return first.value if isinstance(first, ast.Constant) else None
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value
    return None


def stray_outcome_literals(root: Path) -> list[str]:
    names = set(outcomes.NAMES)
    allowed = {path for path, _reason in ALLOWED_TABLES}
    found = []
    for path in sorted([*root.glob("service/**/*.py"), *root.glob("worker/**/*.py")]):
        relative = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Dict, ast.Tuple, ast.List, ast.Set)) and relative not in allowed:
                words = _strings(node)
                # A case-verdict table says so with a case-only word.
                if len(words & names) >= 3 and not words & {"new", "not_applicable"}:
                    found.append(f"{relative}:{node.lineno}: a table of outcomes {sorted(words & names)}")
            if isinstance(node, ast.Compare) and _asked_about(node.left) in ("outcome", "state"):
                if _strings(node) & names:
                    found.append(f"{relative}:{node.lineno}: compares an outcome with {sorted(_strings(node) & names)}")
    return found


def test_no_surface_keeps_its_own_outcome_literals() -> None:
    found = stray_outcome_literals(REPO_ROOT)
    assert found == [], ("name these through service/core/outcomes.py (its constants or its table):\n"
                         + "\n".join(found))


def test_the_stray_literal_finder_finds_them(tmp_path: Path) -> None:
    (tmp_path / "service" / "cli").mkdir(parents=True)
    (tmp_path / "service" / "cli" / "gate.py").write_text(
        'CODES = {"unchanged": 0, "changed": 1, "broken": 3}\n'
        'def code(verdict):\n    return 7 if verdict.get("outcome") == "no-baseline" else 0\n')
    found = stray_outcome_literals(tmp_path)
    assert [line.split(": ", 1)[0] for line in found] == ["service/cli/gate.py:1", "service/cli/gate.py:3"]
