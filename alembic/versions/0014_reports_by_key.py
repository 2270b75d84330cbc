"""Report batches find their rows by key; no transition is JIT-compiled.

1. `complete_tasks_v3` and `heartbeat_tasks_v2`: the set-wise statements of 0011 named the
   status of the tasks they end or extend (`processing`) and the outcome of the attempts they
   close (`running`), which offered the planner the partial indexes of every processing task
   and every running attempt. With statistics taken while few ran, those look like one row
   each, and the plan (cached for the connection) read every run in flight for every batch, and
   joined it with the batch row by row: with 2 workers on 8 tools (1,600 in flight) a
   CompleteTasks of 160 items spent 180 ms of Postgres CPU, against 15 ms with 200 in flight.
   The new versions find the tasks by id and lease token (a lease token is set only while
   processing: CHECK tasks_lease_held_while_processing) and read the attempts' outcome behind a
   MATERIALIZED fence; every scan carries `= ANY` of the batch's own ids or lease tokens, which
   bounds it whatever plan is cached. Their locks (`lock_reported_v2`, also under the new
   `fail_tasks_v2`) read the attempts once, in (task, attempt) order: v1 joined the ledger once
   per kind of row it locks, and a cached plan could read every attempt of the batch's tools.
2. `jit = off` on every PL/pgSQL function of the schema: `enable_seqscan = off` (0010) prices
   the one-row tables' scans at 10^10, so a session with JIT on (psql, a tool, pgbench without
   the service's settings) compiled every transition: a ClaimTasks of 100 took 9.5 s.

Additive: replicas of 0013 keep calling complete_tasks_v2, heartbeat_tasks_v1 and fail_tasks_v1,
which stay.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01
"""

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

