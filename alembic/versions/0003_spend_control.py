"""Spend control: global settings and spend counters, tool settings, not-before and expiry,
idempotent enqueue, cooldowns per resource key, holds per account group, the attempts ledger.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

UPGRADE = r"""
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

ALTER TABLE generation.tools
    ADD COLUMN max_attempts integer NOT NULL DEFAULT 3,
    ADD COLUMN backoff_base_seconds integer NOT NULL DEFAULT 30,
    ADD COLUMN backoff_max_seconds integer NOT NULL DEFAULT 3600,
    ADD COLUMN lease_seconds integer,
    ADD COLUMN resource_key text,
    ADD COLUMN account_group text,
    ADD COLUMN cost_estimate_nanos bigint NOT NULL DEFAULT 0,
    ADD COLUMN daily_cap_nanos bigint,
    ADD COLUMN paused boolean NOT NULL DEFAULT false,
    ADD COLUMN spent_day date,
    ADD COLUMN spent_nanos bigint NOT NULL DEFAULT 0,
    ADD COLUMN reserved_nanos bigint NOT NULL DEFAULT 0,
    ADD CONSTRAINT tools_max_attempts_range CHECK (max_attempts BETWEEN 0 AND 100),
    ADD CONSTRAINT tools_backoff_range
        CHECK (backoff_base_seconds >= 0 AND backoff_max_seconds >= backoff_base_seconds),
    ADD CONSTRAINT tools_lease_positive CHECK (lease_seconds > 0),
    ADD CONSTRAINT tools_money_nonnegative
        CHECK (cost_estimate_nanos >= 0 AND daily_cap_nanos >= 0
               AND spent_nanos >= 0 AND reserved_nanos >= 0);

ALTER TABLE generation.tasks
    ADD COLUMN run_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN expires_at timestamptz,
    ADD COLUMN idempotency_key text,
    ADD COLUMN resource_key text,
    ADD COLUMN account_group text,
    ADD COLUMN cost_estimate_nanos bigint,
    ADD COLUMN attempt_count integer NOT NULL DEFAULT 0,
    ADD COLUMN settlement_round integer NOT NULL DEFAULT 1,
    ADD CONSTRAINT tasks_cost_estimate_nonnegative CHECK (cost_estimate_nanos >= 0);
UPDATE generation.tasks SET run_at = created_at;

DROP INDEX generation.tasks_claim_idx;
CREATE INDEX tasks_claim_idx ON generation.tasks (tool_id, reclaimed DESC, priority DESC, run_at)
    WHERE status = 'queued' AND retry_count < max_retries;
