"""The lease rescuer: hands tasks whose lease lapsed back to the queue, ahead of fresh work.

Why not in the claim: finding lapsed leases in O(1) per claim needs an index on
claim_expires_at, and then every heartbeat would update an indexed column and stop being HOT.
Instead the claim reads one index of claimable rows, and this sweep (every
GENQ_RESCUE_INTERVAL_SECONDS, on the database's clock) moves lapsed rows into it marked
`reclaimed`, so the next claim takes them first and charges the retry then.
Rows whose retries are used up are left `processing` for the watchdog (ListStaleTasks).
"""

from __future__ import annotations

import asyncio
import logging

from service.database import Database
from service.signals import Signals

log = logging.getLogger(__name__)

RESCUE_SQL = """
UPDATE generation.tasks AS t
SET status = 'queued', reclaimed = true, lease_token = NULL, claim_expires_at = NULL
WHERE t.id IN (
  SELECT id FROM generation.tasks
  WHERE status = 'processing' AND claim_expires_at < now() AND retry_count < max_retries
  LIMIT %(batch)s
  FOR UPDATE SKIP LOCKED)
RETURNING t.id, t.tool_id
"""

BATCH = 1000


async def rescue_lapsed_leases(database: Database, signals: Signals) -> int:
    """One sweep; returns how many tasks went back to the queue."""
    total = 0
    while True:
        rows = await database.fetch(RESCUE_SQL, {"batch": BATCH})
        for row in rows:
            signals.task_queued(str(row["tool_id"]))
        total += len(rows)
        if len(rows) < BATCH:
            return total


async def run(database: Database, signals: Signals, interval_seconds: float) -> None:
    while True:
        try:
            if rescued := await rescue_lapsed_leases(database, signals):
                log.info("rescued %d tasks whose lease lapsed", rescued)
        except Exception as error:
            log.warning("lease rescue failed (%s); retrying in %.1f s", error, interval_seconds)
        await asyncio.sleep(interval_seconds)
