-- The DDL beside task.proto: what `alembic upgrade head` builds (tests/test_schema.py proves it).
-- Alembic owns the schema; change it with a new revision, then update this file to match.

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
    -- Spend counters, kept in step with the attempts ledger by the statements that move money.
    spent_day date,
    spent_nanos bigint NOT NULL DEFAULT 0,
    reserved_nanos bigint NOT NULL DEFAULT 0,
    CONSTRAINT tools_name_key UNIQUE (name),
    CONSTRAINT tools_name_length CHECK (char_length(name) BETWEEN 1 AND 200),
    CONSTRAINT tools_max_attempts_range CHECK (max_attempts BETWEEN 0 AND 100),
    CONSTRAINT tools_backoff_range
        CHECK (backoff_base_seconds >= 0 AND backoff_max_seconds >= backoff_base_seconds),
    CONSTRAINT tools_lease_positive CHECK (lease_seconds > 0),
    CONSTRAINT tools_money_nonnegative
        CHECK (cost_estimate_nanos >= 0 AND daily_cap_nanos >= 0
               AND spent_nanos >= 0 AND reserved_nanos >= 0)
);

CREATE TABLE generation.tasks (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tool_id uuid NOT NULL REFERENCES generation.tools (id),
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
    -- The lease: who holds the task (lease_token fences every write) and until when.
    lease_token uuid,
    claim_expires_at timestamptz,
    -- Set by the lease rescuer when a lease lapses; the next claim of the row costs one retry.
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
    CONSTRAINT tasks_priority_range CHECK (priority BETWEEN -100 AND 100),
    CONSTRAINT tasks_max_retries_range CHECK (max_retries BETWEEN 0 AND 100),
    CONSTRAINT tasks_retry_count_nonnegative CHECK (retry_count >= 0),
    CONSTRAINT tasks_reserved_nonnegative CHECK (reserved_token_amount >= 0),
    CONSTRAINT tasks_lease_held_while_processing
        CHECK ((status = 'processing') = (lease_token IS NOT NULL AND claim_expires_at IS NOT NULL)),
    CONSTRAINT tasks_cost_estimate_nonnegative CHECK (cost_estimate_nanos >= 0)
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

-- Tasks in flight, for the lease rescuer and the watchdog. claim_expires_at is deliberately not
-- indexed: heartbeats write only that column and so stay HOT.
CREATE INDEX tasks_in_flight_idx ON generation.tasks (tool_id) WHERE status = 'processing';

-- Queued rows the watchdog may have to fail (never claimed for long, or retries used up).
CREATE INDEX tasks_waiting_idx ON generation.tasks (created_at) WHERE status IN ('queued', 'dispatched');

-- Terminal tasks whose reservation still waits for its settlement (the reconciler's sweep).
CREATE INDEX tasks_unsettled_idx ON generation.tasks (completed_at)
    WHERE status IN ('completed', 'failed', 'cancelled', 'expired')
      AND reserved_token_amount > 0 AND settled_at IS NULL;

-- Why a live task can never finish on its own, or NULL. One definition for ListStaleTasks and
-- for the reaper's forced FailTask, which re-judges the row in its own UPDATE.
CREATE FUNCTION generation.stale_reason(
    t generation.tasks, processing_grace interval, queued_max_age interval
) RETURNS text
LANGUAGE sql STABLE
AS $$
    SELECT CASE
        WHEN t.status = 'processing' AND t.retry_count >= t.max_retries
             AND t.claim_expires_at < now() - processing_grace THEN 'dead_zombie'
        WHEN t.status IN ('queued', 'dispatched') AND t.retry_count >= t.max_retries
             THEN 'unclaimable'
        WHEN t.status IN ('queued', 'dispatched') AND t.started_at IS NULL
             AND t.created_at < now() - queued_max_age THEN 'abandoned'
    END
$$;

-- A task's event stream: progress, streaming URL and partial output from the worker, then the
-- terminal event the service adds in CompleteTask or FailTask.
CREATE TYPE generation.task_event_kind AS ENUM (
    'progress', 'streaming_url', 'partial_output', 'requeued', 'completed', 'failed',
    'cancelled', 'expired'
);

CREATE TABLE generation.task_events (
    task_id uuid NOT NULL REFERENCES generation.tasks (id) ON DELETE CASCADE,
    sequence bigint GENERATED ALWAYS AS IDENTITY,
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

-- Spend control: one row of global settings and today's spend counters.
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
    spent_day date,
    spent_nanos bigint NOT NULL DEFAULT 0,
    reserved_nanos bigint NOT NULL DEFAULT 0,
    CONSTRAINT settings_singleton CHECK (id),
    CONSTRAINT settings_cap_nonnegative CHECK (daily_cap_nanos >= 0),
    CONSTRAINT settings_counters_nonnegative CHECK (spent_nanos >= 0 AND reserved_nanos >= 0),
    CONSTRAINT settings_cooldown_threshold_positive CHECK (cooldown_threshold >= 1),
    CONSTRAINT settings_durations_nonnegative
        CHECK (cooldown_seconds >= 0 AND account_hold_seconds >= 0 AND retention_days >= 0)
);
INSERT INTO generation.settings DEFAULT VALUES;

-- Consecutive retryable failures per resource key (a model, say), and how long it cools.
CREATE TABLE generation.cooldowns (
    resource_key text PRIMARY KEY,
    consecutive_failures integer NOT NULL DEFAULT 0,
    cooling_until timestamptz
);

-- Account holds per group, after an account error (out of credit, say).
CREATE TABLE generation.holds (
    account_group text PRIMARY KEY,
    held_until timestamptz NOT NULL,
    reason text
);

CREATE TYPE generation.attempt_outcome AS ENUM (
    'running', 'completed', 'retry', 'failed', 'abandoned', 'lease_lost', 'cancelled',
    'released', 'account_error'
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
    PRIMARY KEY (task_id, attempt),
    CONSTRAINT attempts_lease_token_key UNIQUE (lease_token),
    CONSTRAINT attempts_money_nonnegative CHECK (estimate_nanos >= 0 AND cost_nanos >= 0)
);
CREATE INDEX attempts_local_day_idx ON generation.attempts (local_day);
-- When each tool last claimed (a worker is alive), and the last hour's throughput.
CREATE INDEX attempts_tool_started_idx ON generation.attempts (tool_id, started_at);
CREATE INDEX attempts_ended_idx ON generation.attempts (ended_at);

-- Whether a cost fits under a cap, given the spend counters: spend counts on `today` only, an
-- estimate must fit (<= cap), and a task estimated at 0 needs the total strictly below the cap.
-- A NULL cap never binds (a tool without a cap of its own).
CREATE FUNCTION generation.within_cap(
    spent bigint, spent_day date, today date, reserved bigint, estimate bigint, cap bigint
) RETURNS boolean
LANGUAGE sql IMMUTABLE
AS $$
    SELECT cap IS NULL OR CASE
        WHEN estimate > 0
            THEN (CASE WHEN spent_day = today THEN spent ELSE 0 END) + reserved + estimate <= cap
        ELSE (CASE WHEN spent_day = today THEN spent ELSE 0 END) + reserved < cap
    END
$$;

-- Closes the attempt run under a lease and moves its money: the reservation is released (once),
-- the cost is added to the spend of the day the attempt started (also for a late report under a
-- lost lease: billed is billed), and the resource key's cooldown and the account group's hold
-- are kept. A second close of the same attempt changes nothing, so a retried call cannot count
-- twice. Lock order, everywhere: the task (held by the caller), settings, the attempt, the tool.
-- Settings come before the attempt so that a sweep closing many attempts (holding settings) and
-- a late report of one of them (wanting settings) cannot deadlock.
CREATE FUNCTION generation.close_attempt(
    task uuid, token uuid, closing generation.attempt_outcome, cost bigint, retryable boolean
) RETURNS generation.attempts
LANGUAGE plpgsql
AS $$
DECLARE
    a generation.attempts;
    s generation.settings;
    released bigint;
    today date;
BEGIN
    SELECT * INTO a FROM generation.attempts WHERE task_id = task AND lease_token = token;
    IF NOT FOUND OR a.outcome NOT IN ('running', 'abandoned') THEN
        RETURN a;
    END IF;
    IF a.estimate_nanos > 0 OR cost > 0 THEN
        SELECT * INTO s FROM generation.settings FOR UPDATE;
    ELSE
        SELECT * INTO s FROM generation.settings;
    END IF;
    SELECT * INTO a FROM generation.attempts
    WHERE task_id = task AND lease_token = token FOR UPDATE;
    IF a.outcome NOT IN ('running', 'abandoned') THEN
        RETURN a;
    END IF;
    released := CASE WHEN a.outcome = 'running' THEN a.estimate_nanos ELSE 0 END;
    UPDATE generation.attempts
    SET outcome = CASE WHEN a.outcome = 'abandoned' THEN 'lease_lost' ELSE closing END,
        cost_nanos = cost_nanos + cost,
        ended_at = COALESCE(ended_at, now())
    WHERE task_id = task AND lease_token = token
    RETURNING * INTO a;

    today := (now() AT TIME ZONE s.timezone)::date;
    IF released > 0 OR cost > 0 THEN
        UPDATE generation.settings
        SET spent_nanos = CASE WHEN spent_day = today THEN spent_nanos ELSE 0 END
                          + CASE WHEN a.local_day = today THEN cost ELSE 0 END,
            spent_day = today,
            reserved_nanos = reserved_nanos - released;
        UPDATE generation.tools
        SET spent_nanos = CASE WHEN spent_day = today THEN spent_nanos ELSE 0 END
                          + CASE WHEN a.local_day = today THEN cost ELSE 0 END,
            spent_day = today,
            reserved_nanos = reserved_nanos - released
        WHERE id = a.tool_id;
    END IF;

    IF a.outcome = 'completed' THEN
        UPDATE generation.cooldowns SET consecutive_failures = 0
        WHERE resource_key = a.resource_key AND consecutive_failures > 0;
    ELSIF retryable THEN
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
