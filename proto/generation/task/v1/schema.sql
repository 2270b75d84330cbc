-- The DDL beside task.proto: what `alembic upgrade head` builds (tests/test_schema.py proves it).
-- Alembic owns the schema; change it with a new revision, then update this file to match.

CREATE SCHEMA generation;

-- Declaration order matters: the claim never sorts by status, but people read this order.
CREATE TYPE generation.task_status AS ENUM ('queued', 'dispatched', 'processing', 'completed', 'failed');

CREATE TABLE generation.tools (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT tools_name_key UNIQUE (name),
    CONSTRAINT tools_name_length CHECK (char_length(name) BETWEEN 1 AND 200)
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
    CONSTRAINT tasks_priority_range CHECK (priority BETWEEN -100 AND 100),
    CONSTRAINT tasks_max_retries_range CHECK (max_retries BETWEEN 0 AND 100),
    CONSTRAINT tasks_retry_count_nonnegative CHECK (retry_count >= 0),
    CONSTRAINT tasks_reserved_nonnegative CHECK (reserved_token_amount >= 0),
    CONSTRAINT tasks_lease_held_while_processing
        CHECK ((status = 'processing') = (lease_token IS NOT NULL AND claim_expires_at IS NOT NULL))
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
CREATE INDEX tasks_claim_idx ON generation.tasks (tool_id, reclaimed DESC, priority DESC, created_at)
    WHERE status = 'queued' AND retry_count < max_retries;

-- Tasks in flight, for the lease rescuer and the watchdog. claim_expires_at is deliberately not
-- indexed: heartbeats write only that column and so stay HOT.
CREATE INDEX tasks_in_flight_idx ON generation.tasks (tool_id) WHERE status = 'processing';

-- Queued rows the watchdog may have to fail (never claimed for long, or retries used up).
CREATE INDEX tasks_waiting_idx ON generation.tasks (created_at) WHERE status IN ('queued', 'dispatched');

-- Terminal tasks whose reservation still waits for its settlement (the reconciler's sweep).
CREATE INDEX tasks_unsettled_idx ON generation.tasks (completed_at)
    WHERE status IN ('completed', 'failed') AND reserved_token_amount > 0 AND settled_at IS NULL;

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
    'progress', 'streaming_url', 'partial_output', 'requeued', 'completed', 'failed'
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
    task_id uuid PRIMARY KEY,
    task_status generation.task_status NOT NULL,
    reserved_token_amount bigint NOT NULL,
    charged_token_amount bigint NOT NULL,
    refunded_token_amount bigint NOT NULL,
    settled_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT settlements_terminal CHECK (task_status IN ('completed', 'failed')),
    CONSTRAINT settlements_amounts CHECK (
        charged_token_amount >= 0 AND refunded_token_amount >= 0
        AND charged_token_amount + refunded_token_amount = reserved_token_amount
    )
);
