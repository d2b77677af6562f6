"""The verify quota: runs per UTC day for a verify-scope token, taken atomically and spent by
refused attempts too.

The old check counted today's runs, processed the request, then recorded the run: ten concurrent
requests all counted 0 and a quota of 1 let 3 through. Now a request first takes a *slot* (a
token_runs row without a run) while holding a lock on the token's row, and commits it before
doing any work. The slot is then filled with the run, or marked with why the request was refused
and kept: a contributor probing with bad patches spends quota like one sending good ones (a 6 MB
patch that inflates costs the API seconds of CPU either way).

Beside the daily quota, a cap on the verify runs a token has queued or running at once
(OPTDRIFT_VERIFY_MAX_ACTIVE_PER_TOKEN, default 1), checked under the same lock before a slot is
taken. Verify runs wait behind commit runs (their own queue, service.broker.queueing), and the cap
keeps one token from lining up a day's quota of them: at any moment it holds at most that many
workers. A request refused by the cap spends no daily slot (nothing was processed; the caller
only has to wait).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from service.db.base import utcnow
from service.db.models import BUILDING, QUEUED, RUNNING, Run
from service.db.token_models import VERIFY, ApiToken, TokenRun
from service.domain.auth import Principal, QuotaExceeded

MAX_REJECTION_CHARS = 500
# A slot without a run and without a rejection is a request still being processed, and counts as
# active; for at most this long, so a slot orphaned by an API killed mid-request frees itself.
PENDING_SLOT_S = 600
# The Retry-After of a refusal while only requests in progress (no run yet) fill the cap.
PENDING_RETRY_AFTER_S = 5
_WAITING_OR_RUNNING = (QUEUED, BUILDING, RUNNING)


def _start_of_utc_day(now: datetime) -> datetime:
    return now.astimezone(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)


def take_slot(*, session: Session, principal: Principal, default_quota: int, max_active: int,
              run_budget_s: float, now: datetime | None = None) -> TokenRun | None:
    """One of today's verify runs for a verify-scope token (None for admin and submit tokens: they
    are not metered), or QuotaExceeded: the token has `max_active` verify runs queued or running
    (`run_budget_s`, the verify run budget, estimates when one ends), or used today's quota. The
    caller commits at once so the slot counts for every concurrent request."""
    if principal.scope != VERIFY:
        return None
    # Lock first, count second. A no-op UPDATE of the token's row: on PostgreSQL it holds the
    # row lock, so a concurrent request of the same token waits here until this one commits and
    # then counts its slot (READ COMMITTED reads afresh per statement); on SQLite it takes the
    # database's write lock before the count is read (a plain SELECT would read a snapshot that
    # another writer could invalidate).
    session.execute(update(ApiToken).where(ApiToken.id == principal.token_id)
                    .values(daily_quota=ApiToken.daily_quota))
    now = now or utcnow()
    quota = principal.daily_quota if principal.daily_quota is not None else default_quota
    day_start = _start_of_utc_day(now)
    used = session.scalar(select(func.count()).select_from(TokenRun).where(
        TokenRun.token_id == principal.token_id, TokenRun.created_at >= day_start)) or 0
    if used >= quota:
        reset = day_start + timedelta(days=1)
        raise QuotaExceeded(
            f"token {principal.name!r} used its {quota} verify attempts for today (UTC; refused "
            f"requests count too); the quota resets at {reset.isoformat()}",
            retry_after_s=max(1, int((reset - now).total_seconds())))
    # After the daily count: a token out of attempts is told so (waiting for its run won't help).
    _refuse_beyond_active_cap(session=session, principal=principal, max_active=max_active,
                              run_budget_s=run_budget_s, now=now)
    slot = TokenRun(token_id=principal.token_id, run_id=None, created_at=now)
    session.add(slot)
    session.flush()
    return slot


def _refuse_beyond_active_cap(*, session: Session, principal: Principal, max_active: int,
                              run_budget_s: float, now: datetime) -> None:
    """QuotaExceeded if the token already has `max_active` verify runs queued or running (requests
    still being processed count too: their runs are about to be queued)."""
    active = session.execute(
        select(TokenRun.id, Run.id, Run.status, Run.started_at)
        .outerjoin(Run, Run.id == TokenRun.run_id)
        .where(TokenRun.token_id == principal.token_id, or_(
            Run.status.in_(_WAITING_OR_RUNNING),
            and_(TokenRun.run_id.is_(None), TokenRun.rejection.is_(None),
                 TokenRun.created_at >= now - timedelta(seconds=PENDING_SLOT_S))))
        .order_by(TokenRun.id)).all()
    if len(active) < max_active:
        return
    runs = [(run_id, status, started) for _slot, run_id, status, started in active if run_id is not None]
    described = ", ".join(f"run {run_id} ({status})" for run_id, status, _ in runs)
    pending = len(active) - len(runs)
    if pending:
        described += (", " if described else "") + f"{pending} request(s) still being processed"
    first = runs[0][0] if runs else None
    what_to_do = (f"wait for run {first} to finish (GET /api/v1/runs/{first} shows its status), then submit "
                  "again" if first is not None else "wait for it to finish, then submit again")
    raise QuotaExceeded(
        f"token {principal.name!r} has {len(active)} verify run(s) queued or running ({described}); a "
        f"verify token may have {max_active} at once (OPTDRIFT_VERIFY_MAX_ACTIVE_PER_TOKEN), so one "
        f"token never holds more workers than that; {what_to_do}. This refusal did not spend a daily "
        "verify attempt.",
        retry_after_s=_seconds_until_one_may_end(runs, run_budget_s=run_budget_s, now=now))


def _seconds_until_one_may_end(runs: list, *, run_budget_s: float, now: datetime) -> int:
    """Retry-After: the least time left in the verify run budget of the token's active runs (a run
    not started yet has all of it); a few seconds when only requests in progress fill the cap."""
    if not runs:
        return PENDING_RETRY_AFTER_S
    left = []
    for _run_id, _status, started in runs:
        if started is None:
            left.append(run_budget_s)
        else:
            started = started if started.tzinfo else started.replace(tzinfo=timezone.utc)
            left.append(run_budget_s - (now - started).total_seconds())
    return max(1, int(min(left)))


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
