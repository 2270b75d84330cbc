"""Each RPC's binding to its SQL: validate the request into statement parameters, then map the rows.

The SQL itself lives in task.proto, in the `sql` option of each method; `STATEMENTS` reads it
from the descriptor, so what the proto shows is exactly what runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message
from psycopg.types.json import Jsonb

from generation.task.v1 import options_pb2, task_pb2
from service import messages, validation
from service.errors import (
    InvalidArgument,
    LeaseLost,
    TaskNotFound,
    TaskNotStale,
    TaskNotTerminal,
)
from service.messages import Row
from service.settings import Settings
from service.signals import Signals

DEFAULT_MAX_RETRIES = 3
DEFAULT_PROCESSING_GRACE_SECONDS = 120
DEFAULT_QUEUED_MAX_AGE_SECONDS = 900
DEFAULT_STALE_LIMIT = 500
MAX_STALE_LIMIT = 10_000
MAX_TEXT = 8_192

SERVICE = task_pb2.DESCRIPTOR.services_by_name["GenerationDataService"]
STATEMENTS: dict[str, str] = {
    method.name: method.GetOptions().Extensions[options_pb2.sql]
    for method in SERVICE.methods
    if method.GetOptions().Extensions[options_pb2.sql]
}

Params = dict[str, Any]


@dataclass(frozen=True)
class Binding:
    bind: Callable[[Any, Settings], Params]
    """Checks the request and returns the statement's parameters."""
    respond: Callable[[list[Row]], Message]
    """Builds the response from the rows the statement returned."""
    after: Callable[[Signals, list[Row]], None] | None = None
    """Signals to send once the statement has committed (wakes, events)."""
    park: Callable[[Any, Params, Settings], tuple[str, float]] | None = None
    """For a claim that may wait: the tool to park on and for how long."""


def _fenced(rows: list[Row], changed_column: str = "id") -> Row:
    """The row a fenced write returned; raises when the task is missing or the lease not held.

    Fenced statements return one row: `found` (the task exists) and the changed row's columns,
    NULL when the WHERE clause (status, lease token, lease still running) refused the write.
    """
    (row,) = rows
    if not row["found"]:
        raise TaskNotFound("task not found")
    if row[changed_column] is None and row.get("forced"):
        raise TaskNotStale(
            "the task is not stale now; only stale tasks can be failed without a lease"
        )
    if row[changed_column] is None:
        raise LeaseLost("lease lost: the task is no longer held under this lease")
    return row


def _stale_thresholds(request: Any) -> Params:
    return {
        "processing_grace_seconds": validation.in_range(
            "processing_grace_seconds", request.processing_grace_seconds, 0, 86_400 * 30
        )
        or DEFAULT_PROCESSING_GRACE_SECONDS,
        "queued_max_age_seconds": validation.in_range(
            "queued_max_age_seconds", request.queued_max_age_seconds, 0, 86_400 * 365
        )
        or DEFAULT_QUEUED_MAX_AGE_SECONDS,
    }


def bind_upsert_tool(request: task_pb2.UpsertToolRequest, settings: Settings) -> Params:
    return {"name": validation.text("name", request.name, max_length=200, required=True)}


def bind_queue_task(request: task_pb2.QueueTaskRequest, settings: Settings) -> Params:
    return {
        "tool_id": validation.required_uuid("tool_id", request.tool_id),
        "input": validation.struct("input", request.input, max_bytes=settings.max_input_bytes),
        "priority": validation.in_range("priority", request.priority, -100, 100),
        "max_retries": validation.in_range(
            "max_retries",
            request.max_retries if request.HasField("max_retries") else DEFAULT_MAX_RETRIES,
            0,
            100,
        ),
        "reserved_token_amount": validation.amount(
            "reserved_token_amount", request.reserved_token_amount
        ),
        "billing_idempotency_key": validation.text(
            "billing_idempotency_key", request.billing_idempotency_key, max_length=512
        ),
        "w3c_traceparent": validation.traceparent("w3c_traceparent", request.w3c_traceparent),
    }


def bind_claim_next_task(request: task_pb2.ClaimNextTaskRequest, settings: Settings) -> Params:
    if request.wait.seconds < 0 or request.wait.nanos < 0:
        raise InvalidArgument("wait must not be negative", field="wait")
    if request.wait.ToTimedelta().total_seconds() > settings.max_claim_wait_seconds:
        raise InvalidArgument(
            f"wait must be at most {settings.max_claim_wait_seconds:g} s", field="wait"
        )
    return {
        "tool_id": validation.required_uuid("tool_id", request.tool_id),
        "lease_seconds": settings.lease_seconds,
    }


