"""Compute and store a run's verdict against its baseline (comparison logic: service.core.verdicts)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.db.models import DONE, FAILED, FINAL_STATUSES, Run, Verdict
from service.domain import acknowledgements, baselines, trajectories
from service.domain.errors import ConflictError, NotFoundError
from service.core import outcomes
from service.core.results import RunComparison
from service.core.verdict_detail import CorunFinding, CorunRecord, VerdictDetail

# Outcomes that are findings a maintainer may acknowledge (service/core/outcomes.py `flagged`).
# nondeterministic too: a kernel that became nondeterministic in this commit (or whose baseline
# could not be repeated to tell) is a finding the maintainer must see; one nondeterministic before
# the commit too does not make a run so. Named in the selector's order (changed, broken, ...).
FLAGGING_OUTCOMES = tuple(sorted(outcomes.FLAGGED, key=outcomes.FILTER_ORDER.index))


def _compare(commit_result, baseline_result) -> RunComparison:  # noqa: ANN001
    from service.core import verdicts  # the engine engineer's pure-python comparison

    return verdicts.compare_runs(commit_result, baseline_result)


def of_run(*, session: Session, run_id: int) -> Verdict | None:
    """The run's verdict; None while it has none."""
    return session.scalar(select(Verdict).where(Verdict.run_id == run_id))


def detail_of(verdict: Verdict) -> VerdictDetail:
    """The verdict's stored detail, typed (service.core.verdict_detail)."""
    return VerdictDetail.model_validate(verdict.detail)


def set_detail(verdict: Verdict, detail: VerdictDetail) -> None:
    """The verdict's detail replaced by `detail`, stored as its JSON (the caller commits)."""
    verdict.detail = detail.stored()


def evaluate(*, session: Session, run: Run) -> Verdict | None:
    """Write the verdict of a finished run; None while its baseline has not finished."""
    existing = of_run(session=session, run_id=run.id)
    if existing is not None:
        return existing
    baseline_run = None
    choice = None
    if run.status == FAILED:
        comparison = RunComparison(
            verdict="broken", summary=f"run failed: {run.error or 'unknown error'}",
            battery_digest=run.battery_hash or "", commit_build_digest=run.build_digest)
    elif run.status == DONE:
        choice = baselines.choose(session=session, run=run)
        if choice.pending:
            return None
        baseline_run = choice.run
        commit_result = trajectories.run_result(session=session, run=run)
        baseline_result = (trajectories.run_result(session=session, run=baseline_run)
                           if baseline_run is not None else None)
        comparison = _compare(commit_result, baseline_result)
    else:
        # Not finished, cancelled, or error: an error is optdrift's failure (retried, then shown as
        # such), never a verdict on the commit, so it gets none.
        return None
    verdict = Verdict(
        run_id=run.id, baseline_run_id=baseline_run.id if baseline_run else None, **_judged(comparison),
        # Which commit the run was compared with, how far back, and why (or why none).
        baseline_commits_back=choice.commits_back if choice is not None and baseline_run is not None else None,
        baseline_note=choice.reason if choice is not None else None,
    )
    record_build_change(verdict, run, baseline_run)
    session.add(verdict)
    session.flush()
    # The same change a person acknowledged on another sha (a PR's merge sha) is acknowledged here too.
    acknowledgements.carry_over(session=session, verdict=verdict)
    return verdict


def _judged(comparison: RunComparison) -> dict:
    """A verdict's columns read from its comparison: the one rule for a run judged when it ends
    and judged again when its co-run finds a case that does not reproduce itself (`rejudge`)."""
    changed = [case for case in comparison.cases if case.verdict in ("changed", "broken")]
    first_steps = [case.first_divergent_step for case in changed if case.first_divergent_step]
    return {"outcome": comparison.verdict, "flagged": comparison.verdict in FLAGGING_OUTCOMES,
            "changed_cases": len(changed), "first_divergent_step": min(first_steps) if first_steps else None,
            "detail": comparison.model_dump(mode="json")}


def record_build_change(verdict: Verdict, run: Run | None = None, baseline_run: Run | None = None) -> None:
    """What differs between the two runs' builds (flags, defines, compilers: their recorded
    environment details) into the verdict's detail, where the attribution's words name it
    (service/core/attribution_view.py); nothing when they were built alike. `run`, `baseline_run`:
    the verdict's own (default: its relationships)."""
    from service.core.environment_attribution import build_change_of_runs

    run = run if run is not None else verdict.run
    baseline_run = baseline_run if baseline_run is not None else verdict.baseline_run
    change = build_change_of_runs(run.environment_detail, baseline_run.environment_detail) if baseline_run else None
    set_detail(verdict, detail_of(verdict).with_build_change(change))


