"""source archives scoped to projects (issue 33): each upload records the project it was for, and
a digest names a source only for the projects that uploaded it (another project's digest is 404)

Existing archives are granted to every project that already used them (their commits and runs),
so no submitted commit or verify base loses its source. An archive uploaded through
POST /sources and not yet used by any commit belongs to no project until a project uploads it
again (the upload is idempotent: the same bytes, the same digest).

Revision ID: 0007_source_archive_projects
Revises: 0006_merge_round3
"""

from alembic import op
import sqlalchemy as sa
import service.db.types

revision = "0007_source_archive_projects"
down_revision = "0006_merge_round3"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "source_archive_projects",
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("created_at", service.db.types.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["digest"], ["source_archives.digest"], ondelete="CASCADE",
                                name=op.f("fk_source_archive_projects_digest_source_archives")),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE",
                                name=op.f("fk_source_archive_projects_project_id_projects")),
        sa.PrimaryKeyConstraint("digest", "project_id", name=op.f("pk_source_archive_projects")),
    )
    # CURRENT_TIMESTAMP is UTC on both PostgreSQL (timestamptz) and SQLite (text, read back as UTC).
    op.execute(
        "INSERT INTO source_archive_projects (digest, project_id, created_at) "
        "SELECT source_digest, project_id, CURRENT_TIMESTAMP FROM commits "
        "UNION SELECT source_digest, project_id, CURRENT_TIMESTAMP FROM runs")


def downgrade() -> None:
    op.drop_table("source_archive_projects")
