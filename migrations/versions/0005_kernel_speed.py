"""kernel speed: each kernel's timing samples per run (worker/speed, service/db/speed_models.py)

Revision ID: 0005_kernel_speed
Revises: 0004_verify_attempts
"""

from alembic import op
import sqlalchemy as sa
import service.db.types

revision = "0005_kernel_speed"
down_revision = "0004_verify_attempts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "kernel_speeds",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("kernel", sa.String(length=100), nullable=False),
        sa.Column("optimizer", sa.String(length=40), nullable=False),
        sa.Column("family", sa.String(length=40), nullable=False),
        sa.Column("param_dtype", sa.String(length=20), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("samples_s", sa.JSON(), nullable=False),
        sa.Column("median_s", sa.Double(), nullable=True),
        sa.Column("spread_s", sa.Double(), nullable=True),
        sa.Column("bytes_moved", sa.BigInteger(), nullable=False),
        sa.Column("copy_samples_s", sa.JSON(), nullable=False),
        sa.Column("copy_median_s", sa.Double(), nullable=True),
        sa.Column("copy_fraction", sa.Double(), nullable=True),
        sa.Column("device", sa.String(length=200), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", service.db.types.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_kernel_speeds_run_id_runs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_kernel_speeds")),
        sa.UniqueConstraint("run_id", "kernel", "param_dtype", "size",
                            name=op.f("uq_kernel_speeds_run_id_kernel_param_dtype_size")),
    )
    op.create_index("ix_kernel_speeds_run_id", "kernel_speeds", ["run_id"])


def downgrade() -> None:
    op.drop_index("ix_kernel_speeds_run_id", table_name="kernel_speeds")
    op.drop_table("kernel_speeds")
