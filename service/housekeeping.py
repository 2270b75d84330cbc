"""The service's background sweeps, on the database's clock.

The maintenance sweeps (rescue, expiry, purge) run in one process among all processes and
replicas on the database: the leader, the holder of the `generation.leader` row named
LEADER_NAME. Every process tries to take or renew that row every GENQ_LEADER_RENEW_SECONDS (3)
with one statement (ELECT_SQL, River's `river_leader` shape): it wins when the lease lapsed or is
already its own, and the lease then runs GENQ_LEADER_TTL_SECONDS (10) on the database's clock. A
leader acts as one only until its own clock says the lease it last won ends (from when it sent
that statement, so never past the database's expiry): a leader frozen (SIGSTOP) or cut off from
the database stops sweeping before another can take over, and a sweep it sent just before runs
only if its lease still holds on the database's clock (LEADING). A clean stop deletes the row, so
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
- Why tasks wait, on the leader every WAITS_CHECK_SECONDS: queued tasks held by something only
  an operator changes (the kill switch, no daily cap or a spent one, a paused tool, a tool's
  own cap spent) are logged as a warning naming the tools and the command that frees them,
  each reason at most once every WAITS_REPEAT_SECONDS while it lasts. Read with GetStatus's own
  statement, so the log says what the status page shows. A replica also warns once at start
  (`warn_at_start`, by the process serving the page) when the switch or the cap lets nothing run.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import uuid
from dataclasses import dataclass

from generation.task.v1 import task_pb2
from service import messages
from service.database import Database
from service.rpcs import (
    STATEMENTS,
    bind_get_settings,
    bind_get_status,
    respond_status,
    signal_event,
    signal_requeue,
)
from service.settings import Settings
from service.signals import Signals
from workers_sdk.cli.render import money

log = logging.getLogger(__name__)

# A sweep runs only while its sender holds the maintenance lease on the database's clock (a
# one-time filter: the function is not called otherwise). A leader cut off from the database can
# send one just before its lease ends, and it arrives when the link heals: the database must not
# run it once another process leads (found in review: a thawed leader rescued 200 tasks after
# another had taken over).
LEADING = (
    "EXISTS (SELECT 1 FROM generation.leader AS l "
    "WHERE l.name = %(leader)s AND l.holder = %(holder)s AND l.expires_at > now())"
)
RESCUE_SQL = (
    "SELECT (r.task).id, (r.task).tool_id, (r.task).status, r.event "
    f"FROM generation.rescue_lapsed_v2(%(batch)s) AS r WHERE {LEADING}"
)
EXPIRE_SQL = (
    "SELECT (e.task).id, e.event FROM generation.expire_tasks_v1(%(batch)s, %(disabled)s) AS e "
    f"WHERE {LEADING}"
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
# Withdrawn at a clean stop. The gates in force change with it, so the watchdog's clock restarts
# (stale_reason_v2 counts from settings.gates_changed_at): a task held by this replica's switch
# is not called abandoned the moment the replica goes, as it is not when one crashes.
OVERRIDES_GONE_SQL = """
WITH gone AS (
  DELETE FROM generation.replica_overrides WHERE replica_id = %(replica)s
  RETURNING disabled OR daily_cap_nanos IS NOT NULL AS overrode)
UPDATE generation.settings SET gates_changed_at = now()
WHERE EXISTS (SELECT 1 FROM gone WHERE gone.overrode)
"""

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

STOP_STATEMENT_SECONDS = 2.0
"""The bound on what a stop writes (giving the lease up, withdrawing overrides) and on the
hand-backs it waits for: each lapses or ages out on its own, and a frozen database must not
hold a stop for the pool's whole bound (17 s; found in review)."""

BATCH = 1000
PURGE_SQL = STATEMENTS["PurgeTasks"]
PURGE_BATCH = 1000
PURGE_MAX_BATCHES = 10
PURGE_INTERVAL_SECONDS = 3600.0
PURGE_RETRY_SECONDS = 60.0


WAITS_CHECK_SECONDS = 10.0
WAITS_REPEAT_SECONDS = 60.0


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


