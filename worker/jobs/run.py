"""The run job: execute a run, given only its id.

claim (conditional UPDATE queued -> building) -> fetch source over HTTP -> build (digest cache) ->
run the battery case by case in a kernel-host subprocess (this process never touches CUDA),
writing the trajectories and the progress in batches as it goes -> done -> verdict against the
baseline -> the co-run and the timing sent (follow_ups.py). A heartbeat thread keeps
`heartbeat_at` fresh; cancellation is honoured between phases and batches; if the reaper took the
run away (heartbeat lost), the job stops writing. Every database access is service.run_store's.

A watchdog thread (worker/jobs/watchdog.py) arms a deadline around each phase that waits on a box
(build, kernel host, blame): its own limit + OPTDRIFT_WATCHDOG_SLACK_S. Past it, on a cancel, or
when the worker is told to shut down, it kills the run's boxes; the job sees JobStopped at its next
check and settles the run (a deadline: `error`, not retried; a cancel: `cancelled`; a shutdown:
queued again for another worker, the start not counted). If this thread stays blocked, the
watchdog records the run itself and ends the process (docs/security/SANDBOX.md, "No run can wedge a worker").
"""

from __future__ import annotations

import logging
import threading
import time

from service import run_store
from service.core import not_buildable
from service.core.project_config import ProjectConfigError
from service.run_store import (
    CANCELLED, DATABASE_DOWN, DONE, ERROR, FAILED, ClaimedRun, RunFacts, RunLost, retry_database,
)
from service.settings import Settings, get_settings
from worker import pipeline, sandbox
from worker.battery import BatteryError
from worker.build import progress as build_progress
from worker.build.refusal import refusal_of
from worker.identity import worker_name
from worker.jobs import follow_ups
from worker.jobs.watchdog import CANCEL, DEADLINE, JobStopped, Stop, Watchdog
from worker.jobs.workspace import Workspace, build_limit_s
from worker.sandbox import log_tail

log = logging.getLogger(__name__)
MAX_LOG_CHARS = 200_000


class RunBudget:
    """The operator's caps for one run (service.settings): build time, per-case timeout, total time.
    A verify run (a contributor's code, the lowest trust) gets the smaller verify_* caps. A tree's
    optdrift.toml may ask for less, never more."""

    def __init__(self, settings: Settings, *, untrusted: bool):
        self.untrusted = untrusted
        self.run_s = settings.verify_max_run_s if untrusted else settings.max_run_s
        self.build_s = build_limit_s(settings, untrusted=untrusted)
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


class OptdriftFailure(RuntimeError):
    """A failure of optdrift, not of the commit (source fetch, sandbox unavailable, a worker bug):
    the run is retried with backoff, then ends `error` — never `failed`/broken."""


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

    def __init__(self, run: RunFacts) -> None:
        self.run_id, self.environment, self.since = run.id, run.environment, run.started_at
        self.last_check = float("-inf")

    def waiting(self) -> int:
        from datetime import datetime, timedelta, timezone

        cutoff = datetime.now(timezone.utc) - timedelta(seconds=self.GRACE_S)
        return run_store.queued_count(environment=self.environment, kind="commit", dispatched_after=self.since,
                                      dispatched_before=cutoff)

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


class Heartbeat:
    def __init__(self, *, run_id: int, worker: str, interval_s: float):
        self.run_id, self.worker, self.interval_s = run_id, worker, interval_s
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{run_id}", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if not run_store.heartbeat(self.run_id, worker=self.worker):
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


