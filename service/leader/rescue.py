"""Lease rescue, every GENQ_RESCUE_INTERVAL_SECONDS on the leader: tasks whose lease lapsed go
back to the queue, ahead of fresh work.

Why not in the claim: finding lapsed leases in O(1) per claim needs an index on
claim_expires_at, and then every heartbeat would update an indexed column and stop being HOT.
So the claim reads one index of claimable rows, and this sweep moves lapsed rows into it marked
`reclaimed`; the next claim takes them first. generation.rescue_lapsed_v1 decides each: an
unconfirmed claim costs nothing, a confirmed run one retry (the task fails at once when that was
its last), a run asked to cancel ends cancelled.
"""

from __future__ import annotations

from service.api.rpcs import signal_requeue
from service.api.signals import Signals
from service.database import Database
from service.leader.lease import BATCH, LEADING, Leadership

RESCUE_SQL = (
    "SELECT (r.task).id, (r.task).tool_id, (r.task).status, r.event "
    f"FROM generation.rescue_lapsed_v1(%(batch)s) AS r WHERE {LEADING}"
)


async def rescue_lapsed_leases(database: Database, signals: Signals, leadership: Leadership) -> int:
    """One rescue sweep, batch after batch while this process leads, each bounded by what is
    left of its lease; returns how many lapsed leases it ended."""
    total = 0
    while leadership.leading:
        rows = await database.fetch(
            RESCUE_SQL, {"batch": BATCH, **leadership.fence}, timeout=leadership.left()
        )
        signal_requeue(signals, rows)
        total += len(rows)
        if len(rows) < BATCH:
            break
    return total