async def expire_tasks(
    database: Database, signals: Signals, settings: Settings, leadership: Leadership
) -> int:
    """One expiry sweep, as `rescue_lapsed_leases`; returns how many tasks expired."""
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
            purge_due = await _purge(database)
        due = min(rescue_due, election_due) if leadership.leading else election_due
        await asyncio.sleep(max(0.0, min(interval, due - loop.time())))


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


# -- why tasks wait ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Wait:
    """Queued tasks held by one thing only an operator changes."""

    reason: str
    """What holds them: disabled, paused, no_cap, zero_cap, cap_spent, tool_cap_spent, or
    over_cap (one task of each tool at least: the claim passes over it, the others run)."""
    tools: list[str]
    tasks: int
    why: str
    fix: str

    def __str__(self) -> str:
        tasks = f"{self.tasks} queued task{'s' if self.tasks != 1 else ''}"
        tools = f"tool{'s' if len(self.tools) != 1 else ''} {', '.join(self.tools)}"
        return f"{tasks} ({tools}) wait: {self.why}; {self.fix}"


def cap_in_force(settings: task_pb2.Settings) -> int | None:
    """The global cap in force, as the claim reads it (gates_v1): an override replaces it."""
    if settings.HasField("cap_override_nanos"):
        return settings.cap_override_nanos
    return settings.daily_cap_nanos if settings.HasField("daily_cap_nanos") else None


def _switch(settings: task_pb2.Settings) -> tuple[str, str] | None:
    """Why the kill switch stops every claim, and the fix; None when it is on."""
    if settings.disabled_by_environment:
        return (
            "GENQ_DISABLED on a replica keeps the kill switch off",
            "unset it there and restart that replica (generation.replica_overrides lists them)",
        )
    if not settings.enabled:
        return "the kill switch is off", "`genq resume` turns it on"
    return None


def _no_cap(settings: task_pb2.Settings) -> tuple[str, str, str] | None:
    """(reason, why, fix) when the global cap lets nothing run at all; None otherwise."""
    cap = cap_in_force(settings)
    if cap is None:
        return (
            "no_cap",
            "no daily spend cap is set",
            "`genq cap N` sets one (N currency units a day, e.g. `genq cap 10`)",
        )
    if cap == 0:
        if settings.HasField("cap_override_nanos"):
            return (
                "zero_cap",
                "GENQ_DAILY_CAP_NANOS=0 on a replica makes the daily cap 0",
                "raise or unset it there and restart that replica",
            )
        return "zero_cap", "the daily cap is 0", "`genq cap N` raises it"
    return None


def start_warnings(settings: task_pb2.Settings) -> list[str]:
    """What to say at start when the switch or the cap lets no task run at all."""
    said = []
    if switch := _switch(settings):
        why, fix = switch
        said.append(f"{why}, so nothing will run: {fix}")
    if cap := _no_cap(settings):
        _, why, fix = cap
        said.append(f"{why}, so nothing will run: {fix}")
    return said


def waits(status: task_pb2.Status) -> list[Wait]:
    """Each tool with queued tasks, under the first thing that holds them in the claim's own
    order (switch, pause, cap, the tool's cap, a task estimated above the cap in force), grouped
    by reason. A cap counts as spent when today's spend and reservations reached it; a room
    today smaller than the next task's estimate also holds the tool, which this does not see
    (the claim's idle reason does)."""
    settings = status.settings
    cap = cap_in_force(settings)
    currency = settings.currency
    # Reason -> (why, the fixes: one for all, or one per tool, the tools).
    held: dict[str, tuple[str, list[str], list[task_pb2.ToolStatus]]] = {}

    def hold(reason: str, why: str, fix: str, tool: task_pb2.ToolStatus) -> None:
        _, fixes, tools = held.setdefault(reason, (why, [], []))
        if fix not in fixes:
            fixes.append(fix)
        tools.append(tool)

    for tool in status.tools:
        if not tool.queued:
            continue
        name = shlex.quote(tool.name)
        if switch := _switch(settings):
            hold("disabled", *switch, tool)
        elif tool.paused:
            hold("paused", "their tool is paused", f"`genq resume {name}`", tool)
        elif no_cap := _no_cap(settings):
            hold(*no_cap, tool)
        elif cap is not None and settings.spent_today_nanos + settings.reserved_nanos >= cap:
            used = money(settings.spent_today_nanos + settings.reserved_nanos, currency)
            fix = (
                "raise GENQ_DAILY_CAP_NANOS on the replica that sets it"
                if settings.HasField("cap_override_nanos")
                else f"`genq cap N` with N above {money(cap)}"
            )
            hold(
                "cap_spent",
                f"today's spend and reservations ({used}) reached the daily cap",
                f"{fix}, or wait for the local day ({settings.timezone}) to turn",
                tool,
            )
        elif (
            tool.HasField("daily_cap_nanos")
            and tool.spent_today_nanos + tool.reserved_nanos >= tool.daily_cap_nanos
        ):
            hold(
                "tool_cap_spent",
                "their tool's own daily cap is spent",
                f"`genq cap N --tool {name}` (now {money(tool.daily_cap_nanos, currency)})",
                tool,
            )
        elif over := over_cap(tool, settings):
            why = "each is estimated above the daily cap in force (passed over; the others run)"
            hold("over_cap", why, over, tool)
    return [
        Wait(
            reason,
            [t.name for t in tools],
            len(tools) if reason == "over_cap" else sum(t.queued for t in tools),
            why,
            "; ".join(fixes),
        )
        for reason, (why, fixes, tools) in held.items()
    ]


