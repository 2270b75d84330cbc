-- The generation schema beside task.proto, and its source: the baseline revision
-- (alembic/versions/0001_baseline.py) runs this file, and tests/test_schema.py checks that a
-- database `genq migrate` built equals it. Until 0.1.0 is released, a schema change edits this
-- file in place (docs/OPERATIONS.md, "Upgrading").

CREATE SCHEMA generation;

-- Declaration order matters: the claim never sorts by status, but people read this order.
CREATE TYPE generation.task_status AS ENUM (
    'queued', 'dispatched', 'processing', 'completed', 'failed', 'cancelled', 'expired'
);

CREATE TABLE generation.tools (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- Settings (NULL: the default named in docs/OPERATIONS.md).
    max_attempts integer NOT NULL DEFAULT 3,
    backoff_base_seconds integer NOT NULL DEFAULT 30,
    backoff_max_seconds integer NOT NULL DEFAULT 3600,
    lease_seconds integer,
    resource_key text,
    account_group text,
    cost_estimate_nanos bigint NOT NULL DEFAULT 0,
    daily_cap_nanos bigint,
    paused boolean NOT NULL DEFAULT false,
    -- Spend counters of the local day `spent_day`, kept in step with the attempts ledger by the
    -- statements that move money: its spend, its open reservations, and (granted_nanos, below) its
    -- share of the global cap.
    spent_day date,
    spent_nanos bigint NOT NULL DEFAULT 0,
    reserved_nanos bigint NOT NULL DEFAULT 0,
    -- The last change of the pause or the cap: a deliberate wait ended (the watchdog's clock).
    gates_changed_at timestamptz NOT NULL DEFAULT now(),
    -- The part of spent_day's global cap granted to this tool (generation.grant_share_v1): it
    -- covers the tool's spend and reservations, so paid claims lock only their tool's row.
    granted_nanos bigint NOT NULL DEFAULT 0,
    -- At most this many of its tasks run at once (NULL: no limit).
    max_in_flight integer,
    CONSTRAINT tools_name_key UNIQUE (name),
    CONSTRAINT tools_name_length CHECK (char_length(name) BETWEEN 1 AND 200),
    CONSTRAINT tools_max_attempts_range CHECK (max_attempts BETWEEN 0 AND 100),
    CONSTRAINT tools_backoff_range
        CHECK (backoff_base_seconds >= 0 AND backoff_max_seconds >= backoff_base_seconds),
    -- The floor: a shorter lease cannot be kept alive across one slow heartbeat.
    CONSTRAINT tools_lease_floor CHECK (lease_seconds >= 1),
    CONSTRAINT tools_max_in_flight_positive CHECK (max_in_flight >= 1),
    CONSTRAINT tools_money_nonnegative
        CHECK (cost_estimate_nanos >= 0 AND daily_cap_nanos >= 0
               AND spent_nanos >= 0 AND reserved_nanos >= 0 AND granted_nanos >= 0)
);

CREATE TABLE generation.tasks (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    -- No foreign key: its check was a fifth of a batch enqueue's statement; tools are kept
    -- instead (below).
    tool_id uuid NOT NULL,
    status generation.task_status NOT NULL DEFAULT 'queued',
    input jsonb NOT NULL DEFAULT '{}',
    output jsonb,
    error text,
    priority integer NOT NULL DEFAULT 0,
    retry_count integer NOT NULL DEFAULT 0,
    max_retries integer NOT NULL DEFAULT 3,
    reserved_token_amount bigint NOT NULL DEFAULT 0,
    billing_idempotency_key text,
    w3c_traceparent text,
    reported_usage jsonb,
    -- The lease: who holds the task and until when. The tasks of one claim share its token;
    -- the pair (id, lease_token) fences every write.
    lease_token uuid,
    claim_expires_at timestamptz,
    -- Set when a lapsed or lost claim put the task back: it is claimed ahead of fresh work.
    reclaimed boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now(),
    started_at timestamptz,
    completed_at timestamptz,
    -- Set once, by SettleTask, when the reservation of a terminal task is settled.
    settled_at timestamptz,
    -- Not before (the claim's FIFO key within a priority) and expiry (swept to 'expired').
    run_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz,
    idempotency_key text,
    -- Per-task overrides of the tool's settings (NULL: the tool's).
    resource_key text,
    account_group text,
    cost_estimate_nanos bigint,
    attempt_count integer NOT NULL DEFAULT 0,
    -- Raised when a finished task is queued again, so its new reservation settles anew.
    settlement_round integer NOT NULL DEFAULT 1,
    -- When it last entered the queue (enqueue, requeue, retry, release, rescue): the watchdog's
    -- clock starts here at the earliest.
    queued_at timestamptz NOT NULL DEFAULT now(),
    -- The claimer confirmed the run (its first heartbeat or event): the run counts. ConfirmClaim
    -- confirms a whole claim in claim_confirmations instead; generation.claim_confirmed_v1 reads
    -- both.
    lease_confirmed boolean NOT NULL DEFAULT false,
    -- Claims whose answer never reached a worker; at 20 the task fails ("claim answers lost").
    unconfirmed_claims integer NOT NULL DEFAULT 0,
    -- A cancel asked of the running task; it ends cancelled when its run does.
    cancel_requested_at timestamptz,
    -- The sequence of the task's last event (events count per task).
    last_event_seq bigint NOT NULL DEFAULT 0,
    -- Who or what enqueued it.
    source text,
    -- The requeue_keys of the QueueTask REQUEUEs that created it or queued it again: one sent
    -- again after a lost answer finds its key here, on the row it holds locked.
    requeue_keys text[],
    -- The units its run is expected to use (tokens, say), for its key's rate limit (max_units).
    rate_units bigint NOT NULL DEFAULT 0,
    CONSTRAINT tasks_priority_range CHECK (priority BETWEEN -100 AND 100),
    CONSTRAINT tasks_max_retries_range CHECK (max_retries BETWEEN 0 AND 100),
    CONSTRAINT tasks_retry_count_nonnegative CHECK (retry_count >= 0),
    CONSTRAINT tasks_reserved_nonnegative CHECK (reserved_token_amount >= 0),
    CONSTRAINT tasks_lease_held_while_processing
        CHECK ((status = 'processing') = (lease_token IS NOT NULL AND claim_expires_at IS NOT NULL)),
    CONSTRAINT tasks_cost_estimate_nonnegative CHECK (cost_estimate_nanos >= 0),
    CONSTRAINT tasks_source_length CHECK (char_length(source) <= 200),
    CONSTRAINT tasks_rate_units_nonnegative CHECK (rate_units >= 0)
)
-- A hot queue: leave room on each page so heartbeats stay HOT, and vacuum after a few
-- thousand dead rows instead of 20 % of the table.
WITH (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 2000,
    autovacuum_vacuum_insert_scale_factor = 0.0,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0.0,
    autovacuum_analyze_threshold = 5000,
    autovacuum_vacuum_cost_limit = 2000
);

-- A tool is never deleted nor renumbered, so every task's tool exists without a foreign key: no
-- RPC deletes one or changes its id, the inserts read their tool's row in the same statement,
-- and this refuses either by hand.
CREATE FUNCTION generation.keep_tools_v1() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION 'a tool is never deleted nor renumbered: its tasks name it (pause it instead)'
        USING ERRCODE = 'restrict_violation';
END
$$;

CREATE TRIGGER tools_are_kept BEFORE UPDATE OF id OR DELETE OR TRUNCATE ON generation.tools
    FOR EACH STATEMENT EXECUTE FUNCTION generation.keep_tools_v1();

-- The claim: an index-ordered top-1 per tool over claimable rows only, so its cost depends on
-- neither the backlog nor the tasks in flight, and needs no statistics to be chosen.
CREATE INDEX tasks_claim_idx ON generation.tasks (tool_id, reclaimed DESC, priority DESC, run_at)
    WHERE status = 'queued' AND retry_count < max_retries;

-- Enqueue idempotency: one task per (tool, key) until it is purged.
CREATE UNIQUE INDEX tasks_idempotency_key_idx ON generation.tasks (tool_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- Finished tasks by age, for the retention purge.
CREATE INDEX tasks_finished_idx ON generation.tasks (completed_at)
    WHERE status IN ('completed', 'failed', 'cancelled', 'expired');

-- Queued tasks by expiry, for the sweep that expires them.
CREATE INDEX tasks_expiry_idx ON generation.tasks (expires_at) WHERE status = 'queued';

-- Tasks in flight, for the lease rescuer, the watchdog and the concurrency limits.
-- claim_expires_at is deliberately not indexed: heartbeats write only that column and so stay
-- HOT.
CREATE INDEX tasks_in_flight_idx ON generation.tasks (tool_id) WHERE status = 'processing';

-- Tasks in flight under a resource key of their own, for the key's concurrency limit
-- (generation.key_running_v1). A task without one (its tool's key) has no entry. A task holds a
-- lease token exactly while it is processing (tasks_lease_held_while_processing, and every
-- transition out of processing clears it); the predicate names the token, not the status, so
-- that a count of a key cannot be planned as a read of every task in flight through
-- tasks_in_flight_idx.
CREATE INDEX tasks_running_key_idx ON generation.tasks (resource_key)
    WHERE lease_token IS NOT NULL AND resource_key IS NOT NULL;

-- Queued rows the watchdog may have to fail (never claimed for long, or retries used up).
CREATE INDEX tasks_waiting_idx ON generation.tasks (queued_at) WHERE status IN ('queued', 'dispatched');

-- Terminal tasks whose reservation still waits for its settlement (the reconciler's sweep).
CREATE INDEX tasks_unsettled_idx ON generation.tasks (completed_at)
    WHERE status IN ('completed', 'failed', 'cancelled', 'expired')
      AND reserved_token_amount > 0 AND settled_at IS NULL;

-- A task's event stream: progress, streaming URL and partial output from the worker, then the
-- terminal event the service adds in CompleteTask or FailTask.
CREATE TYPE generation.task_event_kind AS ENUM (
    'progress', 'streaming_url', 'partial_output', 'requeued', 'completed', 'failed',
    'cancelled', 'expired', 'started', 'cancel_requested'
);

-- No foreign key: every event is appended by a transition that holds its task's
-- row, and PurgeTasks deletes a task's events with it.
CREATE TABLE generation.task_events (
    task_id uuid NOT NULL,
    sequence bigint NOT NULL,
    kind generation.task_event_kind NOT NULL,
    data jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, sequence)
);

-- The one settlement of each reserved task: the primary key is what makes it exactly once.
-- No foreign key: the money record outlives the purge of its task.
CREATE TABLE generation.settlements (
    task_id uuid NOT NULL,
    task_status generation.task_status NOT NULL,
    reserved_token_amount bigint NOT NULL,
    charged_token_amount bigint NOT NULL,
    refunded_token_amount bigint NOT NULL,
    settled_at timestamptz NOT NULL DEFAULT now(),
    settlement_round integer NOT NULL DEFAULT 1,
    CONSTRAINT settlements_pkey PRIMARY KEY (task_id, settlement_round),
    CONSTRAINT settlements_terminal
        CHECK (task_status IN ('completed', 'failed', 'cancelled', 'expired')),
    CONSTRAINT settlements_amounts CHECK (
        charged_token_amount >= 0 AND refunded_token_amount >= 0
        AND charged_token_amount + refunded_token_amount = reserved_token_amount
    )
);

-- Spend control: one row of global settings, and the total of the shares of the global cap
-- granted to the tools for the local day granted_day (the spend itself is counted per tool).
CREATE TABLE generation.settings (
    id boolean PRIMARY KEY DEFAULT true,
    enabled boolean NOT NULL DEFAULT true,
    daily_cap_nanos bigint,
    currency text NOT NULL DEFAULT '',
    timezone text NOT NULL DEFAULT 'UTC',
    cooldown_threshold integer NOT NULL DEFAULT 2,
    cooldown_seconds integer NOT NULL DEFAULT 600,
    account_hold_seconds integer NOT NULL DEFAULT 3600,
    retention_days integer NOT NULL DEFAULT 30,
    granted_day date,
    -- What "stale" means (generation.stale_reason_v1).
    processing_grace_seconds integer NOT NULL DEFAULT 120,
    queued_max_age_seconds integer NOT NULL DEFAULT 900,
    -- The last change of the switch or the cap: a deliberate wait ended (the watchdog's clock).
    gates_changed_at timestamptz NOT NULL DEFAULT now(),
    granted_nanos bigint NOT NULL DEFAULT 0,
    CONSTRAINT settings_singleton CHECK (id),
    CONSTRAINT settings_cap_nonnegative CHECK (daily_cap_nanos >= 0),
    CONSTRAINT settings_granted_nonnegative CHECK (granted_nanos >= 0),
    CONSTRAINT settings_cooldown_threshold_positive CHECK (cooldown_threshold >= 1),
    CONSTRAINT settings_durations_nonnegative
        CHECK (cooldown_seconds >= 0 AND account_hold_seconds >= 0 AND retention_days >= 0),
    CONSTRAINT settings_stale_thresholds_positive
        CHECK (processing_grace_seconds >= 1 AND queued_max_age_seconds >= 1)
);
INSERT INTO generation.settings DEFAULT VALUES;

-- Today's spend and open reservations of every tool together: what the global cap binds.
-- Summed on read, so no one row is written by every paid claim.
CREATE VIEW generation.spend_today AS
SELECT (now() AT TIME ZONE s.timezone)::date AS today,
       COALESCE(sum(t.spent_nanos), 0)::bigint AS spent_nanos,
       COALESCE(sum(t.reserved_nanos), 0)::bigint AS reserved_nanos
FROM generation.settings AS s
LEFT JOIN generation.tools AS t ON t.spent_day = (now() AT TIME ZONE s.timezone)::date
GROUP BY s.timezone;

-- Consecutive retryable failures per resource key (a model, say), and how long it cools.
CREATE TABLE generation.cooldowns (
    resource_key text PRIMARY KEY,
    consecutive_failures integer NOT NULL DEFAULT 0,
    cooling_until timestamptz
);

-- How many tasks of a resource key may run at once, across tools: a provider's concurrency
-- limit for a model, say.
CREATE TABLE generation.resource_limits (
    resource_key text PRIMARY KEY,
    max_in_flight integer NOT NULL,
    CONSTRAINT resource_limits_max_in_flight_positive CHECK (max_in_flight >= 1)
);

-- Rate limits per resource key, across tools (a provider's requests and tokens per minute for a
-- model, say): in any window of window_seconds, at most max_calls runs of the key start and at
-- most max_units of their tasks' rate_units are admitted (NULL: no limit of that kind).
CREATE TABLE generation.rate_limits (
    resource_key text PRIMARY KEY,
    max_calls integer,
    max_units bigint,
    window_seconds integer NOT NULL DEFAULT 60,
    -- Set by the claim that left the window no call or no unit: when its first slot frees. The
    -- claim's unlocked first look reads this instead of counting every key's window; the count
    -- under the row's lock (rate_window_v1) decides. SetRateLimit clears it.
    limited_until timestamptz,
    CONSTRAINT rate_limits_positive CHECK (max_calls >= 1 AND max_units >= 1),
    CONSTRAINT rate_limits_some CHECK (max_calls IS NOT NULL OR max_units IS NOT NULL),
    CONSTRAINT rate_limits_window_range CHECK (window_seconds BETWEEN 1 AND 86400)
);

-- The runs the claim started under a rate limit, counted per key in slices of a sixtieth of its
-- window (a second at least): the runs and their units admitted from slice_end - width up to
-- slice_end. Written only for keys with a rate limit, one row a slice, so a claim counts at most
-- 61 rows whatever the limit; PurgeTasks deletes the slices that left their window.
CREATE TABLE generation.rate_slices (
    resource_key text NOT NULL,
    slice_end timestamptz NOT NULL,
    calls bigint NOT NULL,
    units bigint NOT NULL,
    PRIMARY KEY (resource_key, slice_end)
);

-- Account holds per group, after an account error (out of credit, say).
CREATE TABLE generation.holds (
    account_group text PRIMARY KEY,
    held_until timestamptz NOT NULL,
    reason text
);

CREATE TYPE generation.attempt_outcome AS ENUM (
    'running', 'completed', 'retry', 'failed', 'abandoned', 'lease_lost', 'cancelled',
    'released', 'account_error', 'unconfirmed'
);

-- The attempts ledger: one row per run, with what it cost. No foreign key: the cost history
-- outlives the purge of its task.
CREATE TABLE generation.attempts (
    task_id uuid NOT NULL,
    attempt integer NOT NULL,
    lease_token uuid NOT NULL,
    tool_id uuid NOT NULL,
    resource_key text NOT NULL,
    account_group text NOT NULL,
    local_day date NOT NULL,
    estimate_nanos bigint NOT NULL,
    cost_nanos bigint NOT NULL DEFAULT 0,
    outcome generation.attempt_outcome NOT NULL DEFAULT 'running',
    started_at timestamptz NOT NULL DEFAULT now(),
    ended_at timestamptz,
    -- The run's `started` event's sequence, and its terminal event's when a clean completion
    -- ended it (generation.event_stream derives both events from this row).
    started_seq bigint,
    ended_seq bigint,
    -- ended_at of a run that lasted more than 10 minutes, else NULL: of what a close changes,
    -- the one thing an index holds, and it changes only for such runs
    -- (generation.attempts_ended_since_v1).
    long_run_ended_at timestamptz GENERATED ALWAYS AS (
        CASE WHEN ended_at - started_at > interval '10 minutes' THEN ended_at END) STORED,
    PRIMARY KEY (task_id, attempt),
    CONSTRAINT attempts_money_nonnegative CHECK (estimate_nanos >= 0 AND cost_nanos >= 0)
)
-- Every run's row is updated once, when the run ends. Outcome, end, cost and resource key are in
-- no index nor any index's predicate, so with room left on its page for the new version the
-- close of a run of up to 10 minutes is a HOT update: no index entry.
-- More than half of each page is left free: a batch closes all of a page's rows in one
-- transaction, before any old version can be pruned, and a closed row is 16 bytes longer (its
-- end and its terminal event's sequence). The ledger only grows, so a vacuum at 20 % of it would
-- come ever later: vacuum after a few thousand dead rows instead.
WITH (fillfactor = 45, autovacuum_vacuum_scale_factor = 0.0, autovacuum_vacuum_threshold = 2000);
-- The attempts of a local day: GetStats, and a time-zone change that moves today.
CREATE INDEX attempts_local_day_idx ON generation.attempts (local_day);
-- When each tool last claimed (a worker is alive), and the runs started recently (the last
-- hour's ended runs, with attempts_long_run_idx).
CREATE INDEX attempts_tool_started_idx ON generation.attempts (tool_id, started_at);
-- The runs that lasted more than 10 minutes, by when they ended: the rest of the last hour's
-- ended runs. A shorter run has no entry, so its close stays HOT.
CREATE INDEX attempts_long_run_idx ON generation.attempts (long_run_ended_at)
    WHERE long_run_ended_at IS NOT NULL;

-- A task's event stream: the events stored in task_events, and the two every run has that its
-- attempt's row already tells: `started` (at the claim, numbered started_seq) and, when a
-- completion ended the run cleanly, its terminal event (`completed` or `cancelled`, numbered
-- ended_seq, at ended_at). Read by task id and sequence.
CREATE VIEW generation.event_stream AS
SELECT e.task_id, e.sequence, e.kind, e.data, e.created_at FROM generation.task_events AS e
UNION ALL
SELECT a.task_id, a.started_seq, 'started'::generation.task_event_kind,
       jsonb_build_object('attempt', a.attempt), a.started_at
FROM generation.attempts AS a WHERE a.started_seq IS NOT NULL
UNION ALL
SELECT a.task_id, a.ended_seq, a.outcome::text::generation.task_event_kind, '{}'::jsonb, a.ended_at
FROM generation.attempts AS a WHERE a.ended_seq IS NOT NULL;

-- The claims their worker confirmed with ConfirmClaim, by the token the claim's tasks share: a
-- task holding a token found here counts as confirmed (generation.claim_confirmed_v1). A row
-- matters only while a task holds its token; PurgeTasks deletes the rows no running task holds.
CREATE TABLE generation.claim_confirmations (
    lease_token uuid PRIMARY KEY,
    confirmed_at timestamptz NOT NULL DEFAULT now()
);

-- When a worker last asked for each tool's work (a claim call, claimed or not).
CREATE TABLE generation.tool_polls (
    tool_id uuid PRIMARY KEY,
    polled_at timestamptz NOT NULL
);

-- Each running replica's kill-switch and cap overrides from its environment, refreshed while it
-- runs: gates_v1 applies every live one to every replica's claims.
CREATE TABLE generation.replica_overrides (
    replica_id uuid PRIMARY KEY,
    disabled boolean NOT NULL,
    daily_cap_nanos bigint,
    seen_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT replica_overrides_cap_nonnegative CHECK (daily_cap_nanos >= 0)
);

-- The maintenance leader: the process holding `name`'s row until `expires_at` (the database's
-- clock) runs the periodic sweeps for every replica; it renews the row well before then, and
-- deletes it when it stops cleanly (service/leader/lease.py).
CREATE TABLE generation.leader (
    name text PRIMARY KEY,
    holder uuid NOT NULL,
    expires_at timestamptz NOT NULL
);

-- API tokens: a caller presents `genq_<id>_<secret>`; only the secret's SHA-256 is stored, so a
-- stolen backup holds no credential. A revoked or expired token stops working on
-- every replica within 30 s (the service trusts a looked-up token for 15 s).
CREATE TABLE generation.tokens (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    secret_sha256 bytea NOT NULL,
    roles text[] NOT NULL,
    -- The tools the token reaches (empty: every tool).
    tools text[] NOT NULL DEFAULT '{}',
    note text NOT NULL DEFAULT '',
    created_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz,
    revoked_at timestamptz,
    CONSTRAINT tokens_roles_known CHECK (
        cardinality(roles) >= 1
        AND roles <@ ARRAY['gateway', 'worker', 'reconciler', 'operator', 'viewer']),
    CONSTRAINT tokens_secret_length CHECK (octet_length(secret_sha256) = 32)
);

-- Who changed what, when: one row per audited RPC, written in the change's own transaction, and
-- per `genq token` command.
CREATE TABLE generation.audit (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now(),
    actor text NOT NULL,
    action text NOT NULL,
    detail jsonb NOT NULL DEFAULT '{}'
);

-- The write transitions, one function each (docs/ARCHITECTURE.md: "Transitions"). Each locks what
-- it changes first, then decides, in the one lock order: task rows, claim confirmations,
-- attempts, resource limits, tools, settings, cooldowns and holds, tool_polls. Once 0.1.0 is released, a change adds the
-- function's next version beside it (docs/OPERATIONS.md, "Upgrading").

-- Whether a cost fits under a cap, given the spend counters: spend counts on `today` only, an
-- estimate must fit (<= cap), and a task estimated at 0 needs the total strictly below the cap.
-- A NULL cap never binds (a tool without a cap of its own). Summed in numeric: no overflow.
CREATE FUNCTION generation.within_cap_v1(
    spent bigint, spent_day date, today date, reserved bigint, estimate bigint, cap bigint
) RETURNS boolean
LANGUAGE sql IMMUTABLE
AS $$
    SELECT cap IS NULL OR CASE
        WHEN estimate > 0
            THEN (CASE WHEN spent_day = today THEN spent ELSE 0 END)::numeric + reserved + estimate <= cap
        ELSE (CASE WHEN spent_day = today THEN spent ELSE 0 END)::numeric + reserved < cap
    END
$$;

-- The kill switch and the global cap in force: the stored settings, overridden by this replica's
-- environment (p_disabled, p_cap) and by every live replica's (generation.replica_overrides), so
-- an override in one replica's environment binds every replica's claims while it runs.
CREATE FUNCTION generation.gates_v1(p_disabled boolean, p_cap bigint)
RETURNS TABLE (running boolean, cap bigint, disabled_by_environment boolean, cap_override bigint)
LANGUAGE sql STABLE
AS $$
    SELECT s.enabled AND NOT o.disabled, COALESCE(o.cap, s.daily_cap_nanos, 0), o.disabled, o.cap
    FROM generation.settings AS s,
         (SELECT p_disabled OR COALESCE(bool_or(r.disabled), false) AS disabled,
                 LEAST(p_cap, min(r.daily_cap_nanos)) AS cap
          FROM generation.replica_overrides AS r
          WHERE r.seen_at > now() - interval '30 seconds') AS o
$$;

-- The tools whose queued tasks generation.stale_reason_v1 may call abandoned: the switch on, a
-- cap set, the tool not paused, no gate changed and no worker's poll within queued_max_age, no
-- live lease. Each holds of every abandoned task, so the watchdog's reads (ListStaleTasks,
-- GetStatus) ask stale_reason_v1 only about the queued tasks of these tools: a backlog that a
-- worker drains, a paused tool's, or one the switch holds is not judged row by row.
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
            AND p.polled_at + interval '5 seconds'
                > now() - make_interval(secs => s.queued_max_age_seconds))
      AND NOT EXISTS (
          SELECT 1 FROM generation.tasks AS q
          WHERE q.tool_id = tl.id AND q.status = 'processing' AND q.claim_expires_at > now())
$$;

-- Closes the attempt run under a lease and moves its money on its tool's counters: the
-- reservation is released (once) and the cost added (also for a late report under a lost lease:
-- billed is billed) when the attempt started on the counters' day, today (an earlier day's
-- counters, reservations included, were dropped with that day); the resource key's cooldown and
-- the account group's hold are kept, on the key the run reports it used (p_resource_key: a
-- handler that fell back to another model) or else the one it was claimed with. A second close
-- of the same attempt changes nothing, so a retried call cannot count twice. The caller holds
-- the task's row lock.
CREATE FUNCTION generation.close_attempt_v1(
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

-- The `started` and clean terminal events generation.event_stream derives from an attempt, as
-- the JSON a stored event renders (to_jsonb of a task_events row), for the followers and the
-- Redis mirror. Only their transitions call them, at the moment the events take effect (now()).
CREATE FUNCTION generation.started_event_v1(p_task uuid, p_sequence bigint, p_attempt integer)
RETURNS jsonb
LANGUAGE sql STABLE
AS $$
    SELECT jsonb_build_object('task_id', p_task, 'sequence', p_sequence, 'kind', 'started',
                              'data', jsonb_build_object('attempt', p_attempt),
                              'created_at', now())
$$;

CREATE FUNCTION generation.ended_event_v1(
    p_task uuid, p_sequence bigint, p_kind generation.task_event_kind
) RETURNS jsonb
LANGUAGE sql STABLE
AS $$
    SELECT jsonb_build_object('task_id', p_task, 'sequence', p_sequence, 'kind', p_kind,
                              'data', '{}'::jsonb, 'created_at', now())
$$;

-- Appends the next event of a task's stream, numbered by the task's last_event_seq, which the
-- caller's own UPDATE of the task has just raised. Sequences count per task and are taken under
-- the task's row lock, so they follow commit order: a follower paging by sequence never skips
-- one, and nothing follows the terminal event.
CREATE FUNCTION generation.append_event_v1(
    p_task uuid, p_kind generation.task_event_kind, p_data jsonb
) RETURNS jsonb
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    e generation.task_events;
BEGIN
    INSERT INTO generation.task_events (task_id, sequence, kind, data)
    SELECT p_task, t.last_event_seq, p_kind, COALESCE(p_data, '{}')
    FROM generation.tasks AS t WHERE t.id = p_task
    RETURNING * INTO e;
    RETURN to_jsonb(e);
END
$$;

-- Whether the claimer confirmed the run of t (the row as its caller locked it): its first
-- heartbeat or event set lease_confirmed, or ConfirmClaim recorded its claim's token. The caller
-- reads it in a statement after the one that locked t, so a confirmation that committed while it
-- waited for the lock is seen.
CREATE FUNCTION generation.claim_confirmed_v1(t generation.tasks) RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT t.lease_confirmed OR EXISTS (
        SELECT 1 FROM generation.claim_confirmations AS c WHERE c.lease_token = t.lease_token)
$$;

-- A claim whose answer never reached a worker: the task goes back to the queue at once, first
-- in line, and the run costs no retry: nothing ran. p_lapsed: its unconfirmed lease lapsed (the
-- answer was lost on the way); such losses are counted, and at 20 the task fails with "claim
-- answers lost", so a link that loses every answer cannot keep a task forever. Otherwise the
-- service itself saw the caller's deadline pass before the answer left: that costs the task
-- nothing at all, so a caller with hopeless deadlines cannot wear out the task at the head of
-- the line. A task whose cancel was asked for ends cancelled. The caller holds the row lock.
CREATE FUNCTION generation.hand_back_unconfirmed_v1(t generation.tasks, p_lapsed boolean)
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
    PERFORM generation.close_attempt_v1(t.id, t.lease_token, 'unconfirmed', 0, false, NULL);
    RETURN QUERY SELECT back, generation.append_event_v1(
        t.id, ending::generation.task_event_kind,
        jsonb_build_object('reason', CASE WHEN p_lapsed THEN 'claim answer lost'
                                          ELSE 'claim deadline passed' END,
                           'unconfirmed_claims', back.unconfirmed_claims, 'error', back.error));
END
$$;

-- A run whose lease lapsed, decided: an unconfirmed claim costs nothing (hand_back_unconfirmed_v1);
-- a confirmed run costs one retry and is queued again first in line while retries remain, else
-- the task fails at once (nobody waits for the reaper); a run whose cancel was asked for ends
-- cancelled. The attempt is closed abandoned (its reservation released). The caller holds the
-- task's row lock and its attempt's.
CREATE FUNCTION generation.end_lapsed_run_v1(t generation.tasks)
RETURNS TABLE (task generation.tasks, event jsonb)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    prior uuid;
    ending text;
BEGIN
    IF NOT generation.claim_confirmed_v1(t) THEN
        RETURN QUERY SELECT * FROM generation.hand_back_unconfirmed_v1(t, true);
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
    PERFORM generation.close_attempt_v1(t.id, prior, 'abandoned', 0, false, NULL);
    RETURN QUERY SELECT t, generation.append_event_v1(
        t.id, ending::generation.task_event_kind,
        jsonb_build_object('reason', 'lease lapsed', 'error', t.error, 'retry_count', t.retry_count));
END
$$;

-- How many runs of a resource key are in flight, counted up to p_limit: the tasks processing
-- under that key, their own (tasks_running_key_idx) or, for a task with none, its tool's
-- (tasks_in_flight_idx, per tool whose key it is). A run counts from its claim until its task
-- leaves processing, so a run whose late report was refused (its attempt closed, its task not
-- yet rescued) still counts until the rescuer ends it. A run without a key of its own counts
-- under its tool's key as it is now. The count stops at the limit, so it costs the limit's,
-- never the backlog's (a tool's runs under keys of their own are read past). The one count the
-- claim, GetStatus and the watchdog (stale_reason_v1) use for a key's concurrency limit; the
-- claim takes it in a statement after the key's limit is locked, so it sees every run a claim
-- holding that lock started.
CREATE FUNCTION generation.key_running_v1(p_key text, p_limit integer) RETURNS bigint
LANGUAGE sql STABLE
AS $$
    SELECT count(*) FROM (
        -- Processing: holding a lease (the CHECK's two columns).
        SELECT 1 FROM generation.tasks AS q
        WHERE q.resource_key = p_key AND q.lease_token IS NOT NULL
          AND q.claim_expires_at IS NOT NULL
        UNION ALL
        -- OFFSET 0: each tool's runs are read by its id, whatever the statistics say.
        SELECT 1 FROM generation.tools AS tl
        CROSS JOIN LATERAL (
            SELECT 1 FROM generation.tasks AS q
            WHERE q.tool_id = tl.id AND q.status = 'processing' AND q.resource_key IS NULL
            OFFSET 0) AS own
        WHERE COALESCE(tl.resource_key, tl.name) = p_key
        LIMIT p_limit) AS running
$$;

-- The end of the slice of a window of p_window_seconds that holds now(): slices are a
-- sixtieth of the window wide (a whole second at least), aligned on the epoch.
CREATE FUNCTION generation.rate_slice_end_v1(p_window_seconds integer) RETURNS timestamptz
LANGUAGE sql STABLE
AS $$
    SELECT to_timestamp((floor(extract(epoch FROM now()) / w.width) + 1) * w.width)
    FROM (SELECT ceil(p_window_seconds / 60.0) AS width) AS w
$$;

-- A rate-limited key's window as it stands now, given its limit: the runs it started and the
-- units it admitted in the slices that end after now() - window, whether that is the limit (no
-- call, or no unit, left), and when the oldest of those slices leaves the window (the next slot
-- frees). A slice partly out of the window counts whole: near its edge a key may start fewer
-- than its limit, never more. The one reading of a rate limit: the claim (under the limit's row
-- lock), the watchdog, GetStatus, GetResourceKey.
CREATE FUNCTION generation.rate_window_v1(
    p_key text, p_max_calls integer, p_max_units bigint, p_window_seconds integer
) RETURNS TABLE (calls bigint, units bigint, at_limit boolean, frees_at timestamptz)
LANGUAGE sql STABLE
AS $$
    SELECT w.calls, w.units,
           COALESCE(w.calls >= p_max_calls, false) OR COALESCE(w.units >= p_max_units, false),
           w.oldest + make_interval(secs => p_window_seconds)
    FROM (SELECT COALESCE(sum(s.calls), 0)::bigint AS calls,
                 COALESCE(sum(s.units), 0)::bigint AS units, min(s.slice_end) AS oldest
          FROM generation.rate_slices AS s
          WHERE s.resource_key = p_key
            AND s.slice_end > now() - make_interval(secs => p_window_seconds)) AS w
$$;

-- The keys among p_keys (NULL: every key) at their rate limit now, and the earliest time one of
-- them frees a slot.
CREATE FUNCTION generation.rate_limited_v1(p_keys text[])
RETURNS TABLE (keys text[], frees_at timestamptz)
LANGUAGE sql STABLE
AS $$
    SELECT COALESCE(array_agg(r.resource_key), '{}'), min(w.frees_at)
    FROM generation.rate_limits AS r,
         generation.rate_window_v1(r.resource_key, r.max_calls, r.max_units, r.window_seconds) AS w
    WHERE (p_keys IS NULL OR r.resource_key = ANY (p_keys)) AND w.at_limit
$$;

-- The attempts that ended after p_since: those that started 10 minutes before it or later
-- (attempts_tool_started_idx, tool by tool), and the longer runs (attempts_long_run_idx). Exact:
-- a run that ended after p_since and started earlier lasted more than 10 minutes, so its
-- long_run_ended_at is its ended_at. It reads the runs started since 10 minutes before p_since,
-- never the whole ledger. GetStatus's last hour and the scrape's lease lapses.
CREATE FUNCTION generation.attempts_ended_since_v1(p_since timestamptz)
RETURNS SETOF generation.attempts
LANGUAGE sql STABLE
AS $$
    -- OFFSET 0: each tool's runs are read by its id and start, whatever the statistics say.
    SELECT a.* FROM generation.tools AS tl
    CROSS JOIN LATERAL (
        SELECT * FROM generation.attempts AS x
        WHERE x.tool_id = tl.id AND x.started_at > p_since - interval '10 minutes'
          AND x.ended_at > p_since
        OFFSET 0) AS a
    UNION ALL
    SELECT * FROM generation.attempts AS a
    WHERE a.long_run_ended_at > p_since AND a.started_at <= p_since - interval '10 minutes'
$$;

-- Why a live task can never finish on its own, or NULL: the one definition of "stale" for
-- ListStaleTasks, the status page and the reaper (reap_task_v1), with the stored thresholds.
-- A queued task is abandoned only when nothing deliberate holds it now (switch, cap, pause) and
-- it could have run for queued_max_age with no worker asking for its tool's work: the wait
-- counts from the latest of its queueing, its run_after, a change of the gates, the end of a
-- cooldown or hold, the start of the local day (a new day's cap), and the last claim call. A
-- tool with a live lease has a worker: one whose lanes are full (at max_in_flight, say) asks
-- for no more work until a run ends, and its queue is waiting, not abandoned.
-- The claim holds every task of a tool back while the tool's own key cools, its own group is
-- held or its own key is at its limit, and a task with a key or group of its own also while
-- that one does: both count here as they count there. So does a key at its rate limit, and the
-- wait counts from when its last admission leaves the window at the earliest.
-- A replica's override of the cap ends when it is last seen (gates_v1 counts it for 30 s more);
-- while it lives, only the cap it sets holds anything back.
-- The claim admits money in claim order and stops at the first task today's room cannot take,
-- so a cap short of the tool's next task's estimate holds every task of the tool, the cheaper
-- ones behind it too; a claim notes a poll at most every 5 s, so a poll counts 5 s longer.
CREATE FUNCTION generation.stale_reason_v1(t generation.tasks) RETURNS text
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
                                      AND r.seen_at <= now() - interval '30 seconds')),
                (SELECT max((SELECT max(a.slice_end) FROM generation.rate_slices AS a
                             WHERE a.resource_key = r.resource_key)
                            + make_interval(secs => r.window_seconds))
                 FROM generation.rate_limits AS r
                 WHERE r.resource_key IN (COALESCE(t.resource_key, tool.resource_key, tool.name),
                                          COALESCE(tool.resource_key, tool.name)))
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
        WHEN cardinality((SELECT rl.keys FROM generation.rate_limited_v1(ARRAY[
                 COALESCE(t.resource_key, tool.resource_key, tool.name),
                 COALESCE(tool.resource_key, tool.name)]) AS rl)) > 0 THEN NULL
        -- The claim must admit its tool's next task first (as step 2 picks it: due, not
        -- cooling or held, not over the cap in force) and stops there when today's room cannot
        -- take it: then that task holds this one too. Last, being the dearest check, and looking
        -- among the first 20 tasks in claim order only, so that a queue of tasks over the cap
        -- costs each candidate 20 rows, not the whole queue (past them, only the task's own
        -- estimate counts).
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

