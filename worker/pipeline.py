"""The one job pipeline: prepare -> build -> run -> compare.

Every way of running optdrift goes through it: the run job (worker/jobs/run.py), the baseline
co-run (worker/jobs/corun.py) and `optdrift check` (worker/check.py), so a tree gives the same
verdict whichever way it is run.

    job = prepare(tree, project=..., requested_battery=...)   # optdrift.toml, battery, cases
    build = build(job, policy)                                  # any build kind, digest-cached
    results = run(job, build, policy, baseline_digests=...)    # fast or one-case, repeats
    comparison = compare(commit_run, baseline_run, diffs)

`Policy` is what the operator allows one job: device, engine, time caps, trust. Nothing here
touches the database: callers store what comes back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.core.environments import BuildVariant
from service.core.project_config import ProjectConfig, ProjectConfigError, load_project_config
from service.core.results import CaseResult, CaseSpec, EnvironmentFingerprint, RepeatCheck, RunComparison, RunResult
from service.core.verdicts import compare_runs, first_divergent_step
from service.core.battery_limits import BatteryLimits
from worker.battery import BUILTIN_BATTERIES, BatterySpec, battery_from_file, battery_from_tree, check_within_limits
from worker.build import BuildResult
from worker.engine import reference_cache
from worker.references.digest import case_reference_digests

if TYPE_CHECKING:
    from worker.engine.host import KernelHost

OnResult = Callable[[int, CaseResult], None]


@dataclass(frozen=True)
class Policy:
    """What the operator allows one job (service.settings; worker/jobs/run.py RunBudget for runs)."""

    device: str = "cpu"
    fast_engine: bool = True
    cache_dir: Path | None = None
    cuda_archs: list[str] | None = None  # None: detect; []: a CPU-only build
    # May write to the shared build and compiler caches; an untrusted build is private to its run,
    # deleted when the run's task ends (worker.build.cache.release_builds).
    trusted: bool = True
    max_build_s: float | None = None  # a tree's build.timeout_s may ask for less, never more
    # The run's build variant (service/core/environments.py: another compiler, more flags); None:
    # the worker's own toolchain.
    build_variant: BuildVariant | None = None
    case_timeout_s: float = 600.0
    deadline: float | None = None  # time.monotonic() past which nothing runs
    # Folder of the reference cache (worker.engine.reference_cache; None: none); `trusted` runs write it.
    reference_cache: Path | None = None
    # Take a kernel host started ahead (worker.engine.host_reserve) and start the next one while
    # the run runs: for a long-lived worker; `host_slot_root` holds the spares' build folders (best on
    # the build cache's file system, so a build is hard-linked there, not copied).
    warm_host: bool = False
    host_slot_root: Path | None = None
    # The compile cache's cap (OPTDRIFT_COMPILE_CACHE_MAX_BYTES; None: none): worker.engine.compile_cache.
    compile_cache_max_bytes: int | None = None


@dataclass
class Job:
    source_dir: Path
    config: ProjectConfig
    battery: BatterySpec
    battery_origin: str  # where the battery's name came from, for the run's record
    cases: list[CaseSpec] = field(default_factory=list)

    @property
    def adapter_folders(self) -> list[Path]:
        """The tree's `adapter_path` folders: where its kernel hosts import its own adapter from."""
        return [self.source_dir / folder for folder in self.config.adapter_path]

    def record(self) -> dict[str, Any]:
        """What a run records about its job (environment detail)."""
        return {"battery": self.battery.name, "battery_version": self.battery.version,
                "battery_digest": self.battery.digest, "battery_origin": self.battery_origin,
                "adapter": self.config.adapter, "build_kind": self.config.build.kind}


