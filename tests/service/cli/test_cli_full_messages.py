"""Issue 20 item 5: the CLI's report never cuts the message a user needs to act on. The tables keep
one short cell per case (CELL_CHARS); every message they cut — a failed run's whole error (an
adapter's import error with its file and line), a broken case's multi-line message, a long
not-applicable reason — follows them in full, each reason once with its case count."""

from __future__ import annotations

from service.cli.report import CELL_CHARS, full_messages, make_console, print_report

IMPORT_ERROR = ("adapter 'myproject_optdrift': importing module myproject_optdrift failed: ModuleNotFoundError: "
                "No module named 'myproject_native' (at /src/tools/myproject_optdrift.py:12)")
BROKEN = ("kernel raised RuntimeError: myproject lion returned error code 7 for case lion.32bit.fp32.lr=0.1\n"
          "  the library's log: workspace of 4097 floats requested, 0 available")
REASON = ("myproject has no bfloat16 kernels (float32 parameters only); remove bf16 cases from the project's "
          "battery or build the library with MYPROJECT_BF16=1")


def _case(case_id: str, verdict: str, message: str | None) -> dict:
    return {"case_id": case_id, "verdict": verdict, "first_divergent_step": None, "direction": None,
            "max_abs_diff_per_step": None, "message": message}


FAILED_RUN = {"id": 7, "commit_sha": "a" * 40, "environment": "cpu", "status": "failed", "error": IMPORT_ERROR,
              "verdict": None}
BROKEN_RUN = {"id": 8, "commit_sha": "b" * 40, "environment": "cpu", "status": "done", "error": None,
              "verdict": {"outcome": "broken", "flagged": True, "summary": "1 case broken",
                          "detail": {"cases": [_case("lion.a", "broken", BROKEN)]
                                     + [_case(f"adam.bf16.{i}", "not_applicable", REASON) for i in range(3)]}}}


def test_the_messages_are_longer_than_a_cell():  # else this file tests nothing
    assert min(len(IMPORT_ERROR), len(BROKEN.splitlines()[0]), len(REASON)) > CELL_CHARS


def test_every_cut_message_follows_the_tables_whole(capsys, monkeypatch):  # noqa: ANN001
    monkeypatch.delenv("COLUMNS", raising=False)
    print_report(make_console(), [FAILED_RUN, BROKEN_RUN])
    text = capsys.readouterr().out
    tables, _, details = text.partition("details (in full):")
    assert details, text
    assert f"run 7 (failed): {IMPORT_ERROR}" in details
    assert f"run 8: broken (lion · a): {BROKEN}" in details  # both lines, as the kernel host said them; the case by its name
    assert details.count(REASON) == 1 and f"not applicable (3 cases): {REASON}" in details
    # The tables keep a short cell: the message's first CELL_CHARS - 1 characters and a mark.
    assert BROKEN.splitlines()[0][:CELL_CHARS - 1] + "…" in tables and BROKEN not in tables


def test_a_message_many_cases_share_is_shown_once_with_their_count():
    """A kernel host whose adapter cannot be imported breaks every case with the same message."""
    run = {**BROKEN_RUN, "verdict": {**BROKEN_RUN["verdict"], "detail": {"cases": [
        _case(f"lion.{i}", "broken", f"kernel host did not start: {IMPORT_ERROR}") for i in range(10)]}}}
    assert full_messages([run]) == [f"run 8: broken (10 cases): kernel host did not start: {IMPORT_ERROR}"]


def test_short_messages_are_not_repeated():
    short = {**BROKEN_RUN, "verdict": {**BROKEN_RUN["verdict"], "detail": {"cases": [
        _case("lion.a", "broken", "SIGSEGV"), _case("adam.bf16", "not_applicable", "no bf16 kernels")]}}}
    assert full_messages([short, {**FAILED_RUN, "error": "build failed"}]) == []
