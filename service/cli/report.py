"""What `optdrift submit --wait`, `verify`, `retry --wait` and `serve --demo` print while runs go
and when they end: progress, the verdict tables, the JSON for machines.

Two audiences: a person at a terminal (a live progress bar, tables as wide as the terminal) and a
CI log (no terminal: one progress line per change of phase or every `LINE_INTERVAL_S`, tables at
their full width instead of rich's default 80 columns, which cut case ids and summaries)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from service.cli.exit_codes import EXIT_NO_BASELINE
from service.core import outcomes
from service.core.terminal_tables import Column, Figure, FittedTable, print_table
from service.core.case_names import case_name
from service.core.results import ComparisonFigures, ScaleGroup
from service.core.verdicts import figures_of
from service.core.wording import (
    REFERENCE_CHANGED, before_after, number, reference_changed_sentence, scale_label, scale_line,
)

# A CI log line: at most one per run this often, sooner when the run changes phase.
LINE_INTERVAL_S = 10.0
# Wide enough for any case id and summary line; no terminal means nothing to fit.
LOG_WIDTH = 1000
# A message cell's characters; the whole message follows the tables (`full_messages`).
CELL_CHARS = 80


def make_console(*, stderr: bool = False) -> Console:
    """A terminal's own width; in a log (stdout not a terminal, no COLUMNS) full-width lines."""
    stream = sys.stderr if stderr else sys.stdout
    is_terminal = hasattr(stream, "isatty") and stream.isatty()
    width = None if is_terminal or os.environ.get("COLUMNS") else LOG_WIDTH
    return Console(stderr=stderr, width=width)


def _number(value: float | None) -> str:
    # The one formatter (service.core.wording); "-" marks a missing figure in a terminal table.
    return number(value, missing="-")


def run_phase(run: dict) -> str:
    """Where a run is, in words: queued (and why it waits), building, running the battery..."""
    status = run["status"]
    if status == "queued":
        return f"queued ({run['waiting_for']})" if run.get("waiting_for") else "queued"
    if status == "running":
        return "building" if run["progress"]["cases_total"] is None else "running the battery"
    if status in ("done", "failed") and run.get("verdict") is None:
        return "judging"
    return status


def size_cells(groups: list[ScaleGroup]) -> tuple[str, str]:
    """The run table's size cells, one line per (kernel family, dtype) of its changed cases (the
    verdict's figures.scales: never one figure across scales): the largest
    |commit - baseline| of any step (once the co-run has filled it in), and the largest peak
    distance to the float64 reference before (baseline) → after (commit)."""
    if not groups:
        return "-", "-"
    if len(groups) == 1:  # one scale: the figures alone
        return _number(groups[0].largest_diff), _distance_text(groups[0].baseline_peak, groups[0].commit_peak)
    return ("\n".join(f"{scale_label(g)}: {_number(g.largest_diff)}" for g in groups),
            "\n".join(f"{scale_label(g)}: {_distance_text(g.baseline_peak, g.commit_peak)}" for g in groups))


def size_lines(run: dict) -> list[str]:
    """The size of a run's change per (kernel family, dtype), in words (8-bit distances explained)."""
    return [f"run {run['id']}: {scale_line(group)}" for group in _figures(run).scales]


def _distance_text(before: float | None, after: float | None) -> str:
    return before_after(before, after, missing="-")


def _detail(run: dict) -> dict:
    return (run.get("verdict") or {}).get("detail") or {}


def _figures(run: dict) -> ComparisonFigures:
    """The verdict's stored figures (service.core.verdicts.figures_of: derived from its cases for
    verdicts stored before them)."""
    return figures_of(_detail(run))


def _cases(run: dict) -> list[dict]:
    return _detail(run).get("cases", [])


def compared_with(run: dict) -> str:
    """What the run's verdict compared with (issue 44: every result says so): the baseline's
    commit, run and environment, and how far back when it is not the parent; or why none."""
    verdict = run.get("verdict") or {}
    if not verdict:
        return "-"
    baseline = verdict.get("baseline")
    if not baseline:
        return "no baseline" + (" (allowed)" if verdict.get("no_baseline_allowed") else "")
    back = baseline.get("commits_back")
    distance = f", {back} commits back" if back and back > 1 else ""
    commit = (baseline.get("commit_sha") or "a verify tree")[:12]
    return f"{commit} (run {baseline['run_id']}, {baseline['environment']}{distance})"


