"""RetryTask can be sent again after its answer was lost.

`retry_task_v1` queues any failed, cancelled or expired task again, so the same RetryTask sent
twice (its first answer lost after the commit) told the caller FAILED_PRECONDITION while the
task ran, and if the task had failed again and been settled meanwhile it queued it a second time
and started another settlement round: one reservation refunded twice, one run more. A review
reproduced both.

`retry_task_v2` takes an optional key (RetryTaskRequest.retry_key). The retry writes it into the
`requeued` event it appends, and a call whose key is already in the task's stream answers the
task as it is now (RetryTaskResponse.retried_now false) and changes nothing. Without a key it is
v1.

Additive: replicas of 0020 keep calling retry_task_v1, which stays.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-03
"""

from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

UPGRADE = r"""
-- As retry_task_v1, and idempotent under a key: the retry writes `retry_key` into the `requeued`
-- event it appends, and a call whose key is already in the task's stream answers the task as it
-- is now and changes nothing. So a RetryTask sent again after its answer was lost neither queues
-- a task that has run since nor starts another settlement round (alembic 0021).
CREATE FUNCTION generation.retry_task_v2(p_task uuid, p_reserved bigint, p_key text)
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
"""

DOWNGRADE = r"""
DROP FUNCTION generation.retry_task_v2;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    op.execute(DOWNGRADE)
