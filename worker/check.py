"""`optdrift check`: build a source tree (and a baseline), run a battery, print the verdict.

Exit codes: 0 unchanged or no-baseline, 1 changed or broken, 2 bad input (a missing folder, an
unknown or invalid battery, a baseline that does not build).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from service.results import RunComparison, RunResult
from service.verdicts import compare_runs

EXIT_OK, EXIT_FLAGGED, EXIT_BAD_INPUT = 0, 1, 2


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.3e}"


def print_verdict(comparison: RunComparison, console: Console, *, show_unchanged: bool = False) -> None:
    """The verdict table (changed and broken cases first) and the summary."""
    table = Table(title=f"optdrift verdict: {comparison.verdict}", show_lines=False)
    for column in ("case", "verdict", "first step", "max |commit-base|", "ref64 commit", "ref64 base", "direction"):
        table.add_column(column, overflow="fold")
    order = {"broken": 0, "changed": 1, "new": 2, "unchanged": 3}
    shown = 0
    for case in sorted(comparison.cases, key=lambda c: (order[c.verdict], c.case_id)):
        if case.verdict == "unchanged" and not show_unchanged:
            continue
        largest = max(case.max_abs_diff_per_step) if case.max_abs_diff_per_step else None
        detail = case.direction or ((case.message or "").splitlines()[0] if case.message else "")
        table.add_row(case.case_id, case.verdict, str(case.first_divergent_step or ""), _fmt(largest),
                      _fmt(case.commit_final_ref64_distance), _fmt(case.baseline_final_ref64_distance), detail)
        shown += 1
    if shown:
        console.print(table)
    hidden = len(comparison.cases) - shown
    if hidden:
        console.print(f"({hidden} unchanged cases not shown)")
    console.print(comparison.summary)


def exit_code(comparison: RunComparison) -> int:
    return EXIT_FLAGGED if comparison.verdict in ("changed", "broken") else EXIT_OK


def run_check(source: Path, baseline: Path | None, battery: str = "quick", *, device: str = "auto",
              cache_dir: Path | None = None, case_timeout_s: float = 300.0, json_out: Path | None = None,
              show_unchanged: bool = False, console: Console | None = None) -> int:
    if console is None:
        console = Console()
        if not console.is_terminal:  # CI logs: keep case ids on one line instead of 80 columns
            console = Console(width=220)

    def error(message: str) -> None:  # plain, unwrapped: one line stays one line
        print(f"error: {message}", file=sys.stderr)

    for label, folder in (("--source", source), ("--baseline", baseline)):
        if folder is not None and not Path(folder).is_dir():
            error(f"{label} {folder} is not a folder; pass the kernel source directory (e.g. csrc)")
            return EXIT_BAD_INPUT

    from worker.battery import load_battery
    from worker.build import build_extension
    from worker.engine import corun_battery, run_battery

    try:
        spec = load_battery(battery)
    except (ValueError, ValidationError) as problem:
        error(f"battery {battery}: {problem}")
        return EXIT_BAD_INPUT
    cases = spec.expand()

    started = time.monotonic()
    commit_build = build_extension(Path(source), cache_dir=cache_dir)
    baseline_build = build_extension(Path(baseline), cache_dir=cache_dir) if baseline is not None else None
    if baseline_build is not None and not baseline_build.ok:
        error(f"--baseline {baseline} does not build:\n{baseline_build.error}")
        return EXIT_BAD_INPUT
    console.print(f"built {source} ({'cached' if commit_build.cached else f'{commit_build.duration_s:.1f} s'})"
                  + (f" and {baseline}" if baseline_build else "")
                  + f"; running battery {spec.name} v{spec.version} ({len(cases)} cases)", highlight=False)

    def progress(done: int, total: int, result) -> None:
        if result.status == "broken":
            console.print(f"  [{done}/{total}] {result.case.case_id}: broken: {result.message}",
                          markup=False, highlight=False)

    baseline_run, diffs = None, {}
    if not commit_build.ok:
        commit_run = RunResult(battery_name=spec.name, battery_version=spec.version, battery_digest=spec.digest,
                               build_digest=commit_build.digest, build_ok=False, build_error=commit_build.error)
    elif baseline_build is None:
        commit_run = run_battery(spec, commit_build.library_path, build_digest=commit_build.digest, device=device,
                                 case_timeout_s=case_timeout_s, cases=cases, progress=progress)
    else:
        commit_run, baseline_run, diffs = corun_battery(
            spec, commit_build.library_path, baseline_build.library_path, commit_digest=commit_build.digest,
            baseline_digest=baseline_build.digest, device=device, case_timeout_s=case_timeout_s, cases=cases,
            progress=progress)
    comparison = compare_runs(commit_run, baseline_run, diffs)
    print_verdict(comparison, console, show_unchanged=show_unchanged)
    console.print(f"({time.monotonic() - started:.1f} s)", highlight=False)
    if json_out is not None:
        payload = {"commit": commit_run.model_dump(mode="json"),
                   "baseline": baseline_run.model_dump(mode="json") if baseline_run else None,
                   "comparison": comparison.model_dump(mode="json")}
        import json

        Path(json_out).write_text(json.dumps(payload))
    return exit_code(comparison)


if __name__ == "__main__":  # python -m worker.check SOURCE [BASELINE]
    sys.exit(run_check(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None))