CREATE UNIQUE INDEX tasks_idempotency_key_idx ON generation.tasks (tool_id, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX tasks_expiry_idx ON generation.tasks (expires_at) WHERE status = 'queued';

CREATE TABLE generation.cooldowns (
    resource_key text PRIMARY KEY,
    consecutive_failures integer NOT NULL DEFAULT 0,
    cooling_until timestamptz
);

CREATE TABLE generation.holds (
    account_group text PRIMARY KEY,
    held_until timestamptz NOT NULL,
    reason text
);

CREATE TYPE generation.attempt_outcome AS ENUM (
    'running', 'completed', 'retry', 'failed', 'abandoned', 'lease_lost', 'cancelled',
    'released', 'account_error'
);

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

DROP INDEX generation.tasks_unsettled_idx;
CREATE INDEX tasks_unsettled_idx ON generation.tasks (completed_at)
    WHERE status IN ('completed', 'failed', 'cancelled', 'expired')
      AND reserved_token_amount > 0 AND settled_at IS NULL;

ALTER TABLE generation.settlements ADD COLUMN settlement_round integer NOT NULL DEFAULT 1;
ALTER TABLE generation.settlements DROP CONSTRAINT settlements_pkey;
ALTER TABLE generation.settlements
    ADD CONSTRAINT settlements_pkey PRIMARY KEY (task_id, settlement_round);
ALTER TABLE generation.settlements DROP CONSTRAINT settlements_terminal;
ALTER TABLE generation.settlements ADD CONSTRAINT settlements_terminal
    CHECK (task_status IN ('completed', 'failed', 'cancelled', 'expired'));

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
-- twice. Lock order, as in the claim: the task (held by the caller), settings, then the tool.
CREATE FUNCTION generation.close_attempt(
    token uuid, closing generation.attempt_outcome, cost bigint, retryable boolean
) RETURNS generation.attempts
LANGUAGE plpgsql
AS $$
DECLARE
    a generation.attempts;
    s generation.settings;
    released bigint;
    today date;
BEGIN
    SELECT * INTO a FROM generation.attempts WHERE lease_token = token FOR UPDATE;
    IF NOT FOUND OR a.outcome NOT IN ('running', 'abandoned') THEN
        RETURN a;
    END IF;
    released := CASE WHEN a.outcome = 'running' THEN a.estimate_nanos ELSE 0 END;
    UPDATE generation.attempts
    SET outcome = CASE WHEN a.outcome = 'abandoned' THEN 'lease_lost' ELSE closing END,
        cost_nanos = cost_nanos + cost,
        ended_at = COALESCE(ended_at, now())
    WHERE lease_token = token
    RETURNING * INTO a;

    IF released > 0 OR cost > 0 THEN
        SELECT * INTO s FROM generation.settings FOR UPDATE;
    ELSE
        SELECT * INTO s FROM generation.settings;
    END IF;
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
"""

DOWNGRADE = r"""
DROP FUNCTION generation.close_attempt;
DROP FUNCTION generation.within_cap;
DROP INDEX generation.tasks_unsettled_idx;
CREATE INDEX tasks_unsettled_idx ON generation.tasks (completed_at)
    WHERE status IN ('completed', 'failed') AND reserved_token_amount > 0 AND settled_at IS NULL;
ALTER TABLE generation.settlements DROP CONSTRAINT settlements_terminal;
ALTER TABLE generation.settlements ADD CONSTRAINT settlements_terminal
    CHECK (task_status IN ('completed', 'failed'));
ALTER TABLE generation.settlements DROP CONSTRAINT settlements_pkey;
ALTER TABLE generation.settlements DROP COLUMN settlement_round;
ALTER TABLE generation.settlements ADD PRIMARY KEY (task_id);
DROP TABLE generation.attempts;
DROP TYPE generation.attempt_outcome;
DROP TABLE generation.holds;
DROP TABLE generation.cooldowns;
DROP INDEX generation.tasks_expiry_idx;
DROP INDEX generation.tasks_idempotency_key_idx;
DROP INDEX generation.tasks_claim_idx;
CREATE INDEX tasks_claim_idx ON generation.tasks (tool_id, reclaimed DESC, priority DESC, created_at)
    WHERE status = 'queued' AND retry_count < max_retries;
ALTER TABLE generation.tasks
    DROP COLUMN run_at, DROP COLUMN expires_at, DROP COLUMN idempotency_key,
    DROP COLUMN resource_key, DROP COLUMN account_group, DROP COLUMN cost_estimate_nanos,
    DROP COLUMN attempt_count, DROP COLUMN settlement_round;
ALTER TABLE generation.tools
    DROP COLUMN max_attempts, DROP COLUMN backoff_base_seconds, DROP COLUMN backoff_max_seconds,
    DROP COLUMN lease_seconds, DROP COLUMN resource_key, DROP COLUMN account_group,
    DROP COLUMN cost_estimate_nanos, DROP COLUMN daily_cap_nanos, DROP COLUMN paused,
    DROP COLUMN spent_day, DROP COLUMN spent_nanos, DROP COLUMN reserved_nanos;
DROP TABLE generation.settings;
"""


def upgrade() -> None:
    # New enum values must be committed before anything may use them.
    with op.get_context().autocommit_block():
        op.execute("ALTER TYPE generation.task_status ADD VALUE IF NOT EXISTS 'cancelled'")
        op.execute("ALTER TYPE generation.task_status ADD VALUE IF NOT EXISTS 'expired'")
        op.execute("ALTER TYPE generation.task_event_kind ADD VALUE IF NOT EXISTS 'cancelled'")
        op.execute("ALTER TYPE generation.task_event_kind ADD VALUE IF NOT EXISTS 'expired'")
    op.execute(UPGRADE)


def downgrade() -> None:
    # Postgres cannot drop enum values; 'cancelled' and 'expired' stay (unused) in task_status.
    op.execute(DOWNGRADE)
