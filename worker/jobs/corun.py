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

Kernels are deterministic in one environment, so the co-run reproduces both stored trajectories.
When a re-run's digests disagree with the stored ones, the diffs are not trusted and not stored, and
that disagreement is the run's nondeterminism finding (issue 44): the commit's case gets the re-run
as one more repeat on its stored trajectory and the verdict is judged again by the rule every run
goes through (a case that does not reproduce itself reads nondeterministic, blamed on the commit
when the baseline's re-run reproduced), the case is remembered for the project (every later run,
commit or verify, repeats it), and the finding (both digests, the first differing step) marks the
co-run's detail final so that `submit --wait` stops waiting for it. A co-run that gives up (a side
no longer builds, it fails) marks it final too.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone

from service import run_store
from service.broker.queueing import CORUN_TASK_NAME
from service.core.project_config import load_project_config
from service.core.results import RepeatCheck, RunComparison, RunResult
from service.core.verdict_detail import CorunFinding, CorunRecord, CorunWindow
from service.core.verdicts import compare_runs
from service.settings import Settings
from worker import pipeline
from worker.identity import worker_name
from worker.jobs import follow_ups
from worker.jobs.pair import BuildPair, NotReproduced, Phases
from worker.jobs.workspace import Workspace
from worker.jobs.yielding import CorunYielded, queued_again, yield_to_runs

log = logging.getLogger(__name__)
FINDING_CASES_SHOWN = 20


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
            run_store.corun_given_up(run_id, f"no per-step diffs: {error}")
            return 0
        adapter = job.config.adapter
        stored_diffs: dict[str, list[float]] = {}

        def store(diffs: dict[str, list[float]]) -> RunComparison | None:
            stored_diffs.update(diffs)
            return _store(run_id=run_id, commit_result=commit_result, baseline_result=baseline_result,
                          diffs=diffs, started=started, started_at=started_at, phases=phases,
                          kernels_split=pair.kernels_split, worker=worker_name(),
                          training=settings.resolved_training_model_set or "off")

        def not_reproducible(found: dict[str, dict[str, NotReproduced]]) -> None:
            _store_not_reproducible(run_id=run_id, project_id=run.project_id, baseline_id=baseline.id,
                                    commit_result=commit_result, found=found, started=started,
                                    started_at=started_at, phases=phases, worker=worker_name())

        # Both sides are checked against their stored runs: a baseline that does not reproduce
        # itself makes the change it was compared with a draw, not a finding.
        comparison = pair.corun(battery=job.battery, cases=cases, adapter=adapter,
                                stored={"commit": commit_result, "baseline": baseline_result}, then=store,
                                between_cases=between_cases, not_reproduced=not_reproducible)
        if comparison is None:
            if not run_store.corun_final(run_id):
                run_store.corun_given_up(run_id, "the recomputed verdict disagreed with the stored one")
            return 0
        # Issue 17: rounding-level or semantic, and which variant (worker/attribution), added beside
        # the stored diffs afterwards, so they are served without waiting for it.
        # Inside the sources' folder: a tree's own adapter is imported from it (adapter_path).
        run_store.add_attribution(run_id, pair.attribute(comparison, baseline_result, cases, adapter))
        return len(stored_diffs)


def _store(*, run_id: int, commit_result: RunResult, baseline_result: RunResult, diffs: dict[str, list[float]],
           started: float, started_at: datetime, phases: Phases, kernels_split: dict[str, float],
           worker: str, training: str = "off") -> RunComparison | None:
    """The verdict recomputed with the diffs, stored with the co-run's time; the comparison, or None
    when it would change the stored outcome (it cannot: the same stored results)."""
    with phases("compare"):
        comparison = compare_runs(commit_result, baseline_result, diffs)
    # training_impact: the model set of the training-impact job this worker opens next (issue 46),
    # or "off": `submit --wait` then knows none comes.
    record = CorunRecord(**_time_spent(started=started, started_at=started_at, phases=phases, worker=worker),
                         corun_kernels=kernels_split, training_impact=training)
    if not run_store.store_corun_diffs(run_id, comparison=comparison, corun_record=record):
        return None
    return comparison


