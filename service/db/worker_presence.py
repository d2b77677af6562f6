"""Which Celery workers are alive, per environment class: each worker process writes a row every
few seconds (worker/gpu_workers.py), so the API can say that a queued run has no live worker to
take it. The database, not Celery's broadcast (which the embedded filesystem broker cannot carry),
is the one place every deployment shares."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Index, String
from sqlalchemy.orm import Mapped, mapped_column

from service.db.base import Base, utcnow
from service.db.types import UTCDateTime


class WorkerPresence(Base):
    __tablename__ = "worker_presence"
    __table_args__ = (Index("ix_worker_presence_environment_seen_at", "environment", "seen_at"),)

    # The Celery node name plus pid: unique per worker process.
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    environment: Mapped[str] = mapped_column(String(100))
    # GPU index (CUDA_VISIBLE_DEVICES), host, pid: shown to people, never used for scheduling.
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    seen_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
