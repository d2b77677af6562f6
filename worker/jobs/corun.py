"""The co-run job: the exact per-step |commit − baseline| of a finished run's changed cases.

Digests say *that* a trajectory changed and at which step; the stored float64-reference distances
say whether it moved closer or farther. How far the commit's parameters are from the baseline's at
each step needs both trajectories side by side, which the database does not keep (a parameter
snapshot per step would be gigabytes). So after a run's verdict names changed cases, the worker that
ran it fetches the baseline's source, builds it (usually a cache hit: the baseline ran here too) and
co-runs only the changed cases in two kernel hosts (worker.engine.corun_battery; through the fast
engine's waves, kernels only, when the worker runs the fast engine). The verdict is
then recomputed with those diffs and stored; its outcome cannot change (the same stored
trajectories are compared), only the per-step magnitudes and the summary line are added.

Kernels are deterministic in one environment, so the co-run reproduces both stored trajectories;
if a re-run's digests disagree with the stored ones, the diffs are not trusted and not stored.
"""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import datetime, timezone
from pathlib import Path

from service import run_store
from service.broker.queueing import CORUN_TASK_NAME
from service.core.project_config import load_project_config
from service.core.results import CaseSpec, RunComparison, RunResult
from service.core.verdicts import compare_runs
from service.settings import Settings
from worker import pipeline
from worker.attribution.record import attribute_or_note
from worker.identity import worker_name
from worker.jobs import follow_ups
from worker.jobs.workspace import Workspace

log = logging.getLogger(__name__)


class CorunYielded(RuntimeError):
    """The co-run stopped between cases for runs waiting for this worker (it is queued again)."""


