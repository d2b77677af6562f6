"""`optdrift check`: the service's pipeline (worker/pipeline.py) on a tree and a baseline tree,
without a server: the same configuration (optdrift.toml, any build kind, any adapter), battery,
engine, repeats and verdict the service gives.

Exit codes (as the CLI's): 0 unchanged or no baseline, 1 changed, 2 bad input (a missing folder,
an invalid optdrift.toml or battery, a baseline that does not build), 3 broken, 5 nondeterministic (a
case this commit made nondeterministic, or one not blamed; one nondeterministic in the baseline
too is shown, not judged: docs/ENGINE.md, Nondeterminism), 8 not buildable here (the tree, or the
baseline, refuses this machine's CUDA, compiler or torch in its build files: worker/build/refusal.py;
"warning: not buildable in <environment>: <its line>" on stderr, nothing checked).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console

from service.core.terminal_tables import Column, Figure, FittedTable, print_table
from service.core.case_names import case_name
from service.core import outcomes
from service.core.outcomes import (  # noqa: F401  (the names this command's callers use)
    EXIT_BROKEN, EXIT_CHANGED, EXIT_NONDETERMINISTIC, EXIT_NOT_BUILDABLE, EXIT_OK,
    EXIT_OPTDRIFT_ERROR as EXIT_ERROR, EXIT_USAGE as EXIT_BAD_INPUT,
)
from service.core.results import RunComparison

# `check` has no submission to allow a missing baseline with: a tree checked without one exits 0.
EXIT_BY_VERDICT = {name: outcomes.exit_code(name, no_baseline_allowed=True) for name in outcomes.NAMES}


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
    `build_change`: what differs between the two trees' builds (build_change_of_jobs), named beside
    it as a service verdict names it."""
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


def build_change_of_jobs(job, base_job) -> dict | None:  # noqa: ANN001
    """What differs between the two trees' build flags and defines (optdrift.toml's build.cflags,
    cuda_cflags, defines), as a service run records them (worker/jobs/run.py: a torch-extension
    build's); both are built here, by one toolchain."""
    from service.core.environment_attribution import build_change_of_runs

    def recorded(config) -> dict:  # noqa: ANN001
        build = config.build
        if build.kind != "torch-extension":
            return {}
        return {"build_flags": {"cflags": build.cflags, "cuda_cflags": build.cuda_cflags, "defines": build.defines}}

    return build_change_of_runs(recorded(job.config), recorded(base_job.config))


def progress_line(text: str) -> None:
    """A phase starting, on stderr (the verdict table stays alone on stdout)."""
    print(f"  {text}", file=sys.stderr, flush=True)


class Phases:
    """Wall seconds per phase of a check, said at its end: where a long check's time went."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - began)

    def line(self) -> str:
        total = time.monotonic() - self.started
        parts = ", ".join(f"{name} {seconds:.1f} s ({100 * seconds / total:.0f}%)"
                          for name, seconds in self.seconds.items() if total > 0)
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


def exit_code(comparison: RunComparison) -> int:
    return EXIT_BY_VERDICT.get(comparison.verdict, EXIT_ERROR)


def run_check(source: Path, baseline: Path | None, battery: str | None = None, *, device: str = "auto",
              cache_dir: Path | None = None, case_timeout_s: float = 300.0, json_out: Path | None = None,
              show_unchanged: bool = False, console: Console | None = None, attribute: bool = True,
              wide: bool = False) -> int:
    """`battery`: None runs the tree's own (optdrift.toml, else quick), as the service does.
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
            return EXIT_BAD_INPUT

    from service.core.project_config import ProjectConfigError, load_project_config
    from worker import pipeline
    from worker.battery import BatteryError

    try:
        job = pipeline.prepare(Path(source), requested_battery=battery, local_battery_file=True)
        base_job = None
        if baseline is not None:
            # The baseline runs the commit's battery: the same cases, compared case by case.
            base_job = pipeline.Job(source_dir=Path(baseline), config=load_project_config(Path(baseline)),
                                    battery=job.battery, battery_origin=job.battery_origin, cases=job.cases)
    except (ProjectConfigError, BatteryError) as problem:
        error(str(problem))
        return EXIT_BAD_INPUT
    from service.settings import get_settings
    from worker.build import default_cache_dir

    # References computed once (worker.engine.reference_cache): beside the builds, the user's own trees.
    # Compiled code too (worker.engine.compile_cache), within OPTDRIFT_COMPILE_CACHE_MAX_BYTES.
    policy = pipeline.Policy(device=device, cache_dir=cache_dir, cuda_archs=[] if device == "cpu" else None,
                             case_timeout_s=case_timeout_s,
                             reference_cache=Path(cache_dir or default_cache_dir()) / "references",
                             compile_cache_max_bytes=get_settings().compile_cache_max_bytes)

    from worker.engine import host_reserve

    # Both kernel hosts start now (torch's import, the device's context), beside the builds and
    # then the baseline's battery, instead of each when its battery starts: on 2 cores a host's
    # start is over a second of a few-second check. Only where hosts are boxed (bubblewrap): a
    # host waiting beside a run's code must be out of that code's reach (host_reserve).
    started = time.monotonic()
    spares = host_reserve.spares(2 if base_job is not None else 1, device=device) \
        if host_reserve.start_beside_runs() else []
    try:
        return _build_and_compare(job, base_job, source, baseline, policy, spares, console, error, started,
                                  device=device, case_timeout_s=case_timeout_s, json_out=json_out,
                                  show_unchanged=show_unchanged, attribute=attribute, wide=wide)
    finally:
        for spare in spares:  # those a run did not take (a baseline that does not build...)
            if spare is not None:
                spare.close()