def rejudge(*, verdict: Verdict, comparison: RunComparison, corun: CorunRecord, finding: CorunFinding) -> None:
    """The stored verdict replaced by `comparison` of the same run and baseline, now that a case's
    stored trajectory carries more evidence (the co-run found it does not reproduce itself:
    worker/jobs/corun.py), with the co-run's record and `finding` beside it in the detail. Its
    outcome may change (changed -> nondeterministic); the baseline, the builds' difference and the
    acknowledgement stay."""
    build_change = detail_of(verdict).build_change
    for column, value in _judged(comparison).items():
        setattr(verdict, column, value)
    set_detail(verdict, VerdictDetail.of(comparison, corun, finding).with_build_change(build_change))


def evaluate_with_dependants(*, session: Session, run: Run) -> Verdict | None:
    """The run's own verdict, then those of runs that were waiting for it as their baseline.

    With several workers a run and its baseline can finish at the same moment, and both workers
    then judge the child: one insert wins (one verdict per run), the other meets the unique key.
    It starts again, finds the stored verdict and keeps it (the same stored results give the same
    comparison)."""
    for attempt in (1, 2):
        try:
            verdict = evaluate(session=session, run=run)
            # Any final status: a child that waited for this run is judged now, against this run
            # if it finished, else against the ancestor baselines.choose walks on to.
            if run.status in FINAL_STATUSES:
                for other in baselines.dependants(session=session, run=run):
                    evaluate(session=session, run=other)
            session.commit()
            return verdict
        except IntegrityError:
            session.rollback()
            if attempt == 2:
                raise
    return None  # not reached


def nothing_to_acknowledge(*, run_id: int, verdict: Verdict) -> str | None:
    """Why a verdict cannot be acknowledged, or None when it can: only a flagging outcome (a change,
    a broken build, nondeterminism) is something a maintainer can declare intended. Acknowledging an
    unchanged or no-baseline run would record an intention nobody had, and mark the run as an
    accepted change on the dashboard and in the case history."""
    if verdict.outcome in FLAGGING_OUTCOMES:
        return None
    why = ("it has no baseline to change from" if verdict.outcome == outcomes.NO_BASELINE
           else f"its verdict is {verdict.outcome}")
    return (f"run {run_id} has nothing to acknowledge: {why}; only a {', '.join(FLAGGING_OUTCOMES[:-1])} "
            f"or {FLAGGING_OUTCOMES[-1]} verdict can be acknowledged")


def acknowledge(*, session: Session, run: Run, note: str, by: str | None) -> Verdict:
    """A maintainer marks a flagged change as intended: it no longer fails CI, and as the commit's
    run it is the baseline its children compare with."""
    verdict = session.scalar(select(Verdict).where(Verdict.run_id == run.id))
    if verdict is None:
        raise NotFoundError(f"run {run.id} has no verdict yet; wait for it to finish")
    if not note.strip():
        raise ConflictError("an acknowledgement needs a note saying why the change is intended")
    refusal = nothing_to_acknowledge(run_id=run.id, verdict=verdict)
    if refusal:
        raise ConflictError(refusal)
    return acknowledgements.record(session=session, verdict=verdict, note=note, by=by)


def acknowledge_runs(*, session: Session, runs: list[Run], note: str, by: str | None) -> list[Verdict]:
    """A commit's acknowledgement: every run of it whose verdict flags (one per environment); its
    unchanged runs stay as they are. Refused when none of them has anything to acknowledge."""
    verdicts = {}
    for run in runs:
        verdict = session.scalar(select(Verdict).where(Verdict.run_id == run.id))
        if verdict is None:
            raise NotFoundError(f"run {run.id} has no verdict yet; wait for it to finish")
        verdicts[run.id] = verdict
    flagging = [run for run in runs if nothing_to_acknowledge(run_id=run.id, verdict=verdicts[run.id]) is None]
    if runs and not flagging:
        raise ConflictError("; ".join(nothing_to_acknowledge(run_id=run.id, verdict=verdicts[run.id]) or ""
                                      for run in runs))
    return [acknowledge(session=session, run=run, note=note, by=by) for run in flagging]