def execute_run(run_id: int, *, settings: Settings | None = None, worker: str | None = None) -> str:
    """Run `run_id` to a final status; returns that status ("skipped" if it was not claimable,
    "retrying" after an optdrift failure with attempts left)."""
    settings = settings or get_settings()
    worker = worker or worker_name()

    # A task delivered while PostgreSQL restarts must not be lost: its message is acked when the
    # task returns, and nothing else would re-send a run that stays queued and dispatched.
    if not retry_database(lambda: run_store.claim(run_id, worker=worker), what=f"claiming run {run_id}"):
        log.info("run %s is not queued (taken, finished or cancelled); skipping", run_id)
        return "skipped"
    run_store.run_changed(run_id, settings=settings)  # the check run shows "in progress" (issue 16)
    guard = Watchdog(label=f"run {run_id}", grace_s=settings.watchdog_grace_s,
                     cancelled=lambda: run_store.cancel_requested(run_id),
                     on_wedged=lambda stop: _record_wedged(run_id, stop, settings=settings, worker=worker))
    with guard, Heartbeat(run_id=run_id, worker=worker, interval_s=settings.heartbeat_interval_s) as beat:
        try:
            status = _phases(run_id=run_id, settings=settings, worker=worker, beat=beat, guard=guard)
        except JobStopped as stopped:
            status = _settle_stopped(run_id, stopped.stop, settings=settings, worker=worker)
            if status != ERROR:  # an `error` is judged below, like any other
                return status
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
            if run_store.retry_later(run_id, worker=worker, error=reason, settings=settings):
                return "retrying"
            status = ERROR
    # Runs that finished before this one, their baseline (another worker was faster), have no
    # verdict yet: they are judged now, and their co-runs are sent from here.
    waited_for_this = run_store.judge(run_id, worker=worker, settings=settings)
    if status == DONE:
        for dependant in waited_for_this:
            follow_ups.send_corun(dependant)
        follow_ups.send_corun(run_id)
        follow_ups.send_environment_attributions(run_id)
        follow_ups.send_timing(run_id, settings)
    return status


NOT_RETRIED = ("a run that wedges a worker is not handed to another (docs/SECURITY.md); `optdrift retry` "
               "runs it again")


def _settle_stopped(run_id: int, stop: Stop, *, settings: Settings, worker: str) -> str:
    """The watchdog stopped the run and this thread unwound: a cancel ends it `cancelled`; a
    deadline `error`, never re-sent; a shutdown queues it again for another worker, this start not
    counted (the worker's going is not the run's failure)."""
    log.warning("run %s: stopped by the watchdog (%s): %s", run_id, stop.cause, stop.reason)
    if stop.cause == CANCEL:
        run_store.end_stopped(run_id, worker=worker, status=CANCELLED, error="cancelled on request")
        return CANCELLED
    if stop.cause == DEADLINE:
        run_store.end_stopped(run_id, worker=worker, status=ERROR,
                              error=f"{stop.reason}; its boxes were killed on worker {worker}: {NOT_RETRIED}")
        return ERROR
    return _give_way(run_id, settings=settings, worker=worker,
                     note=f"worker {worker} shut down mid-run ({stop.reason}); queued again for another worker "
                          "(this start is not counted)")


def _record_wedged(run_id: int, stop: Stop, *, settings: Settings, worker: str) -> None:
    """The watchdog's record of a run whose thread stayed blocked after its boxes were killed (its
    worker process ends next): `cancelled` for a cancel, else `error`, never re-sent."""
    blocked = (f"its task stayed blocked {settings.watchdog_grace_s:g} s after its boxes were killed, so worker "
               f"{worker} ended its process")
    if stop.cause == CANCEL:
        run_store.end_stopped(run_id, worker=worker, status=CANCELLED, error=f"cancelled on request; {blocked}")
        return
    if run_store.end_stopped(run_id, worker=worker, status=ERROR, error=f"{stop.reason}; {blocked}: {NOT_RETRIED}"):
        run_store.judge(run_id, worker=worker, settings=settings)


def _give_way(run_id: int, *, settings: Settings, worker: str, note: str) -> str:
    """A verify run yields (VerifyYielded): back to `queued` with `note` on its page, sent again
    on the verify queue, which this worker consumes only once the commit runs' queue is empty
    (service.run_store.give_way). A cancel asked for meanwhile is honoured instead."""
    outcome = run_store.give_way(run_id, worker=worker, note=note, settings=settings)
    if outcome == "lost":
        log.warning("run %s: taken away while yielding to commit runs", run_id)
    elif outcome == "yielded":
        log.info("run %s: %s", run_id, note)
    return outcome


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

    def __init__(self, claimed: ClaimedRun, *, beat: Heartbeat, guard: Watchdog) -> None:
        self.claimed, self.beat, self.guard = claimed, beat, guard
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
        _checkpoint(self.claimed, beat=self.beat, guard=self.guard)
        done = self.indices | {index for index, _ in self.pending}
        self.claimed.store_batch(self.pending, cases_done=len(done))
        self.indices, self.pending = done, []


