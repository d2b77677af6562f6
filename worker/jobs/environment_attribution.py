"""The environment attribution job (issue 36): one commit built by a base environment's toolchain
(A, `cpu`) and by its build variant's (B, `cpu+fma`), on the one worker that serves both, co-run on
the cases whose stored trajectories differ between A's run and B's.

Per changed case it stores the per-step max |B − A| and the numerical attribution (worker/attribution:
rounding-level, semantic, ...; ulps of the case's scale) in the pair's row
(service/db/environment_models.py, through service.run_store); the comparison makes the
looks-like label from it and the two runs' toolchains when it is read
(service/core/environment_attribution.py). The same path as the baseline co-run (worker/jobs/pair.py),
with one tree and two policies instead of two trees and one policy.

Both re-runs must reproduce their stored trajectories bit for bit (each build is deterministic on
its machine); where one does not, nothing is stored and the row says why.
"""

from __future__ import annotations

import logging
import time

from service import run_store
from service.broker.queueing import ENVIRONMENT_ATTRIBUTION_TASK_NAME
from service.core.verdicts import compare_runs
from service.settings import Settings
from worker.attribution.child import json_safe
from worker.identity import worker_name
from worker.jobs.yielding import CorunYielded, queued_again, yield_to_runs
from worker.jobs.pair import BuildPair, Phases
from worker.jobs.workspace import Workspace

log = logging.getLogger(__name__)


class NotAttributed(RuntimeError):
    """Why the pair could not be co-run (a build failed, a re-run did not reproduce)."""


def attribute_environments(*, attribution_id: int, settings: Settings, between_cases=None) -> dict:  # noqa: ANN001
    """The pair's detail (what is stored): per changed case its first divergent step, per-step
    max |B − A| and attribution, and where the job's time went. Raises NotAttributed."""
    started = time.monotonic()
    phases = Phases()
    with phases("load"):
        inputs = run_store.environment_attribution_inputs(attribution_id)
    if inputs is None:
        raise NotAttributed("a run of the pair is gone or no longer done")
    run_a, run_b = inputs.run_a, inputs.run_b
    cases = [c.case for c in inputs.result_b.cases if c.case.case_id in inputs.changed_ids]
    label = f"environment attribution {attribution_id} ({run_b.environment} against {run_a.environment})"
    with BuildPair(settings, phases=phases, label=label) as pair, \
            Workspace(settings, prefix=f"optdrift-environments-{attribution_id}-") as workspace:
        with phases("fetch"):
            source = workspace.fetch(run_b.source_digest)  # one commit: one tree, built twice
        with phases("build"):
            job = workspace.prepare(source, project=inputs.project, battery=run_b.battery)
            # "commit" is the side judged (B), "baseline" the one it is judged against (A).
            # Commit runs only (environment_attribution.open_for), so the trust a commit run gets, as in
            # the baseline co-run (a verify run's tree would be untrusted).
            policies = {side: workspace.policy(untrusted=False, environment=run.environment,
                                               case_timeout_s=settings.case_timeout_s)
                        for side, run in (("commit", run_b), ("baseline", run_a))}
            error = pair.build(workspace, {"commit": job, "baseline": job}, policies)
        if error:
            raise NotAttributed(error)
        adapter = job.config.adapter

        def compare(diffs: dict[str, list[float]]):  # noqa: ANN202
            with phases("compare"):
                return compare_runs(inputs.result_b, inputs.result_a, diffs), diffs

        answer = pair.corun(battery=job.battery, cases=cases, adapter=adapter, then=compare,
                            stored={"commit": inputs.result_b, "baseline": inputs.result_a},
                            between_cases=between_cases)
        if answer is None:
            raise NotAttributed("a re-run did not reproduce its stored trajectories (the worker's log names the "
                                "case): nothing to attribute")
        comparison, diffs = answer
        with phases("attribute"):
            attribution = pair.attribute(comparison, inputs.result_a, cases, adapter)
    return json_safe({
        "cases": {case.case_id: {"first_divergent_step": case.first_divergent_step,
                                 "max_abs_diff_per_step": diffs.get(case.case_id),
                                 "attribution": attribution.get(case.case_id)}
                  for case in comparison.cases if case.case_id in inputs.changed_ids},
        "attribution_error": attribution.get("error") if isinstance(attribution.get("error"), str) else None,
        "worker": worker_name(), "phases": dict(phases.seconds), "kernels": pair.kernels_split,
        "seconds": time.monotonic() - started,
    })


def attribute_and_store(attribution_id: int, settings: Settings) -> str:
    """The task's body: claim the pair, co-run it, store its detail, or its failure (logged; the
    comparison stands without it). Between cases it yields to runs waiting for this worker, as the
    baseline co-run does: it is queued again."""
    # A row another worker left running past the broker's visibility timeout is that worker's no
    # longer: the broker has handed its task out again.
    if not run_store.claim_environment_attribution(attribution_id, worker=worker_name(),
                                                   stale_after_s=settings.visibility_timeout_s):
        return "taken"
    try:
        detail = attribute_environments(attribution_id=attribution_id, settings=settings,
                                        between_cases=lambda: yield_to_runs(settings))
    except CorunYielded as waiting:
        return queued_again(waiting, label=f"environment attribution {attribution_id}",
                            task_name=ENVIRONMENT_ATTRIBUTION_TASK_NAME, job_id=attribution_id, settings=settings,
                            queue=lambda: run_store.environment_attribution_queue(attribution_id),
                            requeue=lambda: run_store.requeue_environment_attribution(attribution_id))
    except Exception as error:  # noqa: BLE001 - recorded on the row, never a run's failure
        log.exception("environment attribution %s failed", attribution_id)
        run_store.finish_environment_attribution(attribution_id, error=f"{type(error).__name__}: {error}"
                                                 if not isinstance(error, NotAttributed) else str(error))
        return "failed"
    run_store.finish_environment_attribution(attribution_id, detail=detail)
    log.info("environment attribution %s: %d changed cases attributed in %.1f s", attribution_id,
             len(detail["cases"]), detail["seconds"])
    return "stored"
