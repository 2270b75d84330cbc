"""Operators: indexes for purging finished tasks and for the status of workers and throughput.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

UPGRADE = r"""
CREATE INDEX tasks_finished_idx ON generation.tasks (completed_at)
    WHERE status IN ('completed', 'failed', 'cancelled', 'expired');
CREATE INDEX attempts_tool_started_idx ON generation.attempts (tool_id, started_at);
CREATE INDEX attempts_ended_idx ON generation.attempts (ended_at);
"""

DOWNGRADE = r"""
DROP INDEX generation.attempts_ended_idx;
DROP INDEX generation.attempts_tool_started_idx;
DROP INDEX generation.tasks_finished_idx;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
