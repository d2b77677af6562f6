"""api tokens and the verify quota ledger

Revision ID: 0002_api_tokens
Revises: 0001
"""

from alembic import op
import sqlalchemy as sa
import service.db.types

revision = "0002_api_tokens"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("scope", sa.String(length=20), nullable=False),
        sa.Column("project", sa.String(length=100), nullable=True),
        sa.Column("daily_quota", sa.Integer(), nullable=True),
        sa.Column("created_at", service.db.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("expires_at", service.db.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", service.db.types.UTCDateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_api_tokens_token_hash")),
    )
    op.create_table(
        "token_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("token_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("created_at", service.db.types.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["token_id"], ["api_tokens.id"], ondelete="CASCADE",
                                name=op.f("fk_token_runs_token_id_api_tokens")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE",
                                name=op.f("fk_token_runs_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_token_runs")),
        sa.UniqueConstraint("run_id", name=op.f("uq_token_runs_run_id")),
    )
    op.create_index("ix_token_runs_token_id_created_at", "token_runs", ["token_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_token_runs_token_id_created_at", table_name="token_runs")
    op.drop_table("token_runs")
    op.drop_table("api_tokens")
