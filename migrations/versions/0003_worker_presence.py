"""worker presence: one row per live Celery worker process, refreshed every few seconds

Revision ID: 0003_worker_presence
Revises: 0002_api_tokens
"""

from alembic import op
import sqlalchemy as sa
import service.db.types

revision = "0003_worker_presence"
down_revision = "0002_api_tokens"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "worker_presence",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("environment", sa.String(length=100), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=True),
        sa.Column("started_at", service.db.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("seen_at", service.db.types.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_worker_presence")),
    )
    op.create_index("ix_worker_presence_environment_seen_at", "worker_presence", ["environment", "seen_at"])


def downgrade() -> None:
    op.drop_index("ix_worker_presence_environment_seen_at", table_name="worker_presence")
    op.drop_table("worker_presence")
