"""training_impacts (issue 46): a run's changed optimizer trained on small reference models beside
its baseline's (worker/jobs/training.py), one row per run, baseline run and model set.

Revision ID: 0013_training_impacts
Revises: 0012_github_pull_request_runs
"""

from alembic import op
import sqlalchemy as sa

import service.db.types

UTC = service.db.types.UTCDateTime(timezone=True)

revision = "0013_training_impacts"
down_revision = "0012_github_pull_request_runs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "training_impacts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("baseline_run_id", sa.Integer(), nullable=False),
        sa.Column("model_set", sa.String(20), nullable=False),
        sa.Column("environment", sa.String(100), nullable=False),
        sa.Column("requested_by", sa.String(100), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("runs_done", sa.Integer(), nullable=False),
        sa.Column("runs_total", sa.Integer(), nullable=False),
        sa.Column("phase", sa.String(40), nullable=True),
        sa.Column("worker", sa.String(255), nullable=True),
        sa.Column("device", sa.String(200), nullable=True),
        sa.Column("results", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.Column("created_at", UTC, nullable=False),
        sa.Column("started_at", UTC, nullable=True),
        sa.Column("finished_at", UTC, nullable=True),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE",
                                name=op.f("fk_training_impacts_project_id_projects")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name=op.f("fk_training_impacts_run_id_runs")),
        sa.ForeignKeyConstraint(["baseline_run_id"], ["runs.id"], ondelete="CASCADE",
                                name=op.f("fk_training_impacts_baseline_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_training_impacts")),
        sa.UniqueConstraint("run_id", "baseline_run_id", "model_set",
                            name=op.f("uq_training_impacts_run_id_baseline_run_id_model_set")),
    )
    for column in ("project_id", "run_id", "baseline_run_id"):
        op.create_index(op.f(f"ix_training_impacts_{column}"), "training_impacts", [column])


def downgrade() -> None:
    op.drop_table("training_impacts")
