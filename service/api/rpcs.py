"""Each RPC's binding to its SQL: validate the request into statement parameters, then map the rows.

The SQL itself lives in task.proto, in the `sql` option of each method; `STATEMENTS` reads it
from the descriptor, so what the proto shows is exactly what runs.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from math import ceil
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message
from psycopg.types.json import Jsonb

from generation.task.v1 import options_pb2, task_pb2
from generation.task.v1.reasons import Reason
from service.api import messages, validation
from service.api.errors import (
    IdempotencyKeyReused,
    InvalidArgument,
    LeaseLost,
    TaskFinished,
    TaskNotFound,
    TaskNotRetryable,
    TaskNotStale,
    TaskNotTerminal,
    ToolNotFound,
)
from service.api.messages import Row
from service.api.signals import Signals
from service.settings import Settings

DEFAULT_TTL_SECONDS = 7 * 86_400
MAX_TTL_SECONDS = 10 * 365 * 86_400
MAX_BATCH = 1_000
"""Most items in one QueueTasks, HeartbeatTasks, CompleteTasks or FailTasks call, and most tasks
one ConfirmClaim names."""
MAX_CLAIM_BATCH = 100
"""Most tasks one ClaimTasks takes: a worker's free lanes, not a backlog to hoard."""
MAX_NAME = 200
MAX_IN_FLIGHT = 100_000
"""The highest concurrency limit of a tool or a resource key."""
MAX_RATE_CALLS = 1_000_000
MAX_RATE_LIMIT_UNITS = 10**15
MAX_RATE_UNITS = 10**12
"""The most runs and units a rate limit allows per window, and the most units one task may say
its run uses (QueueTaskRequest.rate_units)."""
MAX_RATE_WINDOW_SECONDS = 86_400
DEFAULT_PAGE = 500
MAX_PAGE = 10_000
MAX_TEXT = 8_192

SERVICE = task_pb2.DESCRIPTOR.services_by_name["GenerationDataService"]
STATEMENTS: dict[str, str] = {
    method.name: method.GetOptions().Extensions[options_pb2.sql]
    for method in SERVICE.methods
    if method.GetOptions().Extensions[options_pb2.sql]
}

Params = dict[str, Any]

HAND_BACK_SQL = (
    "SELECT c.task_found, c.event, (c.task).* "
    "FROM generation.release_task_v1(%(task_id)s, %(lease_token)s, 0, true) AS c"
)
"""ClaimNextTask's other half: a claim whose caller's deadline passed before its answer left is
handed straight back, costing nothing (see the RPC's comment in task.proto)."""


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
    rerun_deadlocks: bool = False
    """The statement can wait in a cycle by design (an enqueue's new idempotency keys, in
    another call's opposite order): run it again when Postgres rolls it back to break one."""


def _found(rows: list[Row]) -> Row:
    """The one row of a statement that also says whether the task exists (`task_found`)."""
    (row,) = rows
    if not row["task_found"]:
        raise TaskNotFound("task not found")
    return row


def _fenced(rows: list[Row], changed_column: str = "id") -> Row:
    """The row a fenced write returned; raises when the task is missing or the lease not held.

    Fenced statements return one row: `task_found` (the task exists) and the changed row's columns,
    NULL when the WHERE clause (status, lease token, lease still running) refused the write.
    """
    row = _found(rows)
    if row[changed_column] is None and row.get("forced"):
        raise TaskNotStale(
            "the task is not stale now; only stale tasks can be failed without a lease"
        )
    if row[changed_column] is None:
        raise LeaseLost("lease lost: the task is no longer held under this lease")
    return row


def bind_upsert_tool(request: task_pb2.UpsertToolRequest, settings: Settings) -> Params:
    return {"name": validation.text("name", request.name, max_length=MAX_NAME, required=True)}


def bind_queue_task(request: task_pb2.QueueTaskRequest, settings: Settings) -> Params:
    requeue = request.on_conflict == task_pb2.ON_CONFLICT_REQUEUE
    if request.requeue_key and not requeue:
        raise InvalidArgument("requeue_key goes with on_conflict REQUEUE", field="requeue_key")
    return {
        "tool_id": validation.required_uuid("tool_id", request.tool_id),
        **dict.fromkeys(OPTIONAL_TASK_FIELDS),
        **_task_fields(request, settings),
        "requeue": requeue,
        "requeue_key": validation.text("requeue_key", request.requeue_key, max_length=512),
    }


OPTIONAL_TASK_FIELDS = (
    "max_retries",
    "billing_idempotency_key",
    "w3c_traceparent",
    "idempotency_key",
    "run_at",
    "expires_at",
    "source",
    "resource_key",
    "account_group",
    "cost_estimate_nanos",
)
"""The columns of a new task that are NULL (the tool's default, or none) unless its request sets
them; `_task_fields` leaves them out then."""