-- Grants a tool more of today's global cap: the shortfall p_need (negative when a lowered cap
-- takes back the tool's own unused share) and a sixteenth of what stays free, so that the tool's
-- next claims find room in their own row. When the free part is short, the unused parts of the
-- other tools' shares are taken back first. Returns the change of the tool's share and today's
-- total of grants, or a NULL change when even then the cap has no room. The caller holds the
-- tool's row lock and writes the tool's share itself.
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

-- Claims up to p_limit tasks of a tool, in claim order: reclaimed zombies first, then priority
-- (higher first), then FIFO. Each starts a run: an attempt in the ledger, a `started` event,
-- under the claim's one fresh lease token (the pair of task id and token fences each run). Spend is admitted task by task and the batch stops at the first task the
-- caps have no room for. A task estimated above the cap in force (the tool's own, or the global
-- one) cannot run whatever today's spend: the claim passes over it, so it holds back neither its
-- tool nor the tasks behind it, and it runs in its place once the cap is raised; a claim that
-- finds only such tasks answers 'capped'. The concurrency limits (max_in_flight of the tool and
-- of the tasks' resource keys) are kept the same way: a task whose key is busy stays queued, a
-- busy tool stops the batch. So are the rate limits of the tasks' keys (rate_limits): a task
-- whose key has no call, or not its rate_units, left in the window stays queued, and a claim
-- that claims nothing for that answers 'rate_limited' with when the first slot frees
-- (idle_until). A claim of a task estimated at 0 whose tool has spent today and used
-- up its share of the cap takes a new slice, as a paid claim does, so that the costs such runs
-- report fit in the tool's row instead of growing the grants, and locking settings, at every
-- close. No retry is charged here: a run is charged when it ends unsuccessfully (and only once
-- its worker confirmed the claim). With nothing claimed, one row says why.
-- One statement (steps A-E) first takes the case where nothing but the queue decides: the switch
-- on and the global cap above today's grants, the tool not paused, estimated at 0 and free of
-- limits, cooldowns and holds, with no spend today and no zero cap of its own, and every task
-- picked estimated at 0 with a resource key without a limit. Steps 1-8 would admit every task it
-- picks, reserve nothing and grant nothing, so the runs start there; else that statement changes
-- nothing and steps 1-8 decide.
CREATE FUNCTION generation.claim_tasks_v1(
    p_tool uuid, p_limit integer, p_lease_seconds integer, p_disabled boolean, p_cap bigint
) RETURNS TABLE (
    task generation.tasks, lease_seconds integer, idle_reason text, event jsonb,
    idle_until timestamptz
)
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
    units bigint[] := '{}';
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
    rated_keys text[];
    tool_rated boolean;
    rate_keys text[] := '{}';
    calls_left bigint[] := '{}';
    units_left bigint[] := '{}';
    rate_frees timestamptz[] := '{}';
    rate integer;
    rate_limited boolean := false;
    slot_frees timestamptz;
    head record;
    has_head boolean;
    gate record;
    token uuid := gen_random_uuid();
BEGIN
    -- 0. The local day cannot move under a claim: a time-zone change that moves it waits for
    --    claims in flight, and they for it (update_settings_v1).
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
      AND NOT EXISTS (SELECT 1 FROM generation.rate_limits AS r
                      WHERE r.resource_key = COALESCE(tl.resource_key, tl.name))
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
        -- C. All of them free (no estimate, no limit of any kind on their key), or none started
        --    here.
        free AS (
            SELECT * FROM chosen
            WHERE NOT EXISTS (
                SELECT 1 FROM chosen AS o
                WHERE o.estimate <> 0
                   OR EXISTS (SELECT 1 FROM generation.resource_limits AS l
                              WHERE l.resource_key = o.resource_key)
                   OR EXISTS (SELECT 1 FROM generation.rate_limits AS r
                              WHERE r.resource_key = o.resource_key))),
        -- D. Start the runs as step 8 does (found by `= ANY` of their ids, which bounds the
        --    scan whatever the statistics say).
        started AS (
            UPDATE generation.tasks AS t
            SET status = 'processing',
                started_at = COALESCE(t.started_at, now()),
                claim_expires_at = now() + make_interval(secs => gate.lease),
                lease_token = token,
                lease_confirmed = false,
                reclaimed = false,
                attempt_count = t.attempt_count + 1,
                last_event_seq = t.last_event_seq + 1
            WHERE t.id = ANY (ARRAY(SELECT free.id FROM free))
            RETURNING t AS task, t.id, t.attempt_count, t.lease_token, t.last_event_seq),
        -- The attempt carries the `started` event (generation.event_stream).
        attempt AS (
            INSERT INTO generation.attempts
                (task_id, attempt, lease_token, tool_id, resource_key, account_group, local_day,
                 estimate_nanos, started_seq)
            SELECT started.id, started.attempt_count, started.lease_token, p_tool,
                   free.resource_key, free.account_group, gate.today, 0, started.last_event_seq
            FROM started JOIN free ON free.id = started.id)
        SELECT started.task, gate.lease, NULL::text,
               generation.started_event_v1(started.id, started.last_event_seq,
                                           started.attempt_count),
               NULL::timestamptz
        FROM started JOIN free ON free.id = started.id
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
    -- Else (a gate, a limit or money, or nothing to claim): every rule, step by step.
    -- 1. Read the gates, unlocked: the tool, the switch and the cap in force, its cooldown/hold.
    SELECT * INTO tool FROM generation.tools WHERE id = p_tool;
    IF NOT FOUND THEN
        RETURN QUERY SELECT NULL::generation.tasks, NULL::integer, 'unknown_tool'::text, NULL::jsonb,
                            NULL::timestamptz;
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
    -- Keys at their rate limit, as the last claim that filled each window left it (read
    -- unlocked; the picked keys' windows are counted under lock in step 3).
    SELECT COALESCE(array_agg(r.resource_key), '{}') INTO rated_keys
    FROM generation.rate_limits AS r WHERE r.limited_until > now();
    tool_rated := default_key = ANY (rated_keys);

    IF blocked IS NULL AND NOT tool_cooling AND NOT tool_held AND NOT tool_busy
       AND NOT tool_rated THEN
        -- 2. Lock up to p_limit claimable tasks in claim order, skipping rows other claimers
        --    hold (tasks_claim_idx serves this as an index-ordered top-N), and tasks no day's
        --    room could take: estimated above the cap in force.
        FOR picked IN
            SELECT q.id, COALESCE(q.cost_estimate_nanos, tool.cost_estimate_nanos) AS estimate,
                   COALESCE(q.resource_key, default_key) AS resource_key,
                   COALESCE(q.account_group, default_group) AS account_group, q.rate_units
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
              AND (q.resource_key IS NULL OR NOT q.resource_key = ANY (rated_keys))
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
            units := units || picked.rate_units;
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
        --    The rate limits likewise, after the concurrency limits: lock the picked keys'
        --    rate_limits rows in key order, then read each window in a statement of its own, so
        --    that it sees the slices the claim that held the lock before wrote (NULL room: no
        --    limit of that kind).
        PERFORM 1 FROM generation.rate_limits AS r WHERE r.resource_key = ANY (keys)
        ORDER BY r.resource_key
        FOR NO KEY UPDATE;
        SELECT COALESCE(array_agg(r.resource_key), '{}'),
               COALESCE(array_agg(r.max_calls - w.calls), '{}'),
               COALESCE(array_agg(r.max_units - w.units), '{}'),
               COALESCE(array_agg(COALESCE(w.frees_at,
                   generation.rate_slice_end_v1(r.window_seconds)
                   + make_interval(secs => r.window_seconds))), '{}')
        INTO rate_keys, calls_left, units_left, rate_frees
        FROM generation.rate_limits AS r,
             generation.rate_window_v1(r.resource_key, r.max_calls, r.max_units,
                                       r.window_seconds) AS w
        WHERE r.resource_key = ANY (keys);
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
            -- A task whose key has no call or not its units left in the window stays queued
            -- and the next is tried, as a busy key's.
            rate := array_position(rate_keys, keys[i]);
            IF rate IS NOT NULL AND (calls_left[rate] < 1 OR units_left[rate] < units[i]) THEN
                rate_limited := true;
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
            IF rate IS NOT NULL THEN
                calls_left[rate] := calls_left[rate] - 1;
                units_left[rate] := units_left[rate] - units[i];
            END IF;
        END LOOP;
        --    A window left with no call or no unit: mark its key until its first slot frees,
        --    for the next claims' unlocked look (its row is locked already).
        IF cardinality(rate_keys) > 0 THEN
            UPDATE generation.rate_limits AS r
            SET limited_until = filled.frees_at
            FROM unnest(rate_keys, calls_left, units_left, rate_frees)
                 AS filled (resource_key, calls, units, frees_at)
            WHERE r.resource_key = filled.resource_key AND (filled.calls < 1 OR filled.units < 1)
              AND r.limited_until IS DISTINCT FROM filled.frees_at;
        END IF;
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
            blocked := CASE WHEN busy THEN 'busy' WHEN rate_limited THEN 'rate_limited'
                            ELSE 'capped' END;
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
                WHEN tool_rated OR head.resource_key = ANY (rated_keys) THEN 'rate_limited'
                WHEN EXISTS (SELECT 1 FROM generation.holds AS h
                             WHERE h.account_group = head.account_group AND h.held_until > now())
                    THEN 'held'
                WHEN EXISTS (SELECT 1 FROM generation.cooldowns AS c
                             WHERE c.resource_key = head.resource_key AND c.cooling_until > now())
                    THEN 'cooling'
                WHEN head.estimate > LEAST(g.cap, tool.daily_cap_nanos) THEN 'capped'
                ELSE 'waiting' END;
        END IF;
        -- Rate-limited: when the first of the keys that held tasks back frees a slot (for a
        -- task short of units, when the oldest admission of its key leaves the window).
        IF blocked = 'rate_limited' AND rate_limited THEN
            SELECT min(f) INTO slot_frees FROM unnest(rate_frees) AS f;
        ELSIF blocked = 'rate_limited' THEN
            SELECT min(r.limited_until) INTO slot_frees FROM generation.rate_limits AS r
            WHERE r.resource_key IN (default_key, head.resource_key);
        END IF;
        RETURN QUERY SELECT NULL::generation.tasks, NULL::integer, blocked, NULL::jsonb,
                            CASE WHEN blocked = 'rate_limited' THEN slot_frees END;
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

    -- 8. Start the runs: the claim's fresh, unconfirmed lease, an attempt each (which carries
    --    its `started` event), counted in the current slice of each rate-limited key.
    RETURN QUERY
    WITH started AS (
        UPDATE generation.tasks AS t
        SET status = 'processing',
            started_at = COALESCE(t.started_at, now()),
            claim_expires_at = now() + make_interval(secs => lease),
            lease_token = token,
            lease_confirmed = false,
            reclaimed = false,
            attempt_count = t.attempt_count + 1,
            last_event_seq = t.last_event_seq + 1
        WHERE t.id = ANY (admitted)
        RETURNING t.*),
    attempt AS (
        INSERT INTO generation.attempts
            (task_id, attempt, lease_token, tool_id, resource_key, account_group, local_day,
             estimate_nanos, started_seq)
        SELECT started.id, started.attempt_count, started.lease_token, started.tool_id,
               keys[array_position(ids, started.id)], groups[array_position(ids, started.id)],
               today, estimates[array_position(ids, started.id)], started.last_event_seq
        FROM started),
    admission AS (
        INSERT INTO generation.rate_slices AS s (resource_key, slice_end, calls, units)
        SELECT r.resource_key, generation.rate_slice_end_v1(r.window_seconds), count(*),
               sum(units[array_position(ids, started.id)])
        FROM started
        JOIN generation.rate_limits AS r ON r.resource_key = keys[array_position(ids, started.id)]
        GROUP BY r.resource_key, r.window_seconds
        ON CONFLICT (resource_key, slice_end) DO UPDATE
        SET calls = s.calls + EXCLUDED.calls, units = s.units + EXCLUDED.units)
    SELECT ROW(started.*)::generation.tasks, lease, NULL::text,
           generation.started_event_v1(started.id, started.last_event_seq, started.attempt_count),
           NULL::timestamptz
    FROM started
    ORDER BY array_position(admitted, started.id);
END
$$;

-- Extends the lease of a task the caller holds, and confirms the claim (its answer reached the
-- worker, so the run now counts). Touches no indexed column: the update stays HOT.
CREATE FUNCTION generation.heartbeat_task_v1(p_task uuid, p_token uuid, p_lease_seconds integer)
RETURNS TABLE (task_found boolean, claim_expires_at timestamptz, lease_seconds integer,
               cancel_requested boolean)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    t generation.tasks;
    lease integer;
BEGIN
    -- 1. Lock the task, then decide: only the holder of a lease still running may extend it.
    SELECT * INTO t FROM generation.tasks WHERE id = p_task FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, NULL::timestamptz, NULL::integer, NULL::boolean;
        RETURN;
    END IF;
    IF t.status <> 'processing' OR t.lease_token IS DISTINCT FROM p_token
       OR t.claim_expires_at <= now() THEN
        RETURN QUERY SELECT true, NULL::timestamptz, NULL::integer, NULL::boolean;
        RETURN;
    END IF;
    -- 2. Extend and confirm; a cancel asked for meanwhile is told to the worker.
    SELECT COALESCE(tl.lease_seconds, p_lease_seconds) INTO lease
    FROM generation.tools AS tl WHERE tl.id = t.tool_id;
    UPDATE generation.tasks AS q
    SET claim_expires_at = now() + make_interval(secs => lease), lease_confirmed = true
    WHERE q.id = p_task
    RETURNING q.* INTO t;
    RETURN QUERY SELECT true, t.claim_expires_at, lease, t.cancel_requested_at IS NOT NULL;
END
$$;

-- HeartbeatTasks, set-wise: the batch's tasks locked in id order (two batches over the same tasks
-- take turns, never wait in a cycle) and found by id whatever the statistics say, then every
-- lease its holder still holds extended and confirmed in one statement, as heartbeat_task_v1
-- does one. One row per item.
-- p_items: [{ordinal, task_id, lease_token}, ...].
CREATE FUNCTION generation.heartbeat_tasks_v1(p_items jsonb, p_lease_seconds integer)
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
        -- complete_tasks_v1, no status here, or the plan may read every processing task.
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

