"""unsteady cases (issue 34): a case that once failed to reproduce itself, remembered per project,
so every later run repeats it (docs/ENGINE.md, Nondeterminism)

Revision ID: 0008_unsteady_cases
Revises: 0007_source_archive_projects
"""

from alembic import op
import sqlalchemy as sa
import service.db.types

revision = "0008_unsteady_cases"
down_revision = "0007_source_archive_projects"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "unsteady_cases",
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("case_id", sa.String(length=255), nullable=False),
        sa.Column("first_seen_run_id", sa.Integer(), nullable=True),
        sa.Column("last_seen_run_id", sa.Integer(), nullable=True),
        sa.Column("times_seen", sa.Integer(), nullable=False),
        sa.Column("last_seen_at", service.db.types.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE",
                                name=op.f("fk_unsteady_cases_project_id_projects")),
        sa.ForeignKeyConstraint(["first_seen_run_id"], ["runs.id"], ondelete="SET NULL",
                                name=op.f("fk_unsteady_cases_first_seen_run_id_runs")),
        sa.ForeignKeyConstraint(["last_seen_run_id"], ["runs.id"], ondelete="SET NULL",
                                name=op.f("fk_unsteady_cases_last_seen_run_id_runs")),
        sa.PrimaryKeyConstraint("project_id", "case_id", name=op.f("pk_unsteady_cases")),
    )


def downgrade() -> None:
    op.drop_table("unsteady_cases")
