"""The watchdog's reads skip the queued tasks of attended tools.

ListStaleTasks and GetStatus's stale count asked `generation.stale_reason_v2` about every queued
task older than queued_max_age: with a million of them waiting for a live worker, GetStatus took
27 s, and the maintenance leader, which reads it every 10 s to log why tasks wait, kept a core of
Postgres busy. `generation.unattended_tools_v1` names the tools whose queued tasks can be
abandoned at all (each condition is one stale_reason_v2 implies), and the two reads ask about the
queued tasks of those tools only.

Additive: a function only; replicas of 0012 keep their statements.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

UPGRADE = r"""
-- The tools whose queued tasks generation.stale_reason_v2 may call abandoned: the switch on, a
-- cap set, the tool not paused, no gate changed and no worker's poll within queued_max_age, no
-- live lease. Each holds of every abandoned task, so the watchdog's reads (ListStaleTasks,
-- GetStatus) ask stale_reason_v2 only about the queued tasks of these tools: a backlog that a
-- worker drains, a paused tool's, or one the switch holds is not judged row by row (alembic 0013).
CREATE FUNCTION generation.unattended_tools_v1() RETURNS uuid[]
LANGUAGE sql STABLE
AS $$
    SELECT COALESCE(array_agg(tl.id), '{}')
    FROM generation.tools AS tl, generation.settings AS s, generation.gates_v1(false, NULL) AS g
    WHERE g.running AND g.cap > 0 AND NOT tl.paused
      AND GREATEST(s.gates_changed_at, tl.gates_changed_at)
          <= now() - make_interval(secs => s.queued_max_age_seconds)
      AND NOT EXISTS (
          SELECT 1 FROM generation.tool_polls AS p
          WHERE p.tool_id = tl.id
            AND p.polled_at > now() - make_interval(secs => s.queued_max_age_seconds))
      AND NOT EXISTS (
          SELECT 1 FROM generation.tasks AS q
          WHERE q.tool_id = tl.id AND q.status = 'processing' AND q.claim_expires_at > now())
$$;
"""

DOWNGRADE = r"""
DROP FUNCTION generation.unattended_tools_v1;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
