"""Issue 47: the verdict tables of `submit --wait` / `verify` / `retry` (service/cli/report.py) and of
`check` (service/cli/check.py) read whole at a real terminal of 80, 120 and 200 columns.

Each table is rendered at that width, then parsed back from the text: every case's name (its parts,
service.core.case_names) is there across the lines it wraps over, every figure is a whole number
equal to the data at the digits it shows (4 significant, or 3 at a narrow terminal: then it must
round to the same value), no cell is cut ("…"), no line is wider than the terminal; a column left
out at a narrow width is named in the caption, and `--wide` shows every column.
"""

from __future__ import annotations

import io
import math
import re

import pytest
from rich.console import Console

from service.cli.report import print_report
from service.core.case_names import case_name, case_parts
from service.core.results import CaseComparison, RunComparison

WIDTHS = (80, 120, 200)
LAYOUT = "adam.32bit.fp32.lr=0.1.wd=0.1.open.L[1+257+257+4096|1031:lr=0.01,wd=0.0].s0.t10#1928207e"
LION = "lion.32bit.fp32.lr=0.0001.wd=0.1.betas=0.95,0.98.open.n4097.s0.t20#aa11bb22"
ADAGRAD = "adagrad.32bit.bf16.lr=0.01.wd=0.0.eps=1e-10.open.n257.s1.t20#0badf00d"
BROKEN = "adam.8bit_blockwise.fp32.lr=0.001.wd=0.0.open.n4096.s0.t20#deadbeef"
# (case, first step, max |Δ|, to float64 before, after, ulp first, ulp peak, Δ / baseline's distance)
FIGURES = {
    LAYOUT: (1, 3.0517578125e-05, 1.189e-05, 1.996e-05, 2.0, 1712.0, 0.6787),
    LION: (1, 7.62939453125e-06, 4.2950000001e-05, 9.1e-08, 1.0, 1.0, -0.9979),
    ADAGRAD: (3, 1.220703125e-04, 3.71e+04, 6.31e+04, 0.0, 0.0, 0.7008),
}
NUMBER = re.compile(r"-?\d(?:\.\d+)?(?:e[-+]\d+)?|0|NaN|[-+]inf")


def _run() -> dict:
    cases = [{"case_id": case, "verdict": "changed", "first_divergent_step": step, "direction": "farther",
              "max_abs_diff_per_step": [0.0, diff / 2, diff], "baseline_peak_ref64_distance": before,
              "commit_peak_ref64_distance": after, "message": None}
             for case, (step, diff, before, after, *_rest) in FIGURES.items()]
    cases.append({"case_id": BROKEN, "verdict": "broken", "first_divergent_step": None, "direction": None,
                  "max_abs_diff_per_step": None, "message": "SIGSEGV in adam_8bit_step"})
    attribution = [{"case_id": case, "first_step_ulps": first, "peak_ulps": peak,
                    "change_vs_baseline_distance": relative, "text": "semantic: weight decay decoupled"}
                   for case, (_s, _d, _b, _a, first, peak, relative) in FIGURES.items()]
    return {"id": 7, "commit_sha": "0" * 40, "base_sha": None, "environment": "gpu.sm90", "status": "done",
            "error": None, "progress": {"cases_done": 40, "cases_total": 40},
            "verdict": {"outcome": "changed", "flagged": True, "changed_cases": 3, "first_divergent_step": 1,
                        "summary": "3 cases changed, 1 broken", "detail": {"cases": cases},
                        "attribution": attribution}}


