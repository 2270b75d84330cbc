"""QueueTask REQUEUE keeps its requeue keys on the task.

The REQUEUE's requeue_key (0022's release) was looked for in the task's `requeued` events, in
the statement's snapshot: a REQUEUE sent again while the first one's transaction was still open
missed its event once that committed, and could queue the task a second time if something
finished it in between; and the call that created the task wrote no event, so its key was
recorded nowhere and its retry after the task had run queued it again. A review reproduced both.

`tasks.requeue_keys` holds the keys of the REQUEUEs that created the task or queued it again.
The conflict path reads them on the row it holds locked, at its newest version. NULL for every
task enqueued without a key: adding the column rewrites nothing.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-03
"""

from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE generation.tasks ADD COLUMN requeue_keys text[]")


def downgrade() -> None:
    op.execute("ALTER TABLE generation.tasks DROP COLUMN requeue_keys")
