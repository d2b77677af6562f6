"""github_pull_request_runs (issue 44): the verify runs the service starts itself for a pull
request from a fork, on GitHub's pull_request webhook event (service/notify/pull_requests.py),
one per head sha and environment.

Revision ID: 0012_github_pull_request_runs
Revises: 0011_baseline_ancestry_acks
"""

from alembic import op
import sqlalchemy as sa

import service.db.types

UTC = service.db.types.UTCDateTime(timezone=True)

revision = "0012_github_pull_request_runs"
down_revision = "0011_baseline_ancestry_acks"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "github_pull_request_runs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("project_id", sa.Integer(), sa.ForeignKey("projects.id", ondelete="CASCADE"), nullable=False),
        sa.Column("run_id", sa.Integer(), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False,
                  unique=True),
        sa.Column("environment", sa.String(100), nullable=False),
        sa.Column("repository", sa.String(200), nullable=False),
        sa.Column("pull_number", sa.Integer(), nullable=False),
        sa.Column("head_sha", sa.String(64), nullable=False),
        sa.Column("head_repository", sa.String(200), nullable=False),
        sa.Column("merge_sha", sa.String(64), nullable=False),
        sa.Column("base_sha", sa.String(64), nullable=False),
        sa.Column("delivery_id", sa.String(100), nullable=False),
        sa.Column("created_at", UTC, nullable=False),
        sa.UniqueConstraint("project_id", "head_sha", "environment"),
    )
    op.create_index("ix_github_pull_request_runs_head_repository", "github_pull_request_runs",
                    ["head_repository"])


def downgrade() -> None:
    op.drop_index("ix_github_pull_request_runs_head_repository", "github_pull_request_runs")
    op.drop_table("github_pull_request_runs")