def _task_fields(request: task_pb2.QueueTaskRequest, settings: Settings) -> Params:
    """The columns of a new task the request sets, checked, with its input, priority, reserved
    amount and TTL; an unset field is left out (OPTIONAL_TASK_FIELDS). Only the fields a request
    sets are looked at: most set two or three, and checking all sixteen of each item made a bind
    of 1,000 take 4.3 ms, now 3.0."""
    present = {descriptor.name for descriptor, _ in request.ListFields()}
    fields: Params = {"ttl_seconds": DEFAULT_TTL_SECONDS}
    # One fixed order of checks: a request with several bad fields always hears of the same one.
    if "ttl" in present:
        # Whole seconds, rounded up (1 ns lives 1 s); 0 never expires.
        fields["ttl_seconds"] = (
            ceil(validation.seconds("ttl", request.ttl, most=MAX_TTL_SECONDS)) or None
        )
    if "run_after" in present:
        fields["run_at"] = validation.timestamp("run_after", request.run_after)
    if "expires_at" in present:
        if "ttl" in present:
            raise InvalidArgument("set expires_at or ttl, not both", field="expires_at")
        expires_at = fields["expires_at"] = validation.timestamp("expires_at", request.expires_at)
        if "run_at" in fields and expires_at <= fields["run_at"]:
            raise InvalidArgument("expires_at must come after run_after", field="expires_at")
    fields["input"] = validation.struct("input", request.input, max_bytes=settings.max_input_bytes)
    fields["priority"] = validation.in_range("priority", request.priority, -100, 100)
    if "max_retries" in present:
        fields["max_retries"] = validation.in_range("max_retries", request.max_retries, 0, 100)
    fields["reserved_token_amount"] = validation.amount(
        "reserved_token_amount", request.reserved_token_amount
    )
    for name, check in TEXT_CHECKS:
        if name in present:
            fields[name] = check(name, getattr(request, name))
    if "cost_estimate_nanos" in present:
        fields["cost_estimate_nanos"] = validation.amount(
            "cost_estimate_nanos", request.cost_estimate_nanos
        )
    fields["rate_units"] = validation.in_range("rate_units", request.rate_units, 0, MAX_RATE_UNITS)
    return fields


TEXT_CHECKS: tuple[tuple[str, Callable[[str, str], str | None]], ...] = (
    ("billing_idempotency_key", partial(validation.text, max_length=512)),
    ("w3c_traceparent", validation.traceparent),
    ("idempotency_key", partial(validation.text, max_length=512)),
    ("source", partial(validation.text, max_length=MAX_NAME)),
    ("resource_key", partial(validation.text, max_length=MAX_NAME)),
    ("account_group", partial(validation.text, max_length=MAX_NAME)),
)
"""A new task's text fields, each with its check."""


def bind_queue_tasks(request: task_pb2.QueueTasksRequest, settings: Settings) -> Params:
    tool_id = validation.required_uuid("tool_id", request.tool_id)
    if not 1 <= len(request.tasks) <= MAX_BATCH:
        raise InvalidArgument(f"tasks must hold 1 to {MAX_BATCH} items", field="tasks")
    items = []
    for ordinal, item in enumerate(request.tasks):
        if item.tool_id not in ("", request.tool_id):
            raise InvalidArgument(f"tasks[{ordinal}].tool_id differs", field="tasks")
        if item.on_conflict == task_pb2.ON_CONFLICT_REQUEUE or item.requeue_key:
            raise InvalidArgument(
                "QueueTasks skips used keys; REQUEUE is QueueTask's", field="tasks"
            )
        # Unset fields are left out (jsonb_to_recordset reads an absent key as NULL): sending
        # and parsing the nulls of a thousand items took a sixth of the statement's time. So
        # are the values the statement defaults to (an item is often only its ordinal): the
        # items' JSON of a thousand took 1.3 ms to write, now 0.4.
        fields = _task_fields(item, settings)
        if document := fields.pop("input").obj:
            fields["input"] = document
        ttl = fields.pop("ttl_seconds")
        if ttl != DEFAULT_TTL_SECONDS:
            fields["ttl_seconds"] = ttl or 0  # 0: never expires
        for name in ("priority", "reserved_token_amount", "rate_units"):
            if not fields[name]:
                del fields[name]
        for moment in ("run_at", "expires_at"):
            if moment in fields:
                fields[moment] = fields[moment].isoformat()
        items.append({"ordinal": ordinal, **fields})
    return {"tool_id": tool_id, "items": Jsonb(items), "default_ttl_seconds": DEFAULT_TTL_SECONDS}


def _queued(rows: list[Row]) -> list[Row]:
    if not rows[0]["tool_found"]:
        raise ToolNotFound("tool not found")
    return [row for row in rows if row["id"] is not None]