def _time_spent(*, started: float, started_at: datetime, phases: Phases, worker: str) -> dict:
    """The co-run's own time (fetch, builds, kernels: corun_seconds, for /metrics' histogram), when
    and on which worker it ran (corun_window: several workers share a queue, issue 19) and its
    seconds per phase: what a CorunRecord holds whether the co-run stored diffs or a finding."""
    return {"corun_seconds": time.monotonic() - started,
            "corun_window": CorunWindow(worker=worker, started_at=started_at.isoformat(),
                                        finished_at=datetime.now(timezone.utc).isoformat()),
            "corun_phases": dict(phases.seconds)}


def co_run_repeat(stored: RepeatCheck | None, found: NotReproduced, *, baseline_reproduced: bool) -> RepeatCheck:
    """The case's repeat check with the co-run's re-run added: one more run on the same build,
    differing from the first from `found`'s step; the baseline's re-run (one more run of the
    baseline build) is its blame, as the run's own blame repeats the baseline build."""
    runs, differing = (stored.runs, stored.differing) if stored else (1, 0)
    steps = [step for step in ((stored.first_divergent_step if stored else None), found.first_differing_step) if step]
    baseline_runs = (stored.baseline_runs if stored and stored.baseline_runs else 1) + 1
    baseline_differing = (stored.baseline_differing or 0 if stored else 0) + (0 if baseline_reproduced else 1)
    return RepeatCheck(runs=runs + 1, differing=differing + 1, first_divergent_step=min(steps),
                       baseline_runs=baseline_runs, baseline_differing=baseline_differing)


def _store_not_reproducible(*, run_id: int, project_id: int, baseline_id: int, commit_result: RunResult,
                            found: dict[str, dict[str, NotReproduced]], started: float, started_at: datetime,
                            phases: Phases, worker: str) -> None:
    """The co-run's re-runs that did not reproduce the stored trajectories, made the run's finding:
    the commit's cases judged nondeterministic (run_store.store_corun_nondeterminism), each side's
    cases remembered for the project (run_store.remember_unsteady: the flaky-case memory), the
    finding stored so nothing waits for the co-run's detail."""
    commit_found, baseline_found = found.get("commit", {}), found.get("baseline", {})
    stored_checks = {c.case.case_id: c.repeat_check for c in commit_result.cases}
    checks = {case_id: co_run_repeat(stored_checks.get(case_id), item, baseline_reproduced=case_id not in baseline_found)
              for case_id, item in commit_found.items()}
    # The first FINDING_CASES_SHOWN cases' digests (the verdict's detail is served whole; every
    # case's repeat check is on its own case row), and how many in all.
    case_ids = sorted(set(commit_found) | set(baseline_found))
    shown = {case_id: {side: found[side][case_id].as_json() for side in found if case_id in found[side]}
             for case_id in case_ids[:FINDING_CASES_SHOWN]}
    finding = CorunFinding(state="not_reproducible", not_reproduced=len(case_ids), cases=shown)
    record = CorunRecord(**_time_spent(started=started, started_at=started_at, phases=phases, worker=worker))
    with phases("compare"):
        run_store.store_corun_nondeterminism(run_id, commit_checks=checks, finding=finding, corun_record=record)
    run_store.remember_unsteady(project_id, run_id, commit_found)
    run_store.remember_unsteady(project_id, baseline_id, baseline_found)
    log.warning("run %s: the co-run did not reproduce %s: a nondeterminism finding of the run", run_id,
                ", ".join(f"{case_id} ({', '.join(sides)})" for case_id, sides in finding.cases.items()))


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
        if count or run_store.corun_final(run_id):
            # The check and PR comment gain max |Δ|, or the nondeterminism finding.
            run_store.run_changed(run_id, settings=settings)
        if count:  # the changed cases reproduced: does the change matter for a model's loss?
            follow_ups.send_training_impact(run_id, settings)
        return "stored"
    except CorunYielded as waiting:
        return queued_again(waiting, label=f"run {run_id}: baseline co-run", task_name=CORUN_TASK_NAME, job_id=run_id,
                            settings=settings, queue=lambda: run_store.run_facts(run_id).environment)
    except Exception as error:  # noqa: BLE001
        log.exception("run %s: co-running the baseline for per-step diffs failed", run_id)
        try:
            run_store.corun_given_up(run_id, f"the co-run failed: {' '.join(str(error).split())[:300]}")
        except Exception:  # noqa: BLE001  (the verdict stands without it)
            log.exception("run %s: could not say that its co-run gave up", run_id)
        return "failed"
