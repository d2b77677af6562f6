"""Issue 44: a baseline is found, never assumed absent; an acknowledgement belongs to the change.

- commits.ancestry: the commit's first-parent line as the client sent it (parent first, at most
  service.domain.ancestry.MAX_ANCESTRY shas), walked for the nearest ancestor with a finished run;
- runs.allow_no_baseline: the submission accepted a run with nothing to compare with (first
  adoption); without it a no-baseline verdict fails CI;
- verdicts.baseline_commits_back / baseline_note: which ancestor the baseline is and why;
- verdicts.acknowledged_change: what an acknowledgement accepted (source digests, changed cases'
  digests), and acknowledged_via_run_id: the acknowledged run a later same change was matched to.

Revision ID: 0011_baseline_ancestry_acks
Revises: 0010_runs_workers_lost
"""

from alembic import op
import sqlalchemy as sa

revision = "0011_baseline_ancestry_acks"
down_revision = "0010_runs_workers_lost"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch: SQLite cannot ALTER a table in place (alembic copies the table there).
    with op.batch_alter_table("commits") as batch:
        batch.add_column(sa.Column("ancestry", sa.JSON(), nullable=True))
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("allow_no_baseline", sa.Boolean(), nullable=False,
                                   server_default=sa.false()))
    with op.batch_alter_table("verdicts") as batch:
        batch.add_column(sa.Column("baseline_commits_back", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("baseline_note", sa.Text(), nullable=True))
        batch.add_column(sa.Column("acknowledged_change", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("acknowledged_via_run_id", sa.Integer(), nullable=True))
        batch.create_foreign_key("fk_verdicts_acknowledged_via_run_id_runs", "runs",
                                 ["acknowledged_via_run_id"], ["id"], ondelete="SET NULL")


def downgrade() -> None:
    with op.batch_alter_table("verdicts") as batch:
        batch.drop_constraint("fk_verdicts_acknowledged_via_run_id_runs", type_="foreignkey")
        batch.drop_column("acknowledged_via_run_id")
        batch.drop_column("acknowledged_change")
        batch.drop_column("baseline_note")
        batch.drop_column("baseline_commits_back")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("allow_no_baseline")
    with op.batch_alter_table("commits") as batch:
        batch.drop_column("ancestry")