def _build_and_compare(job, base_job, source: Path, baseline: Path | None, policy, spares: list,  # noqa: ANN001
                       console: Console, error, started: float, *, device: str, case_timeout_s: float,  # noqa: ANN001
                       json_out: Path | None, show_unchanged: bool, attribute: bool, wide: bool = False) -> int:
    from worker import pipeline

    with announced_build(str(source)):
        commit_build = pipeline.build(job, policy)
    baseline_build = None
    if base_job is not None:
        with announced_build(f"--baseline {baseline}"):
            baseline_build = pipeline.build(base_job, policy)
    refused = _refused_toolchain([(str(source), commit_build), (f"--baseline {baseline}", baseline_build)], device)
    if refused:
        for line in refused:
            print(f"warning: {line}", file=sys.stderr)
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        if json_out is not None:
            import json

            Path(json_out).write_text(json.dumps({"not_buildable": refused, "commit": None, "baseline": None,
                                                  "comparison": None}))
        return EXIT_NOT_BUILDABLE
    if baseline_build is not None and not baseline_build.ok:
        error(f"--baseline {baseline} does not build:\n{baseline_build.error}")
        return EXIT_BAD_INPUT
    console.print(f"built {source} ({'cached' if commit_build.cached else f'{commit_build.duration_s:.1f} s'})"
                  + (f" and {baseline}" if baseline_build else "")
                  + f"; running battery {job.battery.name} v{job.battery.version} from {job.battery_origin} "
                  f"({len(job.cases)} cases)", highlight=False)

    phases = Phases(started)
    phases.add("builds", time.monotonic() - started)

    def broken(result) -> None:  # noqa: ANN001
        if result.status == "broken":
            console.print(f"  {case_name(result.case.case_id)}: broken: {result.message}", markup=False,
                          highlight=False)

    baseline_run = None
    # What each kernel host loaded (the adapter's describe(): library version, path), as a run records it.
    adapters: dict[str, dict[str, str] | None] = {"commit": None, "baseline": None}
    if base_job is not None:
        # a spare handed to a run is the run's to close: taken off `spares` (run_check closes the rest)
        with phases("baseline battery"), CaseProgress("baseline", len(base_job.cases)) as shown:
            base_ran = pipeline.run(base_job, baseline_build, policy, host=spares.pop(0) if spares else None,
                                    on_result=shown.result)
        baseline_run = pipeline.run_result(base_job, baseline_build, base_ran)
        adapters["baseline"] = base_ran.adapter
    if not commit_build.ok:
        commit_run = pipeline.run_result(job, commit_build, None)
    else:
        digests = {r.case.case_id: r.trajectory.digests for r in (baseline_run.cases if baseline_run else [])
                   if r.status == "ok" and r.trajectory is not None}
        with phases("commit battery and repeats"), CaseProgress("commit", len(job.cases), also=broken) as shown:
            commit_ran = pipeline.run(job, commit_build, policy, on_result=shown.result, baseline_digests=digests,
                                      host=spares.pop(0) if spares else None)
        unsteady = [r.case for r in commit_ran.results if r.repeat_check is not None and r.repeat_check.differing]
        if unsteady and baseline_build is not None:
            # Blame (docs/ENGINE.md, Nondeterminism): the baseline's build repeats those cases.
            progress_line(f"blame: {len(unsteady)} nondeterministic cases repeated on the baseline's build")
            with phases("blame"):
                checks = pipeline.blame(base_job, baseline_build, policy, unsteady)
            commit_ran.results = [pipeline.with_baseline_repeats(r, checks.get(r.case.case_id))
                                  for r in commit_ran.results]
        commit_run = pipeline.run_result(job, commit_build, commit_ran)
        adapters["commit"] = commit_ran.adapter
        if commit_ran.adapter:
            # The adapter's own name first, unlabelled ("adapter: bundled; library: ..."), not "adapter: adapter: ...".
            console.print("adapter: " + "; ".join(str(v) if k == "adapter" else f"{k}: {v}"
                                                  for k, v in commit_ran.adapter.items()),
                          markup=False, highlight=False, soft_wrap=True)
    comparison = pipeline.compare(commit_run, baseline_run)
    changed = [c for c in job.cases if c.case_id in {x.case_id for x in comparison.cases if x.verdict == "changed"}]
    attribution: dict = {}
    if changed and baseline_build is not None:
        # The builds' compile caches, as their batteries' hosts had them: the co-run's and the
        # attribution's hosts load what those compiled (worker.engine.compile_cache).
        caches = (pipeline.compile_cache_for(commit_build.digest, policy),
                  pipeline.compile_cache_for(baseline_build.digest, policy))
        try:
            comparison, attribution = _corun_and_attribute(
                job, base_job, commit_build, baseline_build, commit_run, baseline_run, changed, policy, phases,
                caches, device=device, case_timeout_s=case_timeout_s, attribute=attribute)
        finally:
            from worker.engine import compile_cache

            compile_cache.release(*caches)
    print_verdict(comparison, console, show_unchanged=show_unchanged, wide=wide)
    print_attribution(attribution, console, wide=wide,
                      build_change=build_change_of_jobs(job, base_job) if base_job is not None else None)
    console.print(phases.line(), highlight=False, soft_wrap=True)  # one line, for logs that grep it
    if json_out is not None:
        payload = {"commit": commit_run.model_dump(mode="json"),
                   "baseline": baseline_run.model_dump(mode="json") if baseline_run else None,
                   "comparison": comparison.model_dump(mode="json"), "adapter": adapters,
                   "attribution": attribution}
        import json

        Path(json_out).write_text(json.dumps(payload))
    return exit_code(comparison)


