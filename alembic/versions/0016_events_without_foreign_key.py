"""Events name their task without a foreign key; the purge deletes them with their task.

The foreign key task_events.task_id -> tasks.id ran a check per appended event (a `FOR KEY
SHARE` look-up of the task, fired after the statement): every claim appends a `started` event
and every report a terminal one, so a drained task paid two of them (1.3 ms of a claim of 100
in psql, 0.7 ms of its completion; within noise in a whole drain: docs/BENCHMARKS.md, ninth
round), for a rule the service cannot break. Every event is appended by a transition function
that has just locked and read its task (`append_event_v1` inserts from the task's own row), and
the one statement that deletes tasks, PurgeTasks', now deletes their events in the same
statement (the key's ON DELETE CASCADE did that before).

Rolling: no statement of a newer replica relies on the key. An older replica's purge, while it
still runs, deletes tasks without their events; those events are never read (WatchTaskEvents
answers NOT_FOUND for a task that is gone) and the downgrade deletes them. Dropping the key takes
an ACCESS EXCLUSIVE lock on both tables for an instant, so it gives up after 10 s (lock_timeout)
behind a long transaction, and the migration can be run again (docs/OPERATIONS.md, "Upgrading").

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-03
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

UPGRADE = r"""
SET LOCAL lock_timeout = '10s';
ALTER TABLE generation.task_events DROP CONSTRAINT task_events_task_id_fkey;
"""

# The events of tasks purged meanwhile go first; the key comes back NOT VALID (an instant), then
# is validated under a lock that lets writes through.
DOWNGRADE = r"""
SET LOCAL lock_timeout = '10s';
DELETE FROM generation.task_events AS e
WHERE NOT EXISTS (SELECT 1 FROM generation.tasks AS t WHERE t.id = e.task_id);
ALTER TABLE generation.task_events
    ADD CONSTRAINT task_events_task_id_fkey FOREIGN KEY (task_id)
    REFERENCES generation.tasks (id) ON DELETE CASCADE NOT VALID;
ALTER TABLE generation.task_events VALIDATE CONSTRAINT task_events_task_id_fkey;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
