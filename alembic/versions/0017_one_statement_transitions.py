"""Claims and completions that move no money run in one statement each.

`claim_tasks_v4` (ClaimNextTask, ClaimTasks) and `complete_task_v3` (CompleteTask) put a
single statement in front of `claim_tasks_v3` and `complete_task_v2`, for the case where those
would decide nothing but the queue: no gate, limit, cooldown or hold applies, no estimate is
reserved, no cost is reported. That statement reads the gates, picks, starts the runs and writes
their attempts and events (or ends the run, closes its attempt and appends its event); when any
condition fails it changes nothing and the older function decides, so each rule keeps one
definition. The single-task pair cost Postgres about a quarter less (docs/BENCHMARKS.md, tenth
round): most of the older functions' time was PL/pgSQL and executor start-up per statement, not
the rows they write.

Additive: replicas of 0016 keep calling claim_tasks_v3 and complete_task_v2, which stay.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-03
"""

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

UPGRADE = r"""
-- Claims as claim_tasks_v3 does, in one statement when nothing but the queue decides: the
-- switch on and the global cap above today's grants, the tool not paused and free of limits,
-- cooldowns and holds, with no spend today and no zero cap of its own, and every task picked
-- estimated at 0 with a resource key without a limit. Then v3 would admit every task it picks,
-- reserve nothing and grant nothing, so the runs start here; else nothing is changed and
-- claim_tasks_v3 decides (alembic 0017).
CREATE FUNCTION generation.claim_tasks_v4(
    p_tool uuid, p_limit integer, p_lease_seconds integer, p_disabled boolean, p_cap bigint
) RETURNS TABLE (task generation.tasks, lease_seconds integer, idle_reason text, event jsonb)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
BEGIN
    -- 0. The local day cannot move under a claim (as in v3).
    PERFORM pg_advisory_xact_lock_shared(1734700658);
    RETURN QUERY
    -- 1. The gates, read unlocked as v3 reads them: one row when none of them applies.
    WITH gate AS MATERIALIZED (
        SELECT COALESCE(tl.resource_key, tl.name) AS default_key,
               COALESCE(tl.account_group, tl.name) AS default_group,
               COALESCE(tl.lease_seconds, p_lease_seconds) AS lease,
               tl.cost_estimate_nanos, today.day AS today
        FROM generation.tools AS tl, generation.settings AS s,
             generation.gates_v1(p_disabled, p_cap) AS g,
             LATERAL (SELECT (now() AT TIME ZONE s.timezone)::date AS day) AS today
        WHERE tl.id = p_tool AND g.running AND NOT tl.paused AND g.cap > 0
          AND tl.max_in_flight IS NULL AND (tl.daily_cap_nanos IS NULL OR tl.daily_cap_nanos > 0)
          AND (tl.spent_day IS DISTINCT FROM today.day OR tl.spent_nanos + tl.reserved_nanos = 0)
          AND CASE WHEN s.granted_day = today.day THEN s.granted_nanos ELSE 0 END < g.cap
          AND NOT EXISTS (SELECT 1 FROM generation.resource_limits AS l
                          WHERE l.resource_key = COALESCE(tl.resource_key, tl.name))
          AND NOT EXISTS (SELECT 1 FROM generation.cooldowns AS c
                          WHERE c.resource_key = COALESCE(tl.resource_key, tl.name)
                            AND c.cooling_until > now())
          AND NOT EXISTS (SELECT 1 FROM generation.holds AS h
                          WHERE h.account_group = COALESCE(tl.account_group, tl.name)
                            AND h.held_until > now())),
    -- 2. Lock up to p_limit claimable tasks in claim order, as v3 does. (The gate is a test
    --    made once before the scan, never a join: a plan that scanned the tasks first would
    --    walk the tool's whole queue whenever a gate applies.)
    picked AS MATERIALIZED (
        SELECT q.id, q.reclaimed, q.priority, q.run_at, q.cost_estimate_nanos, q.resource_key,
               q.account_group
        FROM generation.tasks AS q
        WHERE EXISTS (SELECT 1 FROM gate)
          AND q.tool_id = p_tool AND q.status = 'queued' AND q.retry_count < q.max_retries
          AND q.run_at <= now() AND (q.expires_at IS NULL OR q.expires_at > now())
          AND (q.resource_key IS NULL OR NOT EXISTS (
                SELECT 1 FROM generation.cooldowns AS c
                WHERE c.resource_key = q.resource_key AND c.cooling_until > now()))
          AND (q.account_group IS NULL OR NOT EXISTS (
                SELECT 1 FROM generation.holds AS h
                WHERE h.account_group = q.account_group AND h.held_until > now()))
        ORDER BY q.reclaimed DESC, q.priority DESC, q.run_at
        LIMIT p_limit
        FOR NO KEY UPDATE OF q SKIP LOCKED),
    -- 3. All of them free (no estimate, no limit on their key), or none started here.
    run AS (
        SELECT picked.id, picked.reclaimed, picked.priority, picked.run_at,
               COALESCE(picked.cost_estimate_nanos, gate.cost_estimate_nanos) AS estimate,
               COALESCE(picked.resource_key, gate.default_key) AS resource_key,
               COALESCE(picked.account_group, gate.default_group) AS account_group,
               gate.lease, gate.today
        FROM picked, gate),
    admitted AS (
        SELECT * FROM run
        WHERE NOT EXISTS (
            SELECT 1 FROM run AS r
            WHERE r.estimate <> 0 OR EXISTS (SELECT 1 FROM generation.resource_limits AS l
                                             WHERE l.resource_key = r.resource_key))),
    -- 4. Start the runs: a fresh, unconfirmed lease each, an attempt, a `started` event.
    --    (Found by `= ANY` of their ids, which bounds the scan whatever the statistics say.)
    started AS (
        UPDATE generation.tasks AS t
        SET status = 'processing',
            started_at = COALESCE(t.started_at, now()),
            claim_expires_at = now() + make_interval(secs => (SELECT gate.lease FROM gate)),
            lease_token = gen_random_uuid(),
            lease_confirmed = false,
            reclaimed = false,
            attempt_count = t.attempt_count + 1,
            last_event_seq = t.last_event_seq + 1
        WHERE t.id = ANY (ARRAY(SELECT admitted.id FROM admitted))
        RETURNING t AS task, t.id, t.attempt_count, t.lease_token, t.last_event_seq),
    attempt AS (
        INSERT INTO generation.attempts
            (task_id, attempt, lease_token, tool_id, resource_key, account_group, local_day,
             estimate_nanos)
        SELECT started.id, started.attempt_count, started.lease_token, p_tool,
               admitted.resource_key, admitted.account_group, admitted.today, 0
        FROM started JOIN admitted ON admitted.id = started.id),
    event AS (
        INSERT INTO generation.task_events (task_id, sequence, kind, data)
        SELECT started.id, started.last_event_seq, 'started',
               jsonb_build_object('attempt', started.attempt_count)
        FROM started
        RETURNING *)
    SELECT started.task, admitted.lease, NULL::text, to_jsonb(event)
    FROM started JOIN admitted ON admitted.id = started.id JOIN event ON event.task_id = started.id
    ORDER BY admitted.reclaimed DESC, admitted.priority DESC, admitted.run_at;
    IF NOT FOUND THEN
        -- 5. A gate or a limit applies, money moves, or nothing is there: v3 decides.
        RETURN QUERY SELECT * FROM generation.claim_tasks_v3(
            p_tool, p_limit, p_lease_seconds, p_disabled, p_cap);
        RETURN;
    END IF;
    -- 6. A worker asked for the tool's work (as in v3).
    INSERT INTO generation.tool_polls AS p (tool_id, polled_at)
    SELECT p_tool, now()
    WHERE NOT EXISTS (SELECT 1 FROM generation.tool_polls AS x
                      WHERE x.tool_id = p_tool AND x.polled_at > now() - interval '5 seconds')
    ON CONFLICT (tool_id) DO UPDATE SET polled_at = EXCLUDED.polled_at;
END
$$;

-- Ends a held run as complete_task_v2 does, in one statement when no money moves (no cost
-- reported, none reserved at the claim): the run's end, its attempt's close, the key's run of
-- failures reset and the terminal event. Anything else (money, a repeated report, a lost lease,
-- an unknown task) changes nothing here and complete_task_v2 decides (alembic 0017).
CREATE FUNCTION generation.complete_task_v3(
    p_task uuid, p_token uuid, p_output jsonb, p_usage jsonb, p_cost bigint, p_resource_key text
) RETURNS TABLE (task_found boolean, task generation.tasks, event jsonb)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    -- 1. Lock the task and decide (the lease held, no money) in its UPDATE, which rechecks
    --    the newest version of the row once it holds the lock.
    WITH ended AS (
        UPDATE generation.tasks AS q
        SET status = CASE WHEN q.cancel_requested_at IS NULL THEN 'completed' ELSE 'cancelled' END
                     ::generation.task_status,
            output = CASE WHEN q.cancel_requested_at IS NULL THEN p_output END,
            reported_usage = p_usage,
            error = CASE WHEN q.cancel_requested_at IS NULL THEN NULL ELSE 'cancelled' END,
            completed_at = now(), claim_expires_at = NULL, lease_token = NULL,
            lease_confirmed = false, last_event_seq = q.last_event_seq + 1
        WHERE q.id = p_task AND q.status = 'processing' AND q.lease_token = p_token
          AND q.claim_expires_at > now() AND p_cost = 0
          AND EXISTS (SELECT 1 FROM generation.attempts AS a
                      WHERE a.task_id = p_task AND a.lease_token = p_token
                        AND a.outcome = 'running' AND a.estimate_nanos = 0)
        RETURNING q AS task, q.status, q.last_event_seq),
    -- 2. Close its attempt (as close_attempt_v2 closes one that moves no money).
    closed AS (
        UPDATE generation.attempts AS a
        SET outcome = ended.status::text::generation.attempt_outcome,
            resource_key = COALESCE(p_resource_key, a.resource_key),
            ended_at = now()
        FROM ended
        WHERE a.task_id = p_task AND a.lease_token = p_token
        RETURNING a.resource_key, a.outcome),
    -- 3. A completed run ends its key's run of failures.
    cooled AS (
        UPDATE generation.cooldowns AS c SET consecutive_failures = 0
        FROM closed
        WHERE closed.outcome = 'completed' AND c.resource_key = closed.resource_key
          AND c.consecutive_failures > 0),
    -- 4. The terminal event, last in the stream.
    event AS (
        INSERT INTO generation.task_events (task_id, sequence, kind, data)
        SELECT p_task, ended.last_event_seq, ended.status::text::generation.task_event_kind, '{}'
        FROM ended
        RETURNING *)
    SELECT true, ended.task, to_jsonb(event) FROM ended, event;
    IF NOT FOUND THEN
        -- 5. Money moves, or the lease is not held now: v2 decides.
        RETURN QUERY SELECT * FROM generation.complete_task_v2(
            p_task, p_token, p_output, p_usage, p_cost, p_resource_key);
    END IF;
END
$$;
"""

DOWNGRADE = r"""
DROP FUNCTION generation.complete_task_v3;
DROP FUNCTION generation.claim_tasks_v4;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
