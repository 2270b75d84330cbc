"""The service's background sweeps, on the database's clock.

The maintenance sweeps (rescue, expiry, purge) run in one process among all processes and
replicas on the database: the leader, the holder of the `generation.leader` row named
LEADER_NAME. Every process tries to take or renew that row every GENQ_LEADER_RENEW_SECONDS (3)
with one statement (ELECT_SQL, River's `river_leader` shape): it wins when the lease lapsed or is
already its own, and the lease then runs GENQ_LEADER_TTL_SECONDS (10) on the database's clock. A
leader acts as one only until its own clock says the lease it last won ends (from when it sent
that statement, so never past the database's expiry): a leader frozen (SIGSTOP) or cut off from
the database stops sweeping before another can take over. A clean stop deletes the row, so
another process takes over at its next try; a dead or frozen one's lapses, and another takes over
within TTL + renew interval. Each sweep still locks with SKIP LOCKED and re-checks in its WHERE
clause, so two leaders overlapping (a clock that jumps) would be harmless, only wasteful.

- Lease rescue, every GENQ_RESCUE_INTERVAL_SECONDS, on the leader: tasks whose lease lapsed go
  back to the queue, ahead of fresh work. Why not in the claim: finding lapsed leases in O(1)
  per claim needs an index on claim_expires_at, and then every heartbeat would update an indexed
  column and stop being HOT. So the claim reads one index of claimable rows, and this sweep
  moves lapsed rows into it marked `reclaimed`; the next claim takes them first.
  generation.rescue_lapsed_v2 decides each: an unconfirmed claim costs nothing, a confirmed run
  one retry (the task fails at once when that was its last), a run asked to cancel ends
  cancelled.
- Overrides, same interval, in every process (not the leader's job): a process whose environment
  sets GENQ_DISABLED or GENQ_DAILY_CAP_NANOS shows them in generation.replica_overrides under its
  own id (seen_at refreshed), and every replica's claims obey every override seen in the last
  30 s; a clean stop withdraws them. Per process rather than once per host: each process's row
  says "while I run, this binds", so a process that stops withdraws only its own while the rest
  of its host still holds theirs (N tiny upserts a second per host).
- Expiry, same interval, on the leader: queued tasks past `expires_at` end `expired` without
  running. Suspended while the kill switch is off, so a pause keeps its backlog.
- Purge, once when a host starts (its first process, leader or not) and then by the leader at
  most once an hour (PURGE_INTERVAL_SECONDS): PurgeTasks' own statement deletes finished tasks
  older than settings.retention_days (30; 0 keeps everything), never one whose reservation is
  unsettled, in batches of PURGE_BATCH, at most PURGE_MAX_BATCHES a run so one run stays short;
  what is left waits for the next run (or `genq purge`). A failed run is tried again after
  PURGE_RETRY_SECONDS.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from service.database import Database
from service.rpcs import STATEMENTS, signal_event, signal_requeue
from service.settings import Settings
from service.signals import Signals

log = logging.getLogger(__name__)

RESCUE_SQL = (
    "SELECT (r.task).id, (r.task).tool_id, (r.task).status, r.event "
    "FROM generation.rescue_lapsed_v2(%(batch)s) AS r"
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

LEADER_NAME = "maintenance"
# Takes the lease when it lapsed or renews our own; no row back: another process holds it.
ELECT_SQL = """
INSERT INTO generation.leader AS leader (name, holder, expires_at)
VALUES (%(name)s, %(holder)s, now() + make_interval(secs => %(ttl)s))
ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at
WHERE leader.expires_at < now() OR leader.holder = EXCLUDED.holder
RETURNING holder
"""
RESIGN_SQL = "DELETE FROM generation.leader WHERE name = %(name)s AND holder = %(holder)s"

BATCH = 1000
PURGE_SQL = STATEMENTS["PurgeTasks"]
PURGE_BATCH = 1000
PURGE_MAX_BATCHES = 10
PURGE_INTERVAL_SECONDS = 3600.0
PURGE_RETRY_SECONDS = 60.0


def _always() -> bool:
    return True


async def rescue_lapsed_leases(
    database: Database, signals: Signals, go_on: Callable[[], bool] = _always
) -> int:
    """One rescue sweep, batch after batch while `go_on()` (this process still leads); returns
    how many lapsed leases it ended."""
    total = 0
    while True:
        rows = await database.fetch(RESCUE_SQL, {"batch": BATCH})
        signal_requeue(signals, rows)
        total += len(rows)
        if len(rows) < BATCH or not go_on():
            return total


async def expire_tasks(
    database: Database, signals: Signals, settings: Settings, go_on: Callable[[], bool] = _always
) -> int:
    """One expiry sweep, batch after batch while `go_on()`; returns how many tasks expired."""
    total = 0
    while True:
        rows = await database.fetch(EXPIRE_SQL, {"batch": BATCH, "disabled": settings.disabled})
        signal_event(signals, rows)
        total += len(rows)
        if len(rows) < BATCH or not go_on():
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


class Leadership:
    """This process's claim on the maintenance lease (see the module's docstring)."""

    def __init__(self, database: Database, settings: Settings, holder: uuid.UUID) -> None:
        self.database = database
        self.holder = holder
        self.ttl = settings.leader_ttl_seconds
        self.renew = settings.leader_renew_seconds
        self._until: float | None = None
        """Loop time until which this process leads; None when it does not."""
        self._failing = False

    @property
    def leading(self) -> bool:
        return self._until is not None and asyncio.get_running_loop().time() < self._until

    async def elect(self) -> bool:
        """Takes or renews the lease; returns whether this process leads now."""
        loop = asyncio.get_running_loop()
        sent = loop.time()
        was = self._until is not None
        try:
            rows = await self.database.fetch(
                ELECT_SQL,
                {"name": LEADER_NAME, "holder": self.holder, "ttl": self.ttl},
                timeout=self.renew,
            )
        except Exception as error:
            if was and not self.leading:
                self._until = None
                log.info("leader: lease lapsed unrenewed (%s); no longer the leader", error)
            elif not self._failing:
                log.warning("leader election failed (%s); trying every %.1f s", error, self.renew)
            self._failing = True
            return self.leading
        self._failing = False
        if rows:
            self._until = sent + self.ttl
            if not was:
                log.info("leader: this process (%s) now runs the maintenance sweeps", self.holder)
        elif was:
            self._until = None
            log.info("leader: another process holds the lease; no longer the leader")
        return self.leading

    async def resign(self) -> None:
        """Gives the lease up at a clean stop, so another process takes over at its next try."""
        if self._until is None:
            return
        self._until = None
        try:
            await self.database.fetch(RESIGN_SQL, {"name": LEADER_NAME, "holder": self.holder})
        except Exception as error:  # it lapses within the TTL anyway
            log.warning("leader: could not give the lease up (%s); it lapses on its own", error)
        else:
            log.info("leader: this process (%s) gave the lease up", self.holder)


async def run(
    database: Database,
    signals: Signals,
    settings: Settings,
    replica: uuid.UUID,
    leadership: Leadership,
    *,
    purge_at_start: bool = True,
) -> None:
    """The process's housekeeping loop: overrides always, the sweeps while it leads. Runs until
    cancelled; the caller resigns the leadership after cancelling it."""
    interval = settings.rescue_interval_seconds
    loop = asyncio.get_running_loop()
    # Once at start when this is the host's first process (after the first sweeps), then hourly
    # on the leader.
    start_purge = purge_at_start
    purge_due = loop.time() + PURGE_INTERVAL_SECONDS
    election_due = loop.time()

    def leading() -> bool:
        return leadership.leading

    while True:
        if overrides(settings):
            try:
                await show_overrides(database, settings, replica)
            except Exception as error:
                log.warning("could not refresh this process's overrides (%s)", error)
        if loop.time() >= election_due:
            election_due = loop.time() + leadership.renew
            await leadership.elect()
        if leadership.leading:
            try:
                # A long backlog stops at the lease's end: one leader sweeps at a time.
                if rescued := await rescue_lapsed_leases(database, signals, leading):
                    log.info("rescued %d tasks whose lease lapsed", rescued)
                if leadership.leading and (
                    expired := await expire_tasks(database, signals, settings, leading)
                ):
                    log.info("expired %d tasks", expired)
            except Exception as error:
                log.warning("housekeeping failed (%s); retrying in %.1f s", error, interval)
        if start_purge or (leadership.leading and loop.time() >= purge_due):
            start_purge = False
            purge_due = await _purge(database)
        await asyncio.sleep(max(0.0, min(interval, election_due - loop.time())))


async def _purge(database: Database) -> float:
    """One purge run, logged; returns when the next is due."""
    loop = asyncio.get_running_loop()
    try:
        purged, days = await purge_finished(database)
    except Exception as error:
        log.warning("purge failed (%s); retrying in %.0f s", error, PURGE_RETRY_SECONDS)
        return loop.time() + PURGE_RETRY_SECONDS
    if purged:
        log.info("purged %d finished tasks older than %d days", purged, days)
    return loop.time() + PURGE_INTERVAL_SECONDS
