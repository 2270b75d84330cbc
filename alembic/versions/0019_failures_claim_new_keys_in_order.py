"""Batches of failures claim the cooldown and hold rows they may create before locking any.

A FailTasks batch locks its tasks, their attempts, the tools money moves on, settings, and the
cooldown and hold rows that already exist, in that order (lock_reported_v2). It then ends the
items one by one, in task-id order. A retryable failure of a key that has no cooldown row yet
inserts it; an account failure does the same for a group's hold. Two batches that create the
same two new keys, each in its own task order, could therefore each wait for the other's
uncommitted insert. Postgres broke the cycle by failing one of them (deadlock_detected). The
worker then saw UNAVAILABLE and sent its reports again. A review reproduced it.

Now `lock_reported_v2` first takes a transaction advisory lock for every key and group that the
batch's failures may create. It takes them in one order, before any key or group row is locked,
so the second batch waits there for the first. A CompleteTasks batch creates no such row, and
its items carry no failure, so it takes no advisory lock and waits as before. A single FailTask
writes at most one such row, as its last wait, and so closes no cycle.

The function is replaced in place, as 0018 did: same arguments and contract. Replicas older
than 0014 lock their batches through `lock_reported_v1`, which keeps the defect until they are
replaced. The downgrade keeps the fixed body.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-03
"""

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

UPGRADE = r"""
-- As lock_reported_v1, its rows found through index conditions on the batch's own keys
-- (`= ANY` of its task ids, of its lease tokens), which bound the scans whatever the statistics
-- say, and what the later locks need read from the attempts once: v1 joined the ledger again for
-- each kind of row, and a cached plan could read every attempt of the batch's tools (alembic
-- 0014).
-- Failures claim the cooldown and hold rows they may create before any such row is locked
-- (alembic 0019).
CREATE OR REPLACE FUNCTION generation.lock_reported_v2(p_items jsonb) RETURNS void
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    ids uuid[] := ARRAY(SELECT (x ->> 'task_id')::uuid FROM jsonb_array_elements(p_items) AS x);
    tokens uuid[] := ARRAY(
        SELECT (x ->> 'lease_token')::uuid FROM jsonb_array_elements(p_items) AS x);
    tools uuid[];
    grows boolean;
    keys text[];
    groups text[];
    created text[];
BEGIN
    -- 1. The tasks, in id order.
    PERFORM 1 FROM generation.tasks AS t WHERE t.id = ANY (ids) ORDER BY t.id FOR NO KEY UPDATE;
    -- 2. Their attempts under the reported leases, in key order (two leases of one task too).
    SELECT array_agg(DISTINCT r.tool_id) FILTER (
               WHERE r.outcome = 'running' AND r.estimate_nanos > 0 OR r.cost > 0),
           COALESCE(bool_or(r.cost > CASE WHEN r.outcome = 'running' THEN r.estimate_nanos
                                          ELSE 0 END), false),
           array_agg(DISTINCT r.resource_key), array_agg(DISTINCT r.account_group),
           array_agg(DISTINCT CASE r.failure WHEN 'retryable' THEN 'cooldown ' || r.resource_key
                                             WHEN 'account' THEN 'hold ' || r.account_group END)
    INTO tools, grows, keys, groups, created
    FROM (SELECT a.tool_id, a.outcome, a.estimate_nanos, a.account_group, i.failure,
                 COALESCE(i.cost_nanos, 0) AS cost,
                 COALESCE(i.resource_key, a.resource_key) AS resource_key
          FROM generation.attempts AS a
          JOIN jsonb_to_recordset(p_items)
              AS i(task_id uuid, lease_token uuid, failure text, cost_nanos bigint,
                   resource_key text)
            ON i.lease_token = a.lease_token AND i.task_id = a.task_id
          WHERE a.lease_token = ANY (tokens)
          ORDER BY a.task_id, a.attempt
          FOR NO KEY UPDATE OF a) AS r;
    -- 3. The tools money moves on (a reservation to release, a cost to add).
    PERFORM 1 FROM generation.tools AS tl WHERE tl.id = ANY (tools) ORDER BY tl.id
    FOR NO KEY UPDATE;
    -- 4. Settings, when a cost above what its run reserved may grow the grants.
    PERFORM 1 FROM generation.settings WHERE grows FOR NO KEY UPDATE;
    -- 5. The cooldown and hold rows a failure may create (a retryable one its key's, an account
    --    one its group's): an advisory lock each, in one order, before any such row is locked.
    --    A new key's row is inserted by its first failure, item by item in task order, so two
    --    batches of failures creating the same new keys in two orders would each wait for the
    --    other's insert; the second now waits here for the first. A CompleteTasks batch creates
    --    none and takes none.
    PERFORM pg_advisory_xact_lock(w.lock)
    FROM (SELECT DISTINCT hashtextextended(x, 0) AS lock
          FROM unnest(created) AS x WHERE x IS NOT NULL ORDER BY 1) AS w;
    -- 6. The runs' cooldown and hold rows that exist, in key order.
    PERFORM 1 FROM generation.cooldowns AS c WHERE c.resource_key = ANY (keys)
    ORDER BY c.resource_key
    FOR NO KEY UPDATE;
    PERFORM 1 FROM generation.holds AS h WHERE h.account_group = ANY (groups)
    ORDER BY h.account_group
    FOR NO KEY UPDATE;
END
$$;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    """Nothing: the body 0014 created had the defect this fixes (docstring)."""
