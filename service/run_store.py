"""The worker's one door to the database: every read and write a worker makes about a run.

A worker claims a run, beats its heart, stores its results in batches, finishes or fails it,
gives it back (retry later, a verify run yielding), has it judged, adds the co-run's per-step
diffs, the attribution and the kernel timings beside it, opens and stores a build variant's
attribution against its base environment, and says it is alive (presence). It reads what a job
needs as plain values (RunFacts, ProjectFacts, CorunInputs, EnvironmentAttributionInputs: pydantic,
never a row of the ORM). The rules and every query stay in the service's domain modules (runs,
dispatch, trajectories, baselines, verdict_store, corun, unsteady_cases, kernel_speed,
environment_attribution, training_impacts, workers): each function here is one session over them
(it holds no SQL of its own: tests/service/test_run_store_has_no_sql.py), and this module is what
tells the notifier (service.notify.hooks) that a run changed. The verdict's detail it adds to is
typed (service.core.verdict_detail).

Each function opens its own session; `session=` is for tests, which pass their transaction.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session

from service.core.archives import ArchiveLimits
from service.core.results import CaseResult, CaseSpec, RepeatCheck, RunComparison, RunResult
from service.core.verdict_detail import CorunFinding, CorunRecord
from service.core.verdicts import compare_runs
from service.db.models import CANCELLED, DONE, ERROR, FAILED, RUNNING, Project, Run
from service.db.session import get_sessionmaker
from service.domain import (
    baselines, corun, dispatch, environment_attribution, kernel_speed, projects, runs, training_impacts, trajectories,
    unsteady_cases, verdict_store, workers,
)
from service.domain.storage import archive_limits as _archive_limits
from service.notify import hooks as notify
from service.settings import Settings

log = logging.getLogger(__name__)

__all__ = ["CANCELLED", "DONE", "ERROR", "FAILED", "RUNNING"]

# A worker beats every PRESENCE_INTERVAL_S (service.domain.workers: three missed beats and it is gone).
PRESENCE_INTERVAL_S = workers.PRESENCE_INTERVAL_S

# What a database that is restarting or failing over raises.
DATABASE_DOWN = (OperationalError, InterfaceError)

T = TypeVar("T")


def retry_database(action: Callable[[], T], *, what: str, give_up_after_s: float = 300.0) -> T:
    """`action()`, retried with backoff while the database is unreachable (a restart, a failover)."""
    delay = 0.5
    deadline = time.monotonic() + give_up_after_s
    while True:
        try:
            return action()
        except DATABASE_DOWN as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("%s: database unavailable (%s); retrying in %.1f s", what,
                        str(exc).splitlines()[0], delay)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)


class RunLost(RuntimeError):
    """The run is no longer ours (reaped after a missed heartbeat, or cancelled)."""


class RunFacts(BaseModel):
    """A run's row as a job reads it."""

    id: int
    project_id: int
    kind: str
    environment: str
    source_digest: str
    battery: str
    status: str
    worker: str | None = None
    started_at: datetime | None = None


class ProjectFacts(BaseModel):
    """A project's registered fields: the defaults of its configuration
    (service.core.project_config.config_defaults reads these attributes)."""

    name: str
    build_kind: str
    build_command: str | None = None
    adapter: str
    default_battery: str
    environments: list[str]


class CorunInputs(BaseModel):
    """What a baseline co-run needs of a judged run (worker/jobs/corun.py)."""

    run: RunFacts
    baseline: RunFacts
    project: ProjectFacts
    changed_ids: set[str]
    commit_result: RunResult
    baseline_result: RunResult


def _run_facts(run: Run) -> RunFacts:
    return RunFacts(id=run.id, project_id=run.project_id, kind=run.kind, environment=run.environment,
                    source_digest=run.source_digest, battery=run.battery, status=run.status, worker=run.worker,
                    started_at=run.started_at)


def _project_facts(project: Project) -> ProjectFacts:
    return ProjectFacts(name=project.name, build_kind=project.build_kind, build_command=project.build_command,
                        adapter=project.adapter, default_battery=project.default_battery,
                        environments=list(project.environments))


def _run(session: Session, run_id: int) -> Run | None:
    """The run's row as the database has it now (a session passed in may hold an older copy)."""
    return runs.lookup(session=session, run_id=run_id)


