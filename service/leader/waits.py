"""Why tasks wait, on the leader every WAITS_CHECK_SECONDS: queued tasks held by something only
an operator changes (the kill switch, no daily cap or a spent one, a paused tool, a tool's own
cap spent, a task estimated above the cap in force) are logged as a warning naming the tools and
the command that frees them, each reason at most once every WAITS_REPEAT_SECONDS while it lasts.
Read with GetStatus's own statement, so the log says what the status page shows. A replica also
warns once at start (`warn_at_start`, by the process serving the page) when the switch or the
cap lets nothing run.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
from dataclasses import dataclass

from generation.task.v1 import task_pb2
from service.api import messages
from service.api.rpcs import STATEMENTS, bind_get_settings, bind_get_status, respond_status
from service.database import Database
from service.logs import LEADER_LOGGER
from service.settings import Settings
from workers_sdk.money import money

log = logging.getLogger(LEADER_LOGGER)

WAITS_CHECK_SECONDS = 10.0
WAITS_REPEAT_SECONDS = 60.0


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
