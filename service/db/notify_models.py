"""Where a project's verdicts are sent: its GitHub repository (check runs, a PR comment) and its
outgoing webhooks, with what was sent and what came back.

Kept apart from models.py (runs, results) because notifications change for different reasons;
migrations/env.py and service.notify import it so the tables are on Base.metadata.

The GitHub credential and the webhook secrets are stored encrypted (`fernet:` + a Fernet token under
the operator's secrets key, service/notify/sealing.py; a value without the prefix is a row from
before encryption, which `optdrift serve` encrypts at start); the API never returns them
(`has_token`, `has_secret` instead) and every error text stored or logged is scrubbed of them first.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.db.base import Base, utcnow
from service.db.types import UTCDateTime

# GitHub authentication kinds: a token (a fine-grained or classic PAT, or an Actions token) or a
# GitHub App installation (app id + private key; the installation is looked up when not given).
AUTH_TOKEN, AUTH_APP = "token", "app"
# Webhook payload formats: our own JSON document, or Slack's incoming-webhook shape.
PAYLOAD_JSON, PAYLOAD_SLACK = "json", "slack"


class GitHubIntegration(Base):
    """One per project: the repository its commits live in and how to authenticate there."""

    __tablename__ = "github_integrations"

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), unique=True)
    # "owner/name"
    repository: Mapped[str] = mapped_column(String(200))
    # https://api.github.com, or a GitHub Enterprise Server's https://HOST/api/v3.
    api_url: Mapped[str] = mapped_column(String(500))
    auth_kind: Mapped[str] = mapped_column(String(10))
    token: Mapped[str | None] = mapped_column(Text)
    app_id: Mapped[str | None] = mapped_column(String(50))
    private_key: Mapped[str | None] = mapped_column(Text)
    installation_id: Mapped[int | None] = mapped_column(BigInteger)
    # The check run's name on the commit; the environment is appended (one check per run).
    check_name: Mapped[str] = mapped_column(String(100), default="optdrift")
    pr_comments: Mapped[bool] = mapped_column(Boolean, default=True)
    # Where people open the run's page (details_url); NULL: the service's public URL.
    dashboard_url: Mapped[str | None] = mapped_column(String(500))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)


class GitHubCheckRun(Base):
    """What GitHub holds for one of our runs: its check run, the conclusion last sent, and the
    last error (a failure to notify is recorded here, never on the run or its verdict)."""

    __tablename__ = "github_check_runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), unique=True)
    # GitHub's ids are past 2**31 already.
    check_run_id: Mapped[int | None] = mapped_column(BigInteger)
    # in_progress | completed
    status: Mapped[str | None] = mapped_column(String(20))
    conclusion: Mapped[str | None] = mapped_column(String(20))
    # What the last completed notification described (outcome, acknowledged, magnitudes known),
    # so an unchanged state is not sent twice.
    sent_state: Mapped[str | None] = mapped_column(String(200))
    comment_ids: Mapped[list[int]] = mapped_column(JSON, default=list)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, onupdate=utcnow)


class Webhook(Base):
    __tablename__ = "webhooks"

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    url: Mapped[str] = mapped_column(String(1000))
    # The Standard Webhooks signing secret (service/notify/webhooks.py), sealed.
    secret: Mapped[str] = mapped_column(Text)
    # Which outcomes are sent: a subset of changed, broken, error (nondeterministic too if asked).
    events: Mapped[list[str]] = mapped_column(JSON)
    payload_format: Mapped[str] = mapped_column(String(10), default=PAYLOAD_JSON)
    active: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class WebhookDelivery(Base):
    """One event sent to one webhook: every attempt counted, the last status code and error."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        # An event is delivered once per webhook and run, however often the run is looked at.
        UniqueConstraint("webhook_id", "run_id", "event"),
        Index("ix_webhook_deliveries_webhook_id_created_at", "webhook_id", "created_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    webhook_id: Mapped[int] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"))
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    event: Mapped[str] = mapped_column(String(30))
    # A random id per delivery (the webhook-id header), the same on every attempt: receivers dedupe.
    delivery_uuid: Mapped[str] = mapped_column(String(36))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    ok: Mapped[bool] = mapped_column(Boolean, default=False)
    status_code: Mapped[int | None] = mapped_column(Integer)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    duration_s: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class GitHubPullRequestRun(Base):
    """A verify run the service started itself for a pull request from a fork (GitHub gives a
    fork's workflow no secrets, so the Action cannot submit it): which pull request and head it
    verifies, so the run's check run goes on that head and its comment on that pull request
    (service/notify/pull_requests.py). One per head sha and environment: a delivery repeated, or
    a second event for the same head, starts nothing new."""

    __tablename__ = "github_pull_request_runs"
    __table_args__ = (UniqueConstraint("project_id", "head_sha", "environment"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), unique=True)
    environment: Mapped[str] = mapped_column(String(100))
    # The base repository ("owner/name") and the pull request's number there.
    repository: Mapped[str] = mapped_column(String(200))
    pull_number: Mapped[int] = mapped_column(Integer)
    # The fork's commit (the check run's head_sha) and the fork itself (the daily quota's key).
    head_sha: Mapped[str] = mapped_column(String(64))
    head_repository: Mapped[str] = mapped_column(String(200), index=True)
    # The merge commit GitHub made whose tree was verified, and its first parent (the base tip).
    merge_sha: Mapped[str] = mapped_column(String(64))
    base_sha: Mapped[str] = mapped_column(String(64))
    # X-GitHub-Delivery of the event that started it.
    delivery_id: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