def respond_queue_tasks(rows: list[Row]) -> task_pb2.QueueTasksResponse:
    if not rows[0]["tool_found"]:
        raise ToolNotFound("tool not found")
    shapes = [row for row in rows if row["ids"] is not None]
    created = sum(len(shape["ids"]) for shape in shapes)
    response = task_pb2.QueueTasksResponse(skipped=rows[0]["submitted"] - created)
    messages.queued_tasks(response.tasks, shapes)
    if ids := rows[0]["existing_ids"]:
        tool_id = rows[0]["existing_tool_id"]
        for task_id, status, key in zip(
            ids, rows[0]["existing_statuses"], rows[0]["existing_keys"], strict=True
        ):
            response.existing.add(
                id=task_id, tool_id=tool_id, status=messages.STATUSES[status], idempotency_key=key
            )
    return response


def respond_queue_task(rows: list[Row]) -> task_pb2.QueueTaskResponse:
    queued = _queued(rows)
    if not queued:
        raise IdempotencyKeyReused("idempotency_key was already used with a different input")
    return task_pb2.QueueTaskResponse(
        task=messages.task(queued[0]),
        created=queued[0]["inserted"],
        requeued_now=queued[0]["requeued_now"],
    )


def bind_claim_next_task(request: task_pb2.ClaimNextTaskRequest, settings: Settings) -> Params:
    validation.seconds("wait", request.wait, most=settings.max_claim_wait_seconds)
    return {
        "tool_id": validation.required_uuid("tool_id", request.tool_id),
        **_overrides(settings),
        "lease_seconds": settings.lease_seconds,
    }


def _overrides(settings: Settings) -> Params:
    """The environment's word on the kill switch and the cap, which the database cannot undo;
    and whether the claim's `started` events travel back as JSON (only the Redis mirror reads
    them: signal_started wakes in-process followers by the task's id)."""
    return {
        "disabled_override": settings.disabled,
        "cap_override": settings.daily_cap_nanos,
        "mirror": settings.redis_url is not None,
    }


def bind_claim_tasks(request: task_pb2.ClaimTasksRequest, settings: Settings) -> Params:
    validation.seconds("wait", request.wait, most=settings.max_claim_wait_seconds)
    return {
        "tool_id": validation.required_uuid("tool_id", request.tool_id),
        "limit": validation.in_range("limit", request.limit, 0, MAX_CLAIM_BATCH) or 1,
        **_overrides(settings),
        "lease_seconds": settings.lease_seconds,
    }


def respond_claim_tasks(rows: list[Row]) -> task_pb2.ClaimTasksResponse:
    if rows[0]["idle_reason"] == "unknown_tool":
        raise ToolNotFound("tool not found")
    if rows[0]["id"] is None:
        idle = task_pb2.ClaimTasksResponse(idle_reason=_idle_reason(rows[0]))
        messages.timestamp(idle.idle_until, rows[0]["idle_until"])
        return idle
    response = task_pb2.ClaimTasksResponse()
    moments = messages.Moments()
    for row in rows:
        claimed = response.tasks.add(lease_token=str(row["lease_token"]))
        messages.task_into(claimed.task, row, moments)
    response.lease.FromSeconds(rows[0]["lease"])
    return response


def _idle_reason(row: Row) -> task_pb2.IdleReason.ValueType:
    return task_pb2.IdleReason.Value(f"IDLE_REASON_{row['idle_reason'].upper()}")


def _items(request: Any, bind: Callable[[Any, Settings], Params], settings: Settings) -> Params:
    """A batch's items, each checked as its single RPC checks it (errors name `tasks[i]`), as
    one jsonb array the statement unpacks; `ordinal` keeps the request order of the answers."""
    if not 1 <= len(request.tasks) <= MAX_BATCH:
        raise InvalidArgument(f"tasks must hold 1 to {MAX_BATCH} items", field="tasks")
    items = []
    for ordinal, item in enumerate(request.tasks):
        try:
            params = bind(item, settings)
        except InvalidArgument as error:
            field = f"tasks[{ordinal}].{error.metadata.get('field', '')}".rstrip(".")
            raise InvalidArgument(f"tasks[{ordinal}]: {error}", field=field) from None
        items.append(
            {
                "ordinal": ordinal,
                **{name: _json(value) for name, value in params.items()},
            }
        )
    return {"items": Jsonb(items), "lease_seconds": settings.lease_seconds}


def _json(value: Any) -> Any:
    """A statement parameter as an item of a jsonb array."""
    if isinstance(value, Jsonb):
        return value.obj
    return str(value) if isinstance(value, uuid.UUID) else value


def _refused(row: Row, changed_column: str = "id") -> str:
    """A batch item's refusal, as the single RPC would raise it ('' when taken)."""
    if not row["task_found"]:
        return Reason.TASK_NOT_FOUND.value
    return Reason.LEASE_LOST.value if row[changed_column] is None else ""