def prepare(source_dir: Path, *, project: Any | None = None, requested_battery: str | None = None,
            local_battery_file: bool = False, limits: BatteryLimits | None = None) -> Job:
    """The tree's configuration (optdrift.toml over the project's registered fields) and battery.

    Which battery: the one the submission asked for explicitly, else the tree's optdrift.toml,
    else the project's registered default (a submission that names the registered default is
    taken as not naming one: the tree's own battery wins, as docs/PROJECTS.md says). Raises
    ProjectConfigError or BatteryError (the tree's fault) with a message for the submitter.
    `local_battery_file`: the requested battery may also be a file anywhere the caller can read
    (`optdrift check` on its user's own machine; never for a submission). `limits`: the run's
    battery limits (service.core.battery_limits), checked on the file before it is parsed and on
    the battery before it is expanded; a battery past them is a BatteryError and nothing expands."""
    config = load_project_config(source_dir, project)
    root = Path(source_dir).resolve()
    for folder in config.adapter_path:  # shown to the kernel host: a link out would bind a host folder
        if not (root / folder).resolve().is_relative_to(root):
            raise ProjectConfigError(f"adapter_path {folder!r} leads out of the tree (a link); name a folder "
                                     "inside the tree")
    registered_default = getattr(project, "default_battery", None)
    if requested_battery and requested_battery != registered_default:
        name, origin = requested_battery, "the submission"
    elif config.battery != registered_default:
        name, origin = config.battery, "the tree's optdrift.toml"
    else:
        name, origin = config.battery, "the project's default"
    if local_battery_file and origin == "the submission" and Path(name).is_file():
        battery, origin = battery_from_file(Path(name)), f"the file {name}"
    else:
        battery = battery_from_tree(source_dir, name, limits=limits)
    if limits is not None:
        check_within_limits(battery, limits=limits, shown_as=name)
    return Job(source_dir=Path(source_dir), config=config, battery=battery, battery_origin=origin,
               cases=battery.expand())


def build(job: Job, policy: Policy) -> BuildResult:
    """The tree built per its configuration (worker.build.project); never raises for a failed build."""
    from worker.build.project import build_project

    cap = policy.max_build_s
    if policy.deadline is not None:
        left = max(1.0, policy.deadline - time.monotonic())
        cap = left if cap is None else min(cap, left)
    return build_project(job.source_dir, job.config, cache_dir=policy.cache_dir, cuda_archs=policy.cuda_archs,
                         trusted=policy.trusted, max_timeout_s=cap, variant=policy.build_variant)


@dataclass
class Ran:
    results: list[CaseResult]
    environment: EnvironmentFingerprint | None
    adapter: dict[str, str] | None = None  # the adapter's describe() from the kernel host


# Runs in all of a case remembered as nondeterministic (service.run_store.unsteady_case_ids), in
# every run whatever its baseline says, and of a baseline build blamed for a nondeterministic case
# (`blame`): docs/ENGINE.md, Nondeterminism. A race that shows one time in two is missed by 5
# repeats with odds 1/32; a case stops at the first repeat that differs, so a racy kernel costs 2.
UNSTEADY_RUNS = 6


def run(job: Job, built: BuildResult, policy: Policy, *, on_result: OnResult | None = None,
        baseline_digests: dict[str, list[str]] | None = None, cases: list[CaseSpec] | None = None,
        on_pause: Callable[[], None] | None = None, host: KernelHost | None = None,
        unsteady: set[str] | frozenset[str] = frozenset()) -> Ran:
    """Every case on the build in one kernel host (fast engine or one case at a time, per
    `policy`). `host`: one started ahead without a build (worker.engine.host_reserve.spares),
    given this build here in place of the reserve's; one that does not come up is replaced by a
    host started as usual. `on_result(index, result)` as results arrive; a case whose result
    changes later (its repeat check) is reported again. `on_pause()` whenever no further result is ready yet
    (after each burst of results, after each case run one at a time).

    Repeats: a case whose digests differ from `baseline_digests` is run again on the same build
    before it may be reported changed (`job.config.repeats` runs in all, at least 2), and with
    repeats > 1 every case of the run is; a case that does not reproduce itself carries a
    RepeatCheck and reads `nondeterministic`, not `changed`. A case of `unsteady` (remembered as
    nondeterministic for the project) runs UNSTEADY_RUNS times in all, stopping at the first repeat
    that differs, whatever its baseline: a commit run and a verify run of one change judge it alike."""
    from worker.engine import host_reserve

    cases = job.cases if cases is None else cases
    adapter_paths = job.adapter_folders
    load = {"device": policy.device, "adapter": job.config.adapter, "adapter_paths": adapter_paths,
            "case_timeout_s": policy.case_timeout_s, "deadline": policy.deadline,
            "compile_cache": compile_cache_for(built.digest, policy)}
    if host is not None:
        spare = host_reserve.open_host(built.library_path, spare=host, **load)
    else:
        spare = host_reserve.take(built.library_path, **load) if policy.warm_host else None
    if policy.warm_host:  # what the next spares prepare: only a built-in battery's cases (below)
        host_reserve.expect(cases if _builtin_battery(job.battery) else [], device=policy.device)
    if policy.warm_host and host_reserve.start_beside_runs():  # the next ones start while this run runs
        host_reserve.replenish(device=policy.device, slot_root=policy.host_slot_root)
    try:
        return _run_on(spare or host_reserve.open_host(built.library_path, **load),
                       cases, policy, job, on_result, baseline_digests, on_pause, unsteady)
    finally:
        if load["compile_cache"] is not None:  # its host is closed (_run_on): evictable again
            load["compile_cache"].release()
        if policy.warm_host:  # the next (unboxed: only now), or any that died meanwhile
            host_reserve.replenish(device=policy.device, slot_root=policy.host_slot_root)