def park_claim(
    request: task_pb2.ClaimNextTaskRequest, params: Params, settings: Settings
) -> tuple[str, float]:
    return str(params["tool_id"]), request.wait.ToTimedelta().total_seconds()


def bind_heartbeat_task(request: task_pb2.HeartbeatTaskRequest, settings: Settings) -> Params:
    return {
        "task_id": validation.required_uuid("task_id", request.task_id),
        "lease_token": validation.required_uuid("lease_token", request.lease_token),
        "lease_seconds": settings.lease_seconds,
    }


def bind_complete_task(request: task_pb2.CompleteTaskRequest, settings: Settings) -> Params:
    usage = request.reported_usage
    return {
        "task_id": validation.required_uuid("task_id", request.task_id),
        "lease_token": validation.required_uuid("lease_token", request.lease_token),
        "output": validation.struct("output", request.output, max_bytes=settings.max_input_bytes),
        "reported_usage": Jsonb(
            {
                "token_amount": validation.amount(
                    "reported_usage.token_amount", usage.token_amount
                ),
                "cost_nanos": validation.amount("reported_usage.cost_nanos", usage.cost_nanos),
                "details": validation.struct(
                    "reported_usage.details", usage.details, max_bytes=settings.max_input_bytes
                ).obj,
            }
        ),
    }


def bind_release_task(request: task_pb2.ReleaseTaskRequest, settings: Settings) -> Params:
    return {
        "task_id": validation.required_uuid("task_id", request.task_id),
        "lease_token": validation.required_uuid("lease_token", request.lease_token),
    }


def bind_fail_task(request: task_pb2.FailTaskRequest, settings: Settings) -> Params:
    lease_token = validation.optional_uuid("lease_token", request.lease_token)
    if lease_token is None and request.increment_retry:
        raise InvalidArgument(
            "lease_token is required unless increment_retry is false (the reaper's forced fail)",
            field="lease_token",
        )
    return {
        "task_id": validation.required_uuid("task_id", request.task_id),
        "lease_token": lease_token,
        "error": validation.text("error", request.error, max_length=MAX_TEXT),
        "increment_retry": request.increment_retry,
        **_stale_thresholds(request),
    }


def bind_list_stale_tasks(request: task_pb2.ListStaleTasksRequest, settings: Settings) -> Params:
    return {
        **_stale_thresholds(request),
        "limit": validation.in_range("limit", request.limit, 0, MAX_STALE_LIMIT)
        or DEFAULT_STALE_LIMIT,
    }


def bind_get_task(request: task_pb2.GetTaskRequest, settings: Settings) -> Params:
    return {"task_id": validation.required_uuid("task_id", request.task_id)}


PUBLISHABLE = {
    task_pb2.TASK_EVENT_KIND_PROGRESS: "progress",
    task_pb2.TASK_EVENT_KIND_STREAMING_URL: "streaming_url",
    task_pb2.TASK_EVENT_KIND_PARTIAL_OUTPUT: "partial_output",
}


def bind_publish_task_event(
    request: task_pb2.PublishTaskEventRequest, settings: Settings
) -> Params:
    if request.kind not in PUBLISHABLE:
        raise InvalidArgument(
            "kind must be PROGRESS, STREAMING_URL or PARTIAL_OUTPUT; the service adds the others",
            field="kind",
        )
    return {
        "task_id": validation.required_uuid("task_id", request.task_id),
        "lease_token": validation.required_uuid("lease_token", request.lease_token),
        "kind": PUBLISHABLE[request.kind],
        "data": validation.struct("data", request.data, max_bytes=settings.max_input_bytes),
    }


def bind_watch_task_events(request: task_pb2.WatchTaskEventsRequest, settings: Settings) -> Params:
    return {
        "task_id": validation.required_uuid("task_id", request.task_id),
        "after_sequence": validation.amount("after_sequence", request.after_sequence),
    }


def bind_list_unsettled_tasks(
    request: task_pb2.ListUnsettledTasksRequest, settings: Settings
) -> Params:
    return {
        "limit": validation.in_range("limit", request.limit, 0, MAX_STALE_LIMIT)
        or DEFAULT_STALE_LIMIT
    }


