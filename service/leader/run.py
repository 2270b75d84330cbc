"""The loop every service process runs beside gRPC, on the database's clock: its overrides always
(overrides.py), the election every GENQ_LEADER_RENEW_SECONDS (lease.py), and while it leads the
sweeps: rescue (rescue.py) and expiry (expiry.py) every GENQ_RESCUE_INTERVAL_SECONDS, the log of
why tasks wait every WAITS_CHECK_SECONDS (waits.py), and the purge at most hourly (purge.py; also
once at start on the host's first process, leader or not).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from service.api.signals import Signals
from service.database import Database
from service.leader.expiry import expire_tasks
from service.leader.lease import Leadership
from service.leader.overrides import overrides, show_overrides
from service.leader.purge import PURGE_INTERVAL_SECONDS, purge
from service.leader.rescue import rescue_lapsed_leases
from service.leader.waits import Waits
from service.logs import LEADER_LOGGER
from service.settings import Settings

log = logging.getLogger(LEADER_LOGGER)


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
    election_due = rescue_due = loop.time()

    waits = Waits(database, settings)

    while True:
        if overrides(settings):
            try:
                await show_overrides(database, settings, replica)
            except Exception as error:
                log.warning("could not refresh this process's overrides (%s)", error)
        if loop.time() >= election_due:
            election_due = loop.time() + leadership.renew
            await leadership.elect()
        if leadership.leading and loop.time() >= rescue_due:
            # Every `interval`, not at each renewal of the lease too (every 3 s, whatever
            # GENQ_RESCUE_INTERVAL_SECONDS said).
            rescue_due = loop.time() + interval
            try:
                # A long backlog stops at the lease's end: one leader sweeps at a time.
                if rescued := await rescue_lapsed_leases(database, signals, leadership):
                    log.info("rescued %d tasks whose lease lapsed", rescued)
                if leadership.leading and (
                    expired := await expire_tasks(database, signals, settings, leadership)
                ):
                    log.info("expired %d tasks", expired)
            except Exception as error:
                log.warning("housekeeping failed (%s); retrying in %.1f s", error, interval)
        if leadership.leading:
            await waits.check()
        if start_purge or (leadership.leading and loop.time() >= purge_due):
            start_purge = False
            purge_due = await purge(database)
        due = min(rescue_due, election_due) if leadership.leading else election_due
        await asyncio.sleep(max(0.0, min(interval, due - loop.time())))
