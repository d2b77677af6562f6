"""The verify quota: runs per UTC day for a verify-scope token, taken atomically and spent by
refused attempts too.

The old check counted today's runs, processed the request, then recorded the run: ten concurrent
requests all counted 0 and a quota of 1 let 3 through. Now a request first takes a *slot* (a
token_runs row without a run) while holding a lock on the token's row, and commits it before
doing any work. The slot is then filled with the run, or marked with why the request was refused
and kept: a contributor probing with bad patches spends quota like one sending good ones (a 6 MB
patch that inflates costs the API seconds of CPU either way).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from service.db.base import utcnow
from service.db.token_models import VERIFY, ApiToken, TokenRun
from service.domain.auth import Principal, QuotaExceeded

MAX_REJECTION_CHARS = 500


def _start_of_utc_day(now: datetime) -> datetime:
    return now.astimezone(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)


def take_slot(*, session: Session, principal: Principal, default_quota: int,
              now: datetime | None = None) -> TokenRun | None:
    """One of today's verify runs for a verify-scope token (None for admin and submit tokens: they
    are not metered), or QuotaExceeded. The caller commits at once so the slot counts for every
    concurrent request."""
    if principal.scope != VERIFY:
        return None
    # Lock first, count second. A no-op UPDATE of the token's row: on PostgreSQL it holds the
    # row lock, so a concurrent request of the same token waits here until this one commits and
    # then counts its slot (READ COMMITTED reads afresh per statement); on SQLite it takes the
    # database's write lock before the count is read (a plain SELECT would read a snapshot that
    # another writer could invalidate).
    session.execute(update(ApiToken).where(ApiToken.id == principal.token_id)
                    .values(daily_quota=ApiToken.daily_quota))
    quota = principal.daily_quota if principal.daily_quota is not None else default_quota
    now = now or utcnow()
    day_start = _start_of_utc_day(now)
    used = session.scalar(select(func.count()).select_from(TokenRun).where(
        TokenRun.token_id == principal.token_id, TokenRun.created_at >= day_start)) or 0
    if used >= quota:
        reset = day_start + timedelta(days=1)
        raise QuotaExceeded(
            f"token {principal.name!r} used its {quota} verify attempts for today (UTC; refused "
            f"requests count too); the quota resets at {reset.isoformat()}",
            retry_after_s=max(1, int((reset - now).total_seconds())))
    slot = TokenRun(token_id=principal.token_id, run_id=None, created_at=now)
    session.add(slot)
    session.flush()
    return slot


def fill_slot(*, session: Session, principal: Principal, slot_id: int | None, run_id: int) -> None:
    """The run a request created, on its slot (unmetered tokens get a row now: what they spent)."""
    if slot_id is None:
        session.add(TokenRun(token_id=principal.token_id, run_id=run_id))
    else:
        session.execute(update(TokenRun).where(TokenRun.id == slot_id).values(run_id=run_id))
    session.flush()


def reject_slot(*, session: Session, slot_id: int, reason: str) -> None:
    """The request was refused (a 4xx after authentication): the slot stays spent, with why."""
    session.execute(update(TokenRun).where(TokenRun.id == slot_id)
                    .values(rejection=reason[:MAX_REJECTION_CHARS] or "refused"))
    session.flush()


def release_slot(*, session: Session, slot_id: int) -> None:
    """The server failed (not the caller): give the slot back."""
    session.execute(TokenRun.__table__.delete().where(TokenRun.id == slot_id))
    session.flush()
