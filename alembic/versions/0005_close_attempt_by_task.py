"""close_attempt takes the task as well as the token, and locks settings before the attempt.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

UPGRADE = r"""
DROP FUNCTION generation.close_attempt(uuid, generation.attempt_outcome, bigint, boolean);

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
"""


def upgrade() -> None:
    op.execute(UPGRADE)


DOWNGRADE = r"""
DROP FUNCTION generation.close_attempt(uuid, uuid, generation.attempt_outcome, bigint, boolean);

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


def downgrade() -> None:
    op.execute(DOWNGRADE)
