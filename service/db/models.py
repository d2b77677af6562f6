"""ORM models: the application database is the source of truth for every run and result.

Per-step arrays are stored as raw little-endian float64 bytes (``Trajectory.series_data``), never as
rounded text: a one-ulp change is exactly what this project exists to find.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from service.db.base import Base, utcnow
from service.db.types import UTCDateTime

# Run statuses. queued -> building -> running -> done | failed | cancelled | error.
# failed: the commit's fault (its build failed, its kernels crashed or hung: verdict broken).
# error: optdrift's fault (source fetch, lost worker, database, disk, sandbox unavailable): retried
# with backoff a bounded number of times, then final, never blamed on the commit.
QUEUED, BUILDING, RUNNING, DONE, FAILED, CANCELLED, ERROR = (
    "queued", "building", "running", "done", "failed", "cancelled", "error",
)
ACTIVE_STATUSES = (BUILDING, RUNNING)
FINAL_STATUSES = (DONE, FAILED, CANCELLED, ERROR)


class Project(Base):
    __tablename__ = "projects"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    # "torch-extension" (the bundled csrc: torch.utils.cpp_extension + ninja) or "command".
    build_kind: Mapped[str] = mapped_column(String(40), default="torch-extension")
    build_command: Mapped[str | None] = mapped_column(Text)
    adapter: Mapped[str] = mapped_column(String(100), default="bundled")
    default_battery: Mapped[str] = mapped_column(String(100), default="quick")
    environments: Mapped[list[str]] = mapped_column(JSON, default=lambda: ["cpu"])
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class SourceArchive(Base):
    """An uploaded tar.gz, stored once under its sha256 in the content-addressed store."""

    __tablename__ = "source_archives"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    size_bytes: Mapped[int] = mapped_column(Integer)
    member_count: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class SourceArchiveProject(Base):
    """A project an archive was uploaded by or for: only these projects may name its digest
    (issue 33: digests are public, the source is not). Two projects uploading identical bytes get
    a row each; the archive itself is still stored once."""

    __tablename__ = "source_archive_projects"

    digest: Mapped[str] = mapped_column(
        ForeignKey("source_archives.digest", ondelete="CASCADE"), primary_key=True)
    project_id: Mapped[int] = mapped_column(
        ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Commit(Base):
    __tablename__ = "commits"
    __table_args__ = (
        UniqueConstraint("project_id", "sha"),
        # The dashboard lists a project's commits newest first.
        Index("ix_commits_project_id_created_at", "project_id", "created_at"),
        Index("ix_commits_project_id_release_tag", "project_id", "release_tag"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    sha: Mapped[str] = mapped_column(String(64))
    parents: Mapped[list[str]] = mapped_column(JSON, default=list)
    # The first-parent line the client sent (parent first, bounded: service/domain/ancestry.py); the
    # baseline is the nearest of these with a finished run (service/domain/baselines.py). NULL:
    # only `parents` is known.
    ancestry: Mapped[list[str] | None] = mapped_column(JSON)
    ref: Mapped[str | None] = mapped_column(String(255))
    release_tag: Mapped[str | None] = mapped_column(String(100))
    message: Mapped[str | None] = mapped_column(Text)
    source_digest: Mapped[str] = mapped_column(ForeignKey("source_archives.digest"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    project: Mapped[Project] = relationship()
    runs: Mapped[list["Run"]] = relationship(
        back_populates="commit", foreign_keys="Run.commit_id", order_by="Run.id"
    )


class Run(Base):
    """One source x battery x environment class. A Celery task carries only ``id``."""

    __tablename__ = "runs"
    __table_args__ = (
        # Idempotent submission: the same commit x battery x environment is one run. Verify runs
        # have commit_id NULL, which both PostgreSQL and SQLite treat as distinct.
        UniqueConstraint("commit_id", "battery", "environment"),
        UniqueConstraint("project_id", "idempotency_key"),
        Index("ix_runs_status_dispatched_at", "status", "dispatched_at"),
        Index("ix_runs_project_id_created_at", "project_id", "created_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    # "commit" (posted by CI, part of the lineage) or "verify" (a contributor's on-demand run).
    kind: Mapped[str] = mapped_column(String(20), default="commit")
    commit_id: Mapped[int | None] = mapped_column(ForeignKey("commits.id", ondelete="CASCADE"))
    base_commit_id: Mapped[int | None] = mapped_column(ForeignKey("commits.id", ondelete="SET NULL"))
    source_digest: Mapped[str] = mapped_column(ForeignKey("source_archives.digest"))
    battery: Mapped[str] = mapped_column(String(100))
    battery_hash: Mapped[str | None] = mapped_column(String(64))
    environment: Mapped[str] = mapped_column(String(100))
    environment_detail: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    # The submission accepted having nothing to compare with (a project's first commit): its
    # no-baseline verdict passes CI (neutral) instead of failing it.
    allow_no_baseline: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    status: Mapped[str] = mapped_column(String(20), default=QUEUED, index=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    # Attempts that ended with their worker gone mid-run (the reaper found the heartbeat stale): a
    # run that took down its worker twice is not handed to another (service.domain.runs.reap_stale).
    workers_lost: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    worker: Mapped[str | None] = mapped_column(String(255))
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # NULL while the broker has not accepted the task (broker down): the dispatcher re-sends.
    dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())

    cases_total: Mapped[int | None] = mapped_column(Integer)
    cases_done: Mapped[int] = mapped_column(Integer, default=0)
    build_digest: Mapped[str | None] = mapped_column(String(64))
    build_cached: Mapped[bool | None] = mapped_column(Boolean)
    build_log: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)

    commit: Mapped[Commit | None] = relationship(back_populates="runs", foreign_keys=[commit_id])
    base_commit: Mapped[Commit | None] = relationship(foreign_keys=[base_commit_id])
    project: Mapped[Project] = relationship()
    verdict: Mapped["Verdict | None"] = relationship(
        back_populates="run", foreign_keys="Verdict.run_id", uselist=False
    )


class Trajectory(Base):
    """One case of one run: per-step arrays at full precision and per-step digests."""

    __tablename__ = "trajectories"
    __table_args__ = (UniqueConstraint("run_id", "case_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    case_id: Mapped[str] = mapped_column(String(255))
    case_index: Mapped[int] = mapped_column(Integer)
    case: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(20))
    error: Mapped[str | None] = mapped_column(Text)
    steps: Mapped[int] = mapped_column(Integer)
    # [{"name": ..., "length": n}, ...] in the order their float64 LE bytes sit in series_data.
    series_layout: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    series_data: Mapped[bytes] = mapped_column(LargeBinary)
    # Per-step hex digests of parameters + optimizer state, newline-separated.
    digests: Mapped[str] = mapped_column(Text, default="")
    # Anything else the engine reports per case (kept verbatim as JSON).
    extra: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class Verdict(Base):
    __tablename__ = "verdicts"
    __table_args__ = (
        # The dashboard lists flagged verdicts, newest first.
        Index("ix_verdicts_flagged_created_at", "flagged", "created_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), unique=True)
    baseline_run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    # unchanged | changed | broken | no-baseline
    outcome: Mapped[str] = mapped_column(String(20), index=True)
    # changed or broken and not acknowledged: `optdrift submit --wait` exits non-zero.
    flagged: Mapped[bool] = mapped_column(Boolean)
    changed_cases: Mapped[int] = mapped_column(Integer, default=0)
    first_divergent_step: Mapped[int | None] = mapped_column(Integer)
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)
    acknowledged: Mapped[bool] = mapped_column(Boolean, default=False)
    acknowledged_by: Mapped[str | None] = mapped_column(String(255))
    acknowledgement_note: Mapped[str | None] = mapped_column(Text)
    acknowledged_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # How many first-parent commits back the baseline's commit is (1: the parent; NULL: no
    # baseline, or an explicit base), and the sentence saying which baseline and why.
    baseline_commits_back: Mapped[int | None] = mapped_column(Integer)
    baseline_note: Mapped[str | None] = mapped_column(Text)
    # What an acknowledgement accepted (service/domain/acknowledgements.py change_of): the two
    # source digests and each changed case's digest. A later run whose change is the same is
    # acknowledged automatically, linking the run acknowledged by a person (acknowledged_via_run_id).
    acknowledged_change: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    acknowledged_via_run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)

    run: Mapped[Run] = relationship(back_populates="verdict", foreign_keys=[run_id])
    baseline_run: Mapped[Run | None] = relationship(foreign_keys=[baseline_run_id], viewonly=True)
    acknowledged_via_run: Mapped[Run | None] = relationship(foreign_keys=[acknowledged_via_run_id], viewonly=True)


class UnsteadyCase(Base):
    """A case that once failed to reproduce itself on one build, remembered per project: every later
    run repeats it (worker/pipeline.py UNSTEADY_RUNS), commit and verify runs alike, so one change
    gets one verdict (docs/ENGINE.md, Nondeterminism)."""

    __tablename__ = "unsteady_cases"

    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True)
    case_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    first_seen_run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    last_seen_run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    times_seen: Mapped[int] = mapped_column(Integer, default=1)
    last_seen_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