def bind_settle_task(request: task_pb2.SettleTaskRequest, settings: Settings) -> Params:
    return {"task_id": validation.required_uuid("task_id", request.task_id)}


def respond_settle(rows: list[Row]) -> task_pb2.SettleTaskResponse:
    (row,) = rows
    if not row["found"]:
        raise TaskNotFound("task not found")
    if row["task_id"] is None:
        raise TaskNotTerminal("only a completed or failed task can be settled")
    return task_pb2.SettleTaskResponse(
        settlement=messages.settlement(row), settled_now=row["settled_now"]
    )


def signal_event(signals: Signals, rows: list[Row]) -> None:
    for row in rows:
        if row.get("event"):
            signals.event_added(row["event"])


def signal_queued(signals: Signals, rows: list[Row]) -> None:
    for row in rows:
        if row.get("status") == "queued":
            signals.task_queued(str(row["tool_id"]))


def signal_requeue(signals: Signals, rows: list[Row]) -> None:
    """FailTask and ReleaseTask: a requeued task wakes claimers; every outcome is an event."""
    signal_queued(signals, rows)
    signal_event(signals, rows)


def respond_get_task(rows: list[Row]) -> task_pb2.GetTaskResponse:
    if not rows:
        raise TaskNotFound("task not found")
    return task_pb2.GetTaskResponse(task=messages.task(rows[0]))


def respond_claim(rows: list[Row]) -> task_pb2.ClaimNextTaskResponse:
    if not rows:
        return task_pb2.ClaimNextTaskResponse()
    row = rows[0]
    return task_pb2.ClaimNextTaskResponse(
        task=messages.task(row), lease_token=str(row["lease_token"])
    )


def respond_heartbeat(rows: list[Row]) -> task_pb2.HeartbeatTaskResponse:
    row = _fenced(rows, "claim_expires_at")
    response = task_pb2.HeartbeatTaskResponse()
    response.claim_expires_at.FromDatetime(row["claim_expires_at"])
    return response


def respond_stale(rows: list[Row]) -> task_pb2.ListStaleTasksResponse:
    return task_pb2.ListStaleTasksResponse(
        tasks=[
            task_pb2.StaleTask(
                task=messages.task(row),
                reason=task_pb2.StaleReason.Value(f"STALE_REASON_{row['stale_reason'].upper()}"),
            )
            for row in rows
        ]
    )


BINDINGS: dict[str, Binding] = {
    "UpsertTool": Binding(
        bind_upsert_tool,
        lambda rows: task_pb2.UpsertToolResponse(tool=messages.tool(rows[0])),
    ),
    "QueueTask": Binding(
        bind_queue_task,
        lambda rows: task_pb2.QueueTaskResponse(task=messages.task(rows[0])),
        after=signal_queued,
    ),
    "ClaimNextTask": Binding(bind_claim_next_task, respond_claim, park=park_claim),
    "HeartbeatTask": Binding(bind_heartbeat_task, respond_heartbeat),
    "CompleteTask": Binding(
        bind_complete_task,
        lambda rows: task_pb2.CompleteTaskResponse(task=messages.task(_fenced(rows))),
        after=signal_event,
    ),
    "FailTask": Binding(
        bind_fail_task,
        lambda rows: task_pb2.FailTaskResponse(task=messages.task(_fenced(rows))),
        after=signal_requeue,
    ),
    "ReleaseTask": Binding(
        bind_release_task,
        lambda rows: task_pb2.ReleaseTaskResponse(task=messages.task(_fenced(rows))),
        after=signal_requeue,
    ),
    "ListStaleTasks": Binding(bind_list_stale_tasks, respond_stale),
    "GetTask": Binding(bind_get_task, respond_get_task),
    "PublishTaskEvent": Binding(
        bind_publish_task_event,
        lambda rows: task_pb2.PublishTaskEventResponse(
            event=messages.task_event(_fenced(rows)["event"])
        ),
        after=signal_event,
    ),
    "ListUnsettledTasks": Binding(
        bind_list_unsettled_tasks,
        lambda rows: task_pb2.ListUnsettledTasksResponse(tasks=[messages.task(r) for r in rows]),
    ),
    "SettleTask": Binding(bind_settle_task, respond_settle),
}

# Server-streaming: the statement reads one page of events; service/handlers.py follows.
WATCH = bind_watch_task_events