def over_cap(tool: task_pb2.ToolStatus, settings: task_pb2.Settings) -> str | None:
    """The fix when a queued task of the tool is estimated above the cap in force (the tool's
    own, or the global one), which the claim passes over until it is raised; None otherwise."""
    largest = tool.largest_queued_estimate_nanos
    cap = cap_in_force(settings)
    fixes = []
    if tool.HasField("daily_cap_nanos") and largest > tool.daily_cap_nanos:
        fixes.append(f"`genq cap N --tool {shlex.quote(tool.name)}`")
    if cap is not None and largest > cap:
        fixes.append(
            "GENQ_DAILY_CAP_NANOS raised on the replica that sets it"
            if settings.HasField("cap_override_nanos")
            else "`genq cap N`"
        )
    if not fixes:
        return None
    return f"{' and '.join(fixes)} with N at least {money(largest)}, or cancel that task"


async def warn_at_start(database: Database, settings: Settings) -> None:
    """Warns when the switch or the cap lets nothing run (once per host, at start)."""
    try:
        rows = await database.fetch(
            STATEMENTS["GetSettings"], bind_get_settings(task_pb2.GetSettingsRequest(), settings)
        )
    except Exception as error:  # the health check says when the database is down
        log.debug("could not read the settings at start: %s", error)
        return
    for warning in start_warnings(messages.settings(rows[0])):
        log.warning("%s", warning)


class Waits:
    """The leader's log of why queued tasks wait (see the module's docstring)."""

    def __init__(
        self,
        database: Database,
        settings: Settings,
        *,
        check_seconds: float = WAITS_CHECK_SECONDS,
        repeat_seconds: float = WAITS_REPEAT_SECONDS,
    ) -> None:
        self.database = database
        self.params = bind_get_status(task_pb2.GetStatusRequest(), settings)
        self.check_seconds = check_seconds
        self.repeat_seconds = repeat_seconds
        self._due = 0.0
        self._said: dict[str, float] = {}
        """Reason -> loop time it was last logged, for the reasons that still hold."""

    async def check(self) -> list[Wait]:
        """Reads the status when a check is due and logs each reason due again; returns what
        it logged."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now < self._due:
            return []
        try:
            rows = await self.database.fetch(STATEMENTS["GetStatus"], self.params)
        except Exception as error:  # the sweeps and the health check already say so
            log.debug("could not read the status: %s", error)
            return []
        finally:
            # Counted from the read's end: a slow read is never followed at once by the next.
            self._due = loop.time() + self.check_seconds
        found = waits(respond_status(rows).status)
        # A reason that cleared is forgotten: should it come back, it is said at once.
        self._said = {w.reason: self._said[w.reason] for w in found if w.reason in self._said}
        logged = []
        for wait in found:
            last = self._said.get(wait.reason)
            if last is None or now - last >= self.repeat_seconds:
                self._said[wait.reason] = now
                log.warning("%s", wait)
                logged.append(wait)
        return logged
