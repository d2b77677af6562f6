"""Which run a run is compared with: always the same battery and environment class.

* an explicit base (a verify run's base, or a commit submitted with `baseline=`): that commit's run;
* otherwise the nearest commit on the first-parent line whose run in this environment and battery
  finished (`done`). The line is the commit's first parent (for a push, the branch's previous tip),
  then the ancestry the client sent (service/domain/ancestry.py: `git rev-list --first-parent`,
  parent first), then, past its end, the line of the farthest submitted commit in it. Commits never
  submitted, or without a run here, are passed over: a pull request on a base tip that was never
  submitted is compared with the nearest ancestor that was, and the verdict says how many commits
  back. Failed ancestors are passed over too, since a broken build says nothing about
  trajectories; one still running is waited for.

When nothing on the line has a finished run the verdict is no-baseline, and the reason says what
was looked at and what to do (service/notify/conclusions.py: that fails CI unless the submission
allowed it).

An acknowledged change needs no special case: its commit's run becomes the baseline of its
children like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import DONE, FINAL_STATUSES, Commit, Run

# Commits walked back at most (as far as the ancestry a client may send, service/domain/ancestry.py).
MAX_ANCESTRY_WALK = 200
NO_BASELINE_HELP = ("submit the base commit (or an ancestor) in this environment first, or, for a project's "
                    "first commit, submit with --allow-no-baseline (Action input allow-no-baseline: true)")


@dataclass(frozen=True)
class BaselineChoice:
    run: Run | None
    # True while the chosen ancestor's run has not finished: the verdict waits for it.
    pending: bool = False
    reason: str = ""
    # First-parent commits between the two: 1 for the parent; None for an explicit base or no baseline.
    commits_back: int | None = None


def _run_of(*, session: Session, commit: Commit, like: Run) -> Run | None:
    return session.scalar(select(Run).where(
        Run.commit_id == commit.id, Run.battery == like.battery, Run.environment == like.environment))


def known_line(commit: Commit) -> list[tuple[int, str]]:
    """(commits back, sha) of the first-parent line `commit` itself knows, in walking order: its
    first parent (the commit it was submitted to be compared with), then its ancestry."""
    ancestry = list(commit.ancestry or [])
    line: list[tuple[int, str]] = []
    if commit.parents:
        parent = commit.parents[0]
        line.append((ancestry.index(parent) + 1 if parent in ancestry else 1, parent))
    line += [(position, sha) for position, sha in enumerate(ancestry, start=1)
             if not commit.parents or sha != commit.parents[0]]
    return line


def _choose_on_line(*, session: Session, run: Run, commit: Commit) -> BaselineChoice:
    passed_over: list[str] = []  # why nearer commits were not the baseline, nearest first
    offset, looked_at = 0, 0
    current: Commit | None = commit
    while current is not None and offset < MAX_ANCESTRY_WALK:
        line = known_line(current)
        if not line:
            break
        by_sha = {row.sha: row for row in session.scalars(select(Commit).where(
            Commit.project_id == current.project_id, Commit.sha.in_([sha for _, sha in line])))}
        runs = {row.commit_id: row for row in session.scalars(select(Run).where(
            Run.commit_id.in_([row.id for row in by_sha.values()]), Run.battery == run.battery,
            Run.environment == run.environment))} if by_sha else {}
        farthest: tuple[int, Commit] | None = None
        for back, sha in line:
            distance = offset + back
            if distance > MAX_ANCESTRY_WALK:
                break
            looked_at += 1
            ancestor = by_sha.get(sha)
            if ancestor is None:
                passed_over.append(f"{sha[:12]} never submitted")
                continue
            if farthest is None or back > farthest[0]:
                farthest = (back, ancestor)
            ancestor_run = runs.get(ancestor.id)
            if ancestor_run is None:
                passed_over.append(f"{sha[:12]} has no run in {run.environment}")
                continue
            if ancestor_run.status == DONE:
                return BaselineChoice(ancestor_run, reason=_found(ancestor, ancestor_run, distance, passed_over),
                                      commits_back=distance)
            if ancestor_run.status not in FINAL_STATUSES:
                return BaselineChoice(ancestor_run, pending=True, commits_back=distance,
                                      reason=f"waiting for {sha} (run {ancestor_run.id}, {distance} commit(s) back)")
            passed_over.append(f"{sha[:12]} run {ancestor_run.id} {ancestor_run.status}")
        if farthest is None:
            break
        # Past the line this commit knows: the farthest submitted commit on it knows its own.
        offset, current = offset + farthest[0], farthest[1]
    if looked_at == 0:
        return BaselineChoice(None, reason=f"commit {commit.sha} was submitted without parents or ancestry: "
                                           f"nothing to compare with; {NO_BASELINE_HELP}")
    nearest = "; ".join(passed_over[:3]) + ("; ..." if len(passed_over) > 3 else "")
    return BaselineChoice(None, reason=(
        f"none of the {looked_at} first-parent ancestor(s) sent with commit {commit.sha} has a finished run in "
        f"{run.environment} with battery {run.battery} ({nearest}); {NO_BASELINE_HELP}"))


def _found(ancestor: Commit, ancestor_run: Run, distance: int, passed_over: list[str]) -> str:
    if distance == 1 and not passed_over:
        return f"first parent {ancestor.sha}"
    skipped = f": nearer ones passed over ({'; '.join(passed_over[:3])}{'; ...' if len(passed_over) > 3 else ''})" \
        if passed_over else ""
    return f"{ancestor.sha}, {distance} commits back on the first-parent line (run {ancestor_run.id}){skipped}"


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
    if commit is None:
        return BaselineChoice(None, reason="the run has no commit and no base")
    return _choose_on_line(session=session, run=run, commit=commit)


def dependants(*, session: Session, run: Run) -> list[Run]:
    """Finished runs without a verdict that may pick `run` as their baseline (commits whose
    first-parent line holds its commit, verify runs based on it): computed when `run` finishes.
    Each is judged again by baselines.choose, so one that still waits for a nearer run waits on."""
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
                commit.sha in {sha for _, sha in known_line(other.commit)}:
            out.append(other)
    return out