def baseline_lines(runs: list[dict]) -> list[str]:
    """A line per run on what it compared with, or why nothing and what to do; and the
    acknowledgement it inherited from the same change on another commit."""
    lines = []
    for run in runs:
        verdict = run.get("verdict") or {}
        if not verdict:
            continue
        if verdict.get("baseline"):
            lines.append(f"run {run['id']}: compared with {compared_with(run)}")
        elif verdict.get("outcome") == outcomes.NO_BASELINE:
            allowed = "allowed by --allow-no-baseline: passes" if verdict.get("no_baseline_allowed") else \
                f"fails (exit {EXIT_NO_BASELINE})"
            lines.append(f"run {run['id']}: no baseline, {allowed}: {verdict.get('baseline_note') or 'nothing to compare with'}")
        via = verdict.get("acknowledged_via")
        if via:
            lines.append(f"run {run['id']}: acknowledged automatically, the same change as run {via['run_id']} "
                         f"({(via.get('commit_sha') or '')[:12]}) acknowledged"
                         f"{' by ' + via['acknowledged_by'] if via.get('acknowledged_by') else ''}: {via.get('note')}")
    return lines


def size_figures(groups: list[ScaleGroup]) -> tuple[Figure, Figure]:
    """`size_cells` as table figures (written shorter on a narrow terminal, never cut)."""
    if not groups:
        return Figure("-", "-"), Figure("-", "-")
    if len(groups) == 1:
        return Figure.of(groups[0].largest_diff), Figure.pair(groups[0].baseline_peak, groups[0].commit_peak)
    return (Figure.joined((Figure.of(g.largest_diff).prefixed(f"{scale_label(g)}: ") for g in groups), "\n"),
            Figure.joined((Figure.pair(g.baseline_peak, g.commit_peak).prefixed(f"{scale_label(g)}: ")
                           for g in groups), "\n"))


# The columns of each table, by priority at a narrow terminal (terminal_tables): what identifies a row
# and says the verdict first, the figures next; what is repeated in words below the tables last
# (the size per family and dtype has its own lines, a cut message follows in full).
VERDICT_COLUMNS = (
    Column("run", "number", 0), Column("commit", "name", 2, min_width=12), Column("environment", "text", 5),
    Column("status", "text", 6), Column("verdict", "text", 1, min_width=9, markup=True),
    Column("compared with", "text", 7), Column("changed\ncases", "number", 4), Column("first\nstep", "number", 4),
    Column("max |Δ| (per family,\ndtype)", "number", 8),
    Column("to float64 before → after\n(per family, dtype)", "number", 8),
    Column("summary", "text", 3, min_width=24))


def verdict_table(runs: list[dict], *, wide: bool = False) -> FittedTable:
    table = FittedTable("optdrift verdict", VERDICT_COLUMNS, wide=wide)
    for run in runs:
        verdict = run.get("verdict") or {}
        outcome = verdict.get("outcome", "-")
        style = "red" if verdict.get("flagged") else ("green" if outcome == outcomes.UNCHANGED else "")
        largest_diff, distance = size_figures(_figures(run).scales)
        text = verdict.get("summary") or run.get("error") or ""
        table.add_row(str(run["id"]), run.get("commit_sha") or f"verify vs {run.get('base_sha')}",
                      run["environment"], run["status"], f"[{style}]{outcome}[/]" if style else outcome,
                      compared_with(run), str(verdict.get("changed_cases", "-")),
                      str(verdict.get("first_divergent_step") or "-"),
                      largest_diff, distance,
                      text.splitlines()[0] if text else "")
    return table


CHANGED_COLUMNS = (
    Column("run", "number", 0), Column("case", "name", 0, min_width=22), Column("verdict", "text", 1, min_width=9),
    Column("first\nstep", "number", 4), Column("direction", "text", 5), Column("max |Δ|", "number", 2),
    Column("to float64\nbefore → after", "number", 3), Column("ulp first\n/ peak", "number", 6),
    Column("Δ / baseline's\ndistance", "number", 8), Column("kind", "text", 7, min_width=16),
    Column("message", "text", 9, min_width=24))