def bind_heartbeat_tasks(request: task_pb2.HeartbeatTasksRequest, settings: Settings) -> Params:
    return _items(request, bind_heartbeat_task, settings)


def respond_heartbeat_tasks(rows: list[Row]) -> task_pb2.HeartbeatTasksResponse:
    response = task_pb2.HeartbeatTasksResponse()
    moments = messages.Moments()
    for row in rows:
        refused = _refused(row, "claim_expires_at")
        result = response.results.add(task_id=str(row["requested_id"]), refused=refused)
        if not refused:
            _heartbeat(row, result.heartbeat, moments)
    return response


def bind_confirm_claim(request: task_pb2.ConfirmClaimRequest, settings: Settings) -> Params:
    tool_id = validation.required_uuid("tool_id", request.tool_id)
    lease_token = validation.required_uuid("lease_token", request.lease_token)
    if not 1 <= len(request.task_ids) <= MAX_BATCH:
        raise InvalidArgument(f"task_ids must hold 1 to {MAX_BATCH} ids", field="task_ids")
    task_ids = [
        validation.required_uuid(f"task_ids[{ordinal}]", task_id)
        for ordinal, task_id in enumerate(request.task_ids)
    ]
    if len(set(task_ids)) < len(task_ids):
        raise InvalidArgument("task_ids repeats a task", field="task_ids")
    return {"tool_id": tool_id, "lease_token": lease_token, "task_ids": task_ids}


def respond_confirm_claim(rows: list[Row]) -> task_pb2.ConfirmClaimResponse:
    return task_pb2.ConfirmClaimResponse(
        task_ids=[str(row["task_id"]) for row in rows],
        cancel_requested_task_ids=[str(row["task_id"]) for row in rows if row["cancel_requested"]],
    )


def bind_complete_tasks(request: task_pb2.CompleteTasksRequest, settings: Settings) -> Params:
    return _items(request, bind_complete_task, settings)


def bind_fail_tasks(request: task_pb2.FailTasksRequest, settings: Settings) -> Params:
    def leased(item: task_pb2.FailTaskRequest, settings: Settings) -> Params:
        validation.required_uuid("lease_token", item.lease_token)  # no forced fails here
        return bind_fail_task(item, settings)

    return _items(request, leased, settings)


def _report_results(
    response: task_pb2.CompleteTasksResponse | task_pb2.FailTasksResponse, rows: list[Row]
) -> task_pb2.CompleteTasksResponse | task_pb2.FailTasksResponse:
    moments = messages.Moments()
    for row in rows:
        result = response.results.add(task_id=str(row["requested_id"]))
        if refused := _refused(row):
            result.refused = refused
        else:
            messages.brief_task(result.task, row, moments)
    return response


def park_claim(
    request: task_pb2.ClaimNextTaskRequest | task_pb2.ClaimTasksRequest,
    params: Params,
    settings: Settings,
) -> tuple[str, float]:
    return str(params["tool_id"]), request.wait.seconds + request.wait.nanos / 1e9


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
        "cost_nanos": validation.cost("reported_usage.cost_nanos", usage.cost_nanos),
        "reported_usage": Jsonb(
            {
                "token_amount": validation.amount(
                    "reported_usage.token_amount", usage.token_amount
                ),
                "cost_nanos": validation.cost("reported_usage.cost_nanos", usage.cost_nanos),
                "details": validation.struct(
                    "reported_usage.details", usage.details, max_bytes=settings.max_input_bytes
                ).obj,
            }
        ),
        "resource_key": _used_key(request),
    }


def _used_key(request: task_pb2.CompleteTaskRequest | task_pb2.FailTaskRequest) -> str | None:
    return validation.text("resource_key", request.resource_key, max_length=MAX_NAME)


def bind_release_task(request: task_pb2.ReleaseTaskRequest, settings: Settings) -> Params:
    return {
        "task_id": validation.required_uuid("task_id", request.task_id),
        "lease_token": validation.required_uuid("lease_token", request.lease_token),
        "cost_nanos": validation.cost("cost_nanos", request.cost_nanos),
    }


FAILURES = {
    task_pb2.FAILURE_KIND_RETRYABLE: "retryable",
    task_pb2.FAILURE_KIND_PERMANENT: "permanent",
    task_pb2.FAILURE_KIND_ACCOUNT: "account",
    task_pb2.FAILURE_KIND_CANCELLED: "cancelled",
}