# --- reading a rendered table back --------------------------------------------------------------
def _table(text: str, title: str, key: str) -> tuple[list[str], list[list[str]], str]:
    """(the headers, the rows' cells with each cell's lines joined, the caption) of the table titled
    `title` in rich's default box; `key`: a column whose cells are one line, none empty."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(title))
    top = next(i for i in range(start, len(lines)) if lines[i].lstrip().startswith("┏"))
    head_end = next(i for i in range(top, len(lines)) if lines[i].lstrip().startswith("┡"))
    bottom = next(i for i in range(head_end, len(lines)) if lines[i].lstrip().startswith("└"))
    headers = _joined([line.strip().strip("┃").split("┃") for line in lines[top + 1:head_end]])
    body = lines[head_end + 1:bottom]
    # A row starts at a rule (terminal_tables rules rows apart when one takes several lines), or
    # where the `key` column, one line in every row, has its cell.
    key_column = headers.index(key)
    rows, record = [], []
    for line in body:
        if line.lstrip().startswith("├"):
            continue
        cells = line.strip().strip("│").split("│")
        if cells[key_column].strip() and record:
            rows.append(_joined(record))
            record = []
        record.append(cells)
    if record:
        rows.append(_joined(record))
    caption = []
    for line in lines[bottom + 1:]:
        if not line.strip() or line.startswith("run ") or line.strip().startswith(("┏", "changed cases", "kind of",
                                                                                     "not applicable", "details")):
            break
        caption.append(line.strip())
    return headers, rows, " ".join(caption)


def _joined(record: list[list[str]]) -> list[str]:
    columns = len(record[0])
    assert all(len(cells) == columns for cells in record), record
    return [" ".join(cells[c].strip() for cells in record if cells[c].strip()) for c in range(columns)]


def _same_name(shown: str, case_id: str) -> None:
    """The name, as wrapped over lines (a fold may split a part): every part, in order."""
    squeezed = shown.replace(" ", "")
    assert squeezed == case_name(case_id).replace(" ", ""), (shown, case_id)
    assert "#" not in shown and (case_id.split("#")[1] not in shown)  # the hash is not a name
    position = 0
    for part in case_parts(case_id):
        found = squeezed.find(part.replace(" ", ""), position)
        assert found >= 0, (part, shown)
        position = found + len(part)


def _same_number(shown: str, value: float) -> None:
    """A whole number, equal to `value` at the significant digits it shows (at least 3)."""
    assert NUMBER.fullmatch(shown), f"not a whole number: {shown!r}"
    if value == 0:
        assert float(shown) == 0
        return
    mantissa = shown.lstrip("-").split("e")[0].replace(".", "")
    assert len(mantissa) >= 3, shown
    unit = 10 ** (math.floor(math.log10(abs(value))) - (len(mantissa) - 1))
    # Rounding to the shown digits moves a value by at most half a unit of its last digit.
    assert abs(float(shown) - value) <= unit / 2 * (1 + 1e-9), (shown, value)


def _pair(shown: str, before: float, after: float) -> None:
    left, arrow, right = shown.partition(" → ")
    assert arrow, shown
    _same_number(left, before)
    _same_number(right, after)


def _render(width: int, *, wide: bool = False) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    print_report(console, [_run()], wide=wide)
    return console.export_text()


# --- the service's tables (submit --wait, verify, retry) ----------------------------------------
@pytest.mark.parametrize("width", WIDTHS)
def test_the_changed_cases_table_reads_whole_at_each_width(width: int) -> None:
    text = _render(width)
    assert max(len(line) for line in text.splitlines() if "│" in line or "┃" in line) <= width
    headers, rows, caption = _table(text, "changed cases", "max |Δ|")
    assert "…" not in "".join(" ".join(row) for row in rows)
    for needed in ("case", "verdict", "max |Δ|", "to float64 before → after"):
        assert needed in headers, (needed, headers)
    every = ["run", "case", "verdict", "first step", "direction", "max |Δ|", "to float64 before → after",
             "ulp first / peak", "Δ / baseline's distance", "kind", "message"]
    left_out = [h for h in every if h not in headers]
    if width == 200:
        assert not left_out, headers
    if left_out:  # named, so the reader knows to ask for --wide
        assert all(h in caption for h in left_out) and "--wide" in caption, (left_out, caption)
    by_name = {row[headers.index("case")].replace(" ", ""): row for row in rows}
    for case, (step, diff, before, after, first, peak, relative) in FIGURES.items():
        row = by_name[case_name(case).replace(" ", "")]
        _same_name(row[headers.index("case")], case)
        _same_number(row[headers.index("max |Δ|")], diff)
        _pair(row[headers.index("to float64 before → after")], before, after)
        if "first step" in headers:
            assert row[headers.index("first step")] == str(step)
        if "ulp first / peak" in headers:
            shown_first, _, shown_peak = row[headers.index("ulp first / peak")].partition(" / ")
            _same_number(shown_first, first)
            _same_number(shown_peak, peak)
        if "Δ / baseline's distance" in headers:
            _same_number(row[headers.index("Δ / baseline's distance")], relative)
    assert len(rows) == 4
    # A broken case's message is in the table, or said below it when its column was left out.
    broken = by_name[case_name(BROKEN).replace(" ", "")]
    if "message" in headers:
        assert broken[headers.index("message")] == "SIGSEGV in adam_8bit_step"
    else:
        assert f"run 7: broken ({case_name(BROKEN)}): SIGSEGV in adam_8bit_step" in text.split("details (in full):")[1]


@pytest.mark.parametrize("width", WIDTHS)
def test_the_run_table_keeps_the_verdict_and_summary_at_each_width(width: int) -> None:
    text = _render(width)
    headers, rows, caption = _table(text, "optdrift verdict", "run")
    row = rows[0]
    assert row[headers.index("run")] == "7" and row[headers.index("verdict")] == "changed"
    assert row[headers.index("commit")].replace(" ", "") == "0" * 40  # the sha wraps, whole
    assert row[headers.index("summary")] == "3 cases changed, 1 broken"
    assert "…" not in " ".join(row)
    # The sizes per family and dtype follow in words whatever the width.
    assert "run 7: 32bit float32 (2 cases): peak distance to float64" in text


def test_wide_shows_every_column_in_full_at_80_columns() -> None:
    text = _render(80, wide=True)
    headers, rows, caption = _table(text, "changed cases", "max |Δ|")
    assert "ulp first / peak" in headers and "message" in headers and "kind" in headers, headers
    assert "not shown" not in caption
    layout = next(row for row in rows if row[headers.index("case")].replace(" ", "").startswith("adam·32bit·fp32"))
    assert layout[headers.index("to float64 before → after")] == "1.189e-05 → 1.996e-05"  # the 4-digit format
    assert max(len(line) for line in text.splitlines()) > 80  # wider than the terminal, not cropped


def test_at_120_columns_nothing_reads_like_the_issue() -> None:
    """The issue's 120-column terminal read `lion.32…` and `1.189e-… → 1.996e-…`."""
    text = _render(120)
    assert "lion.32…" not in text and "e-…" not in text and "…" not in text.split("details")[0]


