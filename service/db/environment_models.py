"""A build variant's changed cases against its base environment's build, co-run on one worker
(worker/jobs/environment_attribution.py): one row per pair of finished runs of one commit (A: the
base environment's run, e.g. `cpu`; B: its variant's, `cpu+fma`). Kept apart from models.py like
speed_models.py; migrations/env.py imports it so the table is on Base.metadata.

`detail` holds, per changed case, the per-step max |B − A| and the numerical attribution
(worker/attribution/analysis.py: class, ulps of the case's scale); the looks-like label is made
when it is read (service/core/environment_attribution.py), from it and the two runs' toolchains.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.db.base import Base, utcnow
from service.db.types import UTCDateTime

# queued -> running -> done | failed (a failure is logged and shown; the comparison stands without it).
ATTRIBUTION_QUEUED, ATTRIBUTION_RUNNING, ATTRIBUTION_DONE, ATTRIBUTION_FAILED = "queued", "running", "done", "failed"


class EnvironmentAttribution(Base):
    __tablename__ = "environment_attributions"
    __table_args__ = (UniqueConstraint("run_a_id", "run_b_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    run_a_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    run_b_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    # B's environment names the queue: the workers that serve the variant serve its base too.
    environment_a: Mapped[str] = mapped_column(String(100))
    environment_b: Mapped[str] = mapped_column(String(100))
    status: Mapped[str] = mapped_column(String(20), default=ATTRIBUTION_QUEUED)
    changed_cases: Mapped[int] = mapped_column(default=0)
    worker: Mapped[str | None] = mapped_column(String(255))
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
