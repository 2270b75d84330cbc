"""What the page's task view reads: the task through GetTask's statement and binding, its events
through WatchTaskEvents' (one page at a time, as the RPC reads them), its attempts from the
attempts ledger (no RPC lists them), and why it waits, from GetStatus's answer and the reasons
service/leader/waits.py gives (the ones the log warns of).

Who reads what follows the RPCs: the task's input and output, and its events' data, only a caller
whose roles may call GetTask (a gateway, a reconciler, an operator) reads; a viewer reads the task
as ListTasks answers a viewer, without them. A token restricted to tools reaches only their tasks
(auth.py's scope, as GetTask's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from zoneinfo import ZoneInfo

from generation.task.v1 import task_pb2
from service.api import messages
from service.api.auth import RULES, Caller, Guard
from service.api.rpcs import BINDINGS, STATEMENTS, WATCH
from service.database import Database
from service.leader.waits import cap_in_force, waits
from service.settings import Settings

ATTEMPTS_SQL = (
    "SELECT attempt, started_at, ended_at, outcome::text AS outcome, cost_nanos, estimate_nanos "
    "FROM generation.attempts WHERE task_id = %(task_id)s ORDER BY attempt"
)
EVENTS_SHOWN = 2_000
"""Events read at most (WatchTaskEvents' pages of 500)."""
WAITING = (task_pb2.TASK_STATUS_QUEUED, task_pb2.TASK_STATUS_DISPATCHED)
CANCELLABLE = (*WAITING, task_pb2.TASK_STATUS_PROCESSING)
RETRYABLE = (
    task_pb2.TASK_STATUS_FAILED,
    task_pb2.TASK_STATUS_CANCELLED,
    task_pb2.TASK_STATUS_EXPIRED,
)


@dataclass
class TaskView:
    task: task_pb2.Task
    tool_name: str
    attempts: list[dict[str, Any]]
    events: list[task_pb2.TaskEvent]
    bodies: bool
    """The caller may read the input, the output and the events' data."""
    wait: str | None
    more_events: bool = False
    status: task_pb2.Status = field(default_factory=task_pb2.Status)


def may_read_bodies(caller: Caller) -> bool:
    return bool(caller.roles & RULES["GetTask"].roles)


async def read_task(
    database: Database,
    settings: Settings,
    guard: Guard,
    caller: Caller,
    task_id: str,
    status: task_pb2.Status,
    zone: ZoneInfo,
) -> TaskView:
    """The task view; raises the RPCs' own errors (a malformed id, a task not found, a tool
    the caller's token does not reach)."""
    request = task_pb2.GetTaskRequest(task_id=task_id)
    binding = BINDINGS["GetTask"]
    params = binding.bind(request, settings)  # InvalidArgument for a malformed id
    await guard.scope(caller, "GetTask", request, None)
    answer = binding.respond(await database.fetch(STATEMENTS["GetTask"], params))
    assert isinstance(answer, task_pb2.GetTaskResponse)
    task = answer.task
    bodies = may_read_bodies(caller)
    if not bodies:
        task.ClearField("input")
        task.ClearField("output")
    attempts = await database.fetch(ATTEMPTS_SQL, {"task_id": params["task_id"]})
    events: list[task_pb2.TaskEvent] = []
    after = 0
    while len(events) < EVENTS_SHOWN:
        request_page = task_pb2.WatchTaskEventsRequest(task_id=task_id, after_sequence=after)
        page_params = WATCH(request_page, settings)
        rows = await database.fetch(STATEMENTS["WatchTaskEvents"], page_params)
        page = [row["event"] for row in rows if row["event"] is not None]
        if not page:
            break
        events.extend(messages.task_event(event) for event in page)
        after = int(page[-1]["sequence"])
    if not bodies:
        for event in events:
            event.ClearField("data")
    tool = next((tool for tool in status.tools if tool.tool_id == task.tool_id), None)
    return TaskView(
        task=task,
        tool_name=tool.name if tool else task.tool_id,
        attempts=attempts,
        events=events,
        bodies=bodies,
        wait=wait_reason(task, tool, status, zone),
        more_events=len(events) >= EVENTS_SHOWN,
        status=status,
    )


def wait_reason(
    task: task_pb2.Task,
    tool: task_pb2.ToolStatus | None,
    status: task_pb2.Status,
    zone: ZoneInfo,
) -> str | None:
    """Why a queued task is not running yet, in the claim's order; None when it is not queued."""
    if task.status not in WAITING:
        return None
    now = status.as_of.ToDatetime(tzinfo=UTC)
    if tool is not None:
        for held in waits(status):  # the switch, the pause, the caps: what the log warns of
            if tool.name in held.tools and held.reason != "over_cap":
                return f"{held.why}; {held.fix}"
    settings = status.settings
    estimate = task.cost_estimate_nanos if task.HasField("cost_estimate_nanos") else None
    if estimate is not None:
        cap = cap_in_force(settings)
        if cap is not None and estimate > cap:
            return "its cost estimate is above the daily cap in force (the claim passes over it)"
        tool_cap = tool.daily_cap_nanos if tool and tool.HasField("daily_cap_nanos") else None
        if tool_cap is not None and estimate > tool_cap:
            return "its cost estimate is above its tool's daily cap (the claim passes over it)"
    if task.HasField("run_at") and task.run_at.ToDatetime(tzinfo=UTC) > now:
        when = _stamp(task.run_at.ToDatetime(tzinfo=UTC), zone)
        return f"it runs no sooner than {when} (a backoff or a later start)"
    resource_key = task.resource_key or (tool.resource_key if tool else "")
    for cooldown in status.cooling:
        if resource_key and cooldown.resource_key == resource_key:
            until = _stamp(cooldown.cooling_until.ToDatetime(tzinfo=UTC), zone)
            return f"its resource key {resource_key} is cooling until {until}"
    account_group = task.account_group or (tool.account_group if tool else "")
    for hold in status.holds:
        if account_group and hold.account_group == account_group:
            until = _stamp(hold.held_until.ToDatetime(tzinfo=UTC), zone)
            return f"its account group {account_group} is held until {until}"
    if tool is not None and tool.busy:
        return f"its tool or resource key is busy ({tool.in_flight} running)"
    for rate in status.rate_limits:
        if resource_key and rate.resource_key == resource_key and rate.HasField("limited_until"):
            until = _stamp(rate.limited_until.ToDatetime(tzinfo=UTC), zone)
            return f"its resource key {resource_key} is at its rate limit; a slot frees at {until}"
    if tool is not None and tool.no_worker_seen:
        return "no worker has claimed its tool's tasks for 10 minutes or more"
    return "ready: waiting for a worker to claim it"


def _stamp(moment: datetime, zone: ZoneInfo) -> str:
    return moment.astimezone(zone).strftime("%H:%M:%S")
