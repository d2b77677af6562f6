"""API tokens and what they spent: only the sha256 of a token is stored, never the token.

Kept apart from models.py (runs, results) because authentication changes for different reasons;
migrations/env.py and service.domain.auth import it so the tables are on Base.metadata.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from service.db.base import Base, utcnow
from service.db.types import UTCDateTime

# Scopes. admin: everything. submit: CI posting commits of one project (or all when project is
# NULL). verify: a contributor's on-demand runs of one project, within a daily quota. worker:
# fetching source archives (workers write results straight to the database). maintain: a
# maintainer of one project (or all) acknowledging a change as intended, without admin's other rights.
ADMIN, SUBMIT, VERIFY, WORKER, MAINTAIN = "admin", "submit", "verify", "worker", "maintain"
SCOPES = (ADMIN, SUBMIT, VERIFY, WORKER, MAINTAIN)


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    # hex sha256 of the whole token; the lookup key (a token has 256 random bits, see auth.py).
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # The first characters of the token, shown in listings so a person can tell tokens apart.
    prefix: Mapped[str] = mapped_column(String(16))
    scope: Mapped[str] = mapped_column(String(20))
    # Project name the token is limited to (submit/verify); NULL: every project.
    project: Mapped[str | None] = mapped_column(String(100))
    # verify tokens: runs per UTC day (NULL: the configured default).
    daily_quota: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class TokenRun(Base):
    """A verify attempt of a token: the quota counts these per UTC day. Taken before the request
    is processed (so concurrent requests cannot all pass the count); `run_id` is set when the run
    is created, `rejection` when the request was refused (a refused attempt still counts)."""

    __tablename__ = "token_runs"
    __table_args__ = (Index("ix_token_runs_token_id_created_at", "token_id", "created_at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    token_id: Mapped[int] = mapped_column(ForeignKey("api_tokens.id", ondelete="CASCADE"))
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    rejection: Mapped[str | None] = mapped_column(String(500))
