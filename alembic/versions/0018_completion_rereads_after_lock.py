"""The one-statement completion reads its attempt and its key as they are once the task is locked.

`complete_task_v3` (alembic 0017) decided its fast path in one statement. Postgres re-checks an
UPDATE's own row at its newest version once it holds the lock, but every other table the
statement reads it reads as of the statement's start. Two things could therefore be missed while
the completion waited for its task's lock (behind a heartbeat, say):

- a retryable failure of the same resource key that committed meanwhile. The key's run of
  failures was then not reset, and one more failure could cool the key for `cooldown_seconds`
  when it should not;
- a close of the same attempt. This happens when the same lease is refused as lost once it
  lapses: complete_task_v2's step 6 locks the task without changing it, and closes the attempt
  `lease_lost`. The fast path then closed that attempt a second time, as `completed`.

Now the attempt is closed only while it runs, re-checked on its newest version, and the reset
is a statement of its own, run after the task's lock. Both end as complete_task_v2 ends.

The function is replaced in place rather than versioned. Its contract and its callers are
unchanged, and so every replica, older ones included, gets the fix the moment this migrates.
The downgrade keeps the fixed body: 0017's had the defect, and nothing relies on it.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-03
"""

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

UPGRADE = r"""
-- Ends a held run as complete_task_v2 does (its steps 1-6 below are v2's, unchanged), first
-- trying one statement when no money moves (no cost reported, none reserved at the claim) and
-- the lease holds: the run's end, its attempt's close and the terminal event, then the key's run
-- of failures reset in a statement of its own. Anything else (money, a repeated report, a lost
-- lease, an unknown task) changes nothing there and v2's steps decide (alembic 0017; 0018 reads
-- the attempt and the key as they are once the task is locked).
CREATE OR REPLACE FUNCTION generation.complete_task_v3(
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
        -- B. Close its attempt, as close_attempt_v2 closes one that moves no money: only while
        --    it runs. A's EXISTS read the attempt as this statement's snapshot saw it; this
        --    UPDATE re-checks the newest version, so a close that committed meanwhile (the same
        --    lease refused as lost once it lapsed, v2's step 6) stands, as in v2.
        closed AS (
            UPDATE generation.attempts AS r
            SET outcome = ended.status::text::generation.attempt_outcome,
                resource_key = COALESCE(p_resource_key, r.resource_key),
                ended_at = now()
            FROM ended
            WHERE r.task_id = p_task AND r.lease_token = p_token AND r.outcome = 'running'),
        -- C. The terminal event, last in the stream.
        event AS (
            INSERT INTO generation.task_events (task_id, sequence, kind, data)
            SELECT p_task, ended.last_event_seq,
                   ended.status::text::generation.task_event_kind, '{}'
            FROM ended
            RETURNING *)
        SELECT true, ended.task, to_jsonb(event) FROM ended, event;
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
    -- Else (money, or the lease not held now): complete_task_v2's steps.
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
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    """Nothing: the body 0017 created had the defect this fixes (docstring)."""
