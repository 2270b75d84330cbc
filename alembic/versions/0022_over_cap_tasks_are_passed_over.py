"""A task estimated above the cap in force no longer blocks its tool, and the watchdog sees
the cap hold the tasks behind a task today's room cannot take.

The claim admits money in claim order and stops at the first task the caps have no room for.
Two defects followed, both reproduced by a review:

- A task estimated above the whole cap in force (the tool's own cap, or the global one: no
  day's room could take it) stopped every claim of its tool for good. Nothing said why: the
  claim answered `capped` as for a spent cap, and neither the watchdog nor the status named it.
  `claim_tasks_v4` now passes over such a task (it stays queued, and runs in its place once the
  cap is raised); a claim that finds only such tasks answers `capped`. The status's tools carry
  their largest queued estimate, and the leader's log names the tool and the fix.
- A task that only exceeds today's room still stops the claim (so cheaper tasks cannot starve
  it of the room each day frees), and holds back the cheaper tasks behind it. `stale_reason_v2`
  judged each task's own estimate, so with no worker asking, the cheaper ones were called
  abandoned and reaped while the one ahead, which held them, was not. It now also asks for
  room for its tool's next task in claim order, found among the first 20 (last of its checks,
  and bounded: a queue of tasks over the cap must not cost each candidate the whole queue).

Also: a claim notes its tool's poll at most every 5 s, and `queued_max_age_seconds` may be as
low as 1, so a tool whose worker kept asking could be called unattended between two notes.
`stale_reason_v2` and `unattended_tools_v1` count a poll 5 s longer.

Replaced in place (same arguments, same answers), as 0018 to 0020 did. The downgrade keeps the
fixed bodies.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-03
"""

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

