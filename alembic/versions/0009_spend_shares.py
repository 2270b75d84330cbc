"""Spend shares of the global cap per tool, concurrency limits, and who enqueued each task.

Every paid claim and costed completion used to update the one row of `generation.settings`, so
claims of different tools serialized on it. Now each tool's row carries its share of today's
cap (`tools.granted_nanos`, escrow in the manner of O'Neil, 1986); a claim takes the settings
row only to be granted more (`generation.grant_share_v1`), and today's total is the sum of the
tools' counters (`generation.spend_today`). Spend, reservations and shares all count on the
local day their attempt started (docs/ARCHITECTURE.md, "Spend control").

Concurrency limits: `tools.max_in_flight` and `generation.resource_limits`, counted in the claim
over `attempts_running_idx`. And `tasks.source`, who or what enqueued a task.

The counters move to new columns and new function versions, so this revision is a stop-the-world
upgrade (docs/OPERATIONS.md, "Upgrading"): replicas of 0008 fail on the dropped `_v1` functions
rather than count spend in the old row.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

import importlib.util
import re
from pathlib import Path

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

CHANGED = (
    "stale_reason",
    "close_attempt",
    "hand_back_unconfirmed",
    "end_lapsed_run",
    "claim_tasks",
    "complete_task",
    "reap_task",
    "fail_task",
    "release_task",
    "rescue_lapsed",
    "update_settings",
)

UPGRADE = r"""
DROP FUNCTION generation.stale_reason_v1;
DROP FUNCTION generation.close_attempt_v1;
DROP FUNCTION generation.hand_back_unconfirmed_v1;
DROP FUNCTION generation.end_lapsed_run_v1;
DROP FUNCTION generation.claim_tasks_v1;
DROP FUNCTION generation.complete_task_v1;
DROP FUNCTION generation.reap_task_v1;
DROP FUNCTION generation.fail_task_v1;
DROP FUNCTION generation.release_task_v1;
DROP FUNCTION generation.rescue_lapsed_v1;
DROP FUNCTION generation.update_settings_v1;

ALTER TABLE generation.tools
    ADD COLUMN granted_nanos bigint NOT NULL DEFAULT 0,
    DROP CONSTRAINT tools_money_nonnegative,
    ADD CONSTRAINT tools_money_nonnegative
        CHECK (cost_estimate_nanos >= 0 AND daily_cap_nanos >= 0
               AND spent_nanos >= 0 AND reserved_nanos >= 0 AND granted_nanos >= 0);

ALTER TABLE generation.tasks
    ADD COLUMN source text,
    ADD CONSTRAINT tasks_source_length CHECK (char_length(source) <= 200);

ALTER TABLE generation.tools
    ADD COLUMN max_in_flight integer,
    ADD CONSTRAINT tools_max_in_flight_positive CHECK (max_in_flight >= 1);
CREATE TABLE generation.resource_limits (
    resource_key text PRIMARY KEY,
    max_in_flight integer NOT NULL,
    CONSTRAINT resource_limits_max_in_flight_positive CHECK (max_in_flight >= 1)
);
CREATE INDEX attempts_running_idx ON generation.attempts (resource_key) WHERE outcome = 'running';

-- Today's counters from the ledger: what today's attempts cost and still hold reserved.
UPDATE generation.tools AS t
SET spent_day = cfg.today,
    spent_nanos = COALESCE((SELECT sum(a.cost_nanos) FROM generation.attempts AS a
                            WHERE a.tool_id = t.id AND a.local_day = cfg.today), 0),
    reserved_nanos = COALESCE((SELECT sum(a.estimate_nanos) FROM generation.attempts AS a
                               WHERE a.tool_id = t.id AND a.local_day = cfg.today
                                 AND a.outcome = 'running'), 0)
FROM (SELECT (now() AT TIME ZONE timezone)::date AS today FROM generation.settings) AS cfg;
UPDATE generation.tools SET granted_nanos = spent_nanos + reserved_nanos;

ALTER TABLE generation.settings
    DROP CONSTRAINT settings_counters_nonnegative,
    DROP COLUMN spent_nanos,
    DROP COLUMN reserved_nanos;
ALTER TABLE generation.settings RENAME COLUMN spent_day TO granted_day;
ALTER TABLE generation.settings
    ADD COLUMN granted_nanos bigint NOT NULL DEFAULT 0,
    ADD CONSTRAINT settings_granted_nonnegative CHECK (granted_nanos >= 0);
UPDATE generation.settings
SET granted_day = (now() AT TIME ZONE timezone)::date,
    granted_nanos = (SELECT COALESCE(sum(granted_nanos), 0) FROM generation.tools);

CREATE VIEW generation.spend_today AS
SELECT (now() AT TIME ZONE s.timezone)::date AS today,
       COALESCE(sum(t.spent_nanos), 0)::bigint AS spent_nanos,
       COALESCE(sum(t.reserved_nanos), 0)::bigint AS reserved_nanos
FROM generation.settings AS s
LEFT JOIN generation.tools AS t ON t.spent_day = (now() AT TIME ZONE s.timezone)::date
GROUP BY s.timezone;

CREATE FUNCTION generation.key_running_v1(p_key text, p_limit integer) RETURNS bigint
LANGUAGE sql STABLE
AS $$
    SELECT count(*) FROM (
        SELECT 1 FROM generation.attempts AS a
        WHERE a.resource_key = p_key AND a.outcome = 'running'
        LIMIT p_limit) AS running
$$;

CREATE FUNCTION generation.grant_share_v1(p_tool uuid, p_today date, p_need bigint, p_cap bigint)
RETURNS TABLE (share_change bigint, granted bigint)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    s generation.settings;
    total bigint;
    returned bigint;
