"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-30 16:19:39.784986
"""

from alembic import op
import sqlalchemy as sa
import service.db.types


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('projects',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=100), nullable=False),
    sa.Column('build_kind', sa.String(length=40), nullable=False),
    sa.Column('build_command', sa.Text(), nullable=True),
    sa.Column('adapter', sa.String(length=100), nullable=False),
    sa.Column('default_battery', sa.String(length=100), nullable=False),
    sa.Column('environments', sa.JSON(), nullable=False),
    sa.Column('created_at', service.db.types.UTCDateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_projects')),
    sa.UniqueConstraint('name', name=op.f('uq_projects_name'))
    )
    op.create_table('source_archives',
    sa.Column('digest', sa.String(length=64), nullable=False),
    sa.Column('size_bytes', sa.Integer(), nullable=False),
    sa.Column('member_count', sa.Integer(), nullable=False),
    sa.Column('created_at', service.db.types.UTCDateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('digest', name=op.f('pk_source_archives'))
    )
    op.create_table('commits',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('project_id', sa.Integer(), nullable=False),
    sa.Column('sha', sa.String(length=64), nullable=False),
    sa.Column('parents', sa.JSON(), nullable=False),
    sa.Column('ref', sa.String(length=255), nullable=True),
    sa.Column('release_tag', sa.String(length=100), nullable=True),
    sa.Column('message', sa.Text(), nullable=True),
    sa.Column('source_digest', sa.String(length=64), nullable=False),
    sa.Column('created_at', service.db.types.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], name=op.f('fk_commits_project_id_projects'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['source_digest'], ['source_archives.digest'], name=op.f('fk_commits_source_digest_source_archives')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_commits')),
    sa.UniqueConstraint('project_id', 'sha', name=op.f('uq_commits_project_id_sha'))
    )
    with op.batch_alter_table('commits', schema=None) as batch_op:
        batch_op.create_index('ix_commits_project_id_created_at', ['project_id', 'created_at'], unique=False)
        batch_op.create_index('ix_commits_project_id_release_tag', ['project_id', 'release_tag'], unique=False)

    op.create_table('runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('project_id', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=20), nullable=False),
    sa.Column('commit_id', sa.Integer(), nullable=True),
    sa.Column('base_commit_id', sa.Integer(), nullable=True),
    sa.Column('source_digest', sa.String(length=64), nullable=False),
    sa.Column('battery', sa.String(length=100), nullable=False),
    sa.Column('battery_hash', sa.String(length=64), nullable=True),
    sa.Column('environment', sa.String(length=100), nullable=False),
    sa.Column('environment_detail', sa.JSON(), nullable=True),
    sa.Column('idempotency_key', sa.String(length=200), nullable=True),
    sa.Column('status', sa.String(length=20), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('worker', sa.String(length=255), nullable=True),
    sa.Column('cancel_requested', sa.Boolean(), nullable=False),
    sa.Column('created_at', service.db.types.UTCDateTime(timezone=True), nullable=False),
    sa.Column('dispatched_at', service.db.types.UTCDateTime(timezone=True), nullable=True),
    sa.Column('started_at', service.db.types.UTCDateTime(timezone=True), nullable=True),
    sa.Column('heartbeat_at', service.db.types.UTCDateTime(timezone=True), nullable=True),
    sa.Column('finished_at', service.db.types.UTCDateTime(timezone=True), nullable=True),
    sa.Column('cases_total', sa.Integer(), nullable=True),
    sa.Column('cases_done', sa.Integer(), nullable=False),
    sa.Column('build_digest', sa.String(length=64), nullable=True),
    sa.Column('build_cached', sa.Boolean(), nullable=True),
    sa.Column('build_log', sa.Text(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['base_commit_id'], ['commits.id'], name=op.f('fk_runs_base_commit_id_commits'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['commit_id'], ['commits.id'], name=op.f('fk_runs_commit_id_commits'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], name=op.f('fk_runs_project_id_projects'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['source_digest'], ['source_archives.digest'], name=op.f('fk_runs_source_digest_source_archives')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runs')),
    sa.UniqueConstraint('commit_id', 'battery', 'environment', name=op.f('uq_runs_commit_id_battery_environment')),
    sa.UniqueConstraint('project_id', 'idempotency_key', name=op.f('uq_runs_project_id_idempotency_key'))
    )
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.create_index('ix_runs_project_id_created_at', ['project_id', 'created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_runs_status'), ['status'], unique=False)
        batch_op.create_index('ix_runs_status_dispatched_at', ['status', 'dispatched_at'], unique=False)

    op.create_table('trajectories',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('case_id', sa.String(length=255), nullable=False),
    sa.Column('case_index', sa.Integer(), nullable=False),
    sa.Column('case', sa.JSON(), nullable=False),
    sa.Column('status', sa.String(length=20), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('steps', sa.Integer(), nullable=False),
    sa.Column('series_layout', sa.JSON(), nullable=False),
    sa.Column('series_data', sa.LargeBinary(), nullable=False),
    sa.Column('digests', sa.Text(), nullable=False),
    sa.Column('extra', sa.JSON(), nullable=True),
    sa.Column('created_at', service.db.types.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_trajectories_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_trajectories')),
    sa.UniqueConstraint('run_id', 'case_id', name=op.f('uq_trajectories_run_id_case_id'))
    )
    op.create_table('verdicts',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('baseline_run_id', sa.Integer(), nullable=True),
    sa.Column('outcome', sa.String(length=20), nullable=False),
    sa.Column('flagged', sa.Boolean(), nullable=False),
    sa.Column('changed_cases', sa.Integer(), nullable=False),
    sa.Column('first_divergent_step', sa.Integer(), nullable=True),
    sa.Column('detail', sa.JSON(), nullable=False),
    sa.Column('acknowledged', sa.Boolean(), nullable=False),
    sa.Column('acknowledged_by', sa.String(length=255), nullable=True),
    sa.Column('acknowledgement_note', sa.Text(), nullable=True),
    sa.Column('acknowledged_at', service.db.types.UTCDateTime(timezone=True), nullable=True),
    sa.Column('created_at', service.db.types.UTCDateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['baseline_run_id'], ['runs.id'], name=op.f('fk_verdicts_baseline_run_id_runs'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_verdicts_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_verdicts')),
    sa.UniqueConstraint('run_id', name=op.f('uq_verdicts_run_id'))
    )
    with op.batch_alter_table('verdicts', schema=None) as batch_op:
        batch_op.create_index('ix_verdicts_flagged_created_at', ['flagged', 'created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_verdicts_outcome'), ['outcome'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('verdicts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_verdicts_outcome'))
        batch_op.drop_index('ix_verdicts_flagged_created_at')

    op.drop_table('verdicts')
    op.drop_table('trajectories')
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index('ix_runs_status_dispatched_at')
        batch_op.drop_index(batch_op.f('ix_runs_status'))
        batch_op.drop_index('ix_runs_project_id_created_at')

    op.drop_table('runs')
    with op.batch_alter_table('commits', schema=None) as batch_op:
        batch_op.drop_index('ix_commits_project_id_release_tag')
        batch_op.drop_index('ix_commits_project_id_created_at')

    op.drop_table('commits')
    op.drop_table('source_archives')
    op.drop_table('projects')
