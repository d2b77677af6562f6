"""environment attributions (issue 36): a build variant's changed cases co-run against its base
environment's build on one worker, with their per-step |B - A| and attribution
(service/db/environment_models.py)

Revision ID: 0009_environment_attributions
Revises: 0008_unsteady_cases
"""

from alembic import op
import sqlalchemy as sa
import service.db.types

revision = "0009_environment_attributions"
down_revision = "0008_unsteady_cases"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "environment_attributions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("run_a_id", sa.Integer(), nullable=False),
        sa.Column("run_b_id", sa.Integer(), nullable=False),
        sa.Column("environment_a", sa.String(length=100), nullable=False),
        sa.Column("environment_b", sa.String(length=100), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("changed_cases", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", service.db.types.UTCDateTime(timezone=True), nullable=False),
        sa.Column("started_at", service.db.types.UTCDateTime(timezone=True), nullable=True),
        sa.Column("finished_at", service.db.types.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE",
                                name=op.f("fk_environment_attributions_project_id_projects")),
        sa.ForeignKeyConstraint(["run_a_id"], ["runs.id"], ondelete="CASCADE",
                                name=op.f("fk_environment_attributions_run_a_id_runs")),
        sa.ForeignKeyConstraint(["run_b_id"], ["runs.id"], ondelete="CASCADE",
                                name=op.f("fk_environment_attributions_run_b_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_environment_attributions")),
        sa.UniqueConstraint("run_a_id", "run_b_id", name=op.f("uq_environment_attributions_run_a_id_run_b_id")),
    )
    op.create_index(op.f("ix_environment_attributions_run_a_id"), "environment_attributions", ["run_a_id"])
    op.create_index(op.f("ix_environment_attributions_run_b_id"), "environment_attributions", ["run_b_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_environment_attributions_run_b_id"), table_name="environment_attributions")
    op.drop_index(op.f("ix_environment_attributions_run_a_id"), table_name="environment_attributions")
    op.drop_table("environment_attributions")