def changed_cases_table(runs: list[dict], *, wide: bool = False) -> FittedTable | None:
    rows = [(run["id"], case) for run in runs for case in _cases(run)
            if case["verdict"] in ("changed", "broken", "nondeterministic")]
    if not rows:
        return None
    table = FittedTable("changed cases", CHANGED_COLUMNS, wide=wide)
    # Issue 17: the change relative to the case's own scale, and what kind it is (after the co-run).
    attributions = {(run["id"], a["case_id"]): a for run in runs
                    for a in (run.get("verdict") or {}).get("attribution") or []}
    for run_id, case in rows[:40]:
        diffs = case.get("max_abs_diff_per_step")
        scale = attributions.get((run_id, case["case_id"])) or {}
        # A nondeterministic case's blame (docs/ENGINE.md, Nondeterminism): introduced or pre-existing.
        verdict = case["verdict"] + (f" ({case['nondeterminism']})" if case.get("nondeterminism") else "")
        ulps = (Figure.joined((Figure.of(scale.get("first_step_ulps")), Figure.of(scale.get("peak_ulps"))), " / ")
                if scale else Figure("-", "-"))
        table.add_row(str(run_id), case_name(case["case_id"]), verdict,
                      str(case.get("first_divergent_step") or "-"),
                      REFERENCE_CHANGED if case.get("reference_changed") else case.get("direction") or "-",
                      Figure.of(max(diffs) if diffs else None),
                      Figure.pair(case.get("baseline_peak_ref64_distance"), case.get("commit_peak_ref64_distance")),
                      ulps, Figure.of(scale.get("change_vs_baseline_distance")), scale.get("text") or "-",
                      _clipped(case.get("message"), CELL_CHARS))
    if len(rows) > 40:
        table.caption = f"... and {len(rows) - 40} more"
    return table


NOT_APPLICABLE_COLUMNS = (Column("run", "number", 0), Column("case", "name", 0, min_width=22),
                          Column("reason", "text", 1, min_width=24))


def not_applicable_table(runs: list[dict], *, wide: bool = False) -> FittedTable | None:
    """Cases the adapter cannot run on that device: listed with the reason, never judged."""
    rows = [(run["id"], case) for run in runs for case in _cases(run) if case["verdict"] == "not_applicable"]
    if not rows:
        return None
    table = FittedTable("not applicable on this device (not judged)", NOT_APPLICABLE_COLUMNS, wide=wide)
    for run_id, case in rows[:40]:
        table.add_row(str(run_id), case_name(case["case_id"]), _clipped(case.get("message"), CELL_CHARS))
    if len(rows) > 40:
        table.caption = f"... and {len(rows) - 40} more"
    return table


def _clipped(text: str | None, limit: int) -> str:
    """A table cell: the first line, at most `limit` characters; `…` says the details below have it whole."""
    text = text or ""
    first = text.splitlines()[0] if text else ""
    if len(first) > limit:
        return first[:limit - 1] + "…"
    return first if first == text else first + " …"


def full_messages(runs: list[dict], *, every: bool = False) -> list[str]:
    """Every message a table cut short, whole: a run's error (a build log's tail, an adapter's
    import error with its file and line), and each distinct case message (broken, not applicable,
    nondeterministic) once — with its case name, or the number of cases that share it (a kernel host
    whose adapter cannot be imported breaks every case with the same message). `every`: each case
    message, cut or not (a narrow terminal's table left its message column out)."""
    lines: list[str] = []
    for run in runs:
        error = run.get("error") or ""
        if error and _clipped(error, CELL_CHARS) != error:
            lines.append(f"run {run['id']} ({run['status']}): {error}")
        shared: dict[tuple[str, str], list[str]] = {}
        for case in _cases(run):
            message = case.get("message") or ""
            if message and (every or _clipped(message, CELL_CHARS) != message):
                shared.setdefault((case["verdict"].replace("_", " "), message), []).append(case_name(case["case_id"]))
        for (verdict, message), case_ids in shared.items():
            which = case_ids[0] if len(case_ids) == 1 else f"{len(case_ids)} cases"
            lines.append(f"run {run['id']}: {verdict} ({which}): {message}")
    return lines


