"""runs.workers_lost (issue 43): how many of a run's attempts ended with their worker gone
mid-run; the reaper stops handing a run to another worker once it took down two
(service/domain/runs.py reap_stale, docs/security/SANDBOX.md "No run can wedge a worker")

Revision ID: 0010_runs_workers_lost
Revises: 0009_environment_attributions
"""

from alembic import op
import sqlalchemy as sa

revision = "0010_runs_workers_lost"
down_revision = "0009_environment_attributions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch: SQLite cannot ALTER a table in place (alembic copies the table there).
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("workers_lost", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("workers_lost")