def _project(session: Session, project_id: int) -> ProjectFacts | None:
    project = projects.lookup(session=session, project_id=project_id)
    return None if project is None else _project_facts(project)


@contextlib.contextmanager
def _session(session: Session | None) -> Iterator[Session]:
    if session is not None:
        yield session
        return
    with get_sessionmaker()() as own:
        yield own


def archive_limits(settings: Settings) -> ArchiveLimits:
    """The bounds a fetched source archive is unpacked within (the API's upload bounds)."""
    return _archive_limits(settings)


def run_changed(run_id: int, *, settings: Settings, with_dependants: bool = False) -> None:
    """Tell the notifier (GitHub check, PR comment, webhooks) that the run changed; in a thread of
    its own, never failing the run (service.notify.hooks)."""
    notify.run_changed(run_id, settings=settings, with_dependants=with_dependants)


# ----------------------------------------------------------------------------- reading
def run_facts(run_id: int, *, session: Session | None = None) -> RunFacts | None:
    with _session(session) as session:
        run = _run(session, run_id)
        return None if run is None else _run_facts(run)


def project_facts(project_id: int, *, session: Session | None = None) -> ProjectFacts | None:
    with _session(session) as session:
        return _project(session, project_id)


def queued_count(*, environment: str, kind: str | None = None, dispatched_after: datetime | None = None,
                 dispatched_before: datetime | None = None, session: Session | None = None) -> int:
    """Runs waiting for a worker of `environment` (service.domain.runs.queued_count)."""
    with _session(session) as session:
        return runs.queued_count(session=session, environment=environment, kind=kind,
                                 dispatched_after=dispatched_after, dispatched_before=dispatched_before)


# ----------------------------------------------------------------------------- a run's life
def claim(run_id: int, *, worker: str, session: Session | None = None) -> bool:
    """queued -> building for `worker`; False when another has it or it is over."""
    with _session(session) as session:
        return runs.claim(session=session, run_id=run_id, worker=worker)


def heartbeat(run_id: int, *, worker: str, session: Session | None = None) -> bool:
    """Refresh the run's heartbeat; False when it is no longer this worker's."""
    with _session(session) as session:
        return runs.heartbeat(session=session, run_id=run_id, worker=worker)


def cancel_requested(run_id: int, *, session: Session | None = None) -> bool:
    """Whether a cancel of the run was asked for (the watchdog polls this, worker/jobs/watchdog.py)."""
    with _session(session) as session:
        return runs.cancel_requested(session=session, run_id=run_id)


def end_stopped(run_id: int, *, worker: str, status: str, error: str, session: Session | None = None) -> bool:
    """A run the watchdog stopped (deadline, cancel, or a task that stayed blocked): `status`
    (ERROR or CANCELLED) with `error`, final, while it is still `worker`'s; False otherwise.
    Never queued again: the re-delivered task finds it final and skips it."""
    with _session(session) as session:
        return runs.set_status(session=session, run_id=run_id, worker=worker, status=status, error=error)


