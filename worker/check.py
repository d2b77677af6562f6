"""The work of `optdrift check`: the service's pipeline (worker/pipeline.py) on a tree and a
baseline tree, without a server: the same configuration (optdrift.toml, any build kind, any
adapter), battery, engine, repeats and verdict the service gives.

It builds, runs and compares, and returns what it found as plain results (NotBuildable,
BaselineDoesNotBuild, Checked); it prints nothing. What it does as it goes reaches the command
through CheckEvents; the command (service/cli/check.py) words all of it and decides the exit code.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from service.core.results import RunComparison, RunResult

Which = Literal["commit", "baseline"]


class CheckInputError(Exception):
    """The tree or its baseline cannot be checked as given (an invalid optdrift.toml or battery):
    the message says why."""


class Phases:
    """Wall seconds per phase of a check, from `started`: where a long check's time went."""

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


class CheckEvents:
    """What a check reports while it works, for the command to say as it happens (a build's
    progress, the batteries' cases, the phases that follow). Each one here does nothing: a caller
    that says nothing passes this class itself."""

    @contextlib.contextmanager
    def building(self, which: Which) -> Iterator[None]:  # noqa: ARG002
        """Around one tree's build."""
        yield

    def built(self, check: "Check", commit_build, baseline_build) -> None:  # noqa: ANN001
        """Both trees built (the commit's may have failed: it is then judged broken); the batteries come next."""

    @contextlib.contextmanager
    def battery(self, which: Which, total: int) -> Iterator[Callable[[int, Any], None]]:  # noqa: ARG002
        """Around one battery run: yields what is called with each case's (index, result) as it ends."""
        yield lambda index, result: None

    def blaming(self, count: int) -> None:
        """`count` nondeterministic cases of the commit are about to be repeated on the baseline's build."""

    def adapter(self, described: dict[str, str]) -> None:
        """What the commit's kernel host loaded (the adapter's describe())."""

    def corunning(self, count: int) -> None:
        """The co-run of the `count` changed cases on both builds starts."""

    def attributing(self, count: int, limit: int) -> None:
        """The attribution of the `count` changed cases starts (of at most `limit` of them)."""


@dataclass
class Check:
    """A tree (and its baseline tree) prepared to be checked: their jobs and the pipeline's policy."""

    job: Any  # worker.pipeline.Job
    base_job: Any | None
    policy: Any  # worker.pipeline.Policy
    device: str
    case_timeout_s: float


@dataclass
class NotBuildable:
    """A tree refuses this machine's toolchain in its build files (worker/build/refusal.py): nothing
    was checked. `refusals`: (which tree, the refusing line of its build log)."""

    refusals: list[tuple[Which, str]]


@dataclass
class BaselineDoesNotBuild:
    """The baseline tree failed to build (not a refusal): there is nothing to compare with."""

    error: str


@dataclass
class Checked:
    """Both batteries ran and were compared (with the co-run and the attribution of changed cases)."""

    comparison: RunComparison
    commit_run: RunResult
    baseline_run: RunResult | None
    # What each kernel host loaded (the adapter's describe(): library version, path), as a run records it.
    adapters: dict[str, dict[str, str] | None]
    attribution: dict
    build_change: dict | None  # what differs between the two trees' builds; None without a baseline
    phases: Phases


def prepare(source: Path, baseline: Path | None, battery: str | None = None, *, device: str = "auto",
            cache_dir: Path | None = None, case_timeout_s: float = 300.0) -> Check:
    """`battery`: None runs the tree's own (optdrift.toml, else quick), as the service does; the
    baseline runs the commit's battery. CheckInputError for an invalid optdrift.toml or battery."""
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
        raise CheckInputError(str(problem)) from problem
    from service.settings import get_settings
    from worker.build import default_cache_dir

    # References computed once (worker.engine.reference_cache): beside the builds, the user's own trees.
    # Compiled code too (worker.engine.compile_cache), within OPTDRIFT_COMPILE_CACHE_MAX_BYTES.
    policy = pipeline.Policy(device=device, cache_dir=cache_dir, cuda_archs=[] if device == "cpu" else None,
                             case_timeout_s=case_timeout_s,
                             reference_cache=Path(cache_dir or default_cache_dir()) / "references",
                             compile_cache_max_bytes=get_settings().compile_cache_max_bytes)
    return Check(job=job, base_job=base_job, policy=policy, device=device, case_timeout_s=case_timeout_s)


def run(check: Check, events: CheckEvents = CheckEvents(), *,
        attribute: bool = True) -> NotBuildable | BaselineDoesNotBuild | Checked:
    """Build both trees, run the batteries, compare; for changed cases the co-run and, with
    `attribute`, what kind of change each one is (worker/attribution), as a service run's verdict
    says after its co-run (it re-runs the changed cases on both builds)."""
    from worker.engine import host_reserve

    # Both kernel hosts start now (torch's import, the device's context), beside the builds and
    # then the baseline's battery, instead of each when its battery starts: on 2 cores a host's
    # start is over a second of a few-second check. Only where hosts are boxed (bubblewrap): a
    # host waiting beside a run's code must be out of that code's reach (host_reserve).
    started = time.monotonic()
    spares = host_reserve.spares(2 if check.base_job is not None else 1, device=check.device) \
        if host_reserve.start_beside_runs() else []
    try:
        return _build_and_compare(check, spares, events, started, attribute=attribute)
    finally:
        for spare in spares:  # those a run did not take (a baseline that does not build...)
            if spare is not None:
                spare.close()