def bind_fail_task(request: task_pb2.FailTaskRequest, settings: Settings) -> Params:
    lease_token = validation.optional_uuid("lease_token", request.lease_token)
    if request.failure not in (task_pb2.FAILURE_KIND_UNSPECIFIED, *FAILURES):
        raise InvalidArgument("failure is not a FailureKind", field="failure")
    failure = FAILURES.get(request.failure, "retryable" if request.increment_retry else "permanent")
    if lease_token is None and failure != "permanent":
        raise InvalidArgument(
            "lease_token is required unless the failure is permanent (the reaper's forced fail)",
            field="lease_token",
        )
    return {
        "task_id": validation.required_uuid("task_id", request.task_id),
        "lease_token": lease_token,
        "error": validation.text("error", request.error, max_length=MAX_TEXT),
        "failure": failure,
        "cost_nanos": validation.cost(
            "reported_usage.cost_nanos", request.reported_usage.cost_nanos
        ),
        "resource_key": _used_key(request),
    }


def bind_task_id(request: Any, settings: Settings) -> Params:
    return {"task_id": validation.required_uuid("task_id", request.task_id)}


def bind_tool_id(request: Any, settings: Settings) -> Params:
    return {"tool_id": validation.required_uuid("tool_id", request.tool_id)}


def bind_cancel_tasks(request: task_pb2.CancelTasksRequest, settings: Settings) -> Params:
    return {
        "tool_id": validation.required_uuid("tool_id", request.tool_id),
        "include_processing": request.include_processing,
        "idempotency_key_prefix": validation.text(
            "idempotency_key_prefix", request.idempotency_key_prefix, max_length=512
        ),
        "limit": validation.in_range("limit", request.limit, 0, 10_000) or 1_000,
    }


def bind_retry_task(request: task_pb2.RetryTaskRequest, settings: Settings) -> Params:
    return {
        "task_id": validation.required_uuid("task_id", request.task_id),
        "reserved_token_amount": validation.amount(
            "reserved_token_amount", request.reserved_token_amount
        ),
        "retry_key": validation.text("retry_key", request.retry_key, max_length=512),
    }


def _optional(request: Any, name: str, check: Callable[[str, Any], Any]) -> Any:
    return check(name, getattr(request, name)) if request.HasField(name) else None


def _clear(request: Any, allowed: set[str]) -> list[str]:
    unknown = set(request.clear) - allowed
    if unknown:
        raise InvalidArgument(
            f"clear takes {', '.join(sorted(allowed))}; not {', '.join(sorted(unknown))}",
            field="clear",
        )
    return list(request.clear)


def _seconds(name: str, value: int) -> int:
    return validation.in_range(name, value, 0, 30 * 86_400)


def _key(name: str, value: str) -> str | None:
    return validation.text(name, value, max_length=MAX_NAME, required=True)


def bind_configure_tool(request: task_pb2.ConfigureToolRequest, settings: Settings) -> Params:
    params = {
        "tool_id": validation.required_uuid("tool_id", request.tool_id),
        "max_attempts": _optional(
            request, "max_attempts", lambda n, v: validation.in_range(n, v, 0, 100)
        ),
        "backoff_base_seconds": _optional(request, "backoff_base_seconds", _seconds),
        "backoff_max_seconds": _optional(request, "backoff_max_seconds", _seconds),
        "lease_seconds": _optional(
            request,
            "lease_seconds",
            lambda n, v: validation.in_range(n, v, settings.min_lease_seconds, 86_400),
        ),
        "resource_key": _optional(request, "resource_key", _key),
        "account_group": _optional(request, "account_group", _key),
        "cost_estimate_nanos": _optional(request, "cost_estimate_nanos", validation.amount),
        "daily_cap_nanos": _optional(request, "daily_cap_nanos", validation.amount),
        "paused": request.paused if request.HasField("paused") else None,
        "max_in_flight": _optional(request, "max_in_flight", _in_flight),
        "clear": _clear(
            request,
            {"lease_seconds", "resource_key", "account_group", "daily_cap_nanos", "max_in_flight"},
        ),
    }
    return params


def _in_flight(field: str, value: int) -> int:
    return validation.in_range(field, value, 1, MAX_IN_FLIGHT)


def bind_set_resource_limit(
    request: task_pb2.SetResourceLimitRequest, settings: Settings
) -> Params:
    return {
        "resource_key": _key("resource_key", request.resource_key),
        "max_in_flight": _optional(request, "max_in_flight", _in_flight),
    }


def bind_get_resource_key(request: task_pb2.GetResourceKeyRequest, settings: Settings) -> Params:
    return {"resource_key": _key("resource_key", request.resource_key)}


def bind_set_rate_limit(request: task_pb2.SetRateLimitRequest, settings: Settings) -> Params:
    window = 60.0
    if request.HasField("window"):
        window = validation.seconds("window", request.window, most=MAX_RATE_WINDOW_SECONDS)
        if window < 1 or window != int(window):
            raise InvalidArgument("window must be whole seconds, at least 1 s", field="window")
    return {
        "resource_key": _key("resource_key", request.resource_key),
        "max_calls": _optional(
            request, "max_calls", lambda n, v: validation.in_range(n, v, 1, MAX_RATE_CALLS)
        ),
        "max_units": _optional(
            request, "max_units", lambda n, v: validation.in_range(n, v, 1, MAX_RATE_LIMIT_UNITS)
        ),
        "window_seconds": int(window),
    }