class ClaimedRun:
    """One claimed run's transaction-by-transaction record, over one session held for the job:
    its build, its progress and its results in batches, its end. Every write is conditional on
    the run still being `worker`'s (service.domain.runs)."""

    def __init__(self, session: Session, *, run_id: int, worker: str) -> None:
        self.session, self.run_id, self.worker = session, run_id, worker
        run = _run(session, run_id)
        self.run = _run_facts(run)
        self.project = _project(session, run.project_id)

    def set_status(self, status: str, **values: Any) -> bool:
        return runs.set_status(session=self.session, run_id=self.run_id, worker=self.worker, status=status,
                               **values)

    def fail(self, error: str) -> None:
        """The commit's fault (it does not build, its configuration is wrong): `failed`."""
        self.set_status(FAILED, error=error)

    def cancel_if_asked(self) -> bool:
        """True (and the run `cancelled`) when a cancel was asked for."""
        if not runs.cancel_requested(session=self.session, run_id=self.run_id):
            return False
        self.set_status(CANCELLED, error="cancelled on request")
        return True

    def record(self, **values: Any) -> bool:
        """Write what the job learnt (build log, digests, environment detail) with a heartbeat;
        False when the run is no longer ours (then nothing is written)."""
        return runs.heartbeat(session=self.session, run_id=self.run_id, worker=self.worker, **values)

    def start_cases(self, total: int) -> None:
        self.set_status(RUNNING, cases_total=total, cases_done=0)

    def store_batch(self, results: list[tuple[int, CaseResult]], *, cases_done: int) -> None:
        """The results and the progress they make, in one transaction, or (the run was taken
        away) neither: raises RunLost."""
        trajectories.store_case_results(session=self.session, run_id=self.run_id, results=results)
        if not runs.heartbeat(session=self.session, run_id=self.run_id, worker=self.worker, cases_done=cases_done):
            raise RunLost("the run was taken away while running cases")

    def baseline_digests(self) -> dict[str, list[str]]:
        """case id -> digests of the run's baseline, if it has finished (the cases that differ
        from it are repeated before the run ends, worker/pipeline.py); {} otherwise."""
        run = _run(self.session, self.run_id)
        choice = baselines.choose(session=self.session, run=run)
        if choice.run is None or choice.pending or choice.run.status != DONE:
            return {}
        return {row.case_id: row.digests.split("\n")
                for row in trajectories.list_rows(session=self.session, run_id=choice.run.id)
                if row.status == "ok" and row.digests}

    def finish(self, environment_detail: dict) -> None:
        self.set_status(DONE, environment_detail=environment_detail)


@contextlib.contextmanager
def open_run(run_id: int, *, worker: str) -> Iterator[ClaimedRun]:
    with get_sessionmaker()() as session:
        yield ClaimedRun(session, run_id=run_id, worker=worker)


def send_again(run_id: int, *, settings: Settings, delay: float, session: Session | None = None) -> None:
    """Dispatch a re-queued run to start after `delay` s, on its kind's queue, the way the API
    dispatches (service.domain.dispatch); if the broker does not take it now, the API's maintenance
    loop sends it (it stays queued with no dispatch time)."""
    with _session(session) as session:
        dispatch.send_again(session=session, settings=settings, run_id=run_id, delay=delay)


def retry_later(run_id: int, *, worker: str, error: str, settings: Settings,
                session: Session | None = None) -> bool:
    """After an optdrift failure: queued again and sent after its backoff while attempts remain
    (True), else `error` for good (False). service.domain.runs.retry_later."""
    with _session(session) as session:
        delay = runs.retry_later(session=session, run_id=run_id, worker=worker, error=error,
                                 max_attempts=settings.max_attempts, backoff_s=settings.retry_backoff_s)
        if delay is None:
            return False
        send_again(run_id, settings=settings, delay=delay, session=session)
        return True


def give_way(run_id: int, *, worker: str, note: str, settings: Settings, session: Session | None = None) -> str:
    """A verify run yields to commit runs: back to `queued` with `note` on its page, its stored
    cases deleted, its attempt not counted (service.domain.runs.requeue_yielded), and sent again on
    the verify queue. A cancel asked for meanwhile is honoured instead. Returns "yielded",
    CANCELLED, or "lost" (the run is no longer ours)."""
    with _session(session) as session:
        if not runs.requeue_yielded(session=session, run_id=run_id, worker=worker, note=note):
            if runs.cancel_requested(session=session, run_id=run_id) and runs.set_status(
                    session=session, run_id=run_id, worker=worker, status=CANCELLED, error="cancelled on request"):
                return CANCELLED
            return "lost"
        send_again(run_id, settings=settings, delay=0.0, session=session)
    run_changed(run_id, settings=settings)
    return "yielded"


def judge(run_id: int, *, worker: str, settings: Settings, session: Session | None = None) -> list[int]:
    """A run that `worker` took to a final status gets its verdict, and so do the runs that
    waited for it as their baseline (another worker was faster); the notifier is told. Returns
    the ids of those dependants when the run is `done` (their co-runs are sent from here)."""
    with _session(session) as session:
        run = _run(session, run_id)
        waited_for_this: list[int] = []
        if run.status in (DONE, FAILED, ERROR) and run.worker == worker:
            if run.status == DONE:
                waited_for_this = [other.id for other in baselines.dependants(session=session, run=run)]
            verdict_store.evaluate_with_dependants(session=session, run=run)
            run_changed(run_id, settings=settings, with_dependants=True)
        return waited_for_this