def _checkpoint(claimed: ClaimedRun, *, beat: Heartbeat, guard: Watchdog) -> None:
    """Between phases: stop if the watchdog stopped the run, the run was taken from us or a cancel
    was asked for."""
    guard.check()
    if beat.lost.is_set():
        raise RunLost("heartbeat lost; another attempt owns this run now")
    if claimed.cancel_if_asked():
        raise RunLost("cancelled on request")


def _refusal(run: RunFacts, settings: Settings) -> str | None:
    """Why this worker will not run `run` at all, or None."""
    available, what = sandbox.status()
    if run.kind == "verify" and not available and not settings.allow_unsandboxed:
        return (f"this worker cannot sandbox builds ({what}), and verify runs execute a contributor's "
                "code: they need the sandbox. Install bubblewrap on the worker, or an operator may set "
                "OPTDRIFT_ALLOW_UNSANDBOXED=true")
    return None


def _blame(run: RunFacts, ran: pipeline.Ran, *, workspace: Workspace, project, policy: pipeline.Policy,  # noqa: ANN001
           store: StoredResults) -> None:
    """The run's nondeterministic cases: remembered for the project, and repeated on the BASELINE's
    build (a cache hit: it ran here before) to say whether this commit introduced the nondeterminism
    or found it (docs/ENGINE.md, Nondeterminism). Results stored again with the baseline's repeats;
    without a finished baseline, or when its source or build fails, the cases stay unblamed."""
    unsteady = [(index, result) for index, result in enumerate(ran.results)
                if result.repeat_check is not None and result.repeat_check.differing]
    if not unsteady:
        return
    run_store.remember_unsteady(run.project_id, run.id, [result.case.case_id for _, result in unsteady])
    baseline = run_store.baseline_of(run.id)
    if baseline is None:
        return
    try:
        job = workspace.prepare(workspace.fetch(baseline.source_digest, name="baseline"), project=project,
                                battery=baseline.battery)
        built = workspace.build(job, policy)
    except Exception:  # noqa: BLE001  (the baseline's fault or the fetch's: the cases stay unblamed)
        log.exception("run %s: the baseline %s could not be prepared for blame", run.id, baseline.id)
        return
    if not built.ok:
        log.warning("run %s: the baseline %s does not build here; nondeterminism not blamed", run.id, baseline.id)
        return
    try:
        checks = pipeline.blame(job, built, policy, [result.case for _, result in unsteady])
    except Exception:  # noqa: BLE001  (past the run's deadline, a host that died: the cases stay unblamed)
        log.exception("run %s: repeating the baseline %s for blame failed", run.id, baseline.id)
        return
    run_store.remember_unsteady(run.project_id, baseline.id,
                                [case_id for case_id, check in checks.items() if check.differing])
    for index, result in unsteady:
        if result.case.case_id in checks:
            ran.results[index] = pipeline.with_baseline_repeats(result, checks[result.case.case_id])
            store.add(index, ran.results[index])
    store.flush()