def _build_and_compare(check: Check, spares: list, events: CheckEvents, started: float, *,
                       attribute: bool) -> NotBuildable | BaselineDoesNotBuild | Checked:
    from worker import pipeline
    from worker.build.refusal import refusal_of

    job, base_job, policy = check.job, check.base_job, check.policy
    with events.building("commit"):
        commit_build = pipeline.build(job, policy)
    baseline_build = None
    if base_job is not None:
        with events.building("baseline"):
            baseline_build = pipeline.build(base_job, policy)
    refusals: list[tuple[Which, str]] = [(which, line) for which, built in
                                         (("commit", commit_build), ("baseline", baseline_build))
                                         if built is not None and (line := refusal_of(built))]
    if refusals:
        return NotBuildable(refusals)
    if baseline_build is not None and not baseline_build.ok:
        return BaselineDoesNotBuild(baseline_build.error)
    events.built(check, commit_build, baseline_build)

    phases = Phases(started)
    phases.add("builds", time.monotonic() - started)
    baseline_run = None
    adapters: dict[str, dict[str, str] | None] = {"commit": None, "baseline": None}
    if base_job is not None:
        # a spare handed to a run is the run's to close: taken off `spares` (run closes the rest)
        with phases("baseline battery"), events.battery("baseline", len(base_job.cases)) as on_result:
            base_ran = pipeline.run(base_job, baseline_build, policy, host=spares.pop(0) if spares else None,
                                    on_result=on_result)
        baseline_run = pipeline.run_result(base_job, baseline_build, base_ran)
        adapters["baseline"] = base_ran.adapter
    if not commit_build.ok:
        commit_run = pipeline.run_result(job, commit_build, None)
    else:
        digests = {r.case.case_id: r.trajectory.digests for r in (baseline_run.cases if baseline_run else [])
                   if r.status == "ok" and r.trajectory is not None}
        with phases("commit battery and repeats"), events.battery("commit", len(job.cases)) as on_result:
            commit_ran = pipeline.run(job, commit_build, policy, on_result=on_result, baseline_digests=digests,
                                      host=spares.pop(0) if spares else None)
        unsteady = [r.case for r in commit_ran.results if r.repeat_check is not None and r.repeat_check.differing]
        if unsteady and baseline_build is not None:
            # Blame (docs/ENGINE.md, Nondeterminism): the baseline's build repeats those cases.
            events.blaming(len(unsteady))
            with phases("blame"):
                checks = pipeline.blame(base_job, baseline_build, policy, unsteady)
            commit_ran.results = [pipeline.with_baseline_repeats(r, checks.get(r.case.case_id))
                                  for r in commit_ran.results]
        commit_run = pipeline.run_result(job, commit_build, commit_ran)
        adapters["commit"] = commit_ran.adapter
        if commit_ran.adapter:
            events.adapter(commit_ran.adapter)
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
                check, commit_build, baseline_build, commit_run, baseline_run, changed, phases, caches, events,
                attribute=attribute)
        finally:
            from worker.engine import compile_cache

            compile_cache.release(*caches)
    return Checked(comparison=comparison, commit_run=commit_run, baseline_run=baseline_run, adapters=adapters,
                   attribution=attribution,
                   build_change=build_change_of_jobs(job, base_job) if base_job is not None else None,
                   phases=phases)


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


def _corun_and_attribute(check: Check, commit_build, baseline_build,  # noqa: ANN001, ANN202
                         commit_run, baseline_run, changed, phases: Phases, caches,  # noqa: ANN001
                         events: CheckEvents, *, attribute: bool):
    """(the comparison with per-step |commit - baseline| of the changed cases, as the service's
    co-run stores, and their attribution when `attribute`); `caches`: the two builds' compile caches."""
    from worker import pipeline
    from worker.engine.corun import corun_battery

    job, base_job, device, case_timeout_s = check.job, check.base_job, check.device, check.case_timeout_s
    adapter_paths = (job.adapter_folders, base_job.adapter_folders)
    events.corunning(len(changed))
    with phases("co-run"):
        _, _, diffs = corun_battery(job.battery, commit_build.library_path, baseline_build.library_path,
                                    device=device, case_timeout_s=case_timeout_s, cases=changed,
                                    adapter=job.config.adapter, params_only=True, fast=check.policy.fast_engine,
                                    adapter_paths=adapter_paths, compile_caches=caches)
    comparison = pipeline.compare(commit_run, baseline_run, diffs)
    if not attribute:
        return comparison, {}
    from worker.attribution.record import attribute_or_note
    from worker.attribution.selection import DEFAULT_LIMIT

    events.attributing(len(changed), DEFAULT_LIMIT)
    with phases("attribution"):
        attribution = attribute_or_note(comparison, baseline_run, changed, commit_build.library_path,
                                        baseline_build.library_path, device=device,
                                        adapter=job.config.adapter, case_timeout_s=case_timeout_s,
                                        adapter_paths=adapter_paths, compile_caches=caches)
    return comparison, attribution