-- ConfirmClaim: the worker received a claim's answer, so the runs of the claim it still holds
-- count from now on (a lapse costs a retry). One row per claim, not a write per task: the tasks
-- are only locked, and the token recorded once. Sent again after a lost answer, it answers the
-- same. One row per task held, in request order; the others are lost to the worker.
CREATE FUNCTION generation.confirm_claim_v1(p_tool uuid, p_token uuid, p_tasks uuid[])
RETURNS TABLE (task_id uuid, cancel_requested boolean)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
BEGIN
    -- 1. Lock the claim's tasks in id order, FOR SHARE: the weakest lock every writer of a task
    --    row waits for (the service's hand-back of an undeliverable claim, the rescuer, a
    --    report), so each either finds this confirmation committed or has already taken the
    --    task from the claim, which then is not held below; two confirms do not wait on each
    --    other.
    --    Only the tool's own rows: a caller names the tool its token reaches.
    PERFORM 1 FROM generation.tasks AS t WHERE t.id = ANY (p_tasks) AND t.tool_id = p_tool
    ORDER BY t.id
    FOR SHARE;
    -- 2. Record the claim's confirmation once, when it still holds any of them.
    INSERT INTO generation.claim_confirmations (lease_token)
    SELECT p_token
    WHERE EXISTS (SELECT 1 FROM generation.tasks AS t
                  WHERE t.id = ANY (p_tasks) AND t.tool_id = p_tool AND t.lease_token = p_token
                    AND t.claim_expires_at > now())
    ON CONFLICT (lease_token) DO NOTHING;
    -- 3. Answer the tasks held, in request order, with whether a cancel was asked for.
    RETURN QUERY
    SELECT t.id, t.cancel_requested_at IS NOT NULL
    FROM unnest(p_tasks) WITH ORDINALITY AS r(id, n)
    JOIN generation.tasks AS t ON t.id = r.id
    WHERE t.id = ANY (p_tasks) AND t.tool_id = p_tool AND t.lease_token = p_token
      AND t.claim_expires_at > now()
    ORDER BY r.n;
