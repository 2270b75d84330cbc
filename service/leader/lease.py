"""The election: which one process, among all processes and replicas on the database, runs the
maintenance sweeps (rescue, expiry, purge) and logs why tasks wait.

The leader is the holder of the `generation.leader` row named LEADER_NAME. Every process tries
to take or renew that row every GENQ_LEADER_RENEW_SECONDS (3) with one statement (ELECT_SQL,
River's `river_leader` shape): it wins when the lease lapsed or is already its own, and the
lease then runs GENQ_LEADER_TTL_SECONDS (10) on the database's clock. A leader acts as one only
until its own clock says the lease it last won ends (from when it sent that statement, so never
past the database's expiry): a leader frozen (SIGSTOP) or cut off from the database stops
sweeping before another can take over, and a sweep it sent just before runs only if its lease
still holds on the database's clock (LEADING). A clean stop deletes the row, so another process
takes over at its next try; a dead or frozen one's lapses, and another takes over within TTL +
renew interval. Each sweep still locks with SKIP LOCKED and re-checks in its WHERE clause, so
two leaders overlapping (a clock that jumps) would be harmless, only wasteful.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from service.database import STOP_STATEMENT_SECONDS, Database
from service.logs import LEADER_LOGGER
from service.settings import Settings

log = logging.getLogger(LEADER_LOGGER)

LEADER_NAME = "maintenance"
# A sweep runs only while its sender holds the maintenance lease on the database's clock (a
# one-time filter: the function is not called otherwise). A leader cut off from the database can
# send one just before its lease ends, and it arrives when the link heals: the database must not
# run it once another process leads (a thawed leader would rescue tasks another had taken over).
LEADING = (
    "EXISTS (SELECT 1 FROM generation.leader AS l "
    "WHERE l.name = %(leader)s AND l.holder = %(holder)s AND l.expires_at > now())"
)
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
"""Rows one sweep statement takes; a sweep runs batch after batch while its process leads."""


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

    def left(self) -> float:
        """Seconds left of the lease this process last won, by its own clock (0 when none)."""
        if self._until is None:
            return 0.0
        return max(0.0, self._until - asyncio.get_running_loop().time())

    @property
    def fence(self) -> dict[str, object]:
        """The parameters of LEADING: a sweep runs only while this process holds the lease."""
        return {"leader": LEADER_NAME, "holder": self.holder}

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
            await self.database.fetch(
                RESIGN_SQL,
                {"name": LEADER_NAME, "holder": self.holder},
                timeout=STOP_STATEMENT_SECONDS,
            )
        except Exception as error:  # it lapses within the TTL anyway
            log.warning("leader: could not give the lease up (%s); it lapses on its own", error)
        else:
            log.info("leader: this process (%s) gave the lease up", self.holder)