def respond_set_rate_limit(rows: list[Row]) -> task_pb2.SetRateLimitResponse:
    (row,) = rows
    message = task_pb2.SetRateLimitResponse()
    if row["resource_key"] is not None:
        messages.rate_limit_into(message.rate_limit, row)
    return message


def respond_get_resource_key(rows: list[Row]) -> task_pb2.GetResourceKeyResponse:
    (row,) = rows
    message = task_pb2.GetResourceKeyResponse(
        resource_key=row["resource_key"],
        cooling=row["cooling"],
        consecutive_failures=row["consecutive_failures"],
    )
    messages.timestamp(message.cooling_until, row["cooling_until"])
    if row["max_in_flight"] is not None:
        message.max_in_flight = row["max_in_flight"]
    if row["window_seconds"] is not None:
        messages.rate_limit_into(message.rate_limit, row)
    return message


def respond_set_resource_limit(rows: list[Row]) -> task_pb2.SetResourceLimitResponse:
    (row,) = rows
    message = task_pb2.SetResourceLimitResponse(resource_key=row["resource_key"])
    if row["max_in_flight"] is not None:
        message.max_in_flight = row["max_in_flight"]
    return message


def bind_update_settings(request: task_pb2.UpdateSettingsRequest, settings: Settings) -> Params:
    return {
        "enabled": request.enabled if request.HasField("enabled") else None,
        "daily_cap_nanos": _optional(request, "daily_cap_nanos", validation.amount),
        "currency": _optional(
            request, "currency", lambda n, v: validation.text(n, v, max_length=16) or ""
        ),
        "timezone": _optional(request, "timezone", _key),
        "cooldown_threshold": _optional(
            request, "cooldown_threshold", lambda n, v: validation.in_range(n, v, 1, 1_000)
        ),
        "cooldown_seconds": _optional(request, "cooldown_seconds", _seconds),
        "account_hold_seconds": _optional(request, "account_hold_seconds", _seconds),
        "retention_days": _optional(
            request, "retention_days", lambda n, v: validation.in_range(n, v, 0, 36_500)
        ),
        "processing_grace_seconds": _optional(
            request, "processing_grace_seconds", lambda n, v: validation.in_range(n, v, 1, 86_400)
        ),
        "queued_max_age_seconds": _optional(
            request,
            "queued_max_age_seconds",
            lambda n, v: validation.in_range(n, v, 1, 30 * 86_400),
        ),
        "clear": _clear(request, {"daily_cap_nanos"}),
        **_overrides(settings),
    }


def bind_get_settings(request: task_pb2.GetSettingsRequest, settings: Settings) -> Params:
    return _overrides(settings)


def bind_get_status(request: task_pb2.GetStatusRequest, settings: Settings) -> Params:
    return {
        "worker_silence_seconds": validation.in_range(
            "worker_silence_seconds", request.worker_silence_seconds, 0, 30 * 86_400
        )
        or 600,
        **_overrides(settings),
    }


def respond_status(rows: list[Row]) -> task_pb2.GetStatusResponse:
    status = json_format.ParseDict(rows[0]["status"], task_pb2.Status(), ignore_unknown_fields=True)
    return task_pb2.GetStatusResponse(status=status)


def bind_list_tasks(request: task_pb2.ListTasksRequest, settings: Settings) -> Params:
    if request.status not in task_pb2.TaskStatus.values():
        raise InvalidArgument("status is not a TaskStatus", field="status")
    return {
        "tool_id": validation.optional_uuid("tool_id", request.tool_id),
        "status": task_pb2.TaskStatus.Name(request.status).removeprefix("TASK_STATUS_").lower()
        if request.status
        else None,
        "before": validation.timestamp("before", request.before)
        if request.HasField("before")
        else None,
        "before_id": validation.optional_uuid("before_id", request.before_id),
        "limit": validation.in_range("limit", request.limit, 0, 1_000) or 50,
    }


def bind_purge_tasks(request: task_pb2.PurgeTasksRequest, settings: Settings) -> Params:
    return {
        "older_than_days": _optional(
            request, "older_than_days", lambda n, v: validation.in_range(n, v, 0, 36_500)
        ),
        "batch_size": validation.in_range("batch_size", request.batch_size, 0, 10_000) or 1_000,
        "dry_run": request.dry_run,
    }


def bind_get_stats(request: task_pb2.GetStatsRequest, settings: Settings) -> Params:
    return {"days": validation.in_range("days", request.days, 0, 3_660) or 7}


