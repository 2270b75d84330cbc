"""Overrides, every GENQ_RESCUE_INTERVAL_SECONDS in every process (not the leader's job): a
process whose environment sets GENQ_DISABLED or GENQ_DAILY_CAP_NANOS shows them in
generation.replica_overrides under its own id (seen_at refreshed), and every replica's claims
obey every override seen in the last 30 s; a clean stop withdraws them.

Per process rather than once per host: each process's row says "while I run, this binds", so a
process that stops withdraws only its own while the rest of its host still holds theirs (N tiny
upserts a second per host).
"""

from __future__ import annotations

import uuid

from service.database import STOP_STATEMENT_SECONDS, Database
from service.settings import Settings

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
# Withdrawn at a clean stop. The gates in force change with it, so the watchdog's clock restarts
# (stale_reason_v1 counts from settings.gates_changed_at): a task held by this replica's switch
# is not called abandoned the moment the replica goes, as it is not when one crashes.
OVERRIDES_GONE_SQL = """
WITH gone AS (
  DELETE FROM generation.replica_overrides WHERE replica_id = %(replica)s
  RETURNING disabled OR daily_cap_nanos IS NOT NULL AS overrode)
UPDATE generation.settings SET gates_changed_at = now()
WHERE EXISTS (SELECT 1 FROM gone WHERE gone.overrode)
"""


def overrides(settings: Settings) -> bool:
    """Whether this replica's environment overrides the switch or the cap."""
    return settings.disabled or settings.daily_cap_nanos is not None


async def show_overrides(database: Database, settings: Settings, replica: uuid.UUID) -> None:
    await database.fetch(
        OVERRIDES_SQL,
        {"replica": replica, "disabled": settings.disabled, "cap": settings.daily_cap_nanos},
    )


async def withdraw_overrides(database: Database, replica: uuid.UUID) -> None:
    await database.fetch(OVERRIDES_GONE_SQL, {"replica": replica}, timeout=STOP_STATEMENT_SECONDS)
