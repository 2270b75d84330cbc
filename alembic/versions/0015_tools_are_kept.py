"""Tasks name their tool without a foreign key; a tool is never deleted.

The foreign key tasks.tool_id -> tools.id ran a check per inserted row (a `FOR KEY SHARE` lookup
of the tool): a quarter of a 1,000-item QueueTasks' statement time (bench/enqueue_parts.py,
docs/BENCHMARKS.md "fifth round"), for a rule nothing could break. No RPC deletes a tool, and
both inserts (QueueTask, QueueTasks) select their tool's row in the same statement and insert
nothing when it is missing. What the key still guarded, a tool deleted by hand under its tasks,
a statement trigger now refuses (DELETE and TRUNCATE of generation.tools), at no cost to any
insert.

Rolling: no statement of an older replica relies on the key.

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
ALTER TABLE generation.tasks DROP CONSTRAINT tasks_tool_id_fkey;

-- Tasks name their tool without a foreign key (alembic 0015): a tool stays for good.
CREATE FUNCTION generation.keep_tools_v1() RETURNS trigger
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
BEGIN
    RAISE EXCEPTION 'a tool is never deleted: its tasks name it (pause it instead)'
        USING ERRCODE = 'restrict_violation';
END
$$;

CREATE TRIGGER tools_are_kept BEFORE DELETE OR TRUNCATE ON generation.tools
    FOR EACH STATEMENT EXECUTE FUNCTION generation.keep_tools_v1();
"""

DOWNGRADE = r"""
DROP TRIGGER tools_are_kept ON generation.tools;
DROP FUNCTION generation.keep_tools_v1;
ALTER TABLE generation.tasks
    ADD CONSTRAINT tasks_tool_id_fkey FOREIGN KEY (tool_id) REFERENCES generation.tools (id);
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
