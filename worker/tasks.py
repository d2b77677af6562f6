"""The one Celery task: execute a run, given only its id.

claim (conditional UPDATE queued -> building) -> fetch source over HTTP -> build (digest cache) ->
run the battery case by case in a kernel-host subprocess (this process never touches CUDA),
writing each trajectory and the progress as it goes -> done -> verdict against the baseline.
A heartbeat thread keeps `heartbeat_at` fresh; cancellation is honoured between phases and cases;
if the reaper took the run away (heartbeat lost), the task stops writing.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from celery.signals import task_postrun, worker_ready
from sqlalchemy import select
from sqlalchemy.exc import InterfaceError, OperationalError

from service.db.models import CANCELLED, DONE, ERROR, FAILED, RUNNING, Run, Verdict
from service.db.session import get_sessionmaker
from service.domain import baselines, runs, trajectories, verdict_store
from service.domain.queueing import CORUN_TASK_NAME, RUN_TASK_NAME, corun_queue_for
from service.domain.storage import archive_limits
from service.notify import hooks as notify
from service.settings import Settings, get_settings
from worker import gc_policy, sandbox
from worker.identity import worker_name
from worker.sandbox import log_tail
from worker.celery_app import app
from worker.source_fetch import fetch_source

log = logging.getLogger(__name__)
# Co-runs this worker process queued and has not started yet (run id -> time.monotonic() when
# queued). Its kernel timings wait for them: a flagged commit's co-run detail is what a person is
# waiting for, the speed table is not. Another worker may take a co-run from the shared queue, so an
# entry counts only CORUN_FIRST_S: a timing is held back that long at most.
_corun_sent: dict[int, float] = {}
CORUN_FIRST_S = 120.0
MAX_LOG_CHARS = 200_000


DATABASE_DOWN = (OperationalError, InterfaceError)


def retry_database(action, *, what: str, give_up_after_s: float = 300.0):  # noqa: ANN001, ANN201
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


class RunBudget:
    """The operator's caps for one run (service.settings): build time, per-case timeout, total time.
    A verify run (a contributor's code, the lowest trust) gets the smaller verify_* caps. A tree's
    optdrift.toml may ask for less, never more."""

    def __init__(self, settings: Settings, *, untrusted: bool):
        self.untrusted = untrusted
        self.run_s = settings.verify_max_run_s if untrusted else settings.max_run_s
        self.build_s = min(settings.verify_max_build_s, settings.max_build_s) if untrusted else settings.max_build_s
        self.case_timeout_s = (min(settings.verify_case_timeout_s, settings.case_timeout_s) if untrusted
                               else settings.case_timeout_s)
        self.deadline = time.monotonic() + self.run_s

    def build_timeout_s(self) -> float:
        return max(1.0, min(self.build_s, self.deadline - time.monotonic()))

    def exceeded(self) -> bool:
        return time.monotonic() > self.deadline

    def reason(self, done: int, total: int) -> str:
        name = "OPTDRIFT_VERIFY_MAX_RUN_S" if self.untrusted else "OPTDRIFT_MAX_RUN_S"
        return (f"the run took longer than its budget of {self.run_s:g} s ({name}) and was stopped "
                f"after {done} of {total} cases")


class RunBudgetExceeded(RuntimeError):
    pass


class VerifyYielded(RuntimeError):
    """A running verify run gives way to commit runs waiting for its environment (CommitRunsFirst);
    the message is what its page says while it waits again."""


class CommitRunsFirst:
    """CI's commit runs go before contributors' verify runs (issue 33): a verify run that is
    running when a commit run of its environment arrives stops between cases (or between phases)
    and is queued again, so it delays that commit run by one case (one wave on the fast engine)
    and the check's interval, not by its whole budget. A verify build is not interrupted.

    It yields only to commit runs handed to the broker after it started: one that was already
    waiting when this run was claimed was not on the queue this worker took from (a retry's
    countdown, a message the broker lost), and yielding to it again would only start this run
    over and over. And only to those that have waited GRACE_S: an idle worker process takes a
    commit run well within it, and this run need not give way for one that is being taken.
    The check is one COUNT query, made at most every CHECK_EVERY_S."""

    CHECK_EVERY_S = 1.0
    GRACE_S = 2.0

    def __init__(self, run: Run) -> None:
        self.run_id, self.environment, self.since = run.id, run.environment, run.started_at
        self.last_check = float("-inf")

    def waiting(self) -> int:
        from datetime import datetime, timedelta, timezone

        cutoff = datetime.now(timezone.utc) - timedelta(seconds=self.GRACE_S)
        with get_sessionmaker()() as session:
            return runs.queued_count(session=session, environment=self.environment, kind="commit",
                                     dispatched_after=self.since, dispatched_before=cutoff)

    def check(self, where: str) -> None:
        """Raise VerifyYielded if commit runs wait (`where`: how far this run got, for its page)."""
        now = time.monotonic()
        if now - self.last_check < self.CHECK_EVERY_S:
            return
        self.last_check = now
        waiting = self.waiting()
        if waiting:
            raise VerifyYielded(
                f"yielded to {waiting} commit run(s) waiting for {self.environment} {where}: CI's commit "
                "runs go before verify runs (docs/SCALE.md). Queued again on the verify queue; it starts "
                "over, with its whole budget, once no commit run waits (yielding spends no attempt)")


@worker_ready.connect
def _say_whether_sandboxed(**_kwargs) -> None:  # noqa: ANN003
    available, what = sandbox.status()
    if available:
        log.info("sandbox: builds and kernel hosts run under %s", what)
    elif get_settings().allow_unsandboxed:
        log.warning("sandbox UNAVAILABLE (%s); OPTDRIFT_ALLOW_UNSANDBOXED=true: verify runs run without it", what)
    else:
        log.warning("sandbox UNAVAILABLE (%s): verify runs are refused (an operator may set "
                    "OPTDRIFT_ALLOW_UNSANDBOXED=true); commit runs get the weaker measures", what)


@task_postrun.connect
def _release_builds_after_task(**_kwargs) -> None:  # noqa: ANN003
    """A task's runs are over (a run, a co-run, a timing): the untrusted builds it made are deleted
    and the trusted ones it used may be evicted again (worker.build.cache.release_builds). A task
    whose process is killed leaves its untrusted builds to the next one's sweep."""
    from worker.build.cache import release_builds

    release_builds()


@worker_ready.connect
def _build_harness_before_runs(**_kwargs) -> None:  # noqa: ANN003
    """Build optdrift's own harness library (worker.engine.harness) before the first run is taken.
    Otherwise the first run that starts a kernel host on a fresh worker builds it, tens of seconds
    charged to that run's budget (a verify run's is small) for code that is not the run's. It runs
    in a process of its own: the Celery parent, which forks the pool's replacement processes, stays
    without torch. A library that does not build is logged; runs then use the Python paths."""
    settings = get_settings()
    device = settings.worker_device
    started = time.monotonic()
    try:
        built = subprocess.run([sys.executable, "-m", "worker.engine.harness", device], capture_output=True,
                               text=True, timeout=settings.max_build_s)
    except subprocess.TimeoutExpired:
        log.warning("the harness library for %s did not build within %g s (OPTDRIFT_MAX_BUILD_S); the "
                    "first run to start a kernel host builds it", device, settings.max_build_s)
        return
    if built.returncode != 0:
        log.warning("the harness library for %s did not build; runs use the engine's Python paths:\n%s",
                    device, log_tail.clip_lines(built.stderr[-4000:], max_line_chars=400))
    elif built.stdout.strip():
        log.info("harness library for %s ready in %.1f s: %s", device, time.monotonic() - started,
                 built.stdout.strip().splitlines()[-1])


class Heartbeat:
    def __init__(self, *, run_id: int, worker: str, interval_s: float):
        self.run_id, self.worker, self.interval_s = run_id, worker, interval_s
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{run_id}", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with get_sessionmaker()() as session:
                    if not runs.heartbeat(session=session, run_id=self.run_id, worker=self.worker):
                        self.lost.set()
                        return
            except Exception:  # noqa: BLE001  (a database blip: try again next beat)
                log.exception("heartbeat for run %s failed", self.run_id)

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        self._stop.set()


def _read_log(path: str | None) -> str:
    """What the run stores of its build log: the last MAX_LOG_CHARS bytes, lines clipped."""
    return log_tail.clip_lines(log_tail.tail_text(path, MAX_LOG_CHARS), max_line_chars=2000,
                               max_chars=MAX_LOG_CHARS)


class OptdriftFailure(RuntimeError):
    """A failure of optdrift, not of the commit (source fetch, sandbox unavailable, a worker bug):
    the run is retried with backoff, then ends `error` — never `failed`/broken."""


def execute_run(run_id: int, *, settings: Settings | None = None, worker: str | None = None) -> str:
    """Run `run_id` to a final status; returns that status ("skipped" if it was not claimable,
    "retrying" after an optdrift failure with attempts left)."""
    settings = settings or get_settings()
    worker = worker or worker_name()
    sessions = get_sessionmaker()

    def claim() -> bool:
        with sessions() as session:
            return runs.claim(session=session, run_id=run_id, worker=worker)

    # A task delivered while PostgreSQL restarts must not be lost: its message is acked when the
    # task returns, and nothing else would re-send a run that stays queued and dispatched.
    if not retry_database(claim, what=f"claiming run {run_id}"):
        log.info("run %s is not queued (taken, finished or cancelled); skipping", run_id)
        return "skipped"
    notify.run_changed(run_id, settings=settings)  # the check run shows "in progress" (issue 16)
    with Heartbeat(run_id=run_id, worker=worker, interval_s=settings.heartbeat_interval_s) as beat:
        try:
            status = _phases(run_id=run_id, settings=settings, worker=worker, beat=beat)
        except RunLost as lost:
            log.warning("run %s: %s", run_id, lost)
            return "lost"
        except VerifyYielded as yielded:
            return _give_way(run_id, settings=settings, worker=worker, note=str(yielded))
        except DATABASE_DOWN as exc:
            # Not the run's fault: leave it to the reaper, which re-queues it once the heartbeat is
            # stale (bounded by max_attempts); trajectories already stored are kept (unique rows).
            log.warning("run %s: database unavailable mid-run (%s); the reaper will re-queue it",
                        run_id, str(exc).splitlines()[0])
            return "lost"
        except Exception as exc:  # noqa: BLE001  (optdrift's failure: retried, never the commit's)
            reason = str(exc) if isinstance(exc, OptdriftFailure) else f"{type(exc).__name__}: {exc}"
            log.exception("run %s: optdrift failure", run_id)
            with sessions() as session:
                delay = runs.retry_later(session=session, run_id=run_id, worker=worker, error=reason,
                                         max_attempts=settings.max_attempts, backoff_s=settings.retry_backoff_s)
                if delay is not None:
                    _send_again(session, settings, run_id, delay)
                    return "retrying"
            status = ERROR
    waited_for_this = []
    with sessions() as session:
        run = session.get(Run, run_id)
        if run.status in (DONE, FAILED, ERROR) and run.worker == worker:
            # Runs that finished before this one, their baseline (another worker was faster), have
            # no verdict yet: they are judged now, and their co-runs are sent from here.
            if run.status == DONE:
                waited_for_this = [other.id for other in baselines.dependants(session=session, run=run)]
            verdict_store.evaluate_with_dependants(session=session, run=run)
            notify.run_changed(run_id, settings=settings, with_dependants=True)
    if status == DONE:
        for dependant in waited_for_this:
            _send_corun(dependant)
        _send_corun(run_id)
        _send_timing(run_id, settings)
    return status


def _send_timing(run_id: int, settings: Settings) -> None:
    """The kernels' own speed of a finished run, after its verdict, where this worker times at all
    (worker/speed/record.py), as a task of its own on the co-run queue."""
    from worker.speed import record as kernel_speed

    if kernel_speed.budget_s(settings) <= 0:
        return
    try:
        time_kernels_task.apply_async(args=[run_id], queue=corun_queue_for(settings.worker_environment))
    except Exception:  # noqa: BLE001  (the verdict stands without the speed)
        log.exception("run %s: could not queue the kernel timing", run_id)


def _send_corun(run_id: int) -> None:
    """The per-step |commit - baseline| of the changed cases, as a task of its own on the co-run
    queue: the verdict is stored already and the next run must not wait behind it."""
    with get_sessionmaker()() as session:
        verdict = session.scalar(select(Verdict).where(Verdict.run_id == run_id))
        environment = session.get(Run, run_id).environment
    if verdict is None or not verdict.changed_cases or verdict.baseline_run_id is None:
        return
    try:
        record_baseline_diffs_task.apply_async(args=[run_id], queue=corun_queue_for(environment))
        _corun_sent[run_id] = time.monotonic()
    except Exception:  # noqa: BLE001  (the verdict stands without the magnitudes)
        log.exception("run %s: could not queue the baseline co-run", run_id)


def timing_waits_for(runs_waiting: int) -> str | None:
    """Why a kernel timing must wait now (runs waiting for this environment, or a co-run this
    process queued less than CORUN_FIRST_S ago that has not started), or None."""
    if runs_waiting:
        return f"{runs_waiting} run(s) waiting"
    now = time.monotonic()
    for run_id, queued in list(_corun_sent.items()):
        if now - queued > CORUN_FIRST_S:
            _corun_sent.pop(run_id, None)
    if _corun_sent:
        return f"the co-run of run(s) {sorted(_corun_sent)} goes first"
    return None


def _send_again(session, settings: Settings, run_id: int, delay: float) -> None:  # noqa: ANN001
    """Dispatch a re-queued run to start after `delay` s; if the broker does not take it now, the
    API's maintenance loop sends it (it stays queued with no dispatch time)."""
    from datetime import datetime, timedelta, timezone

    from sqlalchemy import update

    from service.domain.queueing import send_run

    run = session.get(Run, run_id)
    try:
        send_run(settings=settings, run_id=run_id, environment=run.environment, kind=run.kind,
                 countdown=delay or None)
    except Exception as exc:  # noqa: BLE001
        log.warning("run %s: the broker did not take the retry (%s); the maintenance loop will", run_id, exc)
        return
    # When the broker hands it out: a retry's countdown included, so a running verify run does not
    # yield to a commit run that no worker may take yet (CommitRunsFirst).
    handed_out = datetime.now(timezone.utc) + timedelta(seconds=delay)
    session.execute(update(Run).where(Run.id == run_id).values(dispatched_at=handed_out))
    session.commit()


def _give_way(run_id: int, *, settings: Settings, worker: str, note: str) -> str:
    """A verify run yields (VerifyYielded): back to `queued` with `note` on its page, its stored
    cases deleted, its attempt not counted (runs.requeue_yielded), and sent again on the verify
    queue, which this worker consumes only once the commit runs' queue is empty. A cancel asked
    for meanwhile is honoured instead."""
    with get_sessionmaker()() as session:
        if not runs.requeue_yielded(session=session, run_id=run_id, worker=worker, note=note):
            # Not re-queued: a cancel was asked for (honoured here), or the run is no longer ours.
            if runs.cancel_requested(session=session, run_id=run_id) and runs.set_status(
                    session=session, run_id=run_id, worker=worker, status=CANCELLED, error="cancelled on request"):
                return CANCELLED
            log.warning("run %s: taken away while yielding to commit runs", run_id)
            return "lost"
        log.info("run %s: %s", run_id, note)
        _send_again(session, settings, run_id, 0.0)
    notify.run_changed(run_id, settings=settings)
    return "yielded"


def _record_baseline_diffs(run_id: int, settings: Settings) -> str:
    """Per-step |commit − baseline| for the changed cases (worker/baseline_diffs.py). The verdict is
    already stored and stands without them, so a failure here is logged, never raised. Between
    cases the co-run yields to runs waiting for this environment: it stops and is queued again."""
    from worker.baseline_diffs import CorunYielded, record_baseline_diffs

    _corun_sent.pop(run_id, None)  # started: the timings no longer wait for it

    def yield_to_runs() -> None:
        with get_sessionmaker()() as session:
            waiting = runs.queued_count(session=session, environment=settings.worker_environment)
        if waiting:
            raise CorunYielded(f"{waiting} run(s) waiting for {settings.worker_environment}")

    try:
        count = record_baseline_diffs(run_id=run_id, settings=settings, between_cases=yield_to_runs)
        if count:
            log.info("run %s: per-step |commit - baseline| stored for %d changed cases", run_id, count)
            notify.run_changed(run_id, settings=settings)  # the check and PR comment gain max |Δ|
        return "stored"
    except CorunYielded as waiting:
        log.info("run %s: baseline co-run yields (%s); queued again", run_id, waiting)
        with get_sessionmaker()() as session:
            environment = session.get(Run, run_id).environment
        record_baseline_diffs_task.apply_async(args=[run_id], queue=corun_queue_for(environment),
                                               countdown=settings.corun_retry_s)
        return "yielded"
    except Exception:  # noqa: BLE001
        log.exception("run %s: co-running the baseline for per-step diffs failed", run_id)
        return "failed"


class StoredResults:
    """The run's case results, stored in batches: one transaction holds up to BATCH results and
    the progress they make (`cases_done`), so progress never runs ahead of what is stored, and a
    battery of a thousand cases costs a few dozen commits instead of a thousand (each with its
    cancel check and heartbeat), which would hold the kernel host's answers back.
    A batch is written when it is full, FLUSH_AFTER_S after its first result, whenever the kernel
    host has no further result ready (`flush` as the pipeline's on_pause: its results come in
    bursts, one per wave), and at the end."""

    BATCH = 128
    FLUSH_AFTER_S = 0.5

    def __init__(self, *, session, run_id: int, worker: str, beat: Heartbeat) -> None:  # noqa: ANN001
        self.session, self.run_id, self.worker, self.beat = session, run_id, worker, beat
        self.pending: list[tuple[int, object]] = []
        self.indices: set[int] = set()
        self.oldest = 0.0

    def __len__(self) -> int:  # cases stored or about to be (what the budget counts)
        return len(self.indices) + len(self.pending)

    def add(self, index: int, result) -> None:  # noqa: ANN001
        if not self.pending:
            self.oldest = time.monotonic()
        self.pending.append((index, result))
        if len(self.pending) >= self.BATCH or time.monotonic() - self.oldest >= self.FLUSH_AFTER_S:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        session = self.session
        _checkpoint(session=session, run_id=self.run_id, worker=self.worker, beat=self.beat)
        trajectories.store_case_results(session=session, run_id=self.run_id, results=self.pending)
        done = self.indices | {index for index, _ in self.pending}
        # The trajectories and the progress commit together, or (the run was taken away) neither.
        if not runs.heartbeat(session=session, run_id=self.run_id, worker=self.worker, cases_done=len(done)):
            raise RunLost("the run was taken away while running cases")
        self.indices, self.pending = done, []


def _checkpoint(*, session, run_id: int, worker: str, beat: Heartbeat) -> None:  # noqa: ANN001
    """Between phases: stop if the run was taken from us or a cancel was asked for."""
    if beat.lost.is_set():
        raise RunLost("heartbeat lost; another attempt owns this run now")
    if runs.cancel_requested(session=session, run_id=run_id):
        runs.set_status(session=session, run_id=run_id, worker=worker, status=CANCELLED,
                        error="cancelled on request")
        raise RunLost("cancelled on request")


def _refusal(run: Run, settings: Settings) -> str | None:
    """Why this worker will not run `run` at all, or None."""
    available, what = sandbox.status()
    if run.kind == "verify" and not available and not settings.allow_unsandboxed:
        return (f"this worker cannot sandbox builds ({what}), and verify runs execute a contributor's "
                "code: they need the sandbox. Install bubblewrap on the worker, or an operator may set "
                "OPTDRIFT_ALLOW_UNSANDBOXED=true")
    return None


def _baseline_digests(session, run: Run) -> dict[str, list[str]]:  # noqa: ANN001
    """case id -> digests of the run's baseline, if it has finished: the cases that differ from it
    are repeated before the run ends (worker/pipeline.py)."""
    choice = baselines.choose(session=session, run=run)
    if choice.run is None or choice.pending or choice.run.status != DONE:
        return {}
    return {row.case_id: row.digests.split("\n") for row in trajectories.list_rows(session=session, run_id=choice.run.id)
            if row.status == "ok" and row.digests}


def _phases(*, run_id: int, settings: Settings, worker: str, beat: Heartbeat) -> str:
    from service.db.models import Project
    from service.core.project_config import ProjectConfigError
    from worker import pipeline
    from worker.battery import BatteryError

    with get_sessionmaker()() as session, tempfile.TemporaryDirectory(prefix=f"optdrift-run{run_id}-") as tmp:
        run = session.get(Run, run_id)

        def fail(error: str) -> str:  # the commit's fault: broken
            runs.set_status(session=session, run_id=run_id, worker=worker, status=FAILED, error=error)
            return FAILED

        refusal = _refusal(run, settings)
        if refusal:
            raise OptdriftFailure(refusal)
        # A verify run's budget starts again with each start (it may yield and start over,
        # CommitRunsFirst): each start may use all of it; no start uses more.
        budget = RunBudget(settings, untrusted=run.kind == "verify")
        commits_first = CommitRunsFirst(run) if run.kind == "verify" else None

        def give_way(where: str) -> None:
            if commits_first is not None:
                commits_first.check(where)
        try:
            source_dir = fetch_source(
                base_url=settings.resolved_public_url, digest=run.source_digest, dest=Path(tmp) / "src",
                limits=archive_limits(settings), max_bytes=settings.max_upload_bytes,
                token=settings.resolved_worker_token())
        except Exception as exc:  # noqa: BLE001
            raise OptdriftFailure(f"fetching the source {run.source_digest[:12]} from {settings.resolved_public_url} "
                                  f"failed: {exc}") from exc
        _checkpoint(session=session, run_id=run_id, worker=worker, beat=beat)
        give_way("before its build")
        try:
            job = pipeline.prepare(source_dir, project=session.get(Project, run.project_id),
                                   requested_battery=run.battery)
        except (ProjectConfigError, BatteryError) as error:
            return fail(str(error))
        policy = pipeline.Policy(
            device=settings.worker_device, fast_engine=settings.fast_engine,
            cache_dir=settings.resolved_build_cache_dir,
            cuda_archs=[] if settings.worker_device == "cpu" else None, trusted=not budget.untrusted,
            max_build_s=budget.build_s, case_timeout_s=budget.case_timeout_s, deadline=budget.deadline,
            reference_cache=settings.resolved_build_cache_dir / "references",
            warm_host=settings.resolved_warm_host,
            host_slot_root=settings.resolved_build_cache_dir / "host-slots")
        built = pipeline.build(job, policy)
        available, what = sandbox.status()
        detail = {**job.record(), "battery_version": job.battery.version, "build_ok": built.ok,
                  "build_error": built.error, "cuda_archs": built.cuda_archs,
                  "sandbox": what if available else f"none: {what}"}
        if job.config.build.kind == "torch-extension":  # the tree's own flags (docs/PROJECTS.md)
            detail["build_flags"] = {"cflags": job.config.build.cflags, "cuda_cflags": job.config.build.cuda_cflags,
                                     "defines": job.config.build.defines}
        if not runs.heartbeat(session=session, run_id=run_id, worker=worker,
                              build_log=_read_log(built.log_path), build_digest=built.digest,
                              build_cached=built.cached, battery_hash=job.battery.digest,
                              environment_detail=detail):
            raise RunLost("the run was taken away during the build")
        if not built.ok:
            return fail(f"build failed: {built.error}")
        _checkpoint(session=session, run_id=run_id, worker=worker, beat=beat)
        if commits_first is not None:
            commits_first.last_check = float("-inf")  # the build may have been long: look now
        give_way("after its build")

        runs.set_status(session=session, run_id=run_id, worker=worker, status=RUNNING,
                        cases_total=len(job.cases), cases_done=0)
        stored = StoredResults(session=session, run_id=run_id, worker=worker, beat=beat)

        def store(index: int, result) -> None:  # noqa: ANN001
            # Before storing: a run that yields writes nothing more (and what it wrote is deleted).
            give_way(f"after {len(stored)} of {len(job.cases)} cases")
            stored.add(index, result)
            if budget.exceeded():
                stored.flush()
                raise RunBudgetExceeded(budget.reason(len(stored), len(job.cases)))

        fingerprint: dict | None = None
        try:
            ran = pipeline.run(job, built, policy, on_result=store, on_pause=stored.flush,
                               baseline_digests=_baseline_digests(session, run))
            stored.flush()
        except RunBudgetExceeded as exceeded:
            return fail(str(exceeded))
        if ran.environment is not None:
            fingerprint = ran.environment.model_dump(mode="json")
        if ran.adapter:  # what the kernel host loaded (the adapter's describe(): version, path)
            detail["adapter"] = ran.adapter
        runs.set_status(session=session, run_id=run_id, worker=worker, status=DONE,
                        environment_detail={**detail, **({"fingerprint": fingerprint} if fingerprint else {})})
        return DONE


@app.task(name=RUN_TASK_NAME, ignore_result=True)
@gc_policy.collect_after  # a full collection after the task, none during it
def execute_run_task(run_id: int) -> str:
    return execute_run(run_id)


@app.task(name=CORUN_TASK_NAME, ignore_result=True)
@gc_policy.collect_after  # a full collection after the task, none during it
def record_baseline_diffs_task(run_id: int) -> str:
    return _record_baseline_diffs(run_id, get_settings())


@app.task(name="optdrift.time_kernels", ignore_result=True)
@gc_policy.collect_after  # a full collection after the task, none during it
def time_kernels_task(run_id: int) -> str:
    """The kernels' own speed of a finished run (worker/speed/record.py). Like the co-run it
    never holds a run back: while runs wait for this environment it is queued again for later."""
    from worker.speed.record import TimingYielded, time_run

    settings = get_settings()

    def waiting() -> int:
        with get_sessionmaker()() as session:
            return runs.queued_count(session=session, environment=settings.worker_environment)

    # Checked before, and while the host times (it is stopped within record.YIELD_POLL_S): a run
    # submitted right after a verdict must not wait behind the timing of the previous one, nor a
    # flagged run's co-run (timing_waits_for).
    reason = timing_waits_for(waiting())
    if reason is None:
        try:
            return time_run(run_id=run_id, settings=settings, should_yield=lambda: waiting() > 0)
        except TimingYielded:
            reason = f"{waiting()} run(s) waiting"
    time_kernels_task.apply_async(args=[run_id], queue=corun_queue_for(settings.worker_environment),
                                  countdown=settings.corun_retry_s)
    log.info("run %s: kernel timing yields (%s); queued again", run_id, reason)
    return "yielded"
