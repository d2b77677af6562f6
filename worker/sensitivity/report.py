"""The tables `optdrift sensitivity` prints: the detection matrix (mutant x battery group), the
catch rate per class, the false positives, and the escaped mutants with the cheapest case of a
larger battery that catches each."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from worker.sensitivity.results import MutantOutcome, SensitivityReport

_STATUS_STYLE = {"caught": "green", "clean": "green", "escaped": "bold red", "flagged": "bold red",
                 "build_failed": "bold red", "not_applicable": "dim"}


def _cell(count: int) -> str:
    return str(count) if count else "·"


def print_matrix(report: SensitivityReport, console: Console) -> None:
    """One row per mutant, one column per battery group: how many of the group's cases caught it."""
    table = Table(title=f"detection matrix: battery {report.battery} v{report.battery_version} "
                        f"({report.case_count} cases) on {report.device}", show_lines=False)
    table.add_column("mutant", overflow="fold")
    table.add_column("status")
    for index in range(len(report.groups)):
        table.add_column(f"g{index + 1}", justify="right")
    table.add_column("first step", justify="right")
    for mutant in report.mutants:
        style = _STATUS_STYLE[mutant.status]
        steps = [c.first_divergent_step for c in mutant.catches if c.first_divergent_step]
        groups = mutant.group_catches or [0] * len(report.groups)
        table.add_row(mutant.id, f"[{style}]{mutant.status}[/]", *(_cell(n) for n in groups),
                      str(min(steps)) if steps else "")
    console.print(table)
    legend = Table(title="battery groups", show_header=False, box=None)
    for label in report.groups:
        legend.add_row(label)
    console.print(legend)


def print_catch_rates(report: SensitivityReport, console: Console) -> None:
    table = Table(title="catch rate per class")
    for column in ("class", "caught", "judged", "rate"):
        table.add_column(column, justify="left" if column == "class" else "right")
    for name, (caught, judged) in report.catch_rates().items():
        table.add_row(name, str(caught), str(judged), f"{caught / judged:.0%}")
    caught, judged = report.catch_rate()
    if judged:
        table.add_row("[bold]all defects[/]", str(caught), str(judged), f"[bold]{caught / judged:.1%}[/]")
    console.print(table)


def _list(title: str, mutants: list[MutantOutcome], console: Console, *, cheapest: bool = False) -> None:
    if not mutants:
        console.print(f"{title}: none")
        return
    table = Table(title=title)
    table.add_column("mutant", overflow="fold")
    table.add_column("expect" if not cheapest else "cheapest catching case", overflow="fold")
    for mutant in mutants:
        if not cheapest:
            detail = f"{mutant.expect}; flagged by {', '.join(c.case_id for c in mutant.catches[:3])}"
        elif mutant.cheapest_catch:
            found = mutant.cheapest_catch
            detail = (f"{found.case_id} ({found.battery}, {found.cost} elements x steps, {found.verdict} "
                      f"from step {found.first_divergent_step}; {found.cases_tried} cases tried)")
        else:
            detail = "no case of the fallback battery catches it (or no fallback battery was searched)"
        table.add_row(mutant.id, detail)
    console.print(table)


def print_attribution(report: SensitivityReport, console: Console) -> None:
    """Per attributed defect: what the catalogue expects the attribution to call it, what it called
    the sampled changed cases, and whether the most common call is the expected one."""
    attributed = [m for m in report.judged("defect") if m.attributed]
    if not attributed:
        return
    table = Table(title="attribution of the caught defects (a sample of each one's changed cases)")
    for column in ("mutant", "expected", "called (cases)", "right", "s"):
        table.add_column(column, overflow="fold", justify="right" if column == "s" else "left")
    for mutant in attributed:
        expected, call = mutant.attribution_expected, mutant.attribution_call()
        calls = ", ".join(f"{name} {count}" for name, count in mutant.attribution.items()) or \
            (f"error: {mutant.attribution_error}" if mutant.attribution_error else "no changed case to attribute")
        if expected in (None, "none") or call is None:
            right = "·"
        else:
            right = "[green]yes[/]" if call == expected else "[bold red]no[/]"
        table.add_row(mutant.id, expected or "(not stated)", calls, right, f"{mutant.attribution_s:.1f}")
    console.print(table)
    for group, (right, total) in report.attribution_scores().items():
        if total:
            what = {"variant": "defects with an expected variant, that variant named",
                    "rounding-level": "defects expected rounding-level, called rounding-level",
                    "quantization": "defects expected quantization, called quantization"}[group]
            console.print(f"{what}: {right} of {total} ({right / total:.0%})", highlight=False)


def print_report(report: SensitivityReport, console: Console) -> None:
    print_matrix(report, console)
    print_catch_rates(report, console)
    print_attribution(report, console)
    _list("false positives (refactors flagged)", report.false_positives(), console)
    _list("escaped (no case of the battery catches them)", report.escaped(), console, cheapest=True)
    failed = [m for m in report.mutants if m.status == "build_failed"]
    for mutant in failed:
        console.print(f"[bold red]{mutant.id} does not build[/]: {(mutant.error or '').strip()[-500:]}", markup=True)
    not_applicable = sum(m.status == "not_applicable" for m in report.mutants)
    clean = sum(m.status == "clean" for m in report.mutants)
    caught, judged = report.catch_rate()
    console.print(f"{caught} of {judged} defects caught, {clean} of {len(report.judged('refactor'))} refactors "
                  f"bit-identical, {not_applicable} not applicable on {report.device} ({report.wall_s:.0f} s)",
                  highlight=False)


def exit_code(report: SensitivityReport) -> int:
    """0 every defect caught and no refactor flagged; 1 otherwise; 3 a mutant that does not build."""
    if any(m.status == "build_failed" for m in report.mutants):
        return 3
    return 1 if report.escaped() or report.false_positives() else 0
