"""The watchdog counts every wait the claim makes a task keep.

`stale_reason_v2` (the one definition of stale: ListStaleTasks, the status page, the reaper)
looked at one resource key and one account group per task: the task's own, else the tool's. The
claim holds a task back for more than that:

- the tool's own key cooling, or its own group held, holds back every task of the tool, those
  with a key or group of their own too;
- a key at its concurrency limit (`resource_limits`) holds back the tasks of that key, and the
  tool's own key at its limit every task of the tool.

A task waiting on one of these, on a tool no worker had asked about for `queued_max_age`, was
called abandoned, and the reaper could fail it while it only waited. Now the cooling and hold
of both keys and both groups count for the clock, and a key at its limit counts as a wait.

The clock counted from the last sighting of a replica with GENQ_DISABLED, so its tasks were not
called abandoned the moment it crashed; one with GENQ_DAILY_CAP_NANOS (0, say) held tasks back
the same way and left nothing to count from, so 31 s after it crashed they were abandoned at
once. Its last sighting now counts too, once it is gone (not seen for the 30 s `gates_v1` still
counts it). While it lives it is not counted: a cap with room holds nothing back, and counting
its sightings would keep every task from ever being found.

A review reproduced all three.

When a key's limit frees, the clock does not restart (unlike the end of a cooldown): nothing
records when a key's runs last ended without reading its whole ledger. A tool whose workers
keep asking is never abandoned anyway. What is left is a tool with no worker at all for
`queued_max_age`, whose tasks are found the moment the key frees.

Replaced in place, as 0018 did (same argument, same answers for everything else). The
downgrade keeps the fixed body.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-03
"""

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

UPGRADE = r"""
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
                (SELECT p.polled_at FROM generation.tool_polls AS p WHERE p.tool_id = t.tool_id),
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
        ELSE 'abandoned'
    END
    FROM generation.settings AS s, generation.spend_today AS sp,
         generation.gates_v1(false, NULL) AS g, generation.tools AS tool
    WHERE tool.id = t.tool_id
$$;
"""


def upgrade() -> None:
    op.execute(UPGRADE)


def downgrade() -> None:
    """Nothing: the body 0009 created had the defect this fixes (docstring)."""