def corun_finding_lines(run: dict) -> list[str]:
    """How the run's co-run ended when it stored no per-step diffs (worker/jobs/corun.py): each case
    whose re-run did not reproduce its stored trajectory, with the side, the first differing step
    and both digests there (the run's nondeterminism finding); or why it gave up."""
    finding = _detail(run).get("corun") or {}
    if finding.get("state") == "given_up":
        return [f"run {run['id']}: no co-run detail will come: {finding.get('reason') or 'the co-run gave up'}"]
    if finding.get("state") != "not_reproducible":
        return []
    lines = [f"run {run['id']}: nondeterministic: the co-run re-ran {finding.get('not_reproduced', 0)} case(s) "
             "and did not reproduce their stored trajectories (no per-step |commit − baseline| comes for them)"]
    for case_id, sides in (finding.get("cases") or {}).items():
        for side, item in sides.items():
            lines.append(f"  {case_id} ({side}): from step {item.get('first_differing_step')}, stored "
                         f"{str(item.get('stored_digest'))[:16]} vs re-run {str(item.get('rerun_digest'))[:16]}"
                         + (f" (re-run {item['rerun_status']})" if item.get("rerun_status") not in (None, "ok") else ""))
    return lines


def print_report(console: Console, runs: list[dict], *, wide: bool = False) -> None:
    """The tables fit the console's width (service/core/terminal_tables.py); `wide`: every column, as wide
    as they need."""
    print_table(console, verdict_table(runs, wide=wide))
    for line in baseline_lines(runs):  # issue 44: what each verdict compared with, or why nothing
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    changed = changed_cases_table(runs, wide=wide)
    for table in (changed, not_applicable_table(runs, wide=wide)):
        print_table(console, table)
    # A narrow terminal's changed-cases table may leave its message column out: the messages follow.
    messages_left_out = changed is not None and "message" not in changed.shown_headers(console.width)
    for run in runs:  # issue 17: what kind of change it is (after the baseline co-run)
        line = (run.get("verdict") or {}).get("attribution_summary")
        if line:
            console.print(f"run {run['id']}: {line}", markup=False, highlight=False, soft_wrap=True)
    for run in runs:  # issue 34: how large, in each family and dtype's own scale
        for line in size_lines(run):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    for run in runs:  # issue 44: the co-run's re-run did not reproduce a stored trajectory
        for line in corun_finding_lines(run):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    for run in runs:  # issue 36: cases whose references moved under them (torch, torch.optim)
        if _figures(run).reference_changed:
            console.print(f"run {run['id']}: {reference_changed_sentence(_figures(run))}", markup=False,
                          highlight=False, soft_wrap=True)
    details = full_messages(runs, every=messages_left_out)
    if details:
        console.print("details (in full):", highlight=False)
        for line in details:  # plain text, not wrapped into a cell: a log keeps it greppable
            console.print(line, markup=False, highlight=False, soft_wrap=True)