# ----------------------------------------------------------------------------- nondeterminism: memory and blame
def unsteady_case_ids(project_id: int, *, session: Session | None = None) -> set[str]:
    """The project's cases that ever failed to reproduce themselves (docs/ENGINE.md, Nondeterminism):
    every run repeats them, commit and verify runs alike (service.domain.unsteady_cases)."""
    with _session(session) as session:
        return unsteady_cases.case_ids(session=session, project_id=project_id)


def remember_unsteady(project_id: int, run_id: int, case_ids: Iterable[str], *,
                      session: Session | None = None) -> None:
    """Remember `case_ids` as nondeterministic for the project, seen in `run_id` (its own build or
    its baseline's, repeated for blame); concurrent workers may remember one case at once
    (service.domain.unsteady_cases.remember)."""
    with _session(session) as session:
        unsteady_cases.remember(session=session, project_id=project_id, run_id=run_id, case_ids=case_ids)


def baseline_of(run_id: int, *, session: Session | None = None) -> RunFacts | None:
    """The run's baseline when it has finished (`done`): the build a nondeterministic case is
    repeated on for blame (worker/jobs/run.py); None otherwise."""
    with _session(session) as session:
        choice = baselines.choose(session=session, run=_run(session, run_id))
        if choice.run is None or choice.pending or choice.run.status != DONE:
            return None
        return _run_facts(choice.run)


# ----------------------------------------------------------------------------- beside the verdict
def corun_environment(run_id: int, *, session: Session | None = None) -> str | None:
    """The run's environment when its verdict names changed cases against a baseline (a co-run
    then adds their per-step |commit - baseline|), else None."""
    with _session(session) as session:
        return corun.environment(session=session, run_id=run_id)


def corun_inputs(run_id: int, *, session: Session | None = None) -> CorunInputs | None:
    """The judged run, its baseline, both results and the changed cases still without per-step
    diffs; None when there is nothing to co-run (service.domain.corun.sides)."""
    with _session(session) as session:
        sides = corun.sides(session=session, run_id=run_id)
        if sides is None:
            return None
        run, baseline = sides.run, sides.baseline
        return CorunInputs(run=_run_facts(run), baseline=_run_facts(baseline),
                           project=_project(session, run.project_id), changed_ids=sides.changed_ids,
                           commit_result=trajectories.run_result(session=session, run=run),
                           baseline_result=trajectories.run_result(session=session, run=baseline))


def store_corun_diffs(run_id: int, *, comparison: RunComparison, corun_record: CorunRecord,
                      session: Session | None = None) -> bool:
    """The verdict recomputed with the co-run's diffs, stored with the co-run's record (its time and
    window) beside it; False, and nothing stored, when it would change the stored outcome (it
    cannot: the same stored results are compared)."""
    with _session(session) as session:
        return corun.store_diffs(session=session, run_id=run_id, comparison=comparison, corun=corun_record)


def store_corun_nondeterminism(run_id: int, *, commit_checks: dict[str, RepeatCheck], finding: CorunFinding,
                               corun_record: CorunRecord, session: Session | None = None) -> RunComparison | None:
    """The co-run re-ran a case and did not reproduce its stored trajectory: that is the run's
    nondeterminism finding. Each such case of the commit gets the re-run as one more repeat on its
    stored trajectory (`commit_checks`: the RepeatCheck it now has, with the baseline's re-run as
    its blame), the verdict is judged again from the stored trajectories by the same rule as when the
    run ended (service.core.verdicts.compare_runs, service.domain.verdict_store.rejudge), and
    `finding` (state not_reproducible, both digests and the first differing step per case and side)
    is stored with the co-run's record. Returns the new comparison (None: no verdict)."""
    with _session(session) as session:
        return corun.store_nondeterminism(session=session, run_id=run_id, commit_checks=commit_checks,
                                          finding=finding, corun=corun_record)


def corun_final(run_id: int, *, session: Session | None = None) -> bool:
    """The run's co-run ended without diffs (a case that does not reproduce itself, or it gave up):
    its detail is final, nothing more comes (service.core.verdict_detail)."""
    with _session(session) as session:
        return corun.is_final(session=session, run_id=run_id)


def corun_given_up(run_id: int, reason: str, *, session: Session | None = None) -> None:
    """The co-run stores no detail and will not try again (`reason`: a side no longer builds, it
    failed): said on the verdict so that nobody waits for its detail."""
    with _session(session) as session:
        corun.give_up(session=session, run_id=run_id, reason=reason)


