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

import logging
import time
from datetime import datetime, timezone

from service import run_store
from service.broker.queueing import CORUN_TASK_NAME
from service.core.project_config import load_project_config
from service.core.results import RunComparison, RunResult
from service.core.verdicts import compare_runs
from service.settings import Settings
from worker import pipeline
from worker.identity import worker_name
from worker.jobs import follow_ups
from worker.jobs.pair import BuildPair, Phases
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
    started, started_at = time.monotonic(), datetime.now(timezone.utc)
    phases = Phases()
    with phases("load"):
        inputs = run_store.corun_inputs(run_id)
        if inputs is None:
            return 0
        run, baseline, project = inputs.run, inputs.baseline, inputs.project
        changed_ids, commit_result, baseline_result = inputs.changed_ids, inputs.commit_result, inputs.baseline_result
        digests = {"commit": run.source_digest, "baseline": baseline.source_digest}
        untrusted = {"commit": run.kind == "verify", "baseline": baseline.kind == "verify"}

    cases = [c.case for c in commit_result.cases if c.case.case_id in changed_ids]
    with BuildPair(settings, phases=phases, label=f"run {run_id}") as pair, \
            Workspace(settings, prefix=f"optdrift-diffs-{run_id}-") as workspace:
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
            policies = {side: workspace.policy(untrusted=untrusted[side], environment=run.environment,
                                               case_timeout_s=settings.case_timeout_s) for side in jobs}
            error = pair.build(workspace, jobs, policies)
        if error:
            log.warning("run %s: %s; no per-step diffs", run_id, error)
            return 0
        adapter = job.config.adapter
        stored_diffs: dict[str, list[float]] = {}

        def store(diffs: dict[str, list[float]]) -> RunComparison | None:
            stored_diffs.update(diffs)
            return _store(run_id=run_id, commit_result=commit_result, baseline_result=baseline_result,
                          diffs=diffs, started=started, started_at=started_at, phases=phases,
                          kernels_split=pair.kernels_split, worker=worker_name())

        comparison = pair.corun(battery=job.battery, cases=cases, adapter=adapter,
                                stored={"commit": commit_result}, then=store, between_cases=between_cases)
        if comparison is None:
            return 0
        # Issue 17: rounding-level or semantic, and which variant (worker/attribution), added beside
        # the stored diffs afterwards, so they are served without waiting for it.
        # Inside the sources' folder: a tree's own adapter is imported from it (adapter_path).
        run_store.add_attribution(run_id, pair.attribute(comparison, baseline_result, cases, adapter))
        return len(stored_diffs)


def _store(*, run_id: int, commit_result: RunResult, baseline_result: RunResult, diffs: dict[str, list[float]],
           started: float, started_at: datetime, phases: Phases, kernels_split: dict[str, float],
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


def yield_to_runs(settings: Settings) -> None:
    """Raise CorunYielded while runs wait for this worker's environment: a job beside the runs
    (a co-run, an environment attribution) stops between cases and is queued again."""
    waiting = run_store.queued_count(environment=settings.worker_environment)
    if waiting:
        raise CorunYielded(f"{waiting} run(s) waiting for {settings.worker_environment}")


def record_and_tell(run_id: int, settings: Settings) -> str:
    """The co-run task's body: per-step |commit − baseline| for the changed cases. The verdict is
    already stored and stands without them, so a failure here is logged, never raised. Between
    cases the co-run yields to runs waiting for this environment: it stops and is queued again."""
    follow_ups.corun_started(run_id)
    try:
        count = record_baseline_diffs(run_id=run_id, settings=settings,
                                      between_cases=lambda: yield_to_runs(settings))
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