UPGRADE = r"""
-- As lock_reported_v1, its rows found through index conditions on the batch's own keys
-- (`= ANY` of its task ids, of its lease tokens), which bound the scans whatever the statistics
-- say, and what the later locks need read from the attempts once: v1 joined the ledger again for
-- each kind of row, and a cached plan could read every attempt of the batch's tools (alembic
-- 0014).
CREATE FUNCTION generation.lock_reported_v2(p_items jsonb) RETURNS void
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
BEGIN
    -- 1. The tasks, in id order.
    PERFORM 1 FROM generation.tasks AS t WHERE t.id = ANY (ids) ORDER BY t.id FOR NO KEY UPDATE;
    -- 2. Their attempts under the reported leases, in key order (two leases of one task too).
    SELECT array_agg(DISTINCT r.tool_id) FILTER (
               WHERE r.outcome = 'running' AND r.estimate_nanos > 0 OR r.cost > 0),
           COALESCE(bool_or(r.cost > CASE WHEN r.outcome = 'running' THEN r.estimate_nanos
                                          ELSE 0 END), false),
           array_agg(DISTINCT r.resource_key), array_agg(DISTINCT r.account_group)
    INTO tools, grows, keys, groups
    FROM (SELECT a.tool_id, a.outcome, a.estimate_nanos, a.account_group,
                 COALESCE(i.cost_nanos, 0) AS cost,
                 COALESCE(i.resource_key, a.resource_key) AS resource_key
          FROM generation.attempts AS a
          JOIN jsonb_to_recordset(p_items)
              AS i(task_id uuid, lease_token uuid, cost_nanos bigint, resource_key text)
            ON i.lease_token = a.lease_token AND i.task_id = a.task_id
          WHERE a.lease_token = ANY (tokens)
          ORDER BY a.task_id, a.attempt
          FOR NO KEY UPDATE OF a) AS r;
    -- 3. The tools money moves on (a reservation to release, a cost to add).
    PERFORM 1 FROM generation.tools AS tl WHERE tl.id = ANY (tools) ORDER BY tl.id
    FOR NO KEY UPDATE;
    -- 4. Settings, when a cost above what its run reserved may grow the grants.
    PERFORM 1 FROM generation.settings WHERE grows FOR NO KEY UPDATE;
    -- 5. The runs' cooldown and hold rows that exist, in key order.
    PERFORM 1 FROM generation.cooldowns AS c WHERE c.resource_key = ANY (keys)
    ORDER BY c.resource_key
    FOR NO KEY UPDATE;
    PERFORM 1 FROM generation.holds AS h WHERE h.account_group = ANY (groups)
    ORDER BY h.account_group
    FOR NO KEY UPDATE;
END
$$;

-- FailTasks, as fail_tasks_v1 with lock_reported_v2 (alembic 0014).
CREATE FUNCTION generation.fail_tasks_v2(p_items jsonb)
RETURNS TABLE (ordinal integer, requested_id uuid, task_found boolean, forced boolean,
               task generation.tasks, event jsonb)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
BEGIN
    PERFORM generation.lock_reported_v2(p_items);
    RETURN QUERY
    SELECT i.ordinal, i.task_id, c.task_found, c.forced, c.task, c.event
    FROM (SELECT * FROM jsonb_to_recordset(p_items) AS x(
              ordinal integer, task_id uuid, lease_token uuid, failure text, error text,
              cost_nanos bigint, resource_key text)
          ORDER BY x.task_id, x.ordinal) AS i,
         LATERAL generation.fail_task_v2(i.task_id, i.lease_token, i.failure, i.error,
                                         i.cost_nanos, i.resource_key) AS c;
END
$$;

-- CompleteTasks, as complete_tasks_v2, its rows found by key whatever the statistics say
-- (alembic 0014): the held runs' tasks by id, their attempts by lease token.
CREATE FUNCTION generation.complete_tasks_v3(p_items jsonb)
RETURNS TABLE (ordinal integer, requested_id uuid, task_found boolean, task generation.tasks,
               event jsonb)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    today date;
    r record;
    ended integer[] := '{}';
    ids uuid[] := ARRAY(SELECT (x ->> 'task_id')::uuid FROM jsonb_array_elements(p_items) AS x);
BEGIN
    -- 1. Lock what the batch may change, in the lock order.
    PERFORM generation.lock_reported_v2(p_items);
    SELECT (now() AT TIME ZONE s.timezone)::date INTO today FROM generation.settings AS s;
    -- 2. End the held runs: a statement after the locks, so it reads the rows as they are now.
    FOR r IN
        WITH item AS (
            SELECT DISTINCT ON (x.task_id, x.lease_token) *
            FROM jsonb_to_recordset(p_items) AS x(
                ordinal integer, task_id uuid, lease_token uuid, output jsonb, reported_usage jsonb,
                cost_nanos bigint, resource_key text)
            ORDER BY x.task_id, x.lease_token, x.ordinal),
        done AS (
            UPDATE generation.tasks AS q
            SET status = CASE WHEN q.cancel_requested_at IS NULL THEN 'completed'
                              ELSE 'cancelled' END::generation.task_status,
                output = CASE WHEN q.cancel_requested_at IS NULL THEN item.output END,
                reported_usage = item.reported_usage,
                error = CASE WHEN q.cancel_requested_at IS NULL THEN NULL ELSE 'cancelled' END,
                completed_at = now(), claim_expires_at = NULL, lease_token = NULL,
                lease_confirmed = false, last_event_seq = q.last_event_seq + 1
            FROM item
            -- Held: its lease token (set only while it is processing, CHECK
            -- tasks_lease_held_while_processing), not yet lapsed. Naming the status would offer
            -- the planner tasks_in_flight_idx, every processing task, which statistics taken while
            -- few ran price at one row: read per batch, that cost 180 ms with 1,600 in flight.
            WHERE q.id = item.task_id AND q.id = ANY (ids)
              AND q.lease_token = item.lease_token AND q.claim_expires_at > now()
            RETURNING q.id, q AS task, item.ordinal, item.lease_token,
                      COALESCE(item.cost_nanos, 0) AS cost, item.resource_key),
        -- Each run's attempt, found by its lease token, with what its close needs; its outcome
        -- is read here, behind the fence, so that no plan reads every running attempt through
        -- attempts_running_idx.
        run AS MATERIALIZED (
            SELECT a.task_id, a.attempt, a.outcome, (done.task).status, done.resource_key,
                   done.cost
            FROM done JOIN generation.attempts AS a
              ON a.lease_token = done.lease_token AND a.task_id = done.id),
        -- Each run's attempt closes with its cost (close_attempt_v2's step 3).
        closed AS (
            UPDATE generation.attempts AS a
            SET outcome = run.status::text::generation.attempt_outcome,
                resource_key = COALESCE(run.resource_key, a.resource_key),
                cost_nanos = a.cost_nanos + run.cost,
                ended_at = COALESCE(a.ended_at, now())
            FROM run
            WHERE a.task_id = run.task_id AND a.attempt = run.attempt AND run.outcome = 'running'
            RETURNING a.tool_id, a.local_day, a.estimate_nanos, a.outcome, a.resource_key,
                      run.cost),
        -- Today's runs release their reservations and add their costs, per tool (step 4).
        money AS (
            SELECT t.id,
                   CASE WHEN t.spent_day = today THEN t.spent_nanos ELSE 0 END + m.cost AS spent,
                   CASE WHEN t.spent_day = today THEN t.reserved_nanos - m.released ELSE 0 END
                       AS reserved,
                   CASE WHEN t.spent_day = today THEN t.granted_nanos ELSE 0 END AS granted
            FROM (SELECT closed.tool_id, sum(closed.estimate_nanos) AS released,
                         sum(closed.cost) AS cost
                  FROM closed
                  WHERE closed.local_day = today AND (closed.estimate_nanos > 0 OR closed.cost > 0)
                  GROUP BY closed.tool_id) AS m
            JOIN generation.tools AS t ON t.id = m.tool_id
            WHERE t.spent_day IS NULL OR t.spent_day <= today),
        moved AS (
            UPDATE generation.tools AS t
            SET spent_nanos = money.spent, reserved_nanos = money.reserved,
                granted_nanos = GREATEST(money.granted, money.spent + money.reserved),
                spent_day = today
            FROM money WHERE t.id = money.id
            RETURNING GREATEST(0, money.spent + money.reserved - money.granted) AS growth),
        -- A cost above its estimate grows the tool's share, and so the total of grants.
        grown AS (
            UPDATE generation.settings AS x
            SET granted_nanos = CASE WHEN x.granted_day = today THEN x.granted_nanos ELSE 0 END
                                + g.growth,
                granted_day = today
            FROM (SELECT sum(moved.growth) AS growth FROM moved) AS g
            WHERE g.growth > 0 AND (x.granted_day IS NULL OR x.granted_day <= today)),
        -- A completed run ends its key's run of failures (step 5).
        cooled AS (
            UPDATE generation.cooldowns AS c SET consecutive_failures = 0
            WHERE c.resource_key IN (SELECT closed.resource_key FROM closed
                                     WHERE closed.outcome = 'completed')
              AND c.consecutive_failures > 0),
        -- The terminal event, last in each stream.
        appended AS (
            INSERT INTO generation.task_events (task_id, sequence, kind, data)
            SELECT done.id, (done.task).last_event_seq,
                   (done.task).status::text::generation.task_event_kind, '{}'
            FROM done
            RETURNING *),
        -- Each run's event by its task, in one value read once: a join of the two CTEs, which
        -- the planner takes for one row each, would compare every pair.
        events AS MATERIALIZED (
            SELECT jsonb_object_agg(appended.task_id, to_jsonb(appended)) AS by_task
            FROM appended)
        SELECT done.ordinal, done.task, events.by_task -> done.id::text AS event
        FROM done, events
    LOOP
        ended := ended || r.ordinal;
        ordinal := r.ordinal;
        requested_id := (r.task).id;
        task_found := true;
        task := r.task;
        event := r.event;
        RETURN NEXT;
    END LOOP;
    -- 3. Every other item as CompleteTask, which sees what step 2 did.
    RETURN QUERY
    SELECT i.ordinal, i.task_id, c.task_found, c.task, c.event
    FROM (SELECT * FROM jsonb_to_recordset(p_items) AS x(
              ordinal integer, task_id uuid, lease_token uuid, output jsonb, reported_usage jsonb,
              cost_nanos bigint, resource_key text)
          WHERE NOT x.ordinal = ANY (ended)
          ORDER BY x.task_id, x.ordinal) AS i,
         LATERAL generation.complete_task_v2(i.task_id, i.lease_token, i.output,
                                             i.reported_usage, i.cost_nanos, i.resource_key) AS c;
END
$$;

-- HeartbeatTasks, as heartbeat_tasks_v1, its tasks found by id whatever the statistics say
-- (alembic 0014).
CREATE FUNCTION generation.heartbeat_tasks_v2(p_items jsonb, p_lease_seconds integer)
RETURNS TABLE (ordinal integer, requested_id uuid, task_found boolean,
               claim_expires_at timestamptz, lease_seconds integer, cancel_requested boolean)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    ids uuid[] := ARRAY(SELECT (x ->> 'task_id')::uuid FROM jsonb_array_elements(p_items) AS x);
BEGIN
    -- 1. Lock the tasks, then decide (`= ANY` bounds the scan whatever the statistics say).
    PERFORM 1 FROM generation.tasks AS t WHERE t.id = ANY (ids) ORDER BY t.id FOR NO KEY UPDATE;
    -- 2. Extend and confirm the leases still running; a cancel asked for is told to the worker.
    RETURN QUERY
    WITH item AS (
        SELECT * FROM jsonb_to_recordset(p_items)
            AS x(ordinal integer, task_id uuid, lease_token uuid)),
    beat AS (
        UPDATE generation.tasks AS q
        SET claim_expires_at
                = now() + make_interval(secs => COALESCE(tl.lease_seconds, p_lease_seconds)),
            lease_confirmed = true
        FROM (SELECT DISTINCT task_id, lease_token FROM item) AS i, generation.tools AS tl
        -- Held: its lease token (set only while processing), not lapsed; as in
        -- complete_tasks_v3, no status here, or the plan may read every processing task.
        WHERE q.id = i.task_id AND q.id = ANY (ids) AND tl.id = q.tool_id
          AND q.lease_token = i.lease_token AND q.claim_expires_at > now()
        RETURNING q.id, q.lease_token, q.claim_expires_at,
                  COALESCE(tl.lease_seconds, p_lease_seconds) AS lease,
                  q.cancel_requested_at IS NOT NULL AS cancel)
    SELECT item.ordinal, item.task_id,
           beat.id IS NOT NULL
               OR EXISTS (SELECT 1 FROM generation.tasks AS t WHERE t.id = item.task_id),
           beat.claim_expires_at, beat.lease, beat.cancel
    FROM item
    LEFT JOIN beat ON beat.id = item.task_id AND beat.lease_token = item.lease_token;
END
$$;
"""

DOWNGRADE = r"""
DROP FUNCTION generation.complete_tasks_v3;
DROP FUNCTION generation.fail_tasks_v2;
DROP FUNCTION generation.lock_reported_v2;
DROP FUNCTION generation.heartbeat_tasks_v2;
"""


def _on_every_transition(clause: str) -> str:
    """ALTER FUNCTION ... `clause` for every PL/pgSQL function of the schema (schema.sql's closing
    block sets the three settings the same way)."""
    return f"""
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure FROM pg_proc AS p JOIN pg_language AS l ON l.oid = p.prolang
        WHERE p.pronamespace = 'generation'::regnamespace AND l.lanname = 'plpgsql'
    LOOP
        EXECUTE format('ALTER FUNCTION %s {clause}', f);
    END LOOP;
END
$$;
"""


def upgrade() -> None:
    op.execute(UPGRADE + _on_every_transition("SET jit = off"))


def downgrade() -> None:
    op.execute(DOWNGRADE + _on_every_transition("RESET jit"))
