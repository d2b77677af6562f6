"""A project's memory of nondeterministic cases (docs/ENGINE.md, Nondeterminism): every case that
ever failed to reproduce itself, in a run's repeats or its co-run's re-run, is repeated by every
later run of the project, commit and verify runs alike."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timezone

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from service.db.models import UnsteadyCase


def case_ids(*, session: Session, project_id: int) -> set[str]:
    """The project's cases that ever failed to reproduce themselves."""
    return set(session.scalars(select(UnsteadyCase.case_id).where(UnsteadyCase.project_id == project_id)))


def remember(*, session: Session, project_id: int, run_id: int, case_ids: Iterable[str]) -> None:
    """Remember `case_ids` as nondeterministic for the project, seen in `run_id` (its own build or
    its baseline's, repeated for blame); committed. Concurrent workers may remember one case at
    once: the insert yields to the other's row and counts on it (an upsert, in each database's
    own words: PostgreSQL's, or SQLite's for the embedded default)."""
    case_ids = sorted(set(case_ids))
    if not case_ids:
        return
    insert = postgresql_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    now = datetime.now(timezone.utc)
    for case_id in case_ids:
        statement = insert(UnsteadyCase).values(project_id=project_id, case_id=case_id, first_seen_run_id=run_id,
                                                last_seen_run_id=run_id, times_seen=1, last_seen_at=now)
        session.execute(statement.on_conflict_do_update(
            index_elements=["project_id", "case_id"],
            set_={"last_seen_run_id": run_id, "last_seen_at": now, "times_seen": UnsteadyCase.times_seen + 1}))
    session.commit()