BEGIN
    -- 1. Lock settings (after the tool's row, in the lock order): today's total of grants. A
    --    total of a later day (a claim begun before midnight, after one of the new day) is
    --    left alone and nothing granted: the next claim asks on the new day.
    SELECT * INTO s FROM generation.settings FOR NO KEY UPDATE;
    IF s.granted_day > p_today THEN
        RETURN QUERY SELECT NULL::bigint, s.granted_nanos;
        RETURN;
    END IF;
    total := CASE WHEN s.granted_day = p_today THEN s.granted_nanos ELSE 0 END;
    -- 2. Short: take back the other tools' unused shares. A row another transaction holds is
    --    skipped, never waited for: waiting after settings' lock could deadlock with its holder.
    IF total + p_need > p_cap THEN
        WITH unused AS (
            SELECT t.id, t.granted_nanos - t.spent_nanos - t.reserved_nanos AS slack
            FROM generation.tools AS t
            WHERE t.id <> p_tool AND t.spent_day = p_today
              AND t.granted_nanos > t.spent_nanos + t.reserved_nanos
            FOR NO KEY UPDATE SKIP LOCKED),
        taken AS (
            UPDATE generation.tools AS t SET granted_nanos = t.spent_nanos + t.reserved_nanos
            FROM unused WHERE t.id = unused.id
            RETURNING unused.slack)
        SELECT COALESCE(sum(taken.slack), 0) INTO returned FROM taken;
        total := total - returned;
    END IF;
    -- 3. Grant, or refuse when the cap has no room.
    share_change := CASE WHEN total + p_need <= p_cap
                         THEN p_need + (p_cap - total - p_need) / 16 END;
    granted := total + COALESCE(share_change, 0);
    UPDATE generation.settings SET granted_day = p_today, granted_nanos = granted;
    RETURN NEXT;
END
$$;

CREATE FUNCTION generation.stale_reason_v2(t generation.tasks) RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT CASE
        WHEN t.status = 'processing' THEN
            CASE WHEN t.claim_expires_at < now() - make_interval(secs => s.processing_grace_seconds)
                 THEN 'dead_zombie' END
        WHEN t.status NOT IN ('queued', 'dispatched') THEN NULL
        WHEN t.retry_count >= t.max_retries THEN 'unclaimable'
        WHEN GREATEST(t.queued_at, t.run_at) > now() - make_interval(secs => s.queued_max_age_seconds)
            THEN NULL
        WHEN t.status = 'dispatched' THEN 'abandoned'
        WHEN GREATEST(
                s.gates_changed_at, tool.gates_changed_at,
                (date_trunc('day', now() AT TIME ZONE s.timezone)) AT TIME ZONE s.timezone,
                (SELECT p.polled_at FROM generation.tool_polls AS p WHERE p.tool_id = t.tool_id),
                (SELECT c.cooling_until FROM generation.cooldowns AS c
                 WHERE c.resource_key = COALESCE(t.resource_key, tool.resource_key, tool.name)),
                (SELECT h.held_until FROM generation.holds AS h
                 WHERE h.account_group = COALESCE(t.account_group, tool.account_group, tool.name)),
                (SELECT max(r.seen_at) FROM generation.replica_overrides AS r WHERE r.disabled)
             ) > now() - make_interval(secs => s.queued_max_age_seconds) THEN NULL
        WHEN NOT g.running OR tool.paused OR g.cap = 0 THEN NULL
        WHEN NOT generation.within_cap_v1(
                sp.spent_nanos, sp.today, sp.today, sp.reserved_nanos,
                COALESCE(t.cost_estimate_nanos, tool.cost_estimate_nanos), g.cap)
          OR NOT generation.within_cap_v1(
                tool.spent_nanos, tool.spent_day, sp.today,
                CASE WHEN tool.spent_day = sp.today THEN tool.reserved_nanos ELSE 0 END,
                COALESCE(t.cost_estimate_nanos, tool.cost_estimate_nanos),
                tool.daily_cap_nanos) THEN NULL
        WHEN EXISTS (SELECT 1 FROM generation.tasks AS q
                     WHERE q.tool_id = t.tool_id AND q.status = 'processing'
                       AND q.claim_expires_at > now()) THEN NULL
        ELSE 'abandoned'
    END
    FROM generation.settings AS s, generation.spend_today AS sp,
         generation.gates_v1(false, NULL) AS g, generation.tools AS tool
    WHERE tool.id = t.tool_id
$$;

CREATE FUNCTION generation.close_attempt_v2(
    p_task uuid, p_token uuid, p_closing generation.attempt_outcome, p_cost bigint,
    p_retryable boolean, p_resource_key text
) RETURNS generation.attempts
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    a generation.attempts;
    s generation.settings;
    tl generation.tools;
    released bigint;
    today date;
BEGIN
    -- 1. Lock the attempt, then decide: a run still open is closed; one closed when its lease
    --    lapsed takes a late cost; any other is closed already and changes nothing.
    SELECT * INTO a FROM generation.attempts WHERE task_id = p_task AND lease_token = p_token
    FOR NO KEY UPDATE;
    IF NOT FOUND OR a.outcome NOT IN ('running', 'abandoned', 'unconfirmed') THEN
        RETURN a;
    END IF;
    released := CASE WHEN a.outcome = 'running' THEN a.estimate_nanos ELSE 0 END;
    -- 2. Lock the tool's row when money moves on it.
    IF released > 0 OR p_cost > 0 THEN
        PERFORM 1 FROM generation.tools WHERE id = a.tool_id FOR NO KEY UPDATE;
    END IF;
    SELECT * INTO s FROM generation.settings;
    -- 3. Close the run with its cost.
    UPDATE generation.attempts
    SET outcome = CASE WHEN a.outcome = 'running' THEN p_closing ELSE 'lease_lost' END,
        resource_key = CASE WHEN a.outcome = 'running' THEN COALESCE(p_resource_key, resource_key)
                            ELSE resource_key END,
        cost_nanos = cost_nanos + p_cost,
        ended_at = COALESCE(ended_at, now())
    WHERE task_id = a.task_id AND attempt = a.attempt
    RETURNING * INTO a;
    -- 4. Move the money of an attempt of today: release its reservation, add its cost.
    today := (now() AT TIME ZONE s.timezone)::date;
    IF (released > 0 OR p_cost > 0) AND a.local_day = today THEN
        -- (Counters already of a later day, after midnight, move nothing back to this one.)
        UPDATE generation.tools AS t
        SET spent_nanos = CASE WHEN t.spent_day = today THEN t.spent_nanos ELSE 0 END + p_cost,
            reserved_nanos = CASE WHEN t.spent_day = today THEN t.reserved_nanos - released ELSE 0 END,
            granted_nanos = CASE WHEN t.spent_day = today THEN t.granted_nanos ELSE 0 END,
            spent_day = today
        WHERE t.id = a.tool_id AND (t.spent_day IS NULL OR t.spent_day <= today)
        RETURNING t.* INTO tl;
        -- A cost above the estimate can spend past the tool's share: the grant grows with it
        -- (billed is billed), so the grants still cover every tool's spend (settings after tools).
        IF tl.spent_nanos + tl.reserved_nanos > tl.granted_nanos THEN
            UPDATE generation.settings AS x
            SET granted_nanos = CASE WHEN x.granted_day = today THEN x.granted_nanos ELSE 0 END
                                + tl.spent_nanos + tl.reserved_nanos - tl.granted_nanos,
                granted_day = today
            WHERE x.granted_day IS NULL OR x.granted_day <= today;
            UPDATE generation.tools AS t SET granted_nanos = t.spent_nanos + t.reserved_nanos
            WHERE t.id = a.tool_id;
        END IF;
    END IF;
    -- 5. The key's run of failures (a cooldown after cooldown_threshold) and the group's hold.
    IF a.outcome = 'completed' THEN
        UPDATE generation.cooldowns SET consecutive_failures = 0
        WHERE resource_key = a.resource_key AND consecutive_failures > 0;
    ELSIF p_retryable AND a.outcome IN ('retry', 'failed') THEN
        INSERT INTO generation.cooldowns AS c (resource_key, consecutive_failures, cooling_until)
        VALUES (
            a.resource_key,
            CASE WHEN s.cooldown_threshold <= 1 THEN 0 ELSE 1 END,
            CASE WHEN s.cooldown_threshold <= 1
                 THEN now() + make_interval(secs => s.cooldown_seconds) END
        )
        ON CONFLICT (resource_key) DO UPDATE SET
            consecutive_failures = CASE WHEN c.consecutive_failures + 1 >= s.cooldown_threshold
                                        THEN 0 ELSE c.consecutive_failures + 1 END,
            cooling_until = CASE WHEN c.consecutive_failures + 1 >= s.cooldown_threshold
                                 THEN now() + make_interval(secs => s.cooldown_seconds)
                                 ELSE c.cooling_until END;
    ELSIF a.outcome = 'account_error' THEN
        INSERT INTO generation.holds AS h (account_group, held_until, reason)
        VALUES (a.account_group, now() + make_interval(secs => s.account_hold_seconds), 'account error')
        ON CONFLICT (account_group) DO UPDATE
        SET held_until = GREATEST(h.held_until, EXCLUDED.held_until), reason = EXCLUDED.reason;
    END IF;
    RETURN a;
END
$$;

CREATE FUNCTION generation.hand_back_unconfirmed_v2(t generation.tasks, p_lapsed boolean)
RETURNS TABLE (task generation.tasks, event jsonb)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    lost integer;
    ending text;
    back generation.tasks;
BEGIN
    lost := t.unconfirmed_claims + p_lapsed::int;
    ending := CASE WHEN t.cancel_requested_at IS NOT NULL THEN 'cancelled'
                   WHEN lost >= 20 THEN 'failed'
                   ELSE 'requeued' END;
    UPDATE generation.tasks AS q
    SET status = CASE ending WHEN 'requeued' THEN 'queued' ELSE ending END::generation.task_status,
        unconfirmed_claims = lost,
        error = CASE ending WHEN 'failed' THEN 'claim answers lost: 20 claims never reached a worker'
                            WHEN 'cancelled' THEN 'cancelled' ELSE q.error END,
        completed_at = CASE WHEN ending = 'requeued' THEN NULL ELSE now() END,
        reclaimed = (ending = 'requeued'),
        queued_at = CASE ending WHEN 'requeued' THEN now() ELSE q.queued_at END,
        lease_token = NULL, claim_expires_at = NULL, lease_confirmed = false,
        last_event_seq = q.last_event_seq + 1
    WHERE q.id = t.id
    RETURNING q.* INTO back;
    PERFORM generation.close_attempt_v2(t.id, t.lease_token, 'unconfirmed', 0, false, NULL);
    RETURN QUERY SELECT back, generation.append_event_v1(
        t.id, ending::generation.task_event_kind,
        jsonb_build_object('reason', CASE WHEN p_lapsed THEN 'claim answer lost'
                                          ELSE 'claim deadline passed' END,
                           'unconfirmed_claims', back.unconfirmed_claims, 'error', back.error));
END
$$;

CREATE FUNCTION generation.end_lapsed_run_v2(t generation.tasks)
RETURNS TABLE (task generation.tasks, event jsonb)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    prior uuid;
    ending text;
BEGIN
    IF NOT t.lease_confirmed THEN
        RETURN QUERY SELECT * FROM generation.hand_back_unconfirmed_v2(t, true);
        RETURN;
    END IF;
    prior := t.lease_token;
    ending := CASE WHEN t.cancel_requested_at IS NOT NULL THEN 'cancelled'
                   WHEN t.retry_count + 1 < t.max_retries THEN 'requeued'
                   ELSE 'failed' END;
    UPDATE generation.tasks AS q
    SET status = CASE ending WHEN 'requeued' THEN 'queued' ELSE ending END::generation.task_status,
        retry_count = q.retry_count + (ending <> 'cancelled')::int,
        reclaimed = (ending = 'requeued'),
        queued_at = CASE ending WHEN 'requeued' THEN now() ELSE q.queued_at END,
        error = CASE ending WHEN 'failed' THEN 'lease lapsed on its last run'
                            WHEN 'cancelled' THEN 'cancelled' ELSE q.error END,
        completed_at = CASE WHEN ending = 'requeued' THEN NULL ELSE now() END,
        claim_expires_at = NULL, lease_token = NULL, lease_confirmed = false,
        last_event_seq = q.last_event_seq + 1
    WHERE q.id = t.id
    RETURNING q.* INTO t;
    PERFORM generation.close_attempt_v2(t.id, prior, 'abandoned', 0, false, NULL);
    RETURN QUERY SELECT t, generation.append_event_v1(
        t.id, ending::generation.task_event_kind,
        jsonb_build_object('reason', 'lease lapsed', 'error', t.error, 'retry_count', t.retry_count));
END
$$;

CREATE FUNCTION generation.claim_tasks_v2(
    p_tool uuid, p_limit integer, p_lease_seconds integer, p_disabled boolean, p_cap bigint
) RETURNS TABLE (task generation.tasks, lease_seconds integer, idle_reason text, event jsonb)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    tool generation.tools;
    s generation.settings;
    g record;
    today date;
    default_key text;
    default_group text;
    lease integer;
    blocked text;
    tool_cooling boolean;
    tool_held boolean;
    picked record;
    ids uuid[] := '{}';
    estimates bigint[] := '{}';
    keys text[] := '{}';
    groups text[] := '{}';
    admitted uuid[] := '{}';
    spend_locked boolean := false;
    used bigint;
    share bigint;
    granted bigint;
    grant_made record;
    reserving bigint := 0;
    in_flight integer;
    limits record;
    key_room jsonb := '{}';
    full_keys text[];
    tool_busy boolean;
    busy boolean := false;
    head record;
    has_head boolean;
BEGIN
    -- 0. The local day cannot move under a claim: a time-zone change that moves it waits for
    --    claims in flight, and they for it (update_settings_v2).
    PERFORM pg_advisory_xact_lock_shared(1734700658);
    -- 1. Read the gates, unlocked: the tool, the switch and the cap in force, its cooldown/hold.
    SELECT * INTO tool FROM generation.tools WHERE id = p_tool;
    IF NOT FOUND THEN
        RETURN QUERY SELECT NULL::generation.tasks, NULL::integer, 'unknown_tool'::text, NULL::jsonb;
        RETURN;
    END IF;
    SELECT * INTO s FROM generation.settings;
    SELECT * INTO g FROM generation.gates_v1(p_disabled, p_cap);
    today := (now() AT TIME ZONE s.timezone)::date;
    default_key := COALESCE(tool.resource_key, tool.name);
    default_group := COALESCE(tool.account_group, tool.name);
    lease := COALESCE(tool.lease_seconds, p_lease_seconds);
    used := CASE WHEN tool.spent_day = today THEN tool.spent_nanos + tool.reserved_nanos ELSE 0 END;
    share := CASE WHEN tool.spent_day = today THEN tool.granted_nanos ELSE 0 END;
    granted := CASE WHEN s.granted_day = today THEN s.granted_nanos ELSE 0 END;
    blocked := CASE WHEN NOT g.running THEN 'disabled' WHEN tool.paused THEN 'paused'
                    WHEN g.cap = 0 THEN 'capped' END;
    tool_cooling := EXISTS (SELECT 1 FROM generation.cooldowns AS c
                            WHERE c.resource_key = default_key AND c.cooling_until > now());
    tool_held := EXISTS (SELECT 1 FROM generation.holds AS h
                         WHERE h.account_group = default_group AND h.held_until > now());
    -- Keys at their concurrency limit, and whether the tool is at its own (counted unlocked,
    -- and again under lock in step 3; each count stops at the limit).
    SELECT COALESCE(array_agg(l.resource_key), '{}') INTO full_keys
    FROM generation.resource_limits AS l
    WHERE generation.key_running_v1(l.resource_key, l.max_in_flight) >= l.max_in_flight;
    tool_busy := default_key = ANY (full_keys) OR CASE WHEN tool.max_in_flight IS NULL THEN false
        ELSE tool.max_in_flight <= (
            SELECT count(*) FROM (
                SELECT 1 FROM generation.tasks AS q
                WHERE q.tool_id = p_tool AND q.status = 'processing'
                LIMIT tool.max_in_flight) AS running) END;

    IF blocked IS NULL AND NOT tool_cooling AND NOT tool_held AND NOT tool_busy THEN
        -- 2. Lock up to p_limit claimable tasks in claim order, skipping rows other claimers
        --    hold (tasks_claim_idx serves this as an index-ordered top-N).
        FOR picked IN
            SELECT q.id, COALESCE(q.cost_estimate_nanos, tool.cost_estimate_nanos) AS estimate,
                   COALESCE(q.resource_key, default_key) AS resource_key,
                   COALESCE(q.account_group, default_group) AS account_group
            FROM generation.tasks AS q
            WHERE q.tool_id = p_tool AND q.status = 'queued' AND q.retry_count < q.max_retries
              AND q.run_at <= now() AND (q.expires_at IS NULL OR q.expires_at > now())
              AND (q.resource_key IS NULL OR NOT EXISTS (
                    SELECT 1 FROM generation.cooldowns AS c
                    WHERE c.resource_key = q.resource_key AND c.cooling_until > now()))
              AND (q.account_group IS NULL OR NOT EXISTS (
                    SELECT 1 FROM generation.holds AS h
                    WHERE h.account_group = q.account_group AND h.held_until > now()))
              AND (q.resource_key IS NULL OR NOT q.resource_key = ANY (full_keys))
            ORDER BY q.reclaimed DESC, q.priority DESC, q.run_at
            LIMIT p_limit
            FOR NO KEY UPDATE OF q SKIP LOCKED
        LOOP
            ids := ids || picked.id;
            estimates := estimates || picked.estimate;
            keys := keys || picked.resource_key;
            groups := groups || picked.account_group;
        END LOOP;

        -- 3. The concurrency limits: lock the picked keys' limits (in key order: claims of one
        --    key across tools take turns), then count what runs of each key in a statement of
        --    its own, whose snapshot comes after the lock and so sees the runs of the claim that
        --    held it; then the tool's, under its row lock. Counting stops at the limit.
        PERFORM 1 FROM generation.resource_limits AS l WHERE l.resource_key = ANY (keys)
        ORDER BY l.resource_key
        FOR NO KEY UPDATE;
        FOR limits IN
            SELECT l.resource_key,
                   l.max_in_flight - generation.key_running_v1(l.resource_key, l.max_in_flight)
                       AS room
            FROM generation.resource_limits AS l
            WHERE l.resource_key = ANY (keys)
        LOOP
            key_room := key_room || jsonb_build_object(limits.resource_key, limits.room);
        END LOOP;
        IF tool.max_in_flight IS NOT NULL AND array_length(ids, 1) > 0 THEN
            SELECT * INTO tool FROM generation.tools AS t WHERE t.id = p_tool FOR NO KEY UPDATE;
            spend_locked := true;
            today := GREATEST(today, tool.spent_day);
            used := CASE WHEN tool.spent_day = today
                         THEN tool.spent_nanos + tool.reserved_nanos ELSE 0 END;
            share := CASE WHEN tool.spent_day = today THEN tool.granted_nanos ELSE 0 END;
            SELECT tool.max_in_flight - count(*) INTO in_flight FROM (
                SELECT 1 FROM generation.tasks AS q
                WHERE q.tool_id = p_tool AND q.status = 'processing'
                LIMIT tool.max_in_flight) AS running;
        END IF;

        -- 4. Admit in claim order: within the limits (a task whose key is busy stays queued and
        --    the next is tried; a busy tool stops the claim), under the tool's own cap and
        --    within its share of the global cap (counters of an earlier day count as nothing).
        --    The tool's row is locked at the first task carrying an estimate; tasks estimated
        --    at 0 reserve nothing and read the counters unlocked.
        FOR i IN 1 .. COALESCE(array_length(ids, 1), 0) LOOP
            IF in_flight IS NOT NULL AND in_flight <= 0 THEN
                busy := true;
                EXIT;
            END IF;
            IF (key_room ->> keys[i])::integer <= 0 THEN
                busy := true;
                CONTINUE;
            END IF;
            IF estimates[i] > 0 AND NOT spend_locked THEN
                SELECT * INTO tool FROM generation.tools AS t WHERE t.id = p_tool FOR NO KEY UPDATE;
                spend_locked := true;
                -- A claim begun just before midnight that waited for a claim of the new day
                -- counts on the new day: a day's counters never move back to the one before.
                today := GREATEST(today, tool.spent_day);
                used := CASE WHEN tool.spent_day = today
                             THEN tool.spent_nanos + tool.reserved_nanos ELSE 0 END;
                share := CASE WHEN tool.spent_day = today THEN tool.granted_nanos ELSE 0 END;
            END IF;
            EXIT WHEN NOT generation.within_cap_v1(
                used, today, today, reserving, estimates[i], tool.daily_cap_nanos);
            IF estimates[i] = 0 THEN
                -- The grants bound the total spend, and it is below them while this share has
                -- room: then the total is strictly below the cap. Else (a lowered cap left the
                -- grants above it, say) the total itself decides, read unlocked: nothing is
                -- reserved for it.
                EXIT WHEN NOT (granted < g.cap OR granted <= g.cap AND used + reserving < share
                               OR (SELECT sp.spent_nanos::numeric + sp.reserved_nanos
                                   FROM generation.spend_today AS sp) < g.cap);
            ELSIF used + reserving + estimates[i] > share OR granted > g.cap THEN
                -- Short of share, or a lowered cap left the grants above it: ask for the
                -- difference (settings' row is locked only here).
                SELECT * INTO grant_made FROM generation.grant_share_v1(
                    p_tool, today, used + reserving + estimates[i] - share, g.cap);
                EXIT WHEN grant_made.share_change IS NULL;
                share := share + grant_made.share_change;
                granted := grant_made.granted;
            END IF;
            reserving := reserving + estimates[i];
            admitted := admitted || ids[i];
            in_flight := in_flight - 1;
            IF key_room ? keys[i] THEN
                key_room := jsonb_set(key_room, ARRAY[keys[i]],
                                      to_jsonb((key_room ->> keys[i])::integer - 1));
            END IF;
        END LOOP;
    END IF;

    -- 5. A worker asked for the tool's work (noted at most every 5 s): the watchdog's sign that
    --    someone is coming for it.
    INSERT INTO generation.tool_polls AS p (tool_id, polled_at)
    SELECT p_tool, now()
    WHERE NOT EXISTS (SELECT 1 FROM generation.tool_polls AS x
                      WHERE x.tool_id = p_tool AND x.polled_at > now() - interval '5 seconds')
    ON CONFLICT (tool_id) DO UPDATE SET polled_at = EXCLUDED.polled_at;

    IF array_length(admitted, 1) IS NULL THEN
        -- 6. Nothing claimed: say why, from the first reason that holds.
        IF blocked IS NULL AND array_length(ids, 1) > 0 THEN
            blocked := CASE WHEN busy THEN 'busy' ELSE 'capped' END;
        END IF;
        IF blocked IS NULL THEN
            SELECT COALESCE(q.resource_key, default_key) AS resource_key,
                   COALESCE(q.account_group, default_group) AS account_group INTO head
            FROM generation.tasks AS q
            WHERE q.tool_id = p_tool AND q.status = 'queued' AND q.retry_count < q.max_retries
            ORDER BY q.reclaimed DESC, q.priority DESC, q.run_at
            LIMIT 1;
            has_head := FOUND;
            blocked := CASE
                WHEN NOT has_head THEN 'empty'
                WHEN tool_held THEN 'held'
                WHEN tool_cooling THEN 'cooling'
                WHEN tool_busy OR head.resource_key = ANY (full_keys) THEN 'busy'
                WHEN EXISTS (SELECT 1 FROM generation.holds AS h
                             WHERE h.account_group = head.account_group AND h.held_until > now())
                    THEN 'held'
                WHEN EXISTS (SELECT 1 FROM generation.cooldowns AS c
                             WHERE c.resource_key = head.resource_key AND c.cooling_until > now())
                    THEN 'cooling'
                ELSE 'waiting' END;
        END IF;
        RETURN QUERY SELECT NULL::generation.tasks, NULL::integer, blocked, NULL::jsonb;
        RETURN;
    END IF;

    -- 7. Reserve the admitted estimates in the tool's row (locked in step 4), with its share.
    IF reserving > 0 THEN
        UPDATE generation.tools AS t
        SET spent_nanos = CASE WHEN t.spent_day = today THEN t.spent_nanos ELSE 0 END,
            reserved_nanos = CASE WHEN t.spent_day = today THEN t.reserved_nanos ELSE 0 END
                             + reserving,
            granted_nanos = share, spent_day = today
        WHERE t.id = p_tool;
    END IF;

    -- 8. Start the runs: a fresh, unconfirmed lease each, an attempt, a `started` event.
    RETURN QUERY
    WITH started AS (
        UPDATE generation.tasks AS t
        SET status = 'processing',
            started_at = COALESCE(t.started_at, now()),
            claim_expires_at = now() + make_interval(secs => lease),
            lease_token = gen_random_uuid(),
            lease_confirmed = false,
            reclaimed = false,
            attempt_count = t.attempt_count + 1,
            last_event_seq = t.last_event_seq + 1
        WHERE t.id = ANY (admitted)
        RETURNING t.*),
    attempt AS (
        INSERT INTO generation.attempts
            (task_id, attempt, lease_token, tool_id, resource_key, account_group, local_day,
             estimate_nanos)
        SELECT started.id, started.attempt_count, started.lease_token, started.tool_id,
               keys[array_position(ids, started.id)], groups[array_position(ids, started.id)],
               today, estimates[array_position(ids, started.id)]
        FROM started),
    event AS (
        INSERT INTO generation.task_events (task_id, sequence, kind, data)
        SELECT started.id, started.last_event_seq, 'started',
               jsonb_build_object('attempt', started.attempt_count)
        FROM started
        RETURNING *)
    SELECT ROW(started.*)::generation.tasks, lease, NULL::text, to_jsonb(event)
    FROM started JOIN event ON event.task_id = started.id
    ORDER BY array_position(admitted, started.id);
END
$$;

CREATE FUNCTION generation.complete_task_v2(
    p_task uuid, p_token uuid, p_output jsonb, p_usage jsonb, p_cost bigint, p_resource_key text
) RETURNS TABLE (task_found boolean, task generation.tasks, event jsonb)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    t generation.tasks;
    a generation.attempts;
BEGIN
    -- 1. Lock the task, then decide.
    SELECT * INTO t FROM generation.tasks WHERE id = p_task FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, NULL::generation.tasks, NULL::jsonb;
        RETURN;
    END IF;
    IF t.status = 'processing' AND t.lease_token = p_token AND t.claim_expires_at > now() THEN
        -- 2. End the run.
        UPDATE generation.tasks AS q
        SET status = CASE WHEN q.cancel_requested_at IS NULL THEN 'completed' ELSE 'cancelled' END
                     ::generation.task_status,
            output = CASE WHEN q.cancel_requested_at IS NULL THEN p_output END,
            reported_usage = p_usage,
            error = CASE WHEN q.cancel_requested_at IS NULL THEN NULL ELSE 'cancelled' END,
            completed_at = now(), claim_expires_at = NULL, lease_token = NULL,
            lease_confirmed = false, last_event_seq = q.last_event_seq + 1
        WHERE q.id = p_task
        RETURNING q.* INTO t;
        -- 3. Close its attempt with the cost; 4. the terminal event, last in the stream.
        PERFORM generation.close_attempt_v2(
            p_task, p_token, t.status::text::generation.attempt_outcome, p_cost, false,
            p_resource_key);
        RETURN QUERY SELECT true, t,
            generation.append_event_v1(p_task, t.status::text::generation.task_event_kind, NULL);
        RETURN;
    END IF;
    -- 5. Not held now: the same lease already ended the run this way -> the task as it is now.
    SELECT * INTO a FROM generation.attempts AS x WHERE x.task_id = p_task AND x.lease_token = p_token;
    IF a.outcome IN ('completed', 'cancelled') THEN
        RETURN QUERY SELECT true, t, NULL::jsonb;
        RETURN;
    END IF;
    -- 6. Else the lease is lost: keep what the run cost, change nothing else.
    PERFORM generation.close_attempt_v2(p_task, p_token, 'lease_lost', p_cost, false, NULL);
    RETURN QUERY SELECT true, NULL::generation.tasks, NULL::jsonb;
END
$$;

CREATE FUNCTION generation.reap_task_v2(p_task uuid, p_error text)
RETURNS TABLE (task_found boolean, task generation.tasks, event jsonb)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    t generation.tasks;
    prior uuid;
    reason text;
BEGIN
    -- 1. Lock the task, then judge it.
    SELECT * INTO t FROM generation.tasks WHERE id = p_task FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, NULL::generation.tasks, NULL::jsonb;
        RETURN;
    END IF;
    reason := generation.stale_reason_v2(t);
    IF reason IS NULL THEN
        RETURN QUERY SELECT true, NULL::generation.tasks, NULL::jsonb;
        RETURN;
    END IF;
    -- 2. A dead zombie's run is ended as the rescuer would have (it is not running): handed back
    --    when unconfirmed or with retries left, failed only when that was its last run.
    IF t.status = 'processing' THEN
        RETURN QUERY SELECT true, e.task, e.event FROM generation.end_lapsed_run_v2(t) AS e;
        RETURN;
    END IF;
    -- 3. Fail it.
    prior := t.lease_token;
    UPDATE generation.tasks AS q
    SET status = 'failed', error = COALESCE(p_error, 'stale: ' || reason), completed_at = now(),
        claim_expires_at = NULL, lease_token = NULL, lease_confirmed = false,
        last_event_seq = q.last_event_seq + 1
    WHERE q.id = p_task
    RETURNING q.* INTO t;
    IF prior IS NOT NULL THEN
        PERFORM generation.close_attempt_v2(p_task, prior, 'abandoned', 0, false, NULL);
    END IF;
    -- 4. The terminal event.
    RETURN QUERY SELECT true, t, generation.append_event_v1(
        p_task, 'failed',
        jsonb_build_object('error', t.error, 'retry_count', t.retry_count, 'stale_reason', reason));
END
$$;

CREATE FUNCTION generation.fail_task_v2(
    p_task uuid, p_token uuid, p_failure text, p_error text, p_cost bigint, p_resource_key text
) RETURNS TABLE (task_found boolean, forced boolean, task generation.tasks, event jsonb)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    t generation.tasks;
    a generation.attempts;
    tool generation.tools;
    ending text;
BEGIN
    IF p_token IS NULL THEN
        RETURN QUERY SELECT r.task_found, true, r.task, r.event FROM generation.reap_task_v2(p_task, p_error) AS r;
        RETURN;
    END IF;
    -- 1. Lock the task, then decide.
    SELECT * INTO t FROM generation.tasks WHERE id = p_task FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, false, NULL::generation.tasks, NULL::jsonb;
        RETURN;
    END IF;
    IF t.status = 'processing' AND t.lease_token = p_token AND t.claim_expires_at > now() THEN
        -- 2. How the run ends.
        ending := CASE
            WHEN t.cancel_requested_at IS NOT NULL OR p_failure = 'cancelled' THEN 'cancelled'
            WHEN p_failure = 'account' THEN 'account_error'
            WHEN p_failure = 'retryable' AND t.retry_count + 1 < t.max_retries THEN 'retry'
            ELSE 'failed' END;
        SELECT * INTO tool FROM generation.tools WHERE id = t.tool_id;
        UPDATE generation.tasks AS q
        SET status = CASE ending WHEN 'cancelled' THEN 'cancelled' WHEN 'failed' THEN 'failed'
                                 ELSE 'queued' END::generation.task_status,
            retry_count = q.retry_count + (p_failure = 'retryable' AND ending <> 'cancelled')::int,
            run_at = CASE WHEN ending = 'retry'
                          THEN now() + make_interval(secs => random() * LEAST(
                                   tool.backoff_max_seconds, tool.backoff_base_seconds * 2 ^ q.retry_count))
                          ELSE q.run_at END,
            queued_at = CASE WHEN ending IN ('retry', 'account_error') THEN now() ELSE q.queued_at END,
            error = CASE WHEN ending = 'cancelled' AND p_failure <> 'cancelled' THEN 'cancelled'
                         ELSE p_error END,
            completed_at = CASE WHEN ending IN ('retry', 'account_error') THEN NULL ELSE now() END,
            claim_expires_at = NULL, lease_token = NULL, lease_confirmed = false,
            last_event_seq = q.last_event_seq + 1
        WHERE q.id = p_task
        RETURNING q.* INTO t;
        -- 3. Close the attempt with its cost; 4. the event (terminal unless requeued).
        PERFORM generation.close_attempt_v2(
            p_task, p_token, ending::generation.attempt_outcome, p_cost,
            p_failure = 'retryable' AND ending <> 'cancelled', p_resource_key);
        RETURN QUERY SELECT true, false, t, generation.append_event_v1(
            p_task,
            CASE t.status WHEN 'queued' THEN 'requeued' ELSE t.status::text END
                ::generation.task_event_kind,
            jsonb_build_object('error', t.error, 'retry_count', t.retry_count));
        RETURN;
    END IF;
    -- 5. Not held now: the same lease already ended the run with a failure -> the same answer.
    SELECT * INTO a FROM generation.attempts AS x WHERE x.task_id = p_task AND x.lease_token = p_token;
    IF a.outcome IN ('retry', 'failed', 'account_error', 'cancelled') THEN
        RETURN QUERY SELECT true, false, t, NULL::jsonb;
        RETURN;
    END IF;
    -- 6. Else the lease is lost: keep what the run cost, change nothing else.
    PERFORM generation.close_attempt_v2(p_task, p_token, 'lease_lost', p_cost, false, NULL);
    RETURN QUERY SELECT true, false, NULL::generation.tasks, NULL::jsonb;
END
$$;

CREATE FUNCTION generation.release_task_v2(
    p_task uuid, p_token uuid, p_cost bigint, p_unconfirmed boolean
) RETURNS TABLE (task_found boolean, task generation.tasks, event jsonb)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    t generation.tasks;
    a generation.attempts;
    ending text;
BEGIN
    -- 1. Lock the task, then decide.
    SELECT * INTO t FROM generation.tasks WHERE id = p_task FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, NULL::generation.tasks, NULL::jsonb;
        RETURN;
    END IF;
    IF t.status = 'processing' AND t.lease_token = p_token AND t.claim_expires_at > now() THEN
        IF p_unconfirmed THEN
            IF t.lease_confirmed THEN  -- the worker has it after all: leave it alone
                RETURN QUERY SELECT true, t, NULL::jsonb;
                RETURN;
            END IF;
            RETURN QUERY SELECT true, h.task, h.event
                FROM generation.hand_back_unconfirmed_v2(t, false) AS h;
            RETURN;
        END IF;
        -- 2. Back to the queue (or cancelled), no retry used.
        ending := CASE WHEN t.cancel_requested_at IS NOT NULL THEN 'cancelled' ELSE 'released' END;
        UPDATE generation.tasks AS q
        SET status = CASE ending WHEN 'cancelled' THEN 'cancelled' ELSE 'queued' END
                     ::generation.task_status,
            error = CASE ending WHEN 'cancelled' THEN 'cancelled' ELSE q.error END,
            completed_at = CASE ending WHEN 'cancelled' THEN now() END,
            queued_at = CASE ending WHEN 'released' THEN now() ELSE q.queued_at END,
            claim_expires_at = NULL, lease_token = NULL, lease_confirmed = false,
            last_event_seq = q.last_event_seq + 1
        WHERE q.id = p_task
        RETURNING q.* INTO t;
        -- 3. Close the attempt with its cost; 4. the event.
        PERFORM generation.close_attempt_v2(p_task, p_token, ending::generation.attempt_outcome, p_cost, false, NULL);
        RETURN QUERY SELECT true, t, generation.append_event_v1(
            p_task,
            CASE ending WHEN 'cancelled' THEN 'cancelled' ELSE 'requeued' END
                ::generation.task_event_kind,
            jsonb_build_object('released', true, 'retry_count', t.retry_count));
        RETURN;
    END IF;
    -- 5. Not held now: the same lease already released it -> the same answer.
    SELECT * INTO a FROM generation.attempts AS x WHERE x.task_id = p_task AND x.lease_token = p_token;
    IF a.outcome IN ('released', 'cancelled') THEN
        RETURN QUERY SELECT true, t, NULL::jsonb;
        RETURN;
    END IF;
    -- 6. Else the lease is lost: keep what the run cost, change nothing else.
    PERFORM generation.close_attempt_v2(p_task, p_token, 'lease_lost', p_cost, false, NULL);
    RETURN QUERY SELECT true, NULL::generation.tasks, NULL::jsonb;
END
$$;

CREATE FUNCTION generation.rescue_lapsed_v2(p_batch integer)
RETURNS TABLE (task generation.tasks, event jsonb)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    ids uuid[];
    t generation.tasks;
BEGIN
    -- 1. Lock the lapsed tasks, then their runs' attempts: all of them before any spend row.
    SELECT array_agg(c.id) INTO ids FROM (
        SELECT q.id FROM generation.tasks AS q
        WHERE q.status = 'processing' AND q.claim_expires_at < now()
        LIMIT p_batch
        FOR NO KEY UPDATE OF q SKIP LOCKED) AS c;
    PERFORM 1 FROM generation.attempts AS a JOIN generation.tasks AS q
        ON a.task_id = q.id AND a.lease_token = q.lease_token
    WHERE q.id = ANY (COALESCE(ids, '{}'))
    ORDER BY a.task_id, a.attempt
    FOR NO KEY UPDATE OF a;
    -- 2. Lock the tools whose reservations the runs release, in id order: ending the runs one
    --    by one would take them in task order, against a report batch that takes them in id
    --    order (generation.lock_reported_v1).
    PERFORM 1 FROM generation.tools AS tl
    WHERE tl.id IN (SELECT a.tool_id FROM generation.attempts AS a JOIN generation.tasks AS q
                        ON a.task_id = q.id AND a.lease_token = q.lease_token
                    WHERE q.id = ANY (COALESCE(ids, '{}')) AND a.estimate_nanos > 0)
    ORDER BY tl.id
    FOR NO KEY UPDATE;
    -- 3. End each run.
    FOR i IN 1 .. COALESCE(array_length(ids, 1), 0) LOOP
        SELECT * INTO t FROM generation.tasks WHERE id = ids[i];
        RETURN QUERY SELECT * FROM generation.end_lapsed_run_v2(t);
    END LOOP;
END
$$;

CREATE FUNCTION generation.update_settings_v2(
    p_enabled boolean, p_cap bigint, p_clear_cap boolean, p_currency text, p_timezone text,
    p_cooldown_threshold integer, p_cooldown_seconds integer, p_account_hold_seconds integer,
    p_retention_days integer, p_processing_grace_seconds integer, p_queued_max_age_seconds integer
) RETURNS generation.settings
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    s generation.settings;
    old_today date;
    new_today date;
BEGIN
    -- 0. A time-zone change first stops claims (the day lock, before any row lock): no attempt
    --    of the old day is started meanwhile, and the zone read below is the one in force.
    IF p_timezone IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(1734700658);
    END IF;
    SELECT * INTO s FROM generation.settings;
    old_today := (now() AT TIME ZONE s.timezone)::date;
    new_today := (now() AT TIME ZONE COALESCE(p_timezone, s.timezone))::date;
    -- 1. Lock today's attempts and every tool when the day moves (both come before settings).
    IF new_today <> old_today THEN
        PERFORM 1 FROM generation.attempts WHERE local_day = old_today
        ORDER BY task_id, attempt FOR NO KEY UPDATE;
        PERFORM 1 FROM generation.tools ORDER BY id FOR NO KEY UPDATE;
    END IF;
    -- 2. Lock settings, then write.
    SELECT * INTO s FROM generation.settings FOR NO KEY UPDATE;
    UPDATE generation.settings AS x
    SET enabled = COALESCE(p_enabled, x.enabled),
        daily_cap_nanos = CASE WHEN p_clear_cap THEN NULL ELSE COALESCE(p_cap, x.daily_cap_nanos) END,
        currency = COALESCE(p_currency, x.currency),
        timezone = COALESCE(p_timezone, x.timezone),
        cooldown_threshold = COALESCE(p_cooldown_threshold, x.cooldown_threshold),
        cooldown_seconds = COALESCE(p_cooldown_seconds, x.cooldown_seconds),
        account_hold_seconds = COALESCE(p_account_hold_seconds, x.account_hold_seconds),
        retention_days = COALESCE(p_retention_days, x.retention_days),
        processing_grace_seconds = COALESCE(p_processing_grace_seconds, x.processing_grace_seconds),
        queued_max_age_seconds = COALESCE(p_queued_max_age_seconds, x.queued_max_age_seconds),
        granted_day = CASE WHEN x.granted_day = old_today THEN new_today ELSE x.granted_day END,
        gates_changed_at = CASE
            WHEN p_enabled IS DISTINCT FROM NULL AND p_enabled IS DISTINCT FROM x.enabled
              OR p_clear_cap OR (p_cap IS NOT NULL AND p_cap IS DISTINCT FROM x.daily_cap_nanos)
            THEN now() ELSE x.gates_changed_at END
    RETURNING x.* INTO s;
    -- 3. Move today's attempts with the day, then count the new day anew from the ledger:
    --    the new date may be one that already had attempts (a zone further west), whose
    --    counters were dropped at its midnight. Each share becomes what its tool holds.
    IF new_today <> old_today THEN
        UPDATE generation.attempts SET local_day = new_today WHERE local_day = old_today;
        UPDATE generation.tools AS t
        SET spent_day = new_today,
            spent_nanos = COALESCE((SELECT sum(a.cost_nanos) FROM generation.attempts AS a
                                    WHERE a.tool_id = t.id AND a.local_day = new_today), 0),
            reserved_nanos = COALESCE((SELECT sum(a.estimate_nanos) FROM generation.attempts AS a
                                       WHERE a.tool_id = t.id AND a.local_day = new_today
                                         AND a.outcome = 'running'), 0);
        UPDATE generation.tools SET granted_nanos = spent_nanos + reserved_nanos;
        UPDATE generation.settings AS x
        SET granted_day = new_today,
            granted_nanos = (SELECT COALESCE(sum(t.granted_nanos), 0) FROM generation.tools AS t)
        RETURNING x.* INTO s;
    END IF;
    RETURN s;
END
$$;

CREATE FUNCTION generation.lock_reported_v1(p_items jsonb) RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM 1 FROM generation.tasks AS t
    WHERE t.id IN (SELECT (x ->> 'task_id')::uuid FROM jsonb_array_elements(p_items) AS x)
    ORDER BY t.id
    FOR NO KEY UPDATE;
    PERFORM 1 FROM generation.attempts AS a
    WHERE (a.task_id, a.lease_token) IN (
        SELECT (x ->> 'task_id')::uuid, (x ->> 'lease_token')::uuid
        FROM jsonb_array_elements(p_items) AS x)
    ORDER BY a.task_id, a.attempt
    FOR NO KEY UPDATE;
    PERFORM 1 FROM generation.tools AS tl
    WHERE tl.id IN (
        SELECT a.tool_id
        FROM jsonb_array_elements(p_items) AS x
        JOIN generation.attempts AS a
          ON a.task_id = (x ->> 'task_id')::uuid AND a.lease_token = (x ->> 'lease_token')::uuid
        WHERE a.outcome = 'running' AND a.estimate_nanos > 0
           OR COALESCE((x ->> 'cost_nanos')::bigint, 0) > 0)
    ORDER BY tl.id
    FOR NO KEY UPDATE;
    -- A cost above what its run reserved may grow the total of grants (close_attempt_v2): then
    -- settings comes before the cooldowns, as in one close.
    PERFORM 1 FROM generation.settings
    WHERE EXISTS (
        SELECT 1 FROM jsonb_array_elements(p_items) AS x
        JOIN generation.attempts AS a
          ON a.task_id = (x ->> 'task_id')::uuid AND a.lease_token = (x ->> 'lease_token')::uuid
        WHERE COALESCE((x ->> 'cost_nanos')::bigint, 0)
              > CASE WHEN a.outcome = 'running' THEN a.estimate_nanos ELSE 0 END)
    FOR NO KEY UPDATE;
    PERFORM 1 FROM generation.cooldowns AS c
    WHERE c.resource_key IN (
        SELECT COALESCE(x ->> 'resource_key', a.resource_key)
        FROM jsonb_array_elements(p_items) AS x
        JOIN generation.attempts AS a
          ON a.task_id = (x ->> 'task_id')::uuid AND a.lease_token = (x ->> 'lease_token')::uuid)
    ORDER BY c.resource_key
    FOR NO KEY UPDATE;
    PERFORM 1 FROM generation.holds AS h
    WHERE h.account_group IN (
        SELECT a.account_group
        FROM jsonb_array_elements(p_items) AS x
        JOIN generation.attempts AS a
          ON a.task_id = (x ->> 'task_id')::uuid AND a.lease_token = (x ->> 'lease_token')::uuid)
    ORDER BY h.account_group
    FOR NO KEY UPDATE;
END
$$;

CREATE FUNCTION generation.complete_tasks_v1(p_items jsonb)
RETURNS TABLE (ordinal integer, requested_id uuid, task_found boolean, task generation.tasks,
               event jsonb)
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM generation.lock_reported_v1(p_items);
    RETURN QUERY
    SELECT i.ordinal, i.task_id, c.task_found, c.task, c.event
    FROM (SELECT * FROM jsonb_to_recordset(p_items) AS x(
              ordinal integer, task_id uuid, lease_token uuid, output jsonb, reported_usage jsonb,
              cost_nanos bigint, resource_key text)
          ORDER BY x.task_id, x.ordinal) AS i,
         LATERAL generation.complete_task_v2(i.task_id, i.lease_token, i.output,
                                             i.reported_usage, i.cost_nanos, i.resource_key) AS c;
END
$$;

CREATE FUNCTION generation.fail_tasks_v1(p_items jsonb)
RETURNS TABLE (ordinal integer, requested_id uuid, task_found boolean, forced boolean,
               task generation.tasks, event jsonb)
LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM generation.lock_reported_v1(p_items);
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
"""

DOWNGRADE = r"""
DROP FUNCTION generation.fail_tasks_v1;
DROP FUNCTION generation.complete_tasks_v1;
DROP FUNCTION generation.lock_reported_v1;
DROP FUNCTION generation.grant_share_v1;
DROP FUNCTION generation.key_running_v1;
DROP FUNCTION generation.stale_reason_v2;
DROP FUNCTION generation.close_attempt_v2;
DROP FUNCTION generation.hand_back_unconfirmed_v2;
DROP FUNCTION generation.end_lapsed_run_v2;
DROP FUNCTION generation.claim_tasks_v2;
DROP FUNCTION generation.complete_task_v2;
DROP FUNCTION generation.reap_task_v2;
DROP FUNCTION generation.fail_task_v2;
DROP FUNCTION generation.release_task_v2;
DROP FUNCTION generation.rescue_lapsed_v2;
DROP FUNCTION generation.update_settings_v2;
DROP VIEW generation.spend_today;

ALTER TABLE generation.settings
    DROP CONSTRAINT settings_granted_nonnegative,
    DROP COLUMN granted_nanos;
ALTER TABLE generation.settings RENAME COLUMN granted_day TO spent_day;
ALTER TABLE generation.settings
    ADD COLUMN spent_nanos bigint NOT NULL DEFAULT 0,
    ADD COLUMN reserved_nanos bigint NOT NULL DEFAULT 0,
    ADD CONSTRAINT settings_counters_nonnegative CHECK (spent_nanos >= 0 AND reserved_nanos >= 0);
-- 0008 counts every open reservation, whatever its day.
UPDATE generation.tools AS t
SET reserved_nanos = COALESCE((SELECT sum(a.estimate_nanos) FROM generation.attempts AS a
                               WHERE a.tool_id = t.id AND a.outcome = 'running'), 0);
UPDATE generation.settings AS s
SET spent_day = (now() AT TIME ZONE s.timezone)::date,
    spent_nanos = (SELECT COALESCE(sum(t.spent_nanos), 0) FROM generation.tools AS t
                   WHERE t.spent_day = (now() AT TIME ZONE s.timezone)::date),
    reserved_nanos = (SELECT COALESCE(sum(t.reserved_nanos), 0) FROM generation.tools AS t);
ALTER TABLE generation.tasks DROP COLUMN source;
DROP INDEX generation.attempts_running_idx;
DROP TABLE generation.resource_limits;
ALTER TABLE generation.tools DROP COLUMN max_in_flight;
ALTER TABLE generation.tools
    DROP CONSTRAINT tools_money_nonnegative,
    DROP COLUMN granted_nanos,
    ADD CONSTRAINT tools_money_nonnegative
        CHECK (cost_estimate_nanos >= 0 AND daily_cap_nanos >= 0
               AND spent_nanos >= 0 AND reserved_nanos >= 0);
"""


def _functions_of_0006() -> str:
    """The `_v1` bodies this revision replaced, exactly as 0006 created them."""
    path = Path(__file__).with_name("0006_transition_functions.py")
    spec = importlib.util.spec_from_file_location("genq_revision_0006", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return "\n".join(
        re.search(
            rf"CREATE FUNCTION generation\.{name}_v1\(.*?\n\$\$;\n", module.UPGRADE, re.S
        ).group(0)  # type: ignore[union-attr]
        for name in CHANGED
    )


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
    op.execute(_functions_of_0006())