def compile_cache_for(build_digest: str | None, policy: Policy):  # noqa: ANN201
    """The inductor/Triton cache of the build `build_digest` under the build cache's root, read-only
    to an untrusted run, capped by the policy (worker.engine.compile_cache), held in use until its
    `release()`: every kernel host of that build is given it (a run's, a co-run's, an attribution's,
    a timing's), so a torch.compile-based library compiles once per build."""
    from worker.build.cache import default_cache_dir
    from worker.engine import compile_cache

    return compile_cache.for_build(Path(policy.cache_dir or default_cache_dir()), build_digest,
                                   trusted=policy.trusted, max_bytes=policy.compile_cache_max_bytes)


def _builtin_battery(battery: BatterySpec) -> bool:
    """Whether `battery` is one optdrift ships, unchanged. The next spare kernel host is given the
    cases it will prepare, and that host then runs whichever project's code comes next, which
    can read them: a project's own battery (from its tree, perhaps private) must not reach
    another project's code that way. A built-in battery is public."""
    maker = BUILTIN_BATTERIES.get(battery.name)
    return maker is not None and maker().digest == battery.digest


def _run_on(host, cases: list[CaseSpec], policy: Policy, job: Job, on_result: OnResult | None,  # noqa: ANN001
            baseline_digests: dict[str, list[str]] | None, on_pause: Callable[[], None] | None,
            unsteady: set[str] | frozenset[str] = frozenset()) -> Ran:
    with host:
        if policy.fast_engine:
            results = reference_cache.run_many(host, cases, _cache(policy), on_result=on_result, on_pause=on_pause)
        else:
            results = []
            for index, case in enumerate(cases):
                results.append(host.run(case))
                if on_result:
                    on_result(index, results[-1])
                if on_pause:
                    on_pause()
        _check_repeats(host, cases, results, policy, job.config.repeats, baseline_digests or {}, on_result,
                       unsteady)
        return Ran(results=results, environment=host.environment, adapter=host.adapter_description)


def _cache(policy: Policy):  # noqa: ANN202
    return reference_cache.for_policy(policy.reference_cache, trusted=policy.trusted)


def _needs_repeat(result: CaseResult, repeats: int, baseline_digests: dict[str, list[str]],
                  unsteady: set[str] | frozenset[str] = frozenset()) -> int:
    """How many runs in all `result`'s case gets (1: none again)."""
    if result.status != "ok" or result.trajectory is None:
        return 1
    if result.case.case_id in unsteady:
        return max(UNSTEADY_RUNS, repeats)
    baseline = baseline_digests.get(result.case.case_id)
    if baseline is not None and baseline != result.trajectory.digests:
        return max(2, repeats)
    return repeats


def _check_repeats(host, cases: list[CaseSpec], results: list[CaseResult], policy: Policy,  # noqa: ANN001
                   repeats: int, baseline_digests: dict[str, list[str]], on_result: OnResult | None,
                   unsteady: set[str] | frozenset[str] = frozenset()) -> None:
    wanted = {index: _needs_repeat(result, repeats, baseline_digests, unsteady)
              for index, result in enumerate(results)}
    checks = _repeat(host, cases, results, policy, wanted, stop_early={
        index for index, result in enumerate(results) if result.case.case_id in unsteady})
    for index, check in checks.items():
        results[index] = results[index].model_copy(update={"repeat_check": check})
        if on_result:
            on_result(index, results[index])