def _elapsed(seconds: float) -> str:
    whole = int(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


class ProgressLines:
    """Progress for a log: `run 7: running the battery, 12/40 cases, elapsed 0:01:05`, printed
    when a run's phase changes and at most every LINE_INTERVAL_S otherwise."""

    def __init__(self, write: Callable[[str], None], *, interval_s: float = LINE_INTERVAL_S,
                 prefix: str = ""):
        self.write, self.interval_s, self.prefix = write, interval_s, prefix
        self.started = time.monotonic()
        self.last: dict[int, tuple[str, float, int]] = {}

    def update(self, runs: list[dict]) -> None:
        now = time.monotonic()
        for run in runs:
            phase, done = run_phase(run), run["progress"]["cases_done"]
            previous = self.last.get(run["id"])
            if previous is not None:
                same_phase, quiet = previous[0] == phase, now - previous[1] < self.interval_s
                if same_phase and (quiet or previous[2] == done):
                    continue
            self.last[run["id"]] = (phase, now, done)
            total = run["progress"]["cases_total"]
            cases = f", {done}/{total} cases" if total else ""
            self.write(f"{self.prefix}run {run['id']}: {phase}{cases}, elapsed {_elapsed(now - self.started)}")


def wait_with_progress(client, run_ids: list[int], console: Console) -> list[dict]:  # noqa: ANN001
    """Poll the runs until final: a live bar at a terminal, progress lines in a log."""
    if not console.is_terminal:
        lines = ProgressLines(lambda text: console.print(text, highlight=False, soft_wrap=True))
        return client.wait(run_ids, on_update=lines.update)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        tasks = {run_id: progress.add_task(f"run {run_id}", total=None) for run_id in run_ids}

        def update(current: list[dict]) -> None:
            for run in current:
                progress.update(tasks[run["id"]], completed=run["progress"]["cases_done"],
                                total=run["progress"]["cases_total"],
                                description=f"run {run['id']} {run_phase(run)}")

        return client.wait(run_ids, on_update=update)


def detail_phase(run: dict) -> str | None:
    """What a run's co-run detail waits for, in words, or None when it is complete or none comes."""
    from service.cli.client import corun_detail

    state = corun_detail(run)
    if state is None or state.complete:
        return None
    if state.with_diffs < state.changed:
        return (f"waiting for the co-run's per-step |commit − baseline| "
                f"({state.with_diffs} of {state.changed} cases)")
    return f"waiting for the attribution (ulp, kind) of {state.changed} changed cases"


def wait_for_detail_with_progress(client, runs: list[dict], console: Console,  # noqa: ANN001
                                  *, timeout_s: float) -> tuple[list[dict], list[int]]:
    """After the verdicts, wait for the flagged runs' co-run detail (max |Δ|, ulp, kind), showing
    what it waits for: a live bar at a terminal, a line per change in a log. Returns the runs and
    the ids whose detail is still coming after `timeout_s`."""
    waiting = {run["id"]: phase for run in runs if (phase := detail_phase(run))}
    if not waiting:
        return runs, []
    if not console.is_terminal:
        said: dict[int, str] = {}

        def lines(current: list[dict]) -> None:
            for run in current:
                phase = detail_phase(run)
                if phase and said.get(run["id"]) != phase:
                    said[run["id"]] = phase
                    console.print(f"run {run['id']}: {phase}", highlight=False, soft_wrap=True)

        lines(runs)
        return client.wait_for_detail(runs, on_update=lines, timeout_s=timeout_s)
    from service.cli.client import corun_detail

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        tasks = {}
        for run in runs:
            if run["id"] in waiting:
                state = corun_detail(run)
                tasks[run["id"]] = progress.add_task(f"run {run['id']} {waiting[run['id']]}",
                                                     total=state.changed, completed=state.with_diffs)

        def update(current: list[dict]) -> None:
            for run in current:
                if run["id"] in tasks:
                    state = corun_detail(run)
                    progress.update(tasks[run["id"]], completed=state.with_diffs,
                                    description=f"run {run['id']} {detail_phase(run) or 'detail complete'}")

        return client.wait_for_detail(runs, on_update=update, timeout_s=timeout_s)


def detail_still_coming(run: dict, *, timeout_s: float, dashboard_url: str) -> str:
    """The message for a run whose co-run detail did not arrive within the bound."""
    from service.cli.client import corun_detail

    state = corun_detail(run)
    got = (f"{state.with_diffs} of {state.changed} changed cases have their per-step |commit − baseline|"
           + ("" if state.with_diffs < state.changed else ", the attribution (ulp, kind) is not stored yet"))
    return (f"run {run['id']}: the co-run detail is still coming after {timeout_s:g} s ({got}; a co-run "
            f"waits behind the runs queued for {run['environment']}). The verdict above stands; max |Δ|, "
            f"ulp and kind fill in on {dashboard_url} and in GET /api/v1/runs/{run['id']}. "
            "Wait longer with --detail-timeout SECONDS, or skip this wait with --no-detail.")


def json_report(runs: list[dict], exit_code: int, **extra: Any) -> str:  # noqa: ANN401
    """One JSON document on stdout for `--format json`: the final runs (as the API gives them,
    verdicts with every case) and the exit code the command ends with."""
    return json.dumps({"exit_code": exit_code, **extra, "runs": runs}, indent=2, default=str)
