"""Rows of generation.* as protobuf messages."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from google.protobuf import struct_pb2, timestamp_pb2

from generation.task.v1 import task_pb2

Row = dict[str, Any]


def task(row: Row) -> task_pb2.Task:
    message = task_pb2.Task(
        id=str(row["id"]),
        tool_id=str(row["tool_id"]),
        status=task_pb2.TaskStatus.Value(f"TASK_STATUS_{row['status'].upper()}"),
        error=row["error"] or "",
        priority=row["priority"],
        retry_count=row["retry_count"],
        max_retries=row["max_retries"],
        reserved_token_amount=row["reserved_token_amount"],
        billing_idempotency_key=row["billing_idempotency_key"] or "",
        w3c_traceparent=row["w3c_traceparent"] or "",
    )
    _struct(message.input, row["input"])
    _struct(message.output, row["output"])
    if usage := row["reported_usage"]:
        message.reported_usage.token_amount = usage.get("token_amount", 0)
        message.reported_usage.cost_nanos = usage.get("cost_nanos", 0)
        _struct(message.reported_usage.details, usage.get("details"))
    for name in ("claim_expires_at", "created_at", "started_at", "completed_at"):
        _timestamp(getattr(message, name), row[name])
    return message


def tool(row: Row) -> task_pb2.Tool:
    message = task_pb2.Tool(id=str(row["id"]), name=row["name"])
    _timestamp(message.created_at, row["created_at"])
    return message


def _struct(target: struct_pb2.Struct, value: dict[str, Any] | None) -> None:
    if value:
        target.update(value)


def _timestamp(target: timestamp_pb2.Timestamp, value: datetime | None) -> None:
    if value is not None:
        target.FromDatetime(value)


def task_event(event: Row) -> task_pb2.TaskEvent:
    """An event as `to_jsonb(task_events row)` renders it."""
    message = task_pb2.TaskEvent(
        task_id=str(event["task_id"]),
        sequence=int(event["sequence"]),
        kind=task_pb2.TaskEventKind.Value(f"TASK_EVENT_KIND_{event['kind'].upper()}"),
    )
    _struct(message.data, event["data"])
    _timestamp(message.created_at, datetime.fromisoformat(event["created_at"]))
    return message


def settlement(row: Row) -> task_pb2.Settlement:
    message = task_pb2.Settlement(
        task_id=str(row["task_id"]),
        task_status=task_pb2.TaskStatus.Value(f"TASK_STATUS_{row['task_status'].upper()}"),
        reserved_token_amount=row["reserved_token_amount"],
        charged_token_amount=row["charged_token_amount"],
        refunded_token_amount=row["refunded_token_amount"],
    )
    _timestamp(message.settled_at, row["settled_at"])
    return message
