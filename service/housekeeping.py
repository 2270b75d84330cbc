"""The service's background sweeps, on the database's clock, in every replica (each sweep locks
with SKIP LOCKED and re-checks in its WHERE clause, so replicas running at once is harmless).

- Lease rescue, every GENQ_RESCUE_INTERVAL_SECONDS: tasks whose lease lapsed go back to the queue,
  ahead of fresh work. Why not in the claim: finding lapsed leases in O(1) per claim needs an
  index on claim_expires_at, and then every heartbeat would update an indexed column and stop
  being HOT. So the claim reads one index of claimable rows, and this sweep moves lapsed rows
  into it marked `reclaimed`; the next claim takes them first. generation.rescue_lapsed_v1
  decides each: an unconfirmed claim costs nothing, a confirmed run one retry (the task fails at
  once when that was its last), a run asked to cancel ends cancelled.
- Overrides, same interval: a replica whose environment sets GENQ_DISABLED or
  GENQ_DAILY_CAP_NANOS shows them in generation.replica_overrides (seen_at refreshed), and every
  replica's claims obey every override seen in the last 30 s; a clean stop withdraws them.
- Expiry, same interval: queued tasks past `expires_at` end `expired` without running. Suspended
  while the kill switch is off, so a pause keeps its backlog.
- Purge, once at start and then at most once an hour (PURGE_INTERVAL_SECONDS): PurgeTasks' own
  statement deletes finished tasks older than settings.retention_days (30; 0 keeps everything),
  never one whose reservation is unsettled, in batches of PURGE_BATCH, at most PURGE_MAX_BATCHES
  a run so one run stays short; what is left waits for the next run (or `genq purge`). A failed
  run is tried again after PURGE_RETRY_SECONDS.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from service.database import Database
from service.rpcs import STATEMENTS, signal_event, signal_requeue
from service.settings import Settings
from service.signals import Signals

log = logging.getLogger(__name__)

RESCUE_SQL = (
    "SELECT (r.task).id, (r.task).tool_id, (r.task).status, r.event "
    "FROM generation.rescue_lapsed_v1(%(batch)s) AS r"
)
EXPIRE_SQL = (
    "SELECT (e.task).id, e.event FROM generation.expire_tasks_v1(%(batch)s, %(disabled)s) AS e"
)
# This replica's environment overrides, shown to every replica's claims while it runs.
OVERRIDES_SQL = """
WITH mine AS (
  INSERT INTO generation.replica_overrides (replica_id, disabled, daily_cap_nanos, seen_at)
  VALUES (%(replica)s, %(disabled)s, %(cap)s, now())
  ON CONFLICT (replica_id) DO UPDATE
  SET disabled = EXCLUDED.disabled, daily_cap_nanos = EXCLUDED.daily_cap_nanos, seen_at = now())
DELETE FROM generation.replica_overrides
WHERE seen_at < now() - interval '1 hour' AND replica_id <> %(replica)s
"""
OVERRIDES_GONE_SQL = "DELETE FROM generation.replica_overrides WHERE replica_id = %(replica)s"

BATCH = 1000
PURGE_SQL = STATEMENTS["PurgeTasks"]
PURGE_BATCH = 1000
PURGE_MAX_BATCHES = 10
PURGE_INTERVAL_SECONDS = 3600.0
PURGE_RETRY_SECONDS = 60.0


async def rescue_lapsed_leases(database: Database, signals: Signals) -> int:
    """One rescue sweep; returns how many lapsed leases it ended."""
    total = 0
    while True:
        rows = await database.fetch(RESCUE_SQL, {"batch": BATCH})
        signal_requeue(signals, rows)
        total += len(rows)
        if len(rows) < BATCH:
            return total


async def expire_tasks(database: Database, signals: Signals, settings: Settings) -> int:
    """One expiry sweep; returns how many tasks expired."""
    total = 0
    while True:
        rows = await database.fetch(EXPIRE_SQL, {"batch": BATCH, "disabled": settings.disabled})
        signal_event(signals, rows)
        total += len(rows)
        if len(rows) < BATCH:
            return total


async def purge_finished(database: Database) -> tuple[int, int]:
    """One purge run: batches until one comes back short, at most PURGE_MAX_BATCHES.

    Returns (tasks purged, the retention in days that applied)."""
    total, days = 0, 0
    for _ in range(PURGE_MAX_BATCHES):
        (row,) = await database.fetch(
            PURGE_SQL, {"older_than_days": None, "batch_size": PURGE_BATCH}
        )
        total, days = total + row["purged"], row["retention_days"]
        if row["purged"] < PURGE_BATCH:
            break
    return total, days


def overrides(settings: Settings) -> bool:
    """Whether this replica's environment overrides the switch or the cap."""
    return settings.disabled or settings.daily_cap_nanos is not None


async def show_overrides(database: Database, settings: Settings, replica: uuid.UUID) -> None:
    await database.fetch(
        OVERRIDES_SQL,
        {"replica": replica, "disabled": settings.disabled, "cap": settings.daily_cap_nanos},
    )


async def withdraw_overrides(database: Database, replica: uuid.UUID) -> None:
    await database.fetch(OVERRIDES_GONE_SQL, {"replica": replica})


async def run(database: Database, signals: Signals, settings: Settings, replica: uuid.UUID) -> None:
    interval = settings.rescue_interval_seconds
    loop = asyncio.get_running_loop()
    purge_due = loop.time()  # once at start
    while True:
        try:
            if overrides(settings):
                await show_overrides(database, settings, replica)
            if rescued := await rescue_lapsed_leases(database, signals):
                log.info("rescued %d tasks whose lease lapsed", rescued)
            if expired := await expire_tasks(database, signals, settings):
                log.info("expired %d tasks", expired)
        except Exception as error:
            log.warning("housekeeping failed (%s); retrying in %.1f s", error, interval)
        if loop.time() >= purge_due:
            try:
                purged, days = await purge_finished(database)
            except Exception as error:
                purge_due = loop.time() + PURGE_RETRY_SECONDS
                log.warning("purge failed (%s); retrying in %.0f s", error, PURGE_RETRY_SECONDS)
            else:
                purge_due = loop.time() + PURGE_INTERVAL_SECONDS
                if purged:
                    log.info("purged %d finished tasks older than %d days", purged, days)
        await asyncio.sleep(interval)