def respond_stats(rows: list[Row]) -> task_pb2.GetStatsResponse:
    return task_pb2.GetStatsResponse(
        days=[
            task_pb2.DayStats(
                local_day=row["local_day"].isoformat(),
                tool_id=str(row["tool_id"]),
                tool_name=row["tool_name"],
                attempts=row["attempts"],
                completed=row["completed"],
                failed=row["failed"],
                lost=row["lost"],
                cost_nanos=row["cost_nanos"],
            )
            for row in rows
        ]
    )


def bind_release_cooldown(request: task_pb2.ReleaseCooldownRequest, settings: Settings) -> Params:
    return {"resource_key": _key("resource_key", request.resource_key)}


def bind_release_hold(request: task_pb2.ReleaseHoldRequest, settings: Settings) -> Params:
    return {"account_group": _key("account_group", request.account_group)}


def bind_list_stale_tasks(request: task_pb2.ListStaleTasksRequest, settings: Settings) -> Params:
    return {"limit": validation.in_range("limit", request.limit, 0, MAX_PAGE) or DEFAULT_PAGE}


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
    return {"limit": validation.in_range("limit", request.limit, 0, MAX_PAGE) or DEFAULT_PAGE}


def bind_list_audit_entries(
    request: task_pb2.ListAuditEntriesRequest, settings: Settings
) -> Params:
    return {
        "limit": validation.in_range("limit", request.limit, 0, MAX_PAGE) or DEFAULT_PAGE,
        "before_id": validation.amount("before_id", request.before_id),
    }


def respond_settle(rows: list[Row]) -> task_pb2.SettleTaskResponse:
    row = _found(rows)
    if row["task_id"] is None:
        raise TaskNotTerminal("only a finished task can be settled")
    return task_pb2.SettleTaskResponse(
        settlement=messages.settlement(row), settled_now=row["settled_now"]
    )


def signal_event(signals: Signals, rows: list[Row]) -> None:
    for row in rows:
        if row.get("event"):
            signals.event_added(row["event"])


def signal_started(signals: Signals, rows: list[Row]) -> None:
    """A claim's `started` events: mirrored when their JSON came back, else the followers of each
    claimed task are woken by its id (they read the event from the stream)."""
    for row in rows:
        if row.get("event"):
            signals.event_added(row["event"])
        elif row.get("id") is not None:
            signals.task_event_added(str(row["id"]))


def signal_queued(signals: Signals, rows: list[Row]) -> None:
    """Wakes one parked claim per task queued, with one Redis message per tool (a QueueTasks
    batch of a thousand is one publish, not a thousand)."""
    queued = Counter(str(row["tool_id"]) for row in rows if row.get("status") == "queued")
    for tool_id, count in queued.items():
        signals.task_queued(tool_id, count)


def signal_queued_tasks(signals: Signals, rows: list[Row]) -> None:
    """signal_queued for QueueTasks' rows, one per shape of its tasks, all of the one tool."""
    if count := sum(len(row["ids"]) for row in rows if row["ids"] is not None):
        signals.task_queued(rows[0]["tool_id"], count)


def signal_requeue(signals: Signals, rows: list[Row]) -> None:
    """A task (re)queued wakes claimers; the transition's event reaches followers."""
    signal_queued(signals, rows)
    signal_event(signals, rows)


def respond_get_task(rows: list[Row]) -> task_pb2.GetTaskResponse:
    if not rows:
        raise TaskNotFound("task not found")
    return task_pb2.GetTaskResponse(task=messages.task(rows[0]))


def respond_claim(rows: list[Row]) -> task_pb2.ClaimNextTaskResponse:
    (row,) = rows
    if row["idle_reason"] == "unknown_tool":
        raise ToolNotFound("tool not found")
    if row["id"] is None:
        idle = task_pb2.ClaimNextTaskResponse(idle_reason=_idle_reason(row))
        messages.timestamp(idle.idle_until, row["idle_until"])
        return idle
    response = task_pb2.ClaimNextTaskResponse(
        task=messages.task(row), lease_token=str(row["lease_token"])
    )
    response.lease.FromSeconds(row["lease"])
    return response


def respond_cancel_tasks(rows: list[Row]) -> task_pb2.CancelTasksResponse:
    statuses = Counter(row["status"] for row in rows)
    return task_pb2.CancelTasksResponse(
        cancelled=statuses["cancelled"], cancel_requested=statuses["processing"]
    )


def respond_cancel(rows: list[Row]) -> task_pb2.CancelTaskResponse:
    row = _found(rows)
    if row["id"] is None:
        raise TaskFinished("the task has already finished")
    return task_pb2.CancelTaskResponse(task=messages.task(row))