# --- check's tables (service/cli/check.py) --------------------------------------------------------
def _comparison() -> RunComparison:
    cases = [CaseComparison(case_id=case, optimizer=case.split(".")[0], verdict="changed", first_divergent_step=step,
                            max_abs_diff_per_step=[0.0, diff], commit_final_ref64_distance=after,
                            baseline_final_ref64_distance=before, direction="farther")
             for case, (step, diff, before, after, *_rest) in FIGURES.items()]
    return RunComparison(verdict="changed", summary="3 cases changed", battery_digest="b" * 64, cases=cases)


@pytest.mark.parametrize("width", WIDTHS)
def test_checks_verdict_and_attribution_tables_read_whole_at_each_width(width: int) -> None:
    from service.cli.check import print_attribution, print_verdict

    console = Console(width=width, record=True, file=io.StringIO())
    print_verdict(_comparison(), console)
    attribution = {case: {"class": "semantic", "variant": "decay_decoupled", "label": "decoupled weight decay",
                          "first_step_ulps": first, "peak_ulps": peak, "distance": 1e-7, "reference_distance": 2e-5}
                   for case, (_s, _d, _b, _a, first, peak, _r) in FIGURES.items()}
    print_attribution(attribution, console)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines() if "│" in line or "┃" in line) <= width
    headers, rows, _ = _table(text, "optdrift verdict: changed", "verdict")
    assert {"case", "verdict", "max |commit - base|", "ref64 commit", "ref64 base"} <= set(headers), headers
    by_name = {row[0].replace(" ", ""): row for row in rows}
    for case, (step, diff, before, after, *_rest) in FIGURES.items():
        row = by_name[case_name(case).replace(" ", "")]
        _same_name(row[0], case)
        _same_number(row[headers.index("max |commit - base|")], diff)
        _same_number(row[headers.index("ref64 commit")], after)
        _same_number(row[headers.index("ref64 base")], before)
    headers, rows, _ = _table(text, "kind of change", "ulp first / peak")
    by_name = {row[0].replace(" ", ""): row for row in rows}
    for case, (_s, _d, _b, _a, first, peak, _r) in FIGURES.items():
        row = by_name[case_name(case).replace(" ", "")]
        shown_first, _, shown_peak = row[headers.index("ulp first / peak")].partition(" / ")
        _same_number(shown_first, first)
        _same_number(shown_peak, peak)
    assert "…" not in text
