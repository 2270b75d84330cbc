"""Purge, once when a host starts (its first process, leader or not) and then by the leader at
most once an hour (PURGE_INTERVAL_SECONDS).

PurgeTasks' own statement deletes finished tasks older than settings.retention_days (30; 0 keeps
everything), never one whose reservation is unsettled, in batches of PURGE_BATCH, at most
PURGE_MAX_BATCHES a run so one run stays short; what is left waits for the next run (or
`genq purge`). A failed run is tried again after PURGE_RETRY_SECONDS.
"""

from __future__ import annotations

import asyncio
import logging

from service.api.rpcs import STATEMENTS
from service.database import Database
from service.logs import LEADER_LOGGER

log = logging.getLogger(LEADER_LOGGER)

PURGE_SQL = STATEMENTS["PurgeTasks"]
PURGE_BATCH = 1000
PURGE_MAX_BATCHES = 10
PURGE_INTERVAL_SECONDS = 3600.0
PURGE_RETRY_SECONDS = 60.0


async def purge_finished(database: Database) -> tuple[int, int]:
    """One purge run: batches until one comes back short, at most PURGE_MAX_BATCHES.

    Returns (tasks purged, the retention in days that applied)."""
    total, days = 0, 0
    for _ in range(PURGE_MAX_BATCHES):
        (row,) = await database.fetch(
            PURGE_SQL, {"older_than_days": None, "batch_size": PURGE_BATCH, "dry_run": False}
        )
        total, days = total + row["purged"], row["retention_days"]
        if row["purged"] < PURGE_BATCH:
            break
    return total, days


async def purge(database: Database) -> float:
    """One purge run, logged; returns the loop time the next is due."""
    loop = asyncio.get_running_loop()
    try:
        purged, days = await purge_finished(database)
    except Exception as error:
        log.warning("purge failed (%s); retrying in %.0f s", error, PURGE_RETRY_SECONDS)
        return loop.time() + PURGE_RETRY_SECONDS
    if purged:
        log.info("purged %d finished tasks older than %d days", purged, days)
    return loop.time() + PURGE_INTERVAL_SECONDS