def record_baseline_diffs(*, run_id: int, settings: Settings, between_cases=None) -> int:  # noqa: ANN001
    """Store per-step |commit − baseline| for the changed cases of `run_id`; returns how many.
    `between_cases()` is called before each case (each chunk of cases on the fast engine) and may
    raise CorunYielded to stop. The verdict's detail records where the co-run's time went
    (`corun_phases`, seconds: load, fetch, build, adopt, hosts, kernels, compare; the rest of
    `corun_seconds` is writing the verdict) and how its kernels phase split (`corun_kernels`:
    chunks, each host's busy seconds, the diffs', which overlap; worker.engine.corun)."""
    # The engine is imported by the task's process when a co-run comes, never by the Celery parent.
    from worker.engine import compile_cache, host_reserve
    from worker.engine.corun import corun_battery
    from worker.engine.host import KernelHost

    started, started_at = time.monotonic(), datetime.now(timezone.utc)
    phases = _Phases()
    with phases("load"):
        inputs = run_store.corun_inputs(run_id)
        if inputs is None:
            return 0
        run, baseline, project = inputs.run, inputs.baseline, inputs.project
        changed_ids, commit_result, baseline_result = inputs.changed_ids, inputs.commit_result, inputs.baseline_result
        digests = {"commit": run.source_digest, "baseline": baseline.source_digest}
        untrusted = {"commit": run.kind == "verify", "baseline": baseline.kind == "verify"}

    cases = [c.case for c in commit_result.cases if c.case.case_id in changed_ids]
    stored = {c.case.case_id: c for c in commit_result.cases}
    slot_root = settings.resolved_build_cache_dir / "host-slots"
    # The two kernel hosts import torch and make their contexts (seconds) while the trees
    # are fetched and built: the worker's waiting spare and one more, given their builds after.
    spares = (host_reserve.spares(2, device=settings.worker_device, slot_root=slot_root)
              if settings.resolved_warm_host else [None, None])
    # Each build's compile cache (worker.engine.compile_cache), as its run's host had it: the co-run's
    # and the attribution's hosts load what the run compiled. Held until the hosts are closed.
    caches: dict[str, object] = {}
    try:
        with Workspace(settings, prefix=f"optdrift-diffs-{run_id}-") as workspace:
            sources = {}
            with phases("fetch"):
                for side, digest in digests.items():
                    sources[side] = workspace.fetch(digest, name=side)
            # The same pipeline as the run (worker/pipeline.py): the commit's configuration and battery;
            # the baseline's tree built its own way and run on the commit's cases.
            with phases("build"):
                job = workspace.prepare(sources["commit"], project=project, battery=run.battery)
                jobs = {"commit": job, "baseline": pipeline.Job(
                    source_dir=sources["baseline"], config=load_project_config(sources["baseline"], project),
                    battery=job.battery, battery_origin=job.battery_origin, cases=cases)}
                libraries = {}
                for side, side_job in jobs.items():
                    policy = workspace.policy(untrusted=untrusted[side], environment=run.environment,
                                              case_timeout_s=settings.case_timeout_s)
                    build = workspace.build(side_job, policy)
                    if not build.ok:
                        log.warning("run %s: the %s no longer builds (%s); no per-step diffs", run_id, side,
                                    build.error)
                        return 0
                    libraries[side] = build.library_path
                    caches[side] = pipeline.compile_cache_for(build.digest, policy)
            battery, adapter = job.battery, job.config.adapter
            adapter_paths = (jobs["commit"].adapter_folders, jobs["baseline"].adapter_folders)
            if between_cases:  # a run that came meanwhile gets the spares, still without a build
                between_cases()
            with phases("adopt"):
                hosts = tuple(host_reserve.adopted(spare, libraries[side], device=settings.worker_device,
                                                   adapter=adapter, adapter_paths=paths,
                                                   case_timeout_s=settings.case_timeout_s,
                                                   compile_cache=caches.get(side))
                              for spare, side, paths in zip(spares, ("commit", "baseline"), adapter_paths))
            spares = []  # theirs now: closed below, once the diffs are stored
            timings: dict[str, float] = {}
            try:
                rerun, _, diffs = corun_battery(battery, libraries["commit"], libraries["baseline"],
                                                device=settings.worker_device, cases=cases,
                                                case_timeout_s=settings.case_timeout_s, adapter=adapter,
                                                between_cases=between_cases, params_only=True,
                                                fast=settings.fast_engine, hosts=hosts, timings=timings,
                                                adapter_paths=adapter_paths, close_hosts=False)
                phases.seconds.update(hosts=timings.pop("hosts_s", 0.0), kernels=timings.pop("kernels_s", 0.0))
                for result in rerun.cases:
                    original = stored[result.case.case_id]
                    if result.trajectory is None or original.trajectory is None \
                            or result.trajectory.digests != original.trajectory.digests:
                        log.warning("run %s: the co-run of %s did not reproduce the stored trajectory; "
                                    "diffs not stored", run_id, result.case.case_id)
                        return 0
                comparison = _store(run_id=run_id, commit_result=commit_result, baseline_result=baseline_result,
                                    diffs=diffs, started=started, started_at=started_at, phases=phases,
                                    kernels_split=timings, worker=worker_name())
            finally:
                # After the store, not before: the two CUDA hosts' exits (tearing down a device
                # context each) do not delay the detail.
                closing = time.monotonic()
                KernelHost.close_together(list(hosts))
                log.info("run %s: the co-run's hosts closed in %.2f s", run_id, time.monotonic() - closing)
            if comparison is None:
                return 0
            # Issue 17: rounding-level or semantic, and which variant (worker/attribution), added beside
            # the stored diffs afterwards, so they are served without waiting for it.
            # Inside the sources' folder: a tree's own adapter is imported from it (adapter_path).
            store_attribution(run_id=run_id, comparison=comparison, baseline=baseline_result, cases=cases,
                              libraries=libraries, settings=settings, adapter=adapter,
                              adapter_paths=adapter_paths,
                              compile_caches=(caches.get("commit"), caches.get("baseline")))
            return len(diffs)
    finally:
        # Spares not given a build (the co-run stopped before: a run waits, a tree no longer builds)
        # wait again for that run; then the pool is filled up for the next.
        host_reserve.put_back(spares, device=settings.worker_device)
        if settings.resolved_warm_host:
            host_reserve.replenish(device=settings.worker_device, slot_root=slot_root)
        compile_cache.release(*caches.values())


