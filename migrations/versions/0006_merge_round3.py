"""Join the two schema branches of round 3: kernel speeds (issue 18) and notifications (issue 16).

Both were written against 0004 at the same time; this revision makes the history one line again,
so `alembic upgrade head` (singular) works as well as the migrator's `heads`.

Revision ID: 0006_merge_round3
Revises: 0005_kernel_speed, 0005_notify
"""

from __future__ import annotations

revision = "0006_merge_round3"
down_revision = ("0005_kernel_speed", "0005_notify")
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