def _phases(*, run_id: int, settings: Settings, worker: str, beat: Heartbeat, guard: Watchdog) -> str:
    with run_store.open_run(run_id, worker=worker) as claimed, \
            Workspace(settings, prefix=f"optdrift-run{run_id}-") as workspace:
        run = claimed.run

        def fail(error: str) -> str:  # the commit's fault: broken
            guard.check()  # unless the watchdog killed what failed
            claimed.fail(error)
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
            source_dir = workspace.fetch(run.source_digest)
        except Exception as exc:  # noqa: BLE001
            raise OptdriftFailure(f"fetching the source {run.source_digest[:12]} from {settings.resolved_public_url} "
                                  f"failed: {exc}") from exc
        _checkpoint(claimed, beat=beat, guard=guard)
        give_way("before its build")
        slack_s = settings.watchdog_slack_s
        # Until the build's log is read: the box's files are waits too.
        with guard.phase("build", budget.build_timeout_s() + slack_s):
            try:
                job = workspace.prepare(source_dir, project=claimed.project, battery=run.battery, kind=run.kind)
            except (ProjectConfigError, BatteryError) as error:
                return fail(str(error))
            policy = workspace.policy(untrusted=budget.untrusted, environment=run.environment, warm=True,
                                      case_timeout_s=budget.case_timeout_s,
                                      deadline=budget.deadline,
                                      reference_cache=settings.resolved_build_cache_dir / "references")
            # The build's progress on the run while it builds, for its page (at most once a second).
            with build_progress.listening(lambda step: run_store.build_progress(
                    claimed.run_id, worker=claimed.worker, **step.counts()), every_s=1.0):
                built = workspace.build(job, policy)
            build_log = _read_log(built.log_path)
        guard.check()  # a build the watchdog killed is not the commit's failure
        available, what = sandbox.status()
        detail = {**job.record(), "battery_version": job.battery.version, "build_ok": built.ok,
                  "build_error": built.error, "cuda_archs": built.cuda_archs,
                  "toolchain": built.toolchain.model_dump(mode="json") if built.toolchain else None,
                  "build_variant": policy.build_variant.model_dump(mode="json") if policy.build_variant else None,
                  "sandbox": what if available else f"none: {what}"}
        if job.config.build.kind == "torch-extension":  # the tree's own flags (docs/PROJECTS.md)
            detail["build_flags"] = {"cflags": job.config.build.cflags, "cuda_cflags": job.config.build.cuda_cflags,
                                     "defines": job.config.build.defines}
        if not claimed.record(build_log=build_log, build_digest=built.digest,
                              build_cached=built.cached, battery_hash=job.battery.digest,
                              environment_detail=detail):
            raise RunLost("the run was taken away during the build")
        if not built.ok:
            # A tree that refuses this worker's CUDA, compiler or torch (worker/build/refusal.py) is
            # not broken: its error says so, and the CLI exits 8 for it (service/core/not_buildable.py).
            refused = refusal_of(built)
            return fail(not_buildable.sentence(run.environment, refused) if refused else f"build failed: {built.error}")
        _checkpoint(claimed, beat=beat, guard=guard)
        if commits_first is not None:
            commits_first.last_check = float("-inf")  # the build may have been long: look now
        give_way("after its build")

        claimed.start_cases(len(job.cases))
        stored = StoredResults(claimed, beat=beat, guard=guard)

        def store(index: int, result) -> None:  # noqa: ANN001
            # Before storing: a run that yields writes nothing more (and what it wrote is deleted).
            give_way(f"after {len(stored)} of {len(job.cases)} cases")
            stored.add(index, result)
            if budget.exceeded():
                stored.flush()
                raise RunBudgetExceeded(budget.reason(len(stored), len(job.cases)))

        fingerprint: dict | None = None
        try:
            # A case may run past the run's budget by its own timeout before the budget is looked at.
            with guard.phase("kernel host", max(0.0, budget.deadline - time.monotonic()) + budget.case_timeout_s
                             + slack_s):
                ran = pipeline.run(job, built, policy, on_result=store, on_pause=stored.flush,
                                   baseline_digests=claimed.baseline_digests(),
                                   unsteady=run_store.unsteady_case_ids(run.project_id))
                stored.flush()
            # Blame builds the baseline (a cache hit, usually) and repeats cases until the deadline.
            with guard.phase("blame", budget.build_s + max(0.0, budget.deadline - time.monotonic())
                             + budget.case_timeout_s + slack_s):
                _blame(run, ran, workspace=workspace, project=claimed.project, policy=policy, store=stored)
        except RunBudgetExceeded as exceeded:
            return fail(str(exceeded))
        if ran.environment is not None:
            fingerprint = ran.environment.model_dump(mode="json")
            detail["reference_digests"] = pipeline.reference_digests(job, ran)
        if ran.adapter:  # what the kernel host loaded (the adapter's describe(): version, path)
            detail["adapter"] = ran.adapter
        guard.check()
        claimed.finish({**detail, **({"fingerprint": fingerprint} if fingerprint else {})})
        return DONE
