"""Transitions planned once, on their indexes; the ledger vacuumed like the queue.

Every PL/pgSQL function in `generation` (the write transitions) now runs with
`plan_cache_mode = force_generic_plan` and `enable_seqscan = off`:

- force_generic_plan: each statement inside a transition is planned once per connection instead
  of once per call (a custom plan for every call cost the claim about 320 us of its 630).
- enable_seqscan = off: a generic plan is kept for the connection's life, so one made while a
  table was small (the attempts ledger right after a deploy, or analyzed while empty) scanned the
  whole ledger on every close until the next ANALYZE; a transition only ever reads rows by key.

And the attempts ledger is vacuumed after 2,000 dead rows, as the queue table is, instead of at
20 % of a table that only grows.

Settings only, no function body changes: replicas of 0009 keep serving beside it, and get faster.
A PL/pgSQL function added to `generation` later must carry both settings (tests/test_schema.py).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# The same block ends schema.sql.
UPGRADE = r"""
ALTER TABLE generation.attempts
    SET (autovacuum_vacuum_scale_factor = 0.0, autovacuum_vacuum_threshold = 2000);

DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure FROM pg_proc AS p JOIN pg_language AS l ON l.oid = p.prolang
        WHERE p.pronamespace = 'generation'::regnamespace AND l.lanname = 'plpgsql'
    LOOP
        EXECUTE format(
            'ALTER FUNCTION %s SET plan_cache_mode = force_generic_plan SET enable_seqscan = off', f);
    END LOOP;
END
$$;
"""

DOWNGRADE = r"""
ALTER TABLE generation.attempts
    RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold);

DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure FROM pg_proc AS p JOIN pg_language AS l ON l.oid = p.prolang
        WHERE p.pronamespace = 'generation'::regnamespace AND l.lanname = 'plpgsql'
    LOOP
        EXECUTE format('ALTER FUNCTION %s RESET ALL', f);
    END LOOP;
END
$$;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
