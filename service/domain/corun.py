"""What a judged run's baseline co-run (worker/jobs/corun.py) reads and stores beside its verdict:
the changed cases still without per-step |commit - baseline|, then those diffs, the attribution,
or how it ended without them (a case that does not reproduce itself, judged again; or given up).

The verdict's detail is typed (service.core.verdict_detail.VerdictDetail); its outcome changes only
when a re-run does not reproduce a stored trajectory (the run is judged again by the rule every run
goes through, service.domain.verdict_store.rejudge).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.orm import Session

from service.core.results import RepeatCheck, RunComparison
from service.core.verdict_detail import CorunFinding, CorunRecord, VerdictDetail
from service.core.verdicts import compare_runs
from service.db.models import DONE, Run
from service.domain import runs, trajectories, verdict_store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CorunSides:
    """A judged run, its baseline and its changed cases still without per-step diffs."""

    run: Run
    baseline: Run
    changed_ids: set[str]


def environment(*, session: Session, run_id: int) -> str | None:
    """The run's environment when its verdict names changed cases against a baseline (a co-run
    then adds their per-step |commit - baseline|), else None."""
    verdict = verdict_store.of_run(session=session, run_id=run_id)
    run_environment = runs.lookup(session=session, run_id=run_id).environment
    if verdict is None or not verdict.changed_cases or verdict.baseline_run_id is None:
        return None
    return run_environment


def sides(*, session: Session, run_id: int) -> CorunSides | None:
    """What is left to co-run of a done run; None when nothing is: no verdict against a baseline,
    every changed case has its diffs, or the co-run ended without them (final)."""
    run = runs.lookup(session=session, run_id=run_id)
    verdict = verdict_store.of_run(session=session, run_id=run_id)
    if run is None or verdict is None or verdict.baseline_run_id is None or run.status != DONE:
        return None
    detail = verdict_store.detail_of(verdict)
    if detail.corun_final:
        return None  # the co-run found a case that does not reproduce, or gave up: nothing more comes
    changed_ids = detail.awaiting_diffs()
    if not changed_ids:
        return None
    return CorunSides(run=run, baseline=runs.lookup(session=session, run_id=verdict.baseline_run_id),
                      changed_ids=changed_ids)


def is_final(*, session: Session, run_id: int) -> bool:
    """The run's co-run ended without diffs (not reproducible, given up): nobody waits for them."""
    verdict = verdict_store.of_run(session=session, run_id=run_id)
    return verdict is not None and verdict_store.detail_of(verdict).corun_final


def store_diffs(*, session: Session, run_id: int, comparison: RunComparison, corun: CorunRecord) -> bool:
    """The verdict's detail recomputed with the co-run's diffs (`comparison`), with the co-run's
    record and the builds' difference beside it; committed. False, and nothing stored, when it would
    change the stored outcome (it cannot: the same stored results are compared)."""
    verdict = verdict_store.of_run(session=session, run_id=run_id)
    if comparison.verdict != verdict.outcome:
        log.error("run %s: recomputed verdict %s != stored %s; diffs not stored",
                  run_id, comparison.verdict, verdict.outcome)
        return False
    verdict_store.set_detail(verdict, VerdictDetail.of(comparison, corun))
    verdict_store.record_build_change(verdict)  # the builds' difference, beside the new detail
    session.commit()
    return True


def store_nondeterminism(*, session: Session, run_id: int, commit_checks: dict[str, RepeatCheck],
                         finding: CorunFinding, corun: CorunRecord) -> RunComparison | None:
    """The co-run re-ran a case and did not reproduce its stored trajectory: that is the run's
    nondeterminism finding. Each such case of the commit gets the re-run as one more repeat on its
    stored trajectory (`commit_checks`: the RepeatCheck it now has, with the baseline's re-run as
    its blame), the verdict is judged again from the stored trajectories by the same rule as when
    the run ended (compare_runs, verdict_store.rejudge), and `finding` is stored with the co-run's
    record; committed. Returns the new comparison (None: no verdict against a baseline)."""
    run = runs.lookup(session=session, run_id=run_id)
    verdict = verdict_store.of_run(session=session, run_id=run_id)
    if run is None or verdict is None or verdict.baseline_run_id is None:
        return None
    trajectories.add_repeat_checks(session=session, run_id=run_id, checks=commit_checks)
    baseline = runs.lookup(session=session, run_id=verdict.baseline_run_id)
    comparison = compare_runs(trajectories.run_result(session=session, run=run),
                              trajectories.run_result(session=session, run=baseline))
    verdict_store.rejudge(verdict=verdict, comparison=comparison, corun=corun, finding=finding)
    session.commit()
    return comparison


def give_up(*, session: Session, run_id: int, reason: str) -> None:
    """The co-run stores no detail and will not try again (`reason`: a side no longer builds, it
    failed): said on the verdict so that nobody waits for its detail; committed. Nothing changes
    when the co-run already ended so."""
    verdict = verdict_store.of_run(session=session, run_id=run_id)
    if verdict is None:
        return
    detail = verdict_store.detail_of(verdict)
    if detail.corun_final:
        return
    verdict_store.set_detail(verdict, detail.given_up(reason))
    session.commit()


def add_attribution(*, session: Session, run_id: int, attribution: dict) -> None:
    """The attribution of the changed cases into the verdict's detail (every other key stays);
    committed."""
    verdict = verdict_store.of_run(session=session, run_id=run_id)
    if verdict is None:
        return
    verdict_store.set_detail(verdict, verdict_store.detail_of(verdict).with_attribution(attribution))
    verdict_store.record_build_change(verdict)  # read by the attribution's words
    session.commit()
