"""`optdrift check`'s presentation and exit code: the work (build, run, compare) is worker/check.py's;
this module says what it does as it goes, prints its verdict and attribution tables, writes the
JSON document and decides the exit code (service/cli/main.py registers the command).

Exit codes (the CLI's, service/core/outcomes.py): 0 unchanged or no baseline, 1 changed, 2 bad
input (a missing folder, an invalid optdrift.toml or battery, a baseline that does not build), 3
broken, 5 nondeterministic (a case this commit made nondeterministic, or one not blamed; one
nondeterministic in the baseline too is shown, not judged: docs/ENGINE.md, Nondeterminism), 8 not
buildable here (the tree, or the baseline, refuses this machine's CUDA, compiler or torch in its
build files: worker/build/refusal.py; "warning: not buildable in <environment>: <its line>" on
stderr, nothing checked).

The worker is imported inside the functions: `optdrift` on a client install imports this module's
command without the worker's packages (service/cli/common.py needs_extra).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console

from service.cli.common import (  # noqa: F401  (the names this command's callers use)
    EXIT_BROKEN, EXIT_BY_VERDICT, EXIT_CHANGED, EXIT_NONDETERMINISTIC, EXIT_NOT_BUILDABLE, EXIT_OK,
    EXIT_OPTDRIFT_ERROR, EXIT_USAGE,
)
from service.core.case_names import case_name
from service.core.results import RunComparison
from service.core.terminal_tables import Column, Figure, FittedTable, print_table

VERDICT_COLUMNS = (
    Column("case", "name", 0, min_width=22), Column("verdict", "text", 1, min_width=9),
    Column("first\nstep", "number", 4), Column("max |commit\n- base|", "number", 2),
    Column("ref64\ncommit", "number", 3), Column("ref64\nbase", "number", 3),
    Column("direction", "text", 5, min_width=12))
ATTRIBUTION_COLUMNS = (
    Column("case", "name", 0, min_width=22), Column("ulp first\n/ peak", "number", 1),
    Column("Δ / baseline's\ndistance", "number", 3), Column("kind", "text", 2, min_width=16))


def print_verdict(comparison: RunComparison, console: Console, *, show_unchanged: bool = False,
                  wide: bool = False) -> None:
    """The verdict table (changed and broken cases first) and the summary; fitted to the console's
    width (service/core/terminal_tables.py), every column with `wide`."""
    table = FittedTable(f"optdrift verdict: {comparison.verdict}", VERDICT_COLUMNS, wide=wide)
    order = {"broken": 0, "nondeterministic": 1, "changed": 2, "new": 3, "not_applicable": 4, "unchanged": 5}
    shown = 0
    for case in sorted(comparison.cases, key=lambda c: (order[c.verdict], c.case_id)):
        if case.verdict == "unchanged" and not show_unchanged:
            continue
        largest = max(case.max_abs_diff_per_step) if case.max_abs_diff_per_step else None
        detail = case.direction or ((case.message or "").splitlines()[0] if case.message else "")
        table.add_row(case_name(case.case_id), case.verdict, str(case.first_divergent_step or ""),
                      Figure.of(largest, missing=""), Figure.of(case.commit_final_ref64_distance, missing=""),
                      Figure.of(case.baseline_final_ref64_distance, missing=""), detail)
        shown += 1
    if shown:
        print_table(console, table)
        if "direction" not in table.shown_headers(console.width):
            for case in comparison.cases:  # the column left out at this width holds what a broken case said
                if case.verdict in ("broken", "nondeterministic") and case.message:
                    console.print(f"{case_name(case.case_id)}: {case.verdict}: {case.message.splitlines()[0]}",
                                  markup=False, highlight=False, soft_wrap=True)
        # A changed layout case (several tensors under one optimizer) says which of its tensors
        # changed, from which step, and whether the guard elements between them were written.
        for case in comparison.cases:
            if case.verdict == "changed" and case.tensors and case.message:
                console.print(f"{case_name(case.case_id)}: {case.message}", markup=False, highlight=False,
                              soft_wrap=True)
    hidden = len(comparison.cases) - shown
    if hidden:
        console.print(f"({hidden} unchanged cases not shown)")
    console.print(comparison.summary)


def print_attribution(attribution: dict, console: Console, *, wide: bool = False,
                      build_change: dict | None = None) -> None:
    """What kind of change each changed case is (service/core/attribution_view.py words it, as the
    service's CLI table and run page do): its size in ulps of its own scale, relative to the
    baseline's distance to float64, and rounding-level or which semantic change it looks like.
    `build_change`: what differs between the two trees' builds (worker.check.build_change_of_jobs),
    named beside it as a service verdict names it."""
    from service.core.attribution_view import attribution_error, by_case, headline, order_by_relative_change

    detail = {"attribution": attribution, **({"build_change": build_change} if build_change else {})}
    if attribution_error(detail):
        console.print(f"attribution: not made: {attribution_error(detail)}", markup=False, highlight=False)
        return
    cases = by_case(detail)
    if not cases:
        return
    table = FittedTable("kind of change (changed cases)", ATTRIBUTION_COLUMNS, wide=wide)
    ranked = list(cases.values())
    order_by_relative_change(ranked, detail)  # the largest change relative to the baseline's distance first
    for case in ranked[:40]:
        table.add_row(case_name(case.case_id),
                      Figure.joined((Figure.of(case.first_step_ulps), Figure.of(case.peak_ulps)), " / "),
                      Figure.of(case.change_vs_baseline_distance), case.text)
    if len(ranked) > 40:
        table.caption = f"... and {len(ranked) - 40} more"
    print_table(console, table)
    console.print(headline(detail), markup=False, highlight=False)


def progress_line(text: str) -> None:
    """A phase starting, on stderr (the verdict table stays alone on stdout)."""
    print(f"  {text}", file=sys.stderr, flush=True)


def phases_line(phases) -> str:  # noqa: ANN001 - worker.check.Phases
    """Where the check's time went, one line for logs that grep it: `(12.3 s: builds 1.0 s (8%), ...)`."""
    total = time.monotonic() - phases.started
    parts = ", ".join(f"{name} {seconds:.1f} s ({100 * seconds / total:.0f}%)"
                      for name, seconds in phases.seconds.items() if total > 0)
    return f"({total:.1f} s: {parts})" if parts else f"({total:.1f} s)"


class BuildLines:
    """A build's progress on stderr while it compiles (worker.build.progress: ninja's [n/m], CMake's
    [ 45%], compile lines counted): `building csrc: [12/40] compiling adam.cpp (9 s)`, at most one
    line every EVERY_S seconds (a terminal) or LOG_EVERY_S (a log), and the last step always."""

    EVERY_S, LOG_EVERY_S = 2.0, 5.0

    def __init__(self, label: str) -> None:
        self.label = label
        self.began = time.monotonic()
        self.last_line: float | None = None
        self.every_s = self.EVERY_S if sys.stderr.isatty() else self.LOG_EVERY_S

    def __call__(self, step) -> None:  # noqa: ANN001 - worker.build.progress.BuildStep
        now = time.monotonic()
        last = step.total is not None and step.done == step.total
        if self.last_line is not None and now - self.last_line < self.every_s and not last:
            return
        self.last_line = now
        progress_line(f"building {self.label}: {step.words()} ({now - self.began:.0f} s)")


@contextlib.contextmanager
def announced_build(label: str) -> Iterator[None]:
    """Say the build starts, then its progress while it compiles (nothing more for a cache hit)."""
    from worker.build import progress as build_progress

    progress_line(f"building {label}")
    with build_progress.listening(BuildLines(label)):
        yield


class CaseProgress:
    """Cases answered of one battery run, on stderr: a live bar on a terminal; in a log, a line
    every LOG_EVERY_S seconds (a CI log is not a terminal). Repeats of a case count once."""

    LOG_EVERY_S = 15.0

    def __init__(self, label: str, total: int, *, also: Callable | None = None) -> None:
        self.label, self.total, self.also = label, total, also
        self.done: set[int] = set()
        self.bar = None
        self.began = self.last_line = time.monotonic()

    def __enter__(self) -> "CaseProgress":
        progress_line(f"{self.label} battery: {self.total} cases")  # the phase, said as it starts
        if sys.stderr.isatty():
            from rich.progress import Progress

            self.bar = Progress(console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task(f"{self.label} battery", total=self.total)
        return self

    def result(self, index: int, result) -> None:  # noqa: ANN001
        if self.also is not None:
            self.also(result)
        if index in self.done:
            return
        self.done.add(index)
        if self.bar is not None:
            self.bar.update(self.task, completed=len(self.done))
        elif time.monotonic() - self.last_line >= self.LOG_EVERY_S:
            self.last_line = time.monotonic()
            progress_line(f"{self.label} battery: {len(self.done)} of {self.total} cases "
                          f"({self.last_line - self.began:.0f} s)")

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        if self.bar is not None:
            self.bar.stop()


def _said_events(console: Console, source: Path, baseline: Path | None):  # noqa: ANN202
    """The check's events (worker.check.CheckEvents) said as they happen: progress on stderr, the
    build line, broken cases and the adapter on the console."""
    from worker.check import CheckEvents

    labels = {"commit": str(source), "baseline": f"--baseline {baseline}"}

    class Said(CheckEvents):
        def building(self, which: str):  # noqa: ANN202
            return announced_build(labels[which])

        def built(self, check, commit_build, baseline_build) -> None:  # noqa: ANN001
            job = check.job
            console.print(f"built {source} ({'cached' if commit_build.cached else f'{commit_build.duration_s:.1f} s'})"
                          + (f" and {baseline}" if baseline_build else "")
                          + f"; running battery {job.battery.name} v{job.battery.version} from {job.battery_origin} "
                          f"({len(job.cases)} cases)", highlight=False)

        @contextlib.contextmanager
        def battery(self, which: str, total: int) -> Iterator[Callable]:
            # The commit's broken cases are said as they end, above its verdict table.
            with CaseProgress(which, total, also=broken if which == "commit" else None) as shown:
                yield shown.result

        def blaming(self, count: int) -> None:
            progress_line(f"blame: {count} nondeterministic cases repeated on the baseline's build")

        def adapter(self, described: dict[str, str]) -> None:
            # The adapter's own name first, unlabelled ("adapter: bundled; library: ..."), not "adapter: adapter: ...".
            console.print("adapter: " + "; ".join(str(v) if k == "adapter" else f"{k}: {v}"
                                                  for k, v in described.items()),
                          markup=False, highlight=False, soft_wrap=True)

        def corunning(self, count: int) -> None:
            progress_line(f"co-run: per-step |commit - baseline| of {count} changed cases, both builds")

        def attributing(self, count: int, limit: int) -> None:
            progress_line(f"attribution: what kind of change, for the {count} changed cases" if count <= limit else
                          f"attribution: what kind of change, for {limit} of the {count} changed cases "
                          "(one per optimizer, family, dtype and hyperparameter point in turn)")

    def broken(result) -> None:  # noqa: ANN001
        if result.status == "broken":
            console.print(f"  {case_name(result.case.case_id)}: broken: {result.message}", markup=False,
                          highlight=False)

    return Said()


def exit_code(comparison: RunComparison) -> int:
    return EXIT_BY_VERDICT.get(comparison.verdict, EXIT_OPTDRIFT_ERROR)


def environment_words(device: str) -> str:
    """This machine's build environment, as `check` names it: the device and the torch and CUDA
    versions a tree's build files may refuse."""
    from worker.build.extension import torch_versions

    torch, cuda = torch_versions()
    return f"this environment ({device}: torch {torch}, CUDA {cuda or 'none'})"


def run_check(source: Path, baseline: Path | None, battery: str | None = None, *, device: str = "auto",
              cache_dir: Path | None = None, case_timeout_s: float = 300.0, json_out: Path | None = None,
              show_unchanged: bool = False, console: Console | None = None, attribute: bool = True,
              wide: bool = False) -> int:
    """Check SOURCE against BASELINE (worker/check.py), say it, and return the exit code.
    `battery`: None runs the tree's own (optdrift.toml, else quick), as the service does.
    `attribute`: say what kind of change each changed case is (worker/attribution), as a service
    run's verdict does after its co-run; it re-runs the changed cases on both builds.
    `wide`: every column of the tables, however narrow the terminal (else they fit its width)."""
    if console is None:
        console = Console()
        if not console.is_terminal:  # CI logs: keep case ids on one line instead of 80 columns
            console = Console(width=220)

    def error(message: str) -> None:  # plain, unwrapped: one line stays one line
        print(f"error: {message}", file=sys.stderr)

    from worker.build.cache import deprecated_cache_message

    if cache_dir is None and (deprecation := deprecated_cache_message()) is not None:
        print(f"warning: {deprecation}", file=sys.stderr)  # Python hides a DeprecationWarning from a CLI user
    for label, folder in (("--source", source), ("--baseline", baseline)):
        if folder is not None and not Path(folder).is_dir():
            error(f"{label} {folder} is not a folder; pass the project's tree (with its optdrift.toml, "
                  "or the kernel source folder, e.g. csrc)")
            return EXIT_USAGE

    from worker import check as work

    try:
        prepared = work.prepare(source, baseline, battery, device=device, cache_dir=cache_dir,
                                case_timeout_s=case_timeout_s)
    except work.CheckInputError as problem:
        error(str(problem))
        return EXIT_USAGE
    found = work.run(prepared, _said_events(console, source, baseline), attribute=attribute)
    if isinstance(found, work.NotBuildable):
        from service.core import not_buildable

        labels = {"commit": str(source), "baseline": f"--baseline {baseline}"}
        lines = [f"{labels[which]}: {not_buildable.sentence(environment_words(device), line)}"
                 for which, line in found.refusals]
        for line in lines:
            print(f"warning: {line}", file=sys.stderr)
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        if json_out is not None:
            Path(json_out).write_text(json.dumps({"not_buildable": lines, "commit": None, "baseline": None,
                                                  "comparison": None}))
        return EXIT_NOT_BUILDABLE
    if isinstance(found, work.BaselineDoesNotBuild):
        error(f"--baseline {baseline} does not build:\n{found.error}")
        return EXIT_USAGE
    print_verdict(found.comparison, console, show_unchanged=show_unchanged, wide=wide)
    print_attribution(found.attribution, console, wide=wide, build_change=found.build_change)
    console.print(phases_line(found.phases), highlight=False, soft_wrap=True)  # one line, for logs that grep it
    if json_out is not None:
        payload = {"commit": found.commit_run.model_dump(mode="json"),
                   "baseline": found.baseline_run.model_dump(mode="json") if found.baseline_run else None,
                   "comparison": found.comparison.model_dump(mode="json"), "adapter": found.adapters,
                   "attribution": found.attribution}
        Path(json_out).write_text(json.dumps(payload))
    return exit_code(found.comparison)


if __name__ == "__main__":  # python -m service.cli.check SOURCE [BASELINE]
    sys.exit(run_check(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None))
