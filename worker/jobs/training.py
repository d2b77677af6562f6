"""The training-impact job (issue 46): a changed run's optimizer trained on small reference models
beside its baseline's, everything else identical.

The same path as the co-run (worker/jobs/pair.py): both trees fetched and built (cache hits where
their runs built here), two kernel hosts with the builds loaded, then instead of the cases the
model set's training runs (worker/training/runner.py: commit, baseline and one-ulp floor, K paired
seeds, per configuration the changed cases ran) and the verdict per model x configuration. Progress
(runs done of runs total) is stored as it goes, for `submit --wait` and the pages.

A run whose re-run we cannot trust fails the job with the run named (its row says why); the run's
verdict stands without it.
"""

from __future__ import annotations

import logging
import time

from service import run_store
from service.broker.queueing import TRAINING_TASK_NAME
from service.core.project_config import load_project_config
from service.core.training import MODEL_SETS, configs_from_cases
from service.settings import Settings
from worker import pipeline
from worker.identity import worker_name
from worker.jobs.yielding import CorunYielded, queued_again, yield_to_runs
from worker.jobs.pair import BuildPair, Phases
from worker.jobs.workspace import Workspace

log = logging.getLogger(__name__)
# Progress is written at most this often (a run of the quick set takes well under a second).
PROGRESS_EVERY_S = 1.0


class NotTrained(RuntimeError):
    """Why the job could not train (a side no longer builds, nothing changed any more)."""


def measure_training_impact(*, job_id: int, settings: Settings, between_phases=None) -> dict:  # noqa: ANN001
    """Train the job's model set in the two builds; {"results": [ModelImpact JSON], "device": ...}.
    Raises NotTrained, or worker.training.runner.TrainingFailed naming the run that failed."""
    from worker.engine.host import KernelHost
    from worker.training import runner

    phases = Phases()
    with phases("load"):
        inputs = run_store.training_impact_inputs(job_id)
    if inputs is None:
        raise NotTrained("a run of the pair is gone or no longer done")
    model_set = MODEL_SETS[inputs.model_set]
    configs = configs_from_cases(inputs.changed, model_set.max_configs)
    if not configs:
        raise NotTrained("no trajectory differs between the two runs any more: nothing to train")
    run, baseline, project = inputs.run, inputs.baseline, inputs.project
    with BuildPair(settings, phases=phases, label=f"training impact {job_id}") as pair, \
            Workspace(settings, prefix=f"optdrift-training-{job_id}-") as workspace:
        run_store.training_impact_progress(job_id, done=0, total=0, phase="building")
        with phases("fetch"):
            sources = {"commit": workspace.fetch(run.source_digest, name="commit"),
                       "baseline": workspace.fetch(baseline.source_digest, name="baseline")}
        with phases("build"):
            job = workspace.prepare(sources["commit"], project=project, battery=run.battery)
            jobs = {"commit": job, "baseline": pipeline.Job(
                source_dir=sources["baseline"], config=load_project_config(sources["baseline"], project),
                battery=job.battery, battery_origin=job.battery_origin, cases=[])}
            untrusted = {"commit": run.kind == "verify", "baseline": baseline.kind == "verify"}
            policies = {side: workspace.policy(untrusted=untrusted[side], environment=run.environment,
                                               case_timeout_s=settings.case_timeout_s) for side in jobs}
            error = pair.build(workspace, jobs, policies)
        if error:
            raise NotTrained(error)
        if between_phases:
            between_phases()
        hosts = pair.adopt_hosts(job.config.adapter)
        last = [0.0]

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if done in (0, total) or now - last[0] >= PROGRESS_EVERY_S:
                last[0] = now
                run_store.training_impact_progress(job_id, done=done, total=total, phase="training")

        pool = runner.HostPool({"commit": hosts[0], "baseline": hosts[1]}, size=settings.resolved_training_hosts,
                               make=lambda side: pair.host(side, job.config.adapter))
        try:
            with phases("train"):
                # From this thread, which outlives the runner's (a host dies with the thread that
                # started it); the baseline's environment keys its cached runs.
                KernelHost.start_together(list(hosts))
                cache = runner.BaselineRuns(settings.resolved_build_cache_dir / "training-runs",
                                            build_digest=pair.build_digests["baseline"],
                                            environment=_environment_key(hosts[1]))
                results = runner.measure(pool, configs, model_set, timeout_s=settings.case_timeout_s, cache=cache,
                                         on_progress=progress, start=KernelHost.start_together)
            device = hosts[0].environment.device_name if hosts[0].environment is not None else None
        finally:
            KernelHost.close_together(pool.all())
    return {"results": [result.model_dump(mode="json") for result in results], "device": device,
            "phases": dict(phases.seconds)}


def _environment_key(host) -> str:  # noqa: ANN001
    """What the baseline's cached runs are valid for: the host's environment class (device, torch,
    capability: EnvironmentFingerprint.class_key)."""
    return host.environment.class_key if host.environment is not None else "unknown"


def train_and_store(job_id: int, settings: Settings) -> str:
    """The task's body: claim the job, train, store the results or the failure (logged; the run's
    verdict stands without it). Before the hosts start it yields to runs waiting for this worker."""
    if not run_store.claim_training_impact(job_id, worker=worker_name(), stale_after_s=settings.visibility_timeout_s):
        return "taken"
    started = time.monotonic()
    try:
        answer = measure_training_impact(job_id=job_id, settings=settings,
                                         between_phases=lambda: yield_to_runs(settings))
    except CorunYielded as waiting:
        return queued_again(waiting, label=f"training impact {job_id}", task_name=TRAINING_TASK_NAME, job_id=job_id,
                            settings=settings, queue=lambda: run_store.training_impact_queue(job_id),
                            requeue=lambda: run_store.requeue_training_impact(job_id))
    except Exception as error:  # noqa: BLE001 - recorded on the row, never a run's failure
        log.exception("training impact %s failed", job_id)
        run_store.finish_training_impact(job_id, error=str(error)[:4000] if isinstance(error, NotTrained)
                                         else f"{type(error).__name__}: {error}"[:4000],
                                         seconds=time.monotonic() - started)
        run_store.training_impact_finished(job_id, settings)  # the PR comment says it was not measured
        return "failed"
    run_store.finish_training_impact(job_id, results=answer["results"], device=answer["device"],
                                     seconds=time.monotonic() - started)
    run_store.training_impact_finished(job_id, settings)  # the check run and PR comment gain the verdicts
    log.info("training impact %s: %d model x configuration verdicts in %.1f s", job_id, len(answer["results"]),
             time.monotonic() - started)
    return "stored"