def _repeat(host, cases: list[CaseSpec], results: list[CaseResult], policy: Policy,  # noqa: ANN001
            wanted: dict[int, int], stop_early: set[int]) -> dict[int, RepeatCheck]:
    """Case `index` run again until `wanted[index]` runs in all (those of `stop_early` only until
    a repeat differs); each one's RepeatCheck against its first result, `results[index]`."""
    wanted = {index: n for index, n in wanted.items() if n > 1}
    if not wanted:
        return {}
    checks = {index: RepeatCheck(runs=1, differing=0) for index in wanted}
    for round_number in range(1, max(wanted.values())):
        indices = [index for index, n in wanted.items() if n > round_number
                   and not (index in stop_early and checks[index].differing)]
        if not indices:
            break
        subset = [cases[index] for index in indices]
        # The same engine as the first run: the fast and the one-case engine are bit-identical by
        # design, but a repeat must not depend on it.
        again = (reference_cache.run_many(host, subset, _cache(policy)) if policy.fast_engine
                 else [host.run(case) for case in subset])
        for index, result in zip(indices, again):
            first = results[index]
            check = checks[index]
            if result.status != "ok" or result.trajectory is None:
                step = 1
            else:
                step = first_divergent_step(first.trajectory.digests, result.trajectory.digests)
            steps = [s for s in (check.first_divergent_step, step) if s is not None]
            checks[index] = RepeatCheck(runs=check.runs + 1, differing=check.differing + (step is not None),
                                        first_divergent_step=min(steps) if steps else None)
    return checks


def blame(job: Job, built: BuildResult, policy: Policy, cases: list[CaseSpec]) -> dict[str, RepeatCheck]:
    """`cases` (nondeterministic in a commit) run on the BASELINE's build (`job`, `built`) up to
    UNSTEADY_RUNS times each, stopping at the first repeat that differs: case id -> its
    RepeatCheck there. No differing repeat: the commit introduced the nondeterminism."""
    from worker.engine import host_reserve

    with host_reserve.open_host(built.library_path, device=policy.device, case_timeout_s=policy.case_timeout_s,
                                adapter=job.config.adapter, deadline=policy.deadline,
                                adapter_paths=job.adapter_folders) as host:
        first = [host.run(case) for case in cases]
        # A case the baseline cannot run (broken, not applicable there) has nothing to blame.
        runnable = {index for index, result in enumerate(first) if result.status == "ok" and result.trajectory}
        checks = _repeat(host, cases, first, policy, {index: UNSTEADY_RUNS for index in runnable},
                         stop_early=runnable)
    return {cases[index].case_id: check for index, check in checks.items()}


def with_baseline_repeats(result: CaseResult, baseline: RepeatCheck | None) -> CaseResult:
    """`result` with the baseline build's repeats of its case (`blame`) on its RepeatCheck."""
    if baseline is None or result.repeat_check is None:
        return result
    return result.model_copy(update={"repeat_check": result.repeat_check.model_copy(
        update={"baseline_runs": baseline.runs, "baseline_differing": baseline.differing})})


def reference_digests(job: Job, ran: Ran | None) -> dict[str, str]:
    """case id -> digest of its references, from what the kernel host said of them ({}: nothing)."""
    environment = ran.environment if ran else None
    return case_reference_digests(job.cases, environment.references if environment else None)


def run_result(job: Job, built: BuildResult, ran: Ran | None) -> RunResult:
    """The engine's RunResult for comparison (a failed build: no cases)."""
    return RunResult(battery_name=job.battery.name, battery_version=job.battery.version,
                     battery_digest=job.battery.digest, environment=ran.environment if ran else None,
                     build_digest=built.digest, build_ok=built.ok, build_error=built.error,
                     cases=ran.results if ran else [], reference_digests=reference_digests(job, ran))


def compare(commit: RunResult, baseline: RunResult | None, diffs: dict[str, list[float]] | None = None) -> RunComparison:
    return compare_runs(commit, baseline, diffs)