UPGRADE = r"""
-- The tools whose queued tasks generation.stale_reason_v2 may call abandoned: the switch on, a
-- cap set, the tool not paused, no gate changed and no worker's poll within queued_max_age, no
-- live lease. Each holds of every abandoned task, so the watchdog's reads (ListStaleTasks,
-- GetStatus) ask stale_reason_v2 only about the queued tasks of these tools: a backlog that a
-- worker drains, a paused tool's, or one the switch holds is not judged row by row (alembic 0013).
CREATE OR REPLACE FUNCTION generation.unattended_tools_v1() RETURNS uuid[]
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
            AND p.polled_at + interval '5 seconds'
                > now() - make_interval(secs => s.queued_max_age_seconds))
      AND NOT EXISTS (
          SELECT 1 FROM generation.tasks AS q
          WHERE q.tool_id = tl.id AND q.status = 'processing' AND q.claim_expires_at > now())
$$;

-- Why a live task can never finish on its own, or NULL: the one definition of "stale" for
-- ListStaleTasks, the status page and the reaper (reap_task_v2), with the stored thresholds.
-- A queued task is abandoned only when nothing deliberate holds it now (switch, cap, pause) and
-- it could have run for queued_max_age with no worker asking for its tool's work: the wait
-- counts from the latest of its queueing, its run_after, a change of the gates, the end of a
-- cooldown or hold, the start of the local day (a new day's cap), and the last claim call. A
-- tool with a live lease has a worker: one whose lanes are full (at max_in_flight, say) asks
-- for no more work until a run ends, and its queue is waiting, not abandoned.
-- The claim holds every task of a tool back while the tool's own key cools, its own group is
-- held or its own key is at its limit, and a task with a key or group of its own also while
-- that one does: both count here as they count there (alembic 0020).
-- A replica's override of the cap ends when it is last seen (gates_v1 counts it for 30 s more);
-- while it lives, only the cap it sets holds anything back (alembic 0020).
-- The claim admits money in claim order and stops at the first task today's room cannot take,
-- so a cap short of the tool's next task's estimate holds every task of the tool, the cheaper
-- ones behind it too; a claim notes a poll at most every 5 s, so a poll counts 5 s longer
-- (alembic 0022).
CREATE OR REPLACE FUNCTION generation.stale_reason_v2(t generation.tasks) RETURNS text
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
                (SELECT p.polled_at + interval '5 seconds'
                 FROM generation.tool_polls AS p WHERE p.tool_id = t.tool_id),
                (SELECT max(c.cooling_until) FROM generation.cooldowns AS c
                 WHERE c.resource_key IN (COALESCE(t.resource_key, tool.resource_key, tool.name),
                                          COALESCE(tool.resource_key, tool.name))),
                (SELECT max(h.held_until) FROM generation.holds AS h
                 WHERE h.account_group IN (COALESCE(t.account_group, tool.account_group, tool.name),
                                           COALESCE(tool.account_group, tool.name))),
                (SELECT max(r.seen_at) FROM generation.replica_overrides AS r
                 WHERE r.disabled OR (r.daily_cap_nanos IS NOT NULL
                                      AND r.seen_at <= now() - interval '30 seconds'))
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
        WHEN EXISTS (SELECT 1 FROM generation.resource_limits AS l
                     WHERE l.resource_key IN (COALESCE(t.resource_key, tool.resource_key, tool.name),
                                              COALESCE(tool.resource_key, tool.name))
                       AND generation.key_running_v1(l.resource_key, l.max_in_flight)
                           >= l.max_in_flight) THEN NULL
        -- The claim must admit its tool's next task first (as step 2 picks it: due, not
        -- cooling or held, not over the cap in force) and stops there when today's room cannot
        -- take it: then that task holds this one too. Last, being the dearest check, and looking
        -- among the first 20 tasks in claim order only, so that a queue of tasks over the cap
        -- costs each candidate 20 rows, not the whole queue (past them, as before 0022, only
        -- the task's own estimate counts).
        WHEN NOT (
            SELECT generation.within_cap_v1(
                       sp.spent_nanos, sp.today, sp.today, sp.reserved_nanos, ahead.estimate,
                       g.cap)
                   AND generation.within_cap_v1(
                       tool.spent_nanos, tool.spent_day, sp.today,
                       CASE WHEN tool.spent_day = sp.today THEN tool.reserved_nanos ELSE 0 END,
                       ahead.estimate, tool.daily_cap_nanos)
            FROM (SELECT COALESCE(h.cost_estimate_nanos, tool.cost_estimate_nanos) AS estimate,
                         h.resource_key, h.account_group, h.reclaimed, h.priority, h.run_at
                  FROM generation.tasks AS h
                  WHERE h.tool_id = t.tool_id AND h.status = 'queued'
                    AND h.retry_count < h.max_retries AND h.run_at <= now()
                    AND (h.expires_at IS NULL OR h.expires_at > now())
                  ORDER BY h.reclaimed DESC, h.priority DESC, h.run_at
                  LIMIT 20) AS ahead
            WHERE ahead.estimate <= LEAST(g.cap, tool.daily_cap_nanos)
              AND (ahead.resource_key IS NULL OR NOT EXISTS (
                    SELECT 1 FROM generation.cooldowns AS c
                    WHERE c.resource_key = ahead.resource_key AND c.cooling_until > now()))
              AND (ahead.account_group IS NULL OR NOT EXISTS (
                    SELECT 1 FROM generation.holds AS o
                    WHERE o.account_group = ahead.account_group AND o.held_until > now()))
            ORDER BY ahead.reclaimed DESC, ahead.priority DESC, ahead.run_at
            LIMIT 1) THEN NULL
        ELSE 'abandoned'
    END
    FROM generation.settings AS s, generation.spend_today AS sp,
         generation.gates_v1(false, NULL) AS g, generation.tools AS tool
    WHERE tool.id = t.tool_id
$$;

-- Claims as claim_tasks_v3 does (its steps 1-8 below are v3's, unchanged), first trying one
-- statement for the case where nothing but the queue decides: the switch on and the global cap
-- above today's grants, the tool not paused, estimated at 0 and free of limits, cooldowns and
-- holds, with no spend today and no zero cap of its own, and every task picked estimated at 0
-- with a resource key without a limit. Then v3 would admit every task it picks, reserve nothing and grant
-- nothing, so the runs start there; else that statement changes nothing and v3's steps decide
-- (alembic 0017). A task estimated above the cap in force (the tool's own, or the global one)
-- cannot run whatever today's spend: the claim passes over it, so it holds back neither its
-- tool nor the tasks behind it, and it runs in its place once the cap is raised; a claim that
-- finds only such tasks answers 'capped' (alembic 0022).
CREATE OR REPLACE FUNCTION generation.claim_tasks_v4(
    p_tool uuid, p_limit integer, p_lease_seconds integer, p_disabled boolean, p_cap bigint
) RETURNS TABLE (task generation.tasks, lease_seconds integer, idle_reason text, event jsonb)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
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
    share_grown boolean := false;
    slice_asked boolean := false;
    reserving bigint := 0;
    in_flight integer;
    limits record;
    key_room jsonb := '{}';
    full_keys text[];
    tool_busy boolean;
    busy boolean := false;
    head record;
    has_head boolean;
    gate record;
BEGIN
    -- 0. The local day cannot move under a claim: a time-zone change that moves it waits for
    --    claims in flight, and they for it (update_settings_v2).
    PERFORM pg_advisory_xact_lock_shared(1734700658);
    -- A. No gate applies: one row (read unlocked, as step 1 reads them). A paid or gated claim
    --    pays only this before step 1.
    SELECT COALESCE(tl.resource_key, tl.name) AS default_key,
           COALESCE(tl.account_group, tl.name) AS default_group,
           COALESCE(tl.lease_seconds, p_lease_seconds) AS lease, local.day AS today
    INTO gate
    FROM generation.tools AS tl, generation.settings AS st,
         generation.gates_v1(p_disabled, p_cap) AS gt,
         LATERAL (SELECT (now() AT TIME ZONE st.timezone)::date AS day) AS local
    WHERE tl.id = p_tool AND gt.running AND NOT tl.paused AND gt.cap > 0
      AND tl.max_in_flight IS NULL AND tl.cost_estimate_nanos = 0
      AND (tl.daily_cap_nanos IS NULL OR tl.daily_cap_nanos > 0)
      AND (tl.spent_day IS DISTINCT FROM local.day OR tl.spent_nanos + tl.reserved_nanos = 0)
      AND CASE WHEN st.granted_day = local.day THEN st.granted_nanos ELSE 0 END < gt.cap
      AND NOT EXISTS (SELECT 1 FROM generation.resource_limits AS l
                      WHERE l.resource_key = COALESCE(tl.resource_key, tl.name))
      AND NOT EXISTS (SELECT 1 FROM generation.cooldowns AS c
                      WHERE c.resource_key = COALESCE(tl.resource_key, tl.name)
                        AND c.cooling_until > now())
      AND NOT EXISTS (SELECT 1 FROM generation.holds AS h
                      WHERE h.account_group = COALESCE(tl.account_group, tl.name)
                        AND h.held_until > now());
    IF FOUND THEN
        RETURN QUERY
        -- B. Lock up to p_limit claimable tasks in claim order, as step 2 does.
        WITH chosen AS MATERIALIZED (
            SELECT q.id, q.reclaimed, q.priority, q.run_at,
                   COALESCE(q.cost_estimate_nanos, 0) AS estimate,
                   COALESCE(q.resource_key, gate.default_key) AS resource_key,
                   COALESCE(q.account_group, gate.default_group) AS account_group
            FROM generation.tasks AS q
            WHERE q.tool_id = p_tool AND q.status = 'queued' AND q.retry_count < q.max_retries
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
        -- C. All of them free (no estimate, no limit on their key), or none started here.
        free AS (
            SELECT * FROM chosen
            WHERE NOT EXISTS (
                SELECT 1 FROM chosen AS o
                WHERE o.estimate <> 0 OR EXISTS (SELECT 1 FROM generation.resource_limits AS l
                                                 WHERE l.resource_key = o.resource_key))),
        -- D. Start the runs as step 8 does (found by `= ANY` of their ids, which bounds the
        --    scan whatever the statistics say).
        started AS (
            UPDATE generation.tasks AS t
            SET status = 'processing',
                started_at = COALESCE(t.started_at, now()),
                claim_expires_at = now() + make_interval(secs => gate.lease),
                lease_token = gen_random_uuid(),
                lease_confirmed = false,
                reclaimed = false,
                attempt_count = t.attempt_count + 1,
                last_event_seq = t.last_event_seq + 1
            WHERE t.id = ANY (ARRAY(SELECT free.id FROM free))
            RETURNING t AS task, t.id, t.attempt_count, t.lease_token, t.last_event_seq),
        attempt AS (
            INSERT INTO generation.attempts
                (task_id, attempt, lease_token, tool_id, resource_key, account_group, local_day,
                 estimate_nanos)
            SELECT started.id, started.attempt_count, started.lease_token, p_tool,
                   free.resource_key, free.account_group, gate.today, 0
            FROM started JOIN free ON free.id = started.id),
        event AS (
            INSERT INTO generation.task_events (task_id, sequence, kind, data)
            SELECT started.id, started.last_event_seq, 'started',
                   jsonb_build_object('attempt', started.attempt_count)
            FROM started
            RETURNING *)
        SELECT started.task, gate.lease, NULL::text, to_jsonb(event)
        FROM started JOIN free ON free.id = started.id JOIN event ON event.task_id = started.id
        ORDER BY free.reclaimed DESC, free.priority DESC, free.run_at;
        IF FOUND THEN
            -- E. A worker asked for the tool's work, as step 5 notes it.
            INSERT INTO generation.tool_polls AS p (tool_id, polled_at)
            SELECT p_tool, now()
            WHERE NOT EXISTS (SELECT 1 FROM generation.tool_polls AS x
                              WHERE x.tool_id = p_tool
                                AND x.polled_at > now() - interval '5 seconds')
            ON CONFLICT (tool_id) DO UPDATE SET polled_at = EXCLUDED.polled_at;
            RETURN;
        END IF;
    END IF;
    -- Else (a gate, a limit or money, or nothing to claim): claim_tasks_v3's steps.
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
        --    hold (tasks_claim_idx serves this as an index-ordered top-N), and tasks no day's
        --    room could take: estimated above the cap in force.
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
              AND COALESCE(q.cost_estimate_nanos, tool.cost_estimate_nanos)
                  <= LEAST(g.cap, tool.daily_cap_nanos)
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
            IF estimates[i] = 0 AND used > 0 AND used + reserving >= share
               AND g.cap - granted >= 16 AND NOT slice_asked THEN
                -- Its run may report a cost, as the tool's runs did today, and the tool's share
                -- has no room left for one: ask for a slice now (once a claim, and only while a
                -- sixteenth of the free part is worth asking for), the tool's row first.
                slice_asked := true;
                IF NOT spend_locked THEN
                    SELECT * INTO tool FROM generation.tools AS t
                    WHERE t.id = p_tool FOR NO KEY UPDATE;
                    spend_locked := true;
                    today := GREATEST(today, tool.spent_day);
                    used := CASE WHEN tool.spent_day = today
                                 THEN tool.spent_nanos + tool.reserved_nanos ELSE 0 END;
                    share := CASE WHEN tool.spent_day = today THEN tool.granted_nanos ELSE 0 END;
                END IF;
                IF used + reserving >= share THEN
                    SELECT * INTO grant_made FROM generation.grant_share_v1(
                        p_tool, today, used + reserving - share, g.cap);
                    IF grant_made.share_change > 0 THEN
                        share := share + grant_made.share_change;
                        granted := grant_made.granted;
                        share_grown := true;
                    END IF;
                END IF;
            END IF;
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
                   COALESCE(q.account_group, default_group) AS account_group,
                   COALESCE(q.cost_estimate_nanos, tool.cost_estimate_nanos) AS estimate
            INTO head
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
                WHEN head.estimate > LEAST(g.cap, tool.daily_cap_nanos) THEN 'capped'
                ELSE 'waiting' END;
        END IF;
        RETURN QUERY SELECT NULL::generation.tasks, NULL::integer, blocked, NULL::jsonb;
        RETURN;
    END IF;

    -- 7. Reserve the admitted estimates in the tool's row (locked in step 4), with its share.
    IF reserving > 0 OR share_grown THEN
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
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    """Nothing: the bodies before had the defects this fixes (docstring)."""
