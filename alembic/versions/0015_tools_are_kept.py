"""Tasks name their tool without a foreign key; a tool is never deleted nor renumbered.

The foreign key tasks.tool_id -> tools.id ran a check per inserted row (a `FOR KEY SHARE` lookup
of the tool): a fifth to a quarter of a 1,000-item QueueTasks' statement time (6.5 to 9 ms of
34 to 39, bench/enqueue_parts.py, docs/BENCHMARKS.md "fifth round"), for a rule the service
cannot break. No RPC deletes a tool or changes its id, and both inserts (QueueTask, QueueTasks)
select their tool's row in the same statement and insert nothing when it is missing. What the
key still guarded by hand, a tool deleted or renumbered under its tasks, a statement trigger now
refuses (DELETE, TRUNCATE and UPDATE OF id on generation.tools), at no cost to any insert. A
task written by hand naming no tool is no longer refused: only the service writes tasks.

Rolling: no statement of an older replica relies on the key. Dropping it takes an ACCESS
EXCLUSIVE lock on both tables for an instant; a long transaction holding either would make it
wait, and every statement on them queue behind it, so it gives up after 10 s (lock_timeout)
and the migration can be run again (docs/OPERATIONS.md, "Upgrading").

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-01
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

UPGRADE = r"""
SET LOCAL lock_timeout = '10s';
ALTER TABLE generation.tasks DROP CONSTRAINT tasks_tool_id_fkey;

-- Tasks name their tool without a foreign key (alembic 0015): a tool stays for good.
CREATE FUNCTION generation.keep_tools_v1() RETURNS trigger
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
BEGIN
    RAISE EXCEPTION 'a tool is never deleted nor renumbered: its tasks name it (pause it instead)'
        USING ERRCODE = 'restrict_violation';
END
$$;

CREATE TRIGGER tools_are_kept BEFORE UPDATE OF id OR DELETE OR TRUNCATE ON generation.tools
    FOR EACH STATEMENT EXECUTE FUNCTION generation.keep_tools_v1();
"""

# The key comes back NOT VALID first (an instant), then is validated under a lock that lets
# writes through; the validation fails if a task written by hand names no tool.
DOWNGRADE = r"""
SET LOCAL lock_timeout = '10s';
DROP TRIGGER tools_are_kept ON generation.tools;
DROP FUNCTION generation.keep_tools_v1;
ALTER TABLE generation.tasks
    ADD CONSTRAINT tasks_tool_id_fkey FOREIGN KEY (tool_id) REFERENCES generation.tools (id)
    NOT VALID;
ALTER TABLE generation.tasks VALIDATE CONSTRAINT tasks_tool_id_fkey;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
