"""Which run a run is compared with: always the same battery and environment class.

* an explicit base (a verify run's base, or a commit submitted with `baseline=`): that commit's run;
* otherwise the nearest first-parent ancestor whose run finished (`done`); failed ancestors are
  skipped, since a broken build says nothing about trajectories.

An acknowledged change needs no special case: its commit's run becomes the baseline of its
children like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import DONE, FINAL_STATUSES, Commit, Run

MAX_ANCESTRY_WALK = 200


@dataclass(frozen=True)
class BaselineChoice:
    run: Run | None
    # True while the chosen ancestor's run has not finished: the verdict waits for it.
    pending: bool = False
    reason: str = ""


def _run_of(*, session: Session, commit: Commit, like: Run) -> Run | None:
    return session.scalar(select(Run).where(
        Run.commit_id == commit.id, Run.battery == like.battery, Run.environment == like.environment))


def choose(*, session: Session, run: Run) -> BaselineChoice:
    if run.base_commit_id is not None:
        base_commit = session.get(Commit, run.base_commit_id)
        base_run = _run_of(session=session, commit=base_commit, like=run)
        if base_run is None:
            return BaselineChoice(None, reason=f"base commit {base_commit.sha} has no run in "
                                               f"{run.environment} with battery {run.battery}")
        if base_run.status != DONE:
            return BaselineChoice(base_run, pending=base_run.status not in FINAL_STATUSES,
                                  reason=f"base run {base_run.id} is {base_run.status}")
        return BaselineChoice(base_run, reason=f"base commit {base_commit.sha}")

    commit = session.get(Commit, run.commit_id) if run.commit_id else None
    seen = 0
    while commit is not None and commit.parents and seen < MAX_ANCESTRY_WALK:
        seen += 1
        parent = session.scalar(select(Commit).where(
            Commit.project_id == commit.project_id, Commit.sha == commit.parents[0]))
        if parent is None:
            return BaselineChoice(None, reason=f"parent {commit.parents[0]} was never submitted")
        parent_run = _run_of(session=session, commit=parent, like=run)
        if parent_run is not None and parent_run.status == DONE:
            return BaselineChoice(parent_run, reason=f"first parent {parent.sha}")
        if parent_run is not None and parent_run.status not in FINAL_STATUSES:
            return BaselineChoice(parent_run, pending=True,
                                  reason=f"waiting for parent {parent.sha} (run {parent_run.id})")
        commit = parent
    return BaselineChoice(None, reason="no ancestor has a finished run in this environment")


def dependants(*, session: Session, run: Run) -> list[Run]:
    """Finished runs without a verdict that would pick `run` as their baseline (children commits,
    verify runs based on its commit): computed when `run` finishes."""
    if run.commit_id is None:
        return []
    commit = session.get(Commit, run.commit_id)
    candidates = session.scalars(select(Run).where(
        Run.project_id == run.project_id, Run.battery == run.battery,
        Run.environment == run.environment, Run.status == DONE, Run.id != run.id,
    )).all()
    out = []
    for other in candidates:
        if other.verdict is not None:
            continue
        if other.base_commit_id == commit.id:
            out.append(other)
        elif other.base_commit_id is None and other.commit is not None and \
                other.commit.parents[:1] == [commit.sha]:
            out.append(other)
    return out