class _Phases:
    """Seconds per named phase, for the verdict's detail (where a co-run's time went)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):  # noqa: ANN204
        began = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - began


def _store(*, run_id: int, commit_result: RunResult, baseline_result: RunResult, diffs: dict[str, list[float]],
           started: float, started_at: datetime, phases: _Phases, kernels_split: dict[str, float],
           worker: str) -> RunComparison | None:
    """The verdict recomputed with the diffs, stored with the co-run's time; the comparison, or None
    when it would change the stored outcome (it cannot: the same stored results)."""
    with phases("compare"):
        comparison = compare_runs(commit_result, baseline_result, diffs)
    # corun_seconds: the co-run's own time (fetch, builds, kernels), for /metrics' histogram;
    # corun_window: when and on which worker it ran (several workers share a queue: issue 19).
    window = {"worker": worker, "started_at": started_at.isoformat(),
              "finished_at": datetime.now(timezone.utc).isoformat()}
    extra = {"corun_seconds": time.monotonic() - started, "corun_window": window,
             "corun_phases": dict(phases.seconds), "corun_kernels": kernels_split}
    if not run_store.store_corun_diffs(run_id, comparison=comparison, extra=extra):
        return None
    return comparison


def store_attribution(*, run_id: int, comparison: RunComparison, baseline: RunResult, cases: list[CaseSpec],
                      libraries: dict[str, str], settings: Settings, adapter: str,
                      adapter_paths: tuple[list[Path], list[Path]] = ([], []),
                      compile_caches: tuple = (None, None)) -> None:
    """The attribution of `run_id`'s changed cases (worker/attribution/record.py) into its verdict's
    detail, after the co-run stored the diffs; the outcome and every other key stay as they are.
    `compile_caches`: (the commit's, the baseline's) build compile caches for its hosts."""
    attribution = attribute_or_note(comparison, baseline, cases, libraries["commit"], libraries["baseline"],
                                    device=settings.worker_device, adapter=adapter,
                                    case_timeout_s=settings.case_timeout_s, adapter_paths=adapter_paths,
                                    compile_caches=compile_caches)
    run_store.add_attribution(run_id, attribution)


def record_and_tell(run_id: int, settings: Settings) -> str:
    """The co-run task's body: per-step |commit − baseline| for the changed cases. The verdict is
    already stored and stands without them, so a failure here is logged, never raised. Between
    cases the co-run yields to runs waiting for this environment: it stops and is queued again."""
    follow_ups.corun_started(run_id)

    def yield_to_runs() -> None:
        waiting = run_store.queued_count(environment=settings.worker_environment)
        if waiting:
            raise CorunYielded(f"{waiting} run(s) waiting for {settings.worker_environment}")

    try:
        count = record_baseline_diffs(run_id=run_id, settings=settings, between_cases=yield_to_runs)
        if count:
            log.info("run %s: per-step |commit - baseline| stored for %d changed cases", run_id, count)
            run_store.run_changed(run_id, settings=settings)  # the check and PR comment gain max |Δ|
        return "stored"
    except CorunYielded as waiting:
        log.info("run %s: baseline co-run yields (%s); queued again", run_id, waiting)
        follow_ups.send_later(CORUN_TASK_NAME, run_id, environment=run_store.run_facts(run_id).environment,
                              countdown=settings.corun_retry_s)
        return "yielded"
    except Exception:  # noqa: BLE001
        log.exception("run %s: co-running the baseline for per-step diffs failed", run_id)
        return "failed"