def environment_words(device: str) -> str:
    """This machine's build environment, as `check` names it: the device and the torch and CUDA
    versions a tree's build files may refuse."""
    from worker.build.extension import torch_versions

    torch, cuda = torch_versions()
    return f"this environment ({device}: torch {torch}, CUDA {cuda or 'none'})"


def _refused_toolchain(builds: list, device: str) -> list[str]:  # list[tuple[str, BuildResult | None]]
    """'not buildable in <environment>: <the line>' for each failed build whose log refuses the
    toolchain (worker/build/refusal.py), the tree named; [] when none does."""
    from service.core import not_buildable
    from worker.build.refusal import refusal_of

    lines = []
    for label, built in builds:
        if built is not None and (line := refusal_of(built)):
            lines.append(f"{label}: {not_buildable.sentence(environment_words(device), line)}")
    return lines


def _corun_and_attribute(job, base_job, commit_build, baseline_build,  # noqa: ANN001, ANN202
                         commit_run, baseline_run, changed, policy, phases, caches,  # noqa: ANN001
                         *, device: str, case_timeout_s: float, attribute: bool):
    """(the comparison with per-step |commit - baseline| of the changed cases, as the service's
    co-run stores, and their attribution when `attribute`); `caches`: the two builds' compile caches."""
    from worker import pipeline
    from worker.engine.corun import corun_battery

    adapter_paths = (job.adapter_folders, base_job.adapter_folders)
    progress_line(f"co-run: per-step |commit - baseline| of {len(changed)} changed cases, both builds")
    with phases("co-run"):
        _, _, diffs = corun_battery(job.battery, commit_build.library_path, baseline_build.library_path,
                                    device=device, case_timeout_s=case_timeout_s, cases=changed,
                                    adapter=job.config.adapter, params_only=True, fast=policy.fast_engine,
                                    adapter_paths=adapter_paths, compile_caches=caches)
    comparison = pipeline.compare(commit_run, baseline_run, diffs)
    if not attribute:
        return comparison, {}
    from worker.attribution.record import attribute_or_note
    from worker.attribution.selection import DEFAULT_LIMIT

    progress_line(f"attribution: what kind of change, for the {len(changed)} changed cases"
                  if len(changed) <= DEFAULT_LIMIT else
                  f"attribution: what kind of change, for {DEFAULT_LIMIT} of the {len(changed)} changed cases "
                  "(one per optimizer, family, dtype and hyperparameter point in turn)")
    with phases("attribution"):
        attribution = attribute_or_note(comparison, baseline_run, changed, commit_build.library_path,
                                        baseline_build.library_path, device=device,
                                        adapter=job.config.adapter, case_timeout_s=case_timeout_s,
                                        adapter_paths=adapter_paths, compile_caches=caches)
    return comparison, attribution


if __name__ == "__main__":  # python -m worker.check SOURCE [BASELINE]
    sys.exit(run_check(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None))
