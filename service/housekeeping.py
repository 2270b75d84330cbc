"""The service's background sweeps, on the database's clock, in every replica (each sweep locks
with SKIP LOCKED and re-checks in its WHERE clause, so replicas running at once is harmless).

- Lease rescue, every GENQ_RESCUE_INTERVAL_SECONDS: tasks whose lease lapsed go back to the queue,
  ahead of fresh work. Why not in the claim: finding lapsed leases in O(1) per claim needs an
  index on claim_expires_at, and then every heartbeat would update an indexed column and stop
  being HOT. So the claim reads one index of claimable rows, and this sweep moves lapsed rows
  into it marked `reclaimed`; the next claim takes them first and charges the retry then. The
  lapsed run's attempt is closed `abandoned` and its reservation released. Rows whose retries
  are used up are left `processing` for the watchdog (ListStaleTasks).
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

from service.database import Database
from service.rpcs import STATEMENTS, signal_queued
from service.settings import Settings
from service.signals import Signals

log = logging.getLogger(__name__)

RESCUE_SQL = """
WITH lapsed AS (
  SELECT id, lease_token FROM generation.tasks
  WHERE status = 'processing' AND claim_expires_at < now() AND retry_count < max_retries
  LIMIT %(batch)s
  FOR UPDATE SKIP LOCKED),
rescued AS (
  UPDATE generation.tasks AS t
  SET status = 'queued', reclaimed = true, lease_token = NULL, claim_expires_at = NULL
  FROM lapsed WHERE t.id = lapsed.id
  RETURNING t.id, t.tool_id, t.status, lapsed.lease_token AS prior_lease_token),
closed AS (
  SELECT generation.close_attempt(id, prior_lease_token, 'abandoned', 0, false) FROM rescued)
SELECT id, tool_id, status, (SELECT count(*) FROM closed) AS closed FROM rescued
"""

EXPIRE_SQL = """
WITH expired AS (
  UPDATE generation.tasks AS t
  SET status = 'expired', completed_at = now()
  WHERE t.id IN (
      SELECT id FROM generation.tasks
      WHERE status = 'queued' AND expires_at < now()
      ORDER BY expires_at
      LIMIT %(batch)s
      FOR UPDATE SKIP LOCKED)
    AND (SELECT enabled FROM generation.settings) AND NOT %(disabled_override)s::boolean
  RETURNING t.id),
event AS (
  INSERT INTO generation.task_events (task_id, kind)
  SELECT id, 'expired' FROM expired
  RETURNING *)
SELECT to_jsonb(event) AS event FROM event
"""

BATCH = 1000
PURGE_SQL = STATEMENTS["PurgeTasks"]
PURGE_BATCH = 1000
PURGE_MAX_BATCHES = 10
PURGE_INTERVAL_SECONDS = 3600.0
PURGE_RETRY_SECONDS = 60.0


async def rescue_lapsed_leases(database: Database, signals: Signals) -> int:
    """One rescue sweep; returns how many tasks went back to the queue."""
    total = 0
    while True:
        rows = await database.fetch(RESCUE_SQL, {"batch": BATCH})
        signal_queued(signals, rows)
        total += len(rows)
        if len(rows) < BATCH:
            return total


async def expire_tasks(database: Database, signals: Signals, settings: Settings) -> int:
    """One expiry sweep; returns how many tasks expired."""
    total = 0
    while True:
        rows = await database.fetch(
            EXPIRE_SQL, {"batch": BATCH, "disabled_override": settings.disabled}
        )
        for row in rows:
            signals.event_added(row["event"])
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


async def run(database: Database, signals: Signals, settings: Settings) -> None:
    interval = settings.rescue_interval_seconds
    loop = asyncio.get_running_loop()
    purge_due = loop.time()  # once at start
    while True:
        try:
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
