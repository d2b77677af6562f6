"""verify attempts: a token_runs row is taken before a verify request is processed (the atomic
quota), so it may have no run yet, and a refused attempt keeps its row with the reason

Revision ID: 0004_verify_attempts
Revises: 0003_worker_presence
"""

from alembic import op
import sqlalchemy as sa

revision = "0004_verify_attempts"
down_revision = "0003_worker_presence"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch: SQLite cannot ALTER a column in place (alembic copies the table there).
    with op.batch_alter_table("token_runs") as batch:
        batch.alter_column("run_id", existing_type=sa.Integer(), nullable=True)
        batch.add_column(sa.Column("rejection", sa.String(length=500), nullable=True))


def downgrade() -> None:
    op.execute("DELETE FROM token_runs WHERE run_id IS NULL")
    with op.batch_alter_table("token_runs") as batch:
        batch.drop_column("rejection")
        batch.alter_column("run_id", existing_type=sa.Integer(), nullable=False)