def add_attribution(run_id: int, attribution: dict, *, session: Session | None = None) -> None:
    """The attribution of the changed cases into the verdict's detail (every other key stays)."""
    with _session(session) as session:
        corun.add_attribution(session=session, run_id=run_id, attribution=attribution)


# ----------------------------------------------------------------------------- a build variant against its base
class EnvironmentAttributionInputs(BaseModel):
    """What the co-run of a base environment's build and its variant's needs
    (worker/jobs/environment_attribution.py): A the base environment's run, B the variant's."""

    id: int
    run_a: RunFacts
    run_b: RunFacts
    project: ProjectFacts
    changed_ids: set[str]
    result_a: RunResult
    result_b: RunResult


def open_environment_attributions(run_id: int, *, session: Session | None = None) -> list[tuple[int, str]]:
    """When a commit run is done: (attribution id, the variant's environment) of each pair of it and
    a finished partner run (its base environment's or its variants') whose trajectories differ,
    opened queued (service.domain.environment_attribution.open_for)."""
    with _session(session) as session:
        run = _run(session, run_id)
        if run is None:
            return []
        return [(row.id, row.environment_b) for row in environment_attribution.open_for(session=session, run=run)]


def claim_environment_attribution(attribution_id: int, *, worker: str, stale_after_s: float | None = None,
                                  session: Session | None = None) -> bool:
    """The attribution is `worker`'s now (service.domain.environment_attribution.claim)."""
    with _session(session) as session:
        return environment_attribution.claim(session=session, attribution_id=attribution_id, worker=worker,
                                             stale_after_s=stale_after_s)


def environment_attribution_inputs(attribution_id: int, *,
                                   session: Session | None = None) -> EnvironmentAttributionInputs | None:
    """Both runs, their results and the changed cases; None when the row or a run is gone."""
    with _session(session) as session:
        row = environment_attribution.lookup(session=session, attribution_id=attribution_id)
        if row is None:
            return None
        run_a, run_b = _run(session, row.run_a_id), _run(session, row.run_b_id)
        if run_a is None or run_b is None or run_a.status != DONE or run_b.status != DONE:
            return None
        result_a = trajectories.run_result(session=session, run=run_a)
        result_b = trajectories.run_result(session=session, run=run_b)
        return EnvironmentAttributionInputs(
            id=row.id, run_a=_run_facts(run_a), run_b=_run_facts(run_b),
            project=_project(session, row.project_id),
            changed_ids=environment_attribution.changed_case_ids(compare_runs(result_b, result_a)),
            result_a=result_a, result_b=result_b)


def environment_attribution_queue(attribution_id: int, *, session: Session | None = None) -> str | None:
    """The environment whose co-run queue the attribution waits on (the variant's)."""
    with _session(session) as session:
        row = environment_attribution.lookup(session=session, attribution_id=attribution_id)
        return None if row is None else row.environment_b


def finish_environment_attribution(attribution_id: int, *, detail: dict | None = None, error: str | None = None,
                                   session: Session | None = None) -> None:
    """done with `detail` (per case: per-step max |B − A|, the attribution), or failed with `error`."""
    with _session(session) as session:
        environment_attribution.finish(session=session, attribution_id=attribution_id, detail=detail, error=error)


def requeue_environment_attribution(attribution_id: int, *, session: Session | None = None) -> None:
    with _session(session) as session:
        environment_attribution.requeue(session=session, attribution_id=attribution_id)


class TrainingJobInputs(BaseModel):
    """What a training-impact job needs (worker/jobs/training.py): both runs, the cases that changed."""

    job_id: int
    run: RunFacts
    baseline: RunFacts
    project: ProjectFacts
    model_set: str
    changed: list[CaseSpec]


def open_training_impact(run_id: int, *, model_set: str, session: Session | None = None) -> tuple[int, str] | None:
    """After a changed run's co-run: its training-impact job against its baseline, opened queued;
    (job id, the queue's environment), or None when nothing differs or it is already done or running."""
    with _session(session) as session:
        row, queued_now = training_impacts.open_job(session=session, run_id=run_id, model_set=model_set)
        return (row.id, row.environment) if queued_now else None