def respond_retry(rows: list[Row]) -> task_pb2.RetryTaskResponse:
    row = _found(rows)
    if row["id"] is None:
        raise TaskNotRetryable("only a failed, cancelled or expired task can be retried")
    return task_pb2.RetryTaskResponse(task=messages.task(row), retried_now=row["retried_now"])


def respond_tool(rows: list[Row]) -> task_pb2.Tool:
    if not rows:
        raise ToolNotFound("tool not found")
    return messages.tool(rows[0])


def respond_heartbeat(rows: list[Row]) -> task_pb2.HeartbeatTaskResponse:
    row = _fenced(rows, "claim_expires_at")
    return _heartbeat(row, task_pb2.HeartbeatTaskResponse(), messages.Moments())


def _heartbeat(
    row: Row, response: task_pb2.HeartbeatTaskResponse, moments: messages.Moments
) -> task_pb2.HeartbeatTaskResponse:
    response.cancel_requested = row["cancel_requested"]
    moments.set(response.claim_expires_at, row["claim_expires_at"])
    response.lease.FromSeconds(row["lease_seconds"])
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
    "QueueTask": Binding(bind_queue_task, respond_queue_task, after=signal_requeue),
    "QueueTasks": Binding(
        bind_queue_tasks,
        respond_queue_tasks,
        after=signal_queued_tasks,
        rerun_deadlocks=True,
    ),
    "CancelTask": Binding(bind_task_id, respond_cancel, after=signal_event),
    "CancelTasks": Binding(bind_cancel_tasks, respond_cancel_tasks, after=signal_event),
    "RetryTask": Binding(bind_retry_task, respond_retry, after=signal_requeue),
    "ConfigureTool": Binding(
        bind_configure_tool,
        lambda rows: task_pb2.ConfigureToolResponse(tool=respond_tool(rows)),
    ),
    "GetTool": Binding(
        bind_tool_id, lambda rows: task_pb2.GetToolResponse(tool=respond_tool(rows))
    ),
    "UpdateSettings": Binding(
        bind_update_settings,
        lambda rows: task_pb2.UpdateSettingsResponse(settings=messages.settings(rows[0])),
    ),
    "GetSettings": Binding(
        bind_get_settings,
        lambda rows: task_pb2.GetSettingsResponse(settings=messages.settings(rows[0])),
    ),
    "ReleaseCooldown": Binding(
        bind_release_cooldown,
        lambda rows: task_pb2.ReleaseCooldownResponse(released=bool(rows)),
    ),
    "ReleaseHold": Binding(
        bind_release_hold, lambda rows: task_pb2.ReleaseHoldResponse(released=bool(rows))
    ),
    "ClaimNextTask": Binding(
        bind_claim_next_task, respond_claim, after=signal_started, park=park_claim
    ),
    "HeartbeatTask": Binding(bind_heartbeat_task, respond_heartbeat),
    "ClaimTasks": Binding(
        bind_claim_tasks, respond_claim_tasks, after=signal_started, park=park_claim
    ),
    "HeartbeatTasks": Binding(bind_heartbeat_tasks, respond_heartbeat_tasks),
    "ConfirmClaim": Binding(bind_confirm_claim, respond_confirm_claim),
    "CompleteTasks": Binding(
        bind_complete_tasks,
        lambda rows: _report_results(task_pb2.CompleteTasksResponse(), rows),
        after=signal_event,
    ),
    "FailTasks": Binding(
        bind_fail_tasks,
        lambda rows: _report_results(task_pb2.FailTasksResponse(), rows),
        after=signal_requeue,
    ),
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
    "GetStatus": Binding(bind_get_status, respond_status),
    "ListTasks": Binding(
        bind_list_tasks,
        lambda rows: task_pb2.ListTasksResponse(tasks=[messages.task(r) for r in rows]),
    ),
    "PurgeTasks": Binding(
        bind_purge_tasks,
        lambda rows: task_pb2.PurgeTasksResponse(
            purged=rows[0]["purged"], retention_days=rows[0]["retention_days"]
        ),
    ),
    "GetStats": Binding(bind_get_stats, respond_stats),
    "GetTask": Binding(bind_task_id, respond_get_task),
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
    "SettleTask": Binding(bind_task_id, respond_settle),
    "SetResourceLimit": Binding(bind_set_resource_limit, respond_set_resource_limit),
    "SetRateLimit": Binding(bind_set_rate_limit, respond_set_rate_limit),
    "GetResourceKey": Binding(bind_get_resource_key, respond_get_resource_key),
    "ListAuditEntries": Binding(
        bind_list_audit_entries,
        lambda rows: task_pb2.ListAuditEntriesResponse(
            entries=[messages.audit_entry(r) for r in rows]
        ),
    ),
}

# Server-streaming: the statement reads one page of events; service/api/handlers.py follows.
WATCH = bind_watch_task_events
