"""Expiry, every GENQ_RESCUE_INTERVAL_SECONDS on the leader: queued tasks past `expires_at` end
`expired` without running. Suspended while the kill switch is off, so a pause keeps its
backlog."""

from __future__ import annotations

from service.api.rpcs import signal_event
from service.api.signals import Signals
from service.database import Database
from service.leader.lease import BATCH, LEADING, Leadership
from service.settings import Settings

EXPIRE_SQL = (
    "SELECT (e.task).id, e.event FROM generation.expire_tasks_v1(%(batch)s, %(disabled)s) AS e "
    f"WHERE {LEADING}"
)


async def expire_tasks(
    database: Database, signals: Signals, settings: Settings, leadership: Leadership
) -> int:
    """One expiry sweep, batch after batch while this process leads, each bounded by what is
    left of its lease; returns how many tasks expired."""
    total = 0
    while leadership.leading:
        rows = await database.fetch(
            EXPIRE_SQL,
            {"batch": BATCH, "disabled": settings.disabled, **leadership.fence},
            timeout=leadership.left(),
        )
        signal_event(signals, rows)
        total += len(rows)
        if len(rows) < BATCH:
            break
    return total