def claim_training_impact(job_id: int, *, worker: str, stale_after_s: float | None = None,
                          session: Session | None = None) -> bool:
    with _session(session) as session:
        return training_impacts.claim(session=session, job_id=job_id, worker=worker, stale_after_s=stale_after_s)


def training_impact_inputs(job_id: int, *, session: Session | None = None) -> TrainingJobInputs | None:
    """Both runs and the changed cases; None when the row or a run is gone or no longer done."""
    with _session(session) as session:
        found = training_impacts.inputs(session=session, job_id=job_id)
        if found is None:
            return None
        run, baseline = _run(session, found.run_id), _run(session, found.baseline_run_id)
        return TrainingJobInputs(job_id=job_id, run=_run_facts(run), baseline=_run_facts(baseline),
                                 project=_project(session, run.project_id),
                                 model_set=found.model_set, changed=found.changed)


def training_impact_queue(job_id: int, *, session: Session | None = None) -> str | None:
    with _session(session) as session:
        row = training_impacts.lookup(session=session, job_id=job_id)
        return None if row is None else row.environment


def training_impact_progress(job_id: int, *, done: int, total: int, phase: str | None,
                             session: Session | None = None) -> None:
    with _session(session) as session:
        training_impacts.progress(session=session, job_id=job_id, done=done, total=total, phase=phase)


def finish_training_impact(job_id: int, *, results: list[dict] | None = None, error: str | None = None,
                           device: str | None = None, seconds: float | None = None,
                           session: Session | None = None) -> None:
    with _session(session) as session:
        training_impacts.finish(session=session, job_id=job_id, results=results, error=error, device=device,
                                seconds=seconds)


def requeue_training_impact(job_id: int, *, session: Session | None = None) -> None:
    with _session(session) as session:
        training_impacts.requeue(session=session, job_id=job_id)


def training_impact_finished(job_id: int, settings: Settings, *, session: Session | None = None) -> None:
    """The job stored its results or its failure: tell the notifier about its run, whose check run
    and PR comment gain the training impact (service.notify.hooks, in a thread of its own; never
    raises, as run_changed: the job's results are stored whatever becomes of the notification)."""
    try:
        with _session(session) as session:
            row = training_impacts.lookup(session=session, job_id=job_id)
            run_id = None if row is None else row.run_id
    except Exception:  # noqa: BLE001
        log.exception("training impact %s: could not find its run to notify", job_id)
        return
    if run_id is not None:
        run_changed(run_id, settings=settings)


def store_timings(run_id: int, answer: dict, *, session: Session | None = None) -> int:
    """The kernel host's `time_kernels` answer stored with the run (service.domain.kernel_speed);
    how many timings. Nothing is stored if it raises."""
    with _session(session) as session:
        try:
            count = kernel_speed.store(session=session, run_id=run_id, answer=answer)
            session.commit()
        except Exception:
            session.rollback()
            raise
        return count


def note_on_run(run_id: int, key: str, note: str, *, session: Session | None = None) -> None:
    """One key of the run's environment detail (a finished run's kernel timing note), the rest as
    it is now (the co-run may have written the run meanwhile)."""
    with _session(session) as session:
        runs.note_in_detail(session=session, run_id=run_id, key=key, note=note)


# ----------------------------------------------------------------------------- presence
def presence_beat(*, name: str, environment: str, detail: dict, session: Session | None = None) -> None:
    """Insert or refresh this worker process's presence row (service.domain.workers)."""
    with _session(session) as session:
        workers.beat(session=session, name=name, environment=environment, detail=detail)


def presence_leave(*, name: str, session: Session | None = None) -> None:
    with _session(session) as session:
        workers.leave(session=session, name=name)


# ----------------------------------------------------------------------------- a build's progress
def build_progress(run_id: int, *, worker: str, done: int | None, total: int | None, unit: str,
                   session: Session | None = None) -> bool:
    """Where the run's build has got to (worker.build.progress: ninja's [n/m], compile lines
    counted), for its page and GET /api/v1/runs/{id}; at most once a second from the build's
    watcher thread, in a session of its own. False once the run is not building or not `worker`'s."""
    with _session(session) as session:
        return runs.set_build_progress(session=session, run_id=run_id, worker=worker, done=done, total=total,
                                       unit=unit)
