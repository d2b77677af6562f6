"""API tokens: creation (shown once), lookup by hash, scope checks, expiry, revocation (the verify
quota: service/domain/verify_quota.py).

A token is `odt_` + 43 url-safe characters from `secrets.token_urlsafe(32)`: 256 random bits.
Only its sha256 is stored. A slow password hash (bcrypt, argon2) exists to make guessing a
*low-entropy* secret expensive after the hashes leak; guessing a 256-bit random value is already
hopeless, so a slow hash would add nothing but ~100 ms of CPU to every authenticated request (and
hand an attacker a cheap way to burn the API's CPU). A plain sha256 also makes the token its own
lookup key (a unique index), so no per-token salt or scan is needed.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.db.base import utcnow
from service.db.token_models import ADMIN, MAINTAIN, SCOPES, SUBMIT, VERIFY, WORKER, ApiToken

TOKEN_PREFIX = "odt_"


class TokenRejected(Exception):
    """401: no token, an unknown one, or one that expired or was revoked."""


class ScopeDenied(Exception):
    """403: a valid token without the scope (or project) the request needs."""


class QuotaExceeded(Exception):
    """429: the verify token used its runs for today."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Principal:
    """Who is asking: the token row's fields the routes need (never the token itself)."""

    token_id: int
    name: str
    scope: str
    project: str | None
    daily_quota: int | None

    def allows(self, *scopes: str, project: str | None = None) -> bool:
        if self.scope == ADMIN:
            return True
        if self.scope not in scopes:
            return False
        return self.project is None or project is None or self.project == project

    def require(self, *scopes: str, project: str | None = None) -> None:
        if not self.allows(*scopes, project=project):
            where = f" for project {project!r}" if project else ""
            limited = f" (limited to project {self.project!r})" if self.project else ""
            raise ScopeDenied(
                f"token {self.name!r} has scope {self.scope!r}{limited}; this request needs "
                f"{' or '.join(repr(s) for s in dict.fromkeys((*scopes, ADMIN)))}{where}")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(*, session: Session, name: str, scope: str, project: str | None = None,
                 expires_in_days: float | None = None, daily_quota: int | None = None
                 ) -> tuple[ApiToken, str]:
    """A new token row and the token itself (the only time it exists in clear)."""
    if scope not in SCOPES:
        raise ValueError(f"scope {scope!r} is not one of {', '.join(SCOPES)}")
    if scope in (ADMIN, WORKER) and project:
        raise ValueError(f"a {scope} token is not limited to a project; drop the project")
    if daily_quota is not None and daily_quota < 0:
        raise ValueError(f"daily quota {daily_quota} must be >= 0")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(
        name=name, token_hash=hash_token(token), prefix=token[:10], scope=scope, project=project,
        daily_quota=daily_quota,
        expires_at=utcnow() + timedelta(days=expires_in_days) if expires_in_days else None,
    )
    session.add(row)
    session.flush()
    return row, token


def authenticate(*, session: Session, token: str | None, now: datetime | None = None) -> Principal:
    if not token:
        raise TokenRejected("this request needs an API token: send `Authorization: Bearer <token>` "
                            "(create one with `optdrift token create`)")
    row = session.scalar(select(ApiToken).where(ApiToken.token_hash == hash_token(token)))
    if row is None:
        raise TokenRejected("unknown API token")
    now = now or utcnow()
    if row.revoked_at is not None:
        raise TokenRejected(f"token {row.name!r} was revoked at {row.revoked_at.isoformat()}")
    if row.expires_at is not None and row.expires_at <= now:
        raise TokenRejected(f"token {row.name!r} expired at {row.expires_at.isoformat()}")
    return Principal(token_id=row.id, name=row.name, scope=row.scope, project=row.project,
                     daily_quota=row.daily_quota)


def revoke(*, session: Session, token_id: int) -> ApiToken:
    row = session.get(ApiToken, token_id)
    if row is None:
        raise LookupError(f"no token with id {token_id}; `optdrift token list` shows them")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    session.flush()
    return row


def list_tokens(*, session: Session) -> list[ApiToken]:
    return list(session.scalars(select(ApiToken).order_by(ApiToken.id)))


__all__ = ["ADMIN", "MAINTAIN", "SUBMIT", "VERIFY", "WORKER", "SCOPES", "Principal", "TokenRejected",
           "ScopeDenied", "QuotaExceeded", "create_token", "authenticate", "revoke", "list_tokens",
           "hash_token"]


# ----------------------------------------------------------------------------- first start
def write_secret_file(path, text: str) -> None:  # noqa: ANN001
    """Create `path` readable by its owner only (0600 from the first byte: no chmod race)."""
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text + "\n")
    os.replace(tmp, path)


def _file_token_valid(session: Session, path) -> bool:  # noqa: ANN001
    try:
        authenticate(session=session, token=path.read_text().strip())
    except (OSError, TokenRejected):
        return False
    return True


def bootstrap_tokens(*, session: Session, admin_file, worker_file, worker_configured: bool
                     ) -> dict[str, str]:
    """What `optdrift serve` does on start so the embedded default is closed from the first
    minute: an admin token in `admin_file` (when no valid one is there and the database has no
    other admin token: a production database's admins are left alone), and a worker token in
    `worker_file` for the local worker (unless one is configured). Returns {kind: what happened}."""
    happened: dict[str, str] = {}
    if not _file_token_valid(session, admin_file):
        active_admins = session.scalar(select(func.count()).select_from(ApiToken).where(
            ApiToken.scope == ADMIN, ApiToken.revoked_at.is_(None))) or 0
        if active_admins == 0:
            _, token = create_token(session=session, name="first-start admin", scope=ADMIN)
            write_secret_file(admin_file, token)
            happened["admin"] = "created"
        else:
            happened["admin"] = "exists in the database (not in the token file)"
    else:
        happened["admin"] = "kept"
    if not worker_configured and not _file_token_valid(session, worker_file):
        _, token = create_token(session=session, name="local worker", scope=WORKER)
        write_secret_file(worker_file, token)
        happened["worker"] = "created"
    session.commit()
    return happened
