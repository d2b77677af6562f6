"""An acknowledgement belongs to the change, not to the sha it was given on.

A pull request's run is filed under GitHub's merge sha, which never lands; after the merge, main's
commit holds the same tree and is compared with the same base, so it makes the same change, and it
must not need a second acknowledgement. So an acknowledgement records what it accepted
(`change_of`): the baseline's and the commit's source digests, and each changed case's digest (the
baseline's and the commit's per-step digests of the case, hashed together). A later flagged verdict
in the same environment and battery is acknowledged automatically when its change is the same one
(`same_change`): the same source against the same baseline source, or the same changed cases with
the same digests on both sides. It says so, and links the run a person acknowledged.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import Run, Trajectory, Verdict

# Acknowledged verdicts of one environment and battery looked at, newest first: the same change
# comes back soon after its acknowledgement (the merge), not years later.
RECENT_ACKNOWLEDGEMENTS = 500


def _case_digests(session: Session, run_id: int, case_ids: list[str]) -> dict[str, str]:
    rows = session.execute(select(Trajectory.case_id, Trajectory.digests).where(
        Trajectory.run_id == run_id, Trajectory.case_id.in_(case_ids))).all()
    return {case_id: hashlib.sha256((digests or "").encode()).hexdigest() for case_id, digests in rows}


def change_of(*, session: Session, verdict: Verdict) -> dict:
    """What the verdict's change is, as digests (stored with an acknowledgement)."""
    run = verdict.run
    baseline = session.get(Run, verdict.baseline_run_id) if verdict.baseline_run_id else None
    changed = [case["case_id"] for case in verdict.detail.get("cases", [])
               if case.get("verdict") in ("changed", "broken", "nondeterministic")]
    commit_side = _case_digests(session, run.id, changed)
    baseline_side = _case_digests(session, baseline.id, changed) if baseline is not None else {}
    return {
        "outcome": verdict.outcome,
        "source_digest": run.source_digest,
        "baseline_source_digest": baseline.source_digest if baseline is not None else None,
        "changed_cases": {case_id: hashlib.sha256(
            f"{baseline_side.get(case_id, '')}:{commit_side.get(case_id, '')}".encode()).hexdigest()
            for case_id in changed},
    }


def same_change(accepted: dict, change: dict) -> str | None:
    """How `change` is the change `accepted` records, in words; None when it is not."""
    if accepted.get("outcome") != change["outcome"]:
        return None
    if accepted.get("source_digest") == change["source_digest"] and \
            accepted.get("baseline_source_digest") == change["baseline_source_digest"]:
        return "the same source against the same baseline source"
    if change["changed_cases"] and accepted.get("changed_cases") == change["changed_cases"]:
        return f"the same {len(change['changed_cases'])} changed case(s) with the same digests"
    return None


def record(*, session: Session, verdict: Verdict, note: str, by: str | None) -> Verdict:
    """A person's acknowledgement: the verdict stops failing CI and remembers the change it accepted."""
    verdict.acknowledged = True
    verdict.flagged = False
    verdict.acknowledgement_note = note
    verdict.acknowledged_by = by
    verdict.acknowledged_at = datetime.now(timezone.utc)
    verdict.acknowledged_change = change_of(session=session, verdict=verdict)
    verdict.acknowledged_via_run_id = None
    session.flush()
    return verdict


def carry_over(*, session: Session, verdict: Verdict) -> Verdict | None:
    """Acknowledge the new flagged `verdict` when an earlier acknowledgement accepted the same
    change; returns that earlier verdict (the one a person acknowledged), or None."""
    run = verdict.run
    if not verdict.flagged or run.kind != "commit":
        return None
    earlier = session.scalars(
        select(Verdict).join(Run, Verdict.run_id == Run.id).where(
            Run.project_id == run.project_id, Run.battery == run.battery, Run.environment == run.environment,
            Run.id != run.id, Verdict.acknowledged.is_(True), Verdict.acknowledged_change.is_not(None),
            Verdict.acknowledged_via_run_id.is_(None))
        .order_by(Verdict.acknowledged_at.desc(), Verdict.id.desc()).limit(RECENT_ACKNOWLEDGEMENTS)).all()
    if not earlier:
        return None
    change = change_of(session=session, verdict=verdict)
    for original in earlier:
        how = same_change(original.acknowledged_change, change)
        if how is None:
            continue
        sha = original.run.commit.sha if original.run.commit else f"verify run {original.run_id}"
        verdict.acknowledged = True
        verdict.flagged = False
        verdict.acknowledged_by = original.acknowledged_by
        verdict.acknowledgement_note = (
            f"acknowledged automatically: {how} as run {original.run_id} ({sha}), acknowledged"
            f"{' by ' + original.acknowledged_by if original.acknowledged_by else ''}: "
            f"{original.acknowledgement_note}")
        verdict.acknowledged_at = datetime.now(timezone.utc)
        verdict.acknowledged_change = change
        verdict.acknowledged_via_run_id = original.run_id
        session.flush()
        return original
    return None
