"""The exact per-step |commit − baseline| of a finished run's changed cases.

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
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import select

from service.db.models import DONE, Project, Run, Verdict
from service.db.session import get_sessionmaker
from service.domain import trajectories
from service.core.project_config import load_project_config
from service.domain.storage import archive_limits
from service.settings import Settings
from service.core.verdicts import compare_runs
from worker.attribution.record import store_attribution
from worker.source_fetch import fetch_source

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
    from worker import pipeline
    from worker.engine import host_reserve
    from worker.engine.corun import corun_battery
    from worker.engine.host import KernelHost
    from worker.identity import worker_name

    started, started_at = time.monotonic(), datetime.now(timezone.utc)
    phases = _Phases()
    sessions = get_sessionmaker()
    with phases("load"), sessions() as session:
        run = session.get(Run, run_id)
        verdict = session.scalar(select(Verdict).where(Verdict.run_id == run_id))
        if run is None or verdict is None or verdict.baseline_run_id is None or run.status != DONE:
            return 0
        changed_ids = {case["case_id"] for case in (verdict.detail or {}).get("cases", [])
                       if case.get("verdict") == "changed" and not case.get("max_abs_diff_per_step")}
        if not changed_ids:
            return 0
        baseline = session.get(Run, verdict.baseline_run_id)
        commit_result = trajectories.run_result(session=session, run=run)
        baseline_result = trajectories.run_result(session=session, run=baseline)
        project = session.get(Project, run.project_id)
        digests = {"commit": run.source_digest, "baseline": baseline.source_digest}
        trusted = {"commit": run.kind != "verify", "baseline": baseline.kind != "verify"}

    cases = [c.case for c in commit_result.cases if c.case.case_id in changed_ids]
    stored = {c.case.case_id: c for c in commit_result.cases}
    slot_root = settings.resolved_build_cache_dir / "host-slots"
    # The two kernel hosts import torch and make their contexts (seconds) while the trees
    # are fetched and built: the worker's waiting spare and one more, given their builds after.
    spares = (host_reserve.spares(2, device=settings.worker_device, slot_root=slot_root)
              if settings.resolved_warm_host else [None, None])
    try:
        with tempfile.TemporaryDirectory(prefix=f"optdrift-diffs-{run_id}-") as tmp:
            sources = {}
            with phases("fetch"):
                for side, digest in digests.items():
                    sources[side] = fetch_source(base_url=settings.resolved_public_url, digest=digest,
                                                 dest=Path(tmp) / side, limits=archive_limits(settings),
                                                 max_bytes=settings.max_upload_bytes,
                                                 token=settings.resolved_worker_token())
            # The same pipeline as the run (worker/pipeline.py): the commit's configuration and battery;
            # the baseline's tree built its own way and run on the commit's cases.
            with phases("build"):
                job = pipeline.prepare(sources["commit"], project=project, requested_battery=run.battery)
                jobs = {"commit": job, "baseline": pipeline.Job(
                    source_dir=sources["baseline"], config=load_project_config(sources["baseline"], project),
                    battery=job.battery, battery_origin=job.battery_origin, cases=cases)}
                libraries = {}
                for side, side_job in jobs.items():
                    policy = pipeline.Policy(device=settings.worker_device, fast_engine=settings.fast_engine,
                                             cache_dir=settings.resolved_build_cache_dir,
                                             cuda_archs=[] if settings.worker_device == "cpu" else None,
                                             trusted=trusted[side], max_build_s=settings.max_build_s,
                                             case_timeout_s=settings.case_timeout_s)
                    build = pipeline.build(side_job, policy)
                    if not build.ok:
                        log.warning("run %s: the %s no longer builds (%s); no per-step diffs", run_id, side,
                                    build.error)
                        return 0
                    libraries[side] = build.library_path
            battery, adapter = job.battery, job.config.adapter
            adapter_paths = (jobs["commit"].adapter_folders, jobs["baseline"].adapter_folders)
            if between_cases:  # a run that came meanwhile gets the spares, still without a build
                between_cases()
            with phases("adopt"):
                hosts = tuple(host_reserve.adopted(spare, libraries[side], device=settings.worker_device,
                                                   adapter=adapter, adapter_paths=paths,
                                                   case_timeout_s=settings.case_timeout_s)
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
                              adapter_paths=adapter_paths)
            return len(diffs)
    finally:
        # Spares not given a build (the co-run stopped before: a run waits, a tree no longer builds)
        # wait again for that run; then the pool is filled up for the next.
        host_reserve.put_back(spares, device=settings.worker_device)
        if settings.resolved_warm_host:
            host_reserve.replenish(device=settings.worker_device, slot_root=slot_root)


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


def _store(*, run_id: int, commit_result, baseline_result, diffs: dict[str, list[float]],  # noqa: ANN001
           started: float, started_at: datetime, phases: _Phases, kernels_split: dict[str, float],
           worker: str):  # noqa: ANN202
    """The verdict recomputed with the diffs, stored with the co-run's time; the comparison, or None
    when it would change the stored outcome (it cannot: the same stored results)."""
    with phases("compare"):
        comparison = compare_runs(commit_result, baseline_result, diffs)
    with get_sessionmaker()() as session:
        verdict = session.scalar(select(Verdict).where(Verdict.run_id == run_id))
        if comparison.verdict != verdict.outcome:  # cannot happen: the same stored results
            log.error("run %s: recomputed verdict %s != stored %s; diffs not stored",
                      run_id, comparison.verdict, verdict.outcome)
            return None
        # corun_seconds: the co-run's own time (fetch, builds, kernels), for /metrics' histogram;
        # corun_window: when and on which worker it ran (several workers share a queue: issue 19).
        window = {"worker": worker, "started_at": started_at.isoformat(),
                  "finished_at": datetime.now(timezone.utc).isoformat()}
        verdict.detail = {**comparison.model_dump(mode="json"), "corun_seconds": time.monotonic() - started,
                          "corun_window": window, "corun_phases": dict(phases.seconds),
                      "corun_kernels": kernels_split}
        session.commit()
    return comparison
