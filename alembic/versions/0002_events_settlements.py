"""Task event streams, settlements of reservations, tasks.settled_at.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

UPGRADE = r"""
ALTER TABLE generation.tasks ADD COLUMN settled_at timestamptz;

CREATE INDEX tasks_unsettled_idx ON generation.tasks (completed_at)
    WHERE status IN ('completed', 'failed') AND reserved_token_amount > 0 AND settled_at IS NULL;

CREATE TYPE generation.task_event_kind AS ENUM (
    'progress', 'streaming_url', 'partial_output', 'requeued', 'completed', 'failed'
);

CREATE TABLE generation.task_events (
    task_id uuid NOT NULL REFERENCES generation.tasks (id) ON DELETE CASCADE,
    sequence bigint GENERATED ALWAYS AS IDENTITY,
    kind generation.task_event_kind NOT NULL,
    data jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, sequence)
);

CREATE TABLE generation.settlements (
    task_id uuid PRIMARY KEY,
    task_status generation.task_status NOT NULL,
    reserved_token_amount bigint NOT NULL,
    charged_token_amount bigint NOT NULL,
    refunded_token_amount bigint NOT NULL,
    settled_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT settlements_terminal CHECK (task_status IN ('completed', 'failed')),
    CONSTRAINT settlements_amounts CHECK (
        charged_token_amount >= 0 AND refunded_token_amount >= 0
        AND charged_token_amount + refunded_token_amount = reserved_token_amount
    )
);
"""

DOWNGRADE = r"""
DROP TABLE generation.settlements;
DROP TABLE generation.task_events;
DROP TYPE generation.task_event_kind;
DROP INDEX generation.tasks_unsettled_idx;
ALTER TABLE generation.tasks DROP COLUMN settled_at;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
