"""Training-impact jobs (issue 46): a run's changed optimizer trained on small reference models
beside its baseline's (worker/jobs/training.py). One row per (run, baseline run, model set); kept
apart from models.py like environment_models.py; migrations/env.py imports it.

`results` holds, per model x configuration, service.core.training.ModelImpact as JSON (the
verdict, its figures and every run's loss at every step, full precision).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.db.base import Base, utcnow
from service.db.types import UTCDateTime

# queued -> running -> done | failed; not_needed: the run did not change against its baseline.
TRAINING_QUEUED, TRAINING_RUNNING, TRAINING_DONE, TRAINING_FAILED = "queued", "running", "done", "failed"
TRAINING_NOT_NEEDED = "not_needed"


class TrainingImpactJob(Base):
    __tablename__ = "training_impacts"
    __table_args__ = (UniqueConstraint("run_id", "baseline_run_id", "model_set"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    baseline_run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    model_set: Mapped[str] = mapped_column(String(20))
    # The run's environment names the queue (its co-run queue: the workers that ran it build both sides).
    environment: Mapped[str] = mapped_column(String(100))
    requested_by: Mapped[str] = mapped_column(String(100), default="automatic")
    status: Mapped[str] = mapped_column(String(20), default=TRAINING_QUEUED)
    runs_done: Mapped[int] = mapped_column(default=0)
    runs_total: Mapped[int] = mapped_column(default=0)
    phase: Mapped[str | None] = mapped_column(String(40))
    worker: Mapped[str | None] = mapped_column(String(255))
    device: Mapped[str | None] = mapped_column(String(200))
    results: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    seconds: Mapped[float | None] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