END
$$;

-- Ends a held run with its output: `completed`, or `cancelled` when a cancel was asked for while
-- it ran (its cost is kept either way). The same lease completing again (a retry after a lost
-- answer, or a second call racing the first) changes nothing and gets the task as it is now
-- (settled, say, or queued again by a REQUEUE); any other caller whose lease is gone changes
-- nothing but its attempt's cost. The one completion rule: CompleteTasks ends through it every
-- item it does not end set-wise.
-- When no money moves (no cost reported, none reserved at the claim) and the lease holds, one
-- statement ends the run (steps A-C: the run's end, its attempt's close, the terminal event),
-- then the key's run of failures is reset in a statement of its own (D). Anything else (money,
-- a repeated report, a lost lease, an unknown task) changes nothing there, and steps 1-6 decide
-- with the task locked, reading the attempt and the key as they are once it is.
CREATE FUNCTION generation.complete_task_v1(
    p_task uuid, p_token uuid, p_output jsonb, p_usage jsonb, p_cost bigint, p_resource_key text
) RETURNS TABLE (task_found boolean, task generation.tasks, event jsonb)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    t generation.tasks;
    a generation.attempts;
BEGIN
    IF p_cost = 0 THEN
        RETURN QUERY
        -- A. Lock the task and decide (the lease held, nothing reserved) in its UPDATE, which
        --    re-checks the newest version of the row once it holds the lock.
        WITH ended AS (
            UPDATE generation.tasks AS q
            SET status = CASE WHEN q.cancel_requested_at IS NULL THEN 'completed'
                              ELSE 'cancelled' END::generation.task_status,
                output = CASE WHEN q.cancel_requested_at IS NULL THEN p_output END,
                reported_usage = p_usage,
                error = CASE WHEN q.cancel_requested_at IS NULL THEN NULL ELSE 'cancelled' END,
                completed_at = now(), claim_expires_at = NULL, lease_token = NULL,
                lease_confirmed = false, last_event_seq = q.last_event_seq + 1
            WHERE q.id = p_task AND q.status = 'processing' AND q.lease_token = p_token
              AND q.claim_expires_at > now()
              AND EXISTS (SELECT 1 FROM generation.attempts AS x
                          WHERE x.task_id = p_task AND x.lease_token = p_token
                            AND x.outcome = 'running' AND x.estimate_nanos = 0)
            RETURNING q AS task, q.status, q.last_event_seq),
        -- B. Close its attempt, as close_attempt_v1 closes one that moves no money: only while
        --    it runs. A's EXISTS read the attempt as this statement's snapshot saw it; this
        --    UPDATE re-checks the newest version, so a close that committed meanwhile (the same
        --    lease refused as lost once it lapsed, step 6) stands, as it does in steps 1-6.
        --    The closed attempt carries the terminal event (generation.event_stream).
        closed AS (
            UPDATE generation.attempts AS r
            SET outcome = ended.status::text::generation.attempt_outcome,
                resource_key = COALESCE(p_resource_key, r.resource_key),
                ended_at = now(), ended_seq = ended.last_event_seq
            FROM ended
            WHERE r.task_id = p_task AND r.lease_token = p_token AND r.outcome = 'running'
            RETURNING r.task_id),
        -- C. The terminal event, last in the stream: stored only when B closed nothing.
        event AS (
            INSERT INTO generation.task_events (task_id, sequence, kind, data)
            SELECT p_task, ended.last_event_seq,
                   ended.status::text::generation.task_event_kind, '{}'
            FROM ended
            WHERE NOT EXISTS (SELECT 1 FROM closed)
            RETURNING *)
        SELECT true, ended.task,
               COALESCE((SELECT to_jsonb(event) FROM event),
                        generation.ended_event_v1(p_task, ended.last_event_seq,
                                                  ended.status::text::generation.task_event_kind))
        FROM ended;
        IF FOUND THEN
            -- D. A completed run ends its key's run of failures: a statement of its own, whose
            --    snapshot is taken now, so that it sees a failure of the key that committed
            --    while A waited for the task (in A the key's row was read as it was before).
            UPDATE generation.cooldowns AS c SET consecutive_failures = 0
            FROM generation.attempts AS x
            WHERE x.task_id = p_task AND x.lease_token = p_token AND x.outcome = 'completed'
              AND c.resource_key = x.resource_key AND c.consecutive_failures > 0;
            RETURN;
        END IF;
    END IF;
    -- Else (money, or the lease not held now): the task locked first, then the rule decides.
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
        PERFORM generation.close_attempt_v1(
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
    PERFORM generation.close_attempt_v1(p_task, p_token, 'lease_lost', p_cost, false, NULL);
    RETURN QUERY SELECT true, NULL::generation.tasks, NULL::jsonb;
END
$$;

-- The reaper's forced fail: a task that is stale right now (stale_reason_v1, judged under the
-- row lock with the stored thresholds) ends `failed` (a dead zombie: as its lapse decides); any
-- other is refused, so a forced fail can never kill a live or deliberately waiting task.
CREATE FUNCTION generation.reap_task_v1(p_task uuid, p_error text)
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
    reason := generation.stale_reason_v1(t);
    IF reason IS NULL THEN
        RETURN QUERY SELECT true, NULL::generation.tasks, NULL::jsonb;
        RETURN;
    END IF;
    -- 2. A dead zombie's run is ended as the rescuer would have (it is not running): handed back
    --    when unconfirmed or with retries left, failed only when that was its last run.
    IF t.status = 'processing' THEN
        RETURN QUERY SELECT true, e.task, e.event FROM generation.end_lapsed_run_v1(t) AS e;
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
        PERFORM generation.close_attempt_v1(p_task, prior, 'abandoned', 0, false, NULL);
    END IF;
    -- 4. The terminal event.
    RETURN QUERY SELECT true, t, generation.append_event_v1(
        p_task, 'failed',
        jsonb_build_object('error', t.error, 'retry_count', t.retry_count, 'stale_reason', reason));
END
$$;

-- Ends a held run that did not complete (p_failure: retryable, permanent, account, cancelled).
-- Retryable: one retry used; requeued with full-jitter backoff while retries remain, else failed.
-- Account: requeued without using a retry (the group is held). Cancelled, or any failure of a run
-- whose cancel was asked for: cancelled. Permanent: failed. Without a lease token it is the
-- reaper's forced fail (reap_task_v1). A retry by the same lease gets the task as it is now.
CREATE FUNCTION generation.fail_task_v1(
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
        RETURN QUERY SELECT r.task_found, true, r.task, r.event FROM generation.reap_task_v1(p_task, p_error) AS r;
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
        PERFORM generation.close_attempt_v1(
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
    PERFORM generation.close_attempt_v1(p_task, p_token, 'lease_lost', p_cost, false, NULL);
    RETURN QUERY SELECT true, false, NULL::generation.tasks, NULL::jsonb;
END
$$;

-- Locks what a batch of reports (CompleteTasks, FailTasks) may change, each kind in key order and
-- in the lock order: the tasks, their attempts under the reported leases, the tools money moves
-- on (a reservation to release or a cost to add), settings when a cost may grow the grants, then
-- the existing cooldown and hold rows of the runs' keys and groups. The items' transitions then
-- find those rows held, so two batches over the same tools or keys, or a batch and the rescuer,
-- do not wait on each other in a cycle; failures claim the cooldown and hold rows they may
-- create before any such row is locked. The rows are found through index conditions on the
-- batch's own task ids (`= ANY`: the tasks by id, their attempts by the primary key's task id),
-- which bound the scans whatever the statistics say, and what the later locks need is read from the attempts once.
-- p_items: [{task_id, lease_token, failure, cost_nanos, resource_key}, ...].
CREATE FUNCTION generation.lock_reported_v1(p_items jsonb) RETURNS void
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
DECLARE
    ids uuid[] := ARRAY(SELECT (x ->> 'task_id')::uuid FROM jsonb_array_elements(p_items) AS x);
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
          WHERE a.task_id = ANY (ids)
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

-- CompleteTasks, set-wise: the batch's rows locked (lock_reported_v1), then every run a reported
-- lease still holds ends at once, each as complete_task_v1 ends one (the task `completed`, or
-- `cancelled` when a cancel was asked for; its attempt closed with its cost; the money moved on
-- its tool; its key's run of failures reset; the terminal event), one statement for them all,
-- its rows found by key whatever the statistics say (the tasks by id, their attempts by lease
-- token). A tool's counters move once for the batch: its share grows by what the batch's spend
-- exceeds it, where runs closed one by one might have grown it in steps. The other items (a
-- repeated report, a lost lease, a task reported twice) then go through complete_task_v1 one by
-- one, in task-id order. One row per item.
-- p_items: [{ordinal, task_id, lease_token, output, reported_usage, cost_nanos, resource_key}, ...].
CREATE FUNCTION generation.complete_tasks_v1(p_items jsonb)
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
    PERFORM generation.lock_reported_v1(p_items);
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
        -- Each run's attempt, found by its lease token, with what its close needs, read once
        -- behind the fence (the close below joins these rows only, by primary key).
        run AS MATERIALIZED (
            SELECT a.task_id, a.attempt, a.outcome, (done.task).status, done.resource_key,
                   done.cost, (done.task).last_event_seq AS seq
            FROM done JOIN generation.attempts AS a
              ON a.lease_token = done.lease_token AND a.task_id = done.id),
        -- Each run's attempt closes with its cost (close_attempt_v1's step 3).
        closed AS (
            UPDATE generation.attempts AS a
            SET outcome = run.status::text::generation.attempt_outcome,
                resource_key = COALESCE(run.resource_key, a.resource_key),
                cost_nanos = a.cost_nanos + run.cost,
                ended_at = COALESCE(a.ended_at, now()), ended_seq = run.seq
            FROM run
            WHERE a.task_id = run.task_id AND a.attempt = run.attempt AND run.outcome = 'running'
            RETURNING a.task_id, a.tool_id, a.local_day, a.estimate_nanos, a.outcome,
                      a.resource_key, run.cost, a.ended_seq),
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
        -- The terminal event, last in each stream: carried by the attempt closed above
        -- (generation.event_stream), stored only for a run whose attempt was closed already.
        appended AS (
            INSERT INTO generation.task_events (task_id, sequence, kind, data)
            SELECT done.id, (done.task).last_event_seq,
                   (done.task).status::text::generation.task_event_kind, '{}'
            FROM done
            WHERE done.id NOT IN (SELECT closed.task_id FROM closed)
            RETURNING *),
        -- Each run's event by its task, in one value read once: a join of the CTEs, which the
        -- planner takes for one row each, would compare every pair.
        events AS MATERIALIZED (
            SELECT jsonb_object_agg(x.task_id, x.event) AS by_task
            FROM (SELECT appended.task_id, to_jsonb(appended) AS event FROM appended
                  UNION ALL
                  SELECT closed.task_id,
                         generation.ended_event_v1(
                             closed.task_id, closed.ended_seq,
                             closed.outcome::text::generation.task_event_kind)
                  FROM closed) AS x)
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
         LATERAL generation.complete_task_v1(i.task_id, i.lease_token, i.output,
                                             i.reported_usage, i.cost_nanos, i.resource_key) AS c;
END
$$;

-- FailTasks: the batch's rows locked (lock_reported_v1), then each item as FailTask with its lease,
-- in task-id order; one row per item, with its ordinal.
CREATE FUNCTION generation.fail_tasks_v1(p_items jsonb)
RETURNS TABLE (ordinal integer, requested_id uuid, task_found boolean, forced boolean,
               task generation.tasks, event jsonb)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
BEGIN
    PERFORM generation.lock_reported_v1(p_items);
    RETURN QUERY
    SELECT i.ordinal, i.task_id, c.task_found, c.forced, c.task, c.event
    FROM (SELECT * FROM jsonb_to_recordset(p_items) AS x(
              ordinal integer, task_id uuid, lease_token uuid, failure text, error text,
              cost_nanos bigint, resource_key text)
          ORDER BY x.task_id, x.ordinal) AS i,
         LATERAL generation.fail_task_v1(i.task_id, i.lease_token, i.failure, i.error,
                                         i.cost_nanos, i.resource_key) AS c;
END
$$;

-- Hands a held task back without using a retry: a worker that stops on purpose (SIGTERM drain)
-- releases what it could not finish. A run whose cancel was asked for ends cancelled instead.
-- p_unconfirmed: the service itself hands back a claim whose answer it could not deliver.
CREATE FUNCTION generation.release_task_v1(
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
            IF generation.claim_confirmed_v1(t) THEN  -- the worker has it: leave it alone
                RETURN QUERY SELECT true, t, NULL::jsonb;
                RETURN;
            END IF;
            RETURN QUERY SELECT true, h.task, h.event
                FROM generation.hand_back_unconfirmed_v1(t, false) AS h;
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
        PERFORM generation.close_attempt_v1(p_task, p_token, ending::generation.attempt_outcome, p_cost, false, NULL);
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
    PERFORM generation.close_attempt_v1(p_task, p_token, 'lease_lost', p_cost, false, NULL);
    RETURN QUERY SELECT true, NULL::generation.tasks, NULL::jsonb;
END
$$;

-- Cancels a task that has not finished. A queued one ends `cancelled` at once. A running one is
-- asked to stop: cancel_requested_at is set and a `cancel_requested` event added; the worker
-- learns it on its next heartbeat, and the run ends `cancelled` when it reports (its cost kept)
-- or its lease lapses. Cancelling again, or a cancelled task, answers the task as it is.
CREATE FUNCTION generation.cancel_task_v1(p_task uuid)
RETURNS TABLE (task_found boolean, task generation.tasks, event jsonb)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    t generation.tasks;
BEGIN
    -- 1. Lock the task, then decide.
    SELECT * INTO t FROM generation.tasks WHERE id = p_task FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, NULL::generation.tasks, NULL::jsonb;
        RETURN;
    END IF;
    IF t.status IN ('queued', 'dispatched') THEN
        -- 2a. Never ran, or waits to run again: cancelled now.
        UPDATE generation.tasks AS q
        SET status = 'cancelled', error = 'cancelled', completed_at = now(),
            last_event_seq = q.last_event_seq + 1
        WHERE q.id = p_task
        RETURNING q.* INTO t;
        RETURN QUERY SELECT true, t, generation.append_event_v1(p_task, 'cancelled', NULL);
    ELSIF t.status = 'processing' AND t.cancel_requested_at IS NULL THEN
        -- 2b. Running: ask its worker to stop.
        UPDATE generation.tasks AS q
        SET cancel_requested_at = now(), last_event_seq = q.last_event_seq + 1
        WHERE q.id = p_task
        RETURNING q.* INTO t;
        RETURN QUERY SELECT true, t, generation.append_event_v1(p_task, 'cancel_requested', NULL);
    ELSIF t.status IN ('processing', 'cancelled') THEN
        RETURN QUERY SELECT true, t, NULL::jsonb;
    ELSE
        RETURN QUERY SELECT true, NULL::generation.tasks, NULL::jsonb;
    END IF;
END
$$;

-- Cancels, oldest first, up to p_limit queued tasks of a tool (and asks running ones to stop,
-- with p_include_processing), optionally only those whose idempotency key starts with p_prefix.
-- Each is cancel_task_v1's transition; rows other callers hold are skipped.
CREATE FUNCTION generation.cancel_tasks_v1(
    p_tool uuid, p_include_processing boolean, p_prefix text, p_limit integer
) RETURNS TABLE (task generation.tasks, event jsonb)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    ids uuid[];
BEGIN
    -- 1. Lock the tasks, oldest first.
    SELECT array_agg(c.id ORDER BY c.created_at) INTO ids FROM (
        SELECT q.id, q.created_at FROM generation.tasks AS q
        WHERE q.tool_id = p_tool
          AND (q.status = 'queued'
               OR (p_include_processing AND q.status = 'processing' AND q.cancel_requested_at IS NULL))
          AND (p_prefix IS NULL OR starts_with(q.idempotency_key, p_prefix))
        ORDER BY q.created_at
        LIMIT p_limit
        FOR NO KEY UPDATE OF q SKIP LOCKED) AS c;
    -- 2. Cancel each.
    RETURN QUERY
    SELECT c.task, c.event FROM unnest(COALESCE(ids, '{}')) AS id,
         LATERAL generation.cancel_task_v1(id) AS c;
END
$$;

-- Queues a failed, cancelled or expired task again with fresh retries. If its reservation was
-- already settled, the task starts a new settlement round with the reservation given here; if
-- not, the old reservation is kept and settles once, when the task ends again. Idempotent under
-- a key: the retry writes `retry_key` into the `requeued` event it appends, and a call whose key
-- is already in the task's stream answers the task as it is now and changes nothing. So a
-- RetryTask sent again after its answer was lost neither queues a task that has run since nor
-- starts another settlement round.
CREATE FUNCTION generation.retry_task_v1(p_task uuid, p_reserved bigint, p_key text)
RETURNS TABLE (task_found boolean, retried_now boolean, task generation.tasks, event jsonb)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    t generation.tasks;
BEGIN
    -- 1. Lock the task, then decide.
    SELECT * INTO t FROM generation.tasks WHERE id = p_task FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, false, NULL::generation.tasks, NULL::jsonb;
        RETURN;
    END IF;
    -- 2. This key retried it already: the task as it is now (its events are its own, under its
    --    lock).
    IF p_key IS NOT NULL AND EXISTS (
        SELECT 1 FROM generation.task_events AS e
        WHERE e.task_id = p_task AND e.kind = 'requeued' AND e.data ->> 'retry_key' = p_key) THEN
        RETURN QUERY SELECT true, false, t, NULL::jsonb;
        RETURN;
    END IF;
    IF t.status NOT IN ('failed', 'cancelled', 'expired') THEN
        RETURN QUERY SELECT true, false, NULL::generation.tasks, NULL::jsonb;
        RETURN;
    END IF;
    -- 3. Queue it again.
    UPDATE generation.tasks AS q
    SET status = 'queued', retry_count = 0, unconfirmed_claims = 0, reclaimed = false,
        error = NULL, completed_at = NULL, cancel_requested_at = NULL,
        run_at = now(), queued_at = now(), settled_at = NULL,
        settlement_round = q.settlement_round + (q.settled_at IS NOT NULL)::int,
        reserved_token_amount = CASE WHEN q.settled_at IS NOT NULL THEN p_reserved
                                     ELSE q.reserved_token_amount END,
        expires_at = CASE WHEN q.expires_at IS NULL THEN NULL ELSE now() + (q.expires_at - q.run_at) END,
        last_event_seq = q.last_event_seq + 1
    WHERE q.id = p_task
    RETURNING q.* INTO t;
    -- 4. The event, with the key: followers of the old run learn it runs again.
    RETURN QUERY SELECT true, true, t, generation.append_event_v1(
        p_task, 'requeued',
        jsonb_build_object('retried', true, 'retry_count', 0)
        || CASE WHEN p_key IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('retry_key', p_key) END);
END
$$;

-- Hands lapsed leases back, up to p_batch at a time, each decided by end_lapsed_run_v1.
CREATE FUNCTION generation.rescue_lapsed_v1(p_batch integer)
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
        RETURN QUERY SELECT * FROM generation.end_lapsed_run_v1(t);
    END LOOP;
END
$$;

-- Ends queued tasks past their expiry `expired`, up to p_batch at a time; suspended while the
-- kill switch is off (stored, or any replica's environment), so a stop keeps its backlog.
CREATE FUNCTION generation.expire_tasks_v1(p_batch integer, p_disabled boolean)
RETURNS TABLE (task generation.tasks, event jsonb)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    ids uuid[];
    t generation.tasks;
BEGIN
    IF NOT (SELECT g.running FROM generation.gates_v1(p_disabled, NULL) AS g) THEN
        RETURN;
    END IF;
    -- 1. Lock the expired tasks.
    SELECT array_agg(c.id) INTO ids FROM (
        SELECT q.id FROM generation.tasks AS q
        WHERE q.status = 'queued' AND q.expires_at < now()
        ORDER BY q.expires_at
        LIMIT p_batch
        FOR NO KEY UPDATE OF q SKIP LOCKED) AS c;
    -- 2. End them, each with its terminal event.
    FOR i IN 1 .. COALESCE(array_length(ids, 1), 0) LOOP
        UPDATE generation.tasks AS q
        SET status = 'expired', completed_at = now(), last_event_seq = q.last_event_seq + 1
        WHERE q.id = ids[i]
        RETURNING q.* INTO t;
        RETURN QUERY SELECT t, generation.append_event_v1(t.id, 'expired', NULL);
    END LOOP;
END
$$;

-- Settles a terminal task's reservation exactly once per settlement round: completed charges the
-- reported usage (at most the reservation) and refunds the rest; any other end refunds it all.
-- The task is locked first, so a RetryTask or a REQUEUE either comes before (the task is not
-- terminal: nothing settles) or after (it sees the settlement and opens a new round).
CREATE FUNCTION generation.settle_task_v1(p_task uuid)
RETURNS TABLE (task_found boolean, settled_now boolean, settlement generation.settlements)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    t generation.tasks;
    st generation.settlements;
    charged bigint;
BEGIN
    -- 1. Lock the task, then decide.
    SELECT * INTO t FROM generation.tasks WHERE id = p_task FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, false, NULL::generation.settlements;
        RETURN;
    END IF;
    IF t.status NOT IN ('completed', 'failed', 'cancelled', 'expired') THEN
        RETURN QUERY SELECT true, false, NULL::generation.settlements;
        RETURN;
    END IF;
    -- 2. The round's one settlement; a second call finds it.
    charged := CASE WHEN t.status = 'completed'
                    THEN LEAST(t.reserved_token_amount,
                               COALESCE((t.reported_usage ->> 'token_amount')::bigint, 0))
                    ELSE 0 END;
    INSERT INTO generation.settlements
        (task_id, settlement_round, task_status, reserved_token_amount, charged_token_amount,
         refunded_token_amount)
    VALUES (t.id, t.settlement_round, t.status, t.reserved_token_amount, charged,
            t.reserved_token_amount - charged)
    ON CONFLICT (task_id, settlement_round) DO NOTHING
    RETURNING * INTO st;
    IF FOUND THEN
        UPDATE generation.tasks SET settled_at = st.settled_at WHERE id = p_task;
        RETURN QUERY SELECT true, true, st;
        RETURN;
    END IF;
    SELECT * INTO st FROM generation.settlements AS x
    WHERE x.task_id = p_task AND x.settlement_round = t.settlement_round;
    RETURN QUERY SELECT true, false, st;
END
$$;

-- Appends a progress, streaming-URL or partial-output event to a task the caller holds (which
-- also confirms its claim). The task's row lock orders it before the terminal event.
CREATE FUNCTION generation.publish_task_event_v1(
    p_task uuid, p_token uuid, p_kind generation.task_event_kind, p_data jsonb
) RETURNS TABLE (task_found boolean, event jsonb)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    t generation.tasks;
BEGIN
    -- 1. Lock the task, then decide.
    SELECT * INTO t FROM generation.tasks WHERE id = p_task FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, NULL::jsonb;
        RETURN;
    END IF;
    IF t.status <> 'processing' OR t.lease_token IS DISTINCT FROM p_token
       OR t.claim_expires_at <= now() THEN
        RETURN QUERY SELECT true, NULL::jsonb;
        RETURN;
    END IF;
    -- 2. Take the next sequence (HOT: no indexed column) and append.
    UPDATE generation.tasks AS q
    SET last_event_seq = q.last_event_seq + 1, lease_confirmed = true
    WHERE q.id = p_task;
    RETURN QUERY SELECT true, generation.append_event_v1(p_task, p_kind, p_data);
END
$$;

-- Changes the global settings; NULL leaves a setting as it is. Spend never drops by a change:
-- when a new time zone puts "today" on another date, today's attempts move to the new date and
-- its counters and shares are counted anew from the ledger. A change of the switch or the cap
-- restarts the watchdog's clock of every waiting task (a deliberate wait just ended).
CREATE FUNCTION generation.update_settings_v1(
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

-- Every transition runs with its statements planned once per connection (a custom plan for each
-- call cost the claim half its time) and by key only: a generic plan lives as long as its
-- connection, and one made while a table was small (the ledger right after a deploy) would
-- otherwise scan the whole table on every call until the next ANALYZE. None is JIT-compiled:
-- disabled scans are priced at 10^10, which a session with JIT on would compile for. A PL/pgSQL
-- function added later carries the three settings (tests/test_schema.py checks it).
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure FROM pg_proc AS p JOIN pg_language AS l ON l.oid = p.prolang
        WHERE p.pronamespace = 'generation'::regnamespace AND l.lanname = 'plpgsql'
    LOOP
        EXECUTE format(
            'ALTER FUNCTION %s SET plan_cache_mode = force_generic_plan SET enable_seqscan = off SET jit = off', f);
    END LOOP;
END
$$;
