"""notifications: a project's GitHub integration and the check run of each run, its outgoing
webhooks and their delivery log (service/db/notify_models.py)

Revision ID: 0005_notify
Revises: 0004_verify_attempts
"""

from alembic import op
import sqlalchemy as sa
import service.db.types

revision = "0005_notify"
down_revision = "0004_verify_attempts"
branch_labels = None
depends_on = None

UTC = service.db.types.UTCDateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "github_integrations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("repository", sa.String(length=200), nullable=False),
        sa.Column("api_url", sa.String(length=500), nullable=False),
        sa.Column("auth_kind", sa.String(length=10), nullable=False),
        sa.Column("token", sa.Text(), nullable=True),
        sa.Column("app_id", sa.String(length=50), nullable=True),
        sa.Column("private_key", sa.Text(), nullable=True),
        sa.Column("installation_id", sa.BigInteger(), nullable=True),
        sa.Column("check_name", sa.String(length=100), nullable=False),
        sa.Column("pr_comments", sa.Boolean(), nullable=False),
        sa.Column("dashboard_url", sa.String(length=500), nullable=True),
        sa.Column("created_at", UTC, nullable=False),
        sa.Column("updated_at", UTC, nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE",
                                name=op.f("fk_github_integrations_project_id_projects")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_github_integrations")),
        sa.UniqueConstraint("project_id", name=op.f("uq_github_integrations_project_id")),
    )
    op.create_table(
        "github_check_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("check_run_id", sa.BigInteger(), nullable=True),
        sa.Column("status", sa.String(length=20), nullable=True),
        sa.Column("conclusion", sa.String(length=20), nullable=True),
        sa.Column("sent_state", sa.String(length=200), nullable=True),
        sa.Column("comment_ids", sa.JSON(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("updated_at", UTC, nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE",
                                name=op.f("fk_github_check_runs_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_github_check_runs")),
        sa.UniqueConstraint("run_id", name=op.f("uq_github_check_runs_run_id")),
    )
    op.create_table(
        "webhooks",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("url", sa.String(length=1000), nullable=False),
        sa.Column("secret", sa.Text(), nullable=False),
        sa.Column("events", sa.JSON(), nullable=False),
        sa.Column("payload_format", sa.String(length=10), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.Column("created_at", UTC, nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE",
                                name=op.f("fk_webhooks_project_id_projects")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhooks")),
    )
    op.create_index(op.f("ix_webhooks_project_id"), "webhooks", ["project_id"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("webhook_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("event", sa.String(length=30), nullable=False),
        sa.Column("delivery_uuid", sa.String(length=36), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("duration_s", sa.Float(), nullable=True),
        sa.Column("created_at", UTC, nullable=False),
        sa.Column("delivered_at", UTC, nullable=True),
        sa.ForeignKeyConstraint(["webhook_id"], ["webhooks.id"], ondelete="CASCADE",
                                name=op.f("fk_webhook_deliveries_webhook_id_webhooks")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE",
                                name=op.f("fk_webhook_deliveries_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_deliveries")),
        sa.UniqueConstraint("webhook_id", "run_id", "event",
                            name=op.f("uq_webhook_deliveries_webhook_id_run_id_event")),
    )
    op.create_index("ix_webhook_deliveries_webhook_id_created_at", "webhook_deliveries",
                    ["webhook_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_webhook_deliveries_webhook_id_created_at", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_index(op.f("ix_webhooks_project_id"), table_name="webhooks")
    op.drop_table("webhooks")
    op.drop_table("github_check_runs")
    op.drop_table("github_integrations")
