"""The kernels' own speed per run (worker/speed): one row per run x kernel x parameter dtype x size.

Every timing sample is kept (JSON floats round-trip bit-exactly), not only the median: the
comparison with a later run bootstraps over the samples (service/core/speed_noise.py). Kept apart from
models.py because speed is measured and judged apart from trajectories; migrations/env.py imports
it so the table is on Base.metadata.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, BigInteger, Double, ForeignKey, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from service.db.base import Base, utcnow
from service.db.types import UTCDateTime


class KernelSpeed(Base):
    __tablename__ = "kernel_speeds"
    __table_args__ = (UniqueConstraint("run_id", "kernel", "param_dtype", "size"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    kernel: Mapped[str] = mapped_column(String(100))  # "<optimizer>/<family>", e.g. "adam/32bit"
    optimizer: Mapped[str] = mapped_column(String(40))
    family: Mapped[str] = mapped_column(String(40))
    param_dtype: Mapped[str] = mapped_column(String(20))
    size: Mapped[int] = mapped_column(BigInteger)
    # Seconds per step, every sample in timing order; empty when the kernel failed (`error`).
    samples_s: Mapped[list[float]] = mapped_column(JSON, default=list)
    median_s: Mapped[float | None] = mapped_column(Double)
    spread_s: Mapped[float | None] = mapped_column(Double)  # interquartile range of the samples
    bytes_moved: Mapped[int] = mapped_column(BigInteger, default=0)
    # A device-to-device copy of bytes_moved in the same run: the card's bandwidth yardstick.
    copy_samples_s: Mapped[list[float]] = mapped_column(JSON, default=list)
    copy_median_s: Mapped[float | None] = mapped_column(Double)
    copy_fraction: Mapped[float | None] = mapped_column(Double)  # copy time / kernel time
    device: Mapped[str] = mapped_column(String(200), default="")
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
