"""How `genq` prints answers: each message as JSON, or as text (tables, money in currency units
through workers_sdk/money.py, times in UTC)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from generation.task.v1 import task_pb2
from workers_sdk.commands import table
from workers_sdk.money import money


def as_json(message: Message) -> str:
    """The message as JSON with the proto field names; fields at their default are printed too,
    so `enabled: false` or a count of 0 is there to read (grpcurl leaves them out)."""
    document = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return json.dumps(document, indent=2, sort_keys=True)


def when(stamp: Timestamp) -> str:
    """A timestamp in UTC to the second, or "-" when unset."""
    if not stamp.seconds and not stamp.nanos:
        return "-"
    return stamp.ToDatetime(tzinfo=UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def exact(stamp: Timestamp) -> str:
    """A timestamp to its last digit, as RFC 3339 (what `--before` reads back): a list cursor
    rounded to the second skips the tasks of that second not shown yet."""
    return str(stamp.ToJsonString())


def ago(stamp: Timestamp) -> str:
    if not stamp.seconds and not stamp.nanos:
        return "never"
    seconds = int((datetime.now(UTC) - stamp.ToDatetime(tzinfo=UTC)).total_seconds())
    return f"{duration(seconds)} ago"


def duration(seconds: float) -> str:
    """A short age: 42s, 5m07s, 3h05m, 2d04h."""
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3_600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86_400:
        return f"{s // 3_600}h{s % 3_600 // 60:02d}m"
    return f"{s // 86_400}d{s % 86_400 // 3_600:02d}h"


def status_name(value: Any) -> str:
    return task_pb2.TaskStatus.Name(value).removeprefix("TASK_STATUS_").lower()


def _cap(message: Any, field: str = "daily_cap_nanos", currency: str = "") -> str:
    return money(getattr(message, field), currency) if message.HasField(field) else "none"


def _optional(message: Any, field: str, unset: str = "none") -> str:
    return str(getattr(message, field)) if message.HasField(field) else unset


def settings(value: task_pb2.Settings) -> str:
    cur = value.currency
    lines = [
        f"switch: {'on' if value.enabled else 'OFF'} (stored)"
        + ("; GENQ_DISABLED keeps the queue off" if value.disabled_by_environment else ""),
        f"daily cap: {_cap(value, currency=cur)}"
        + (
            f"; GENQ_DAILY_CAP_NANOS replaces it with {money(value.cap_override_nanos, cur)}"
            if value.HasField("cap_override_nanos")
            else ""
        ),
        f"currency: {cur or '-'}",
        f"timezone: {value.timezone}",
        f"local day: {value.local_day}",
        f"spent today: {money(value.spent_today_nanos, cur)}",
        f"reserved: {money(value.reserved_nanos, cur)}",
        f"cooldown: after {value.cooldown_threshold} failures, {value.cooldown_seconds} s",
        f"account hold: {value.account_hold_seconds} s",
        f"retention: {value.retention_days} days"
        + (" (keeps everything)" if value.retention_days == 0 else ""),
        f"stale after: {value.processing_grace_seconds} s past a lapsed lease (processing), "
        f"{value.queued_max_age_seconds} s with no worker asking (queued)",
    ]
    return "\n".join(lines)


def tool(value: task_pb2.Tool, currency: str = "") -> str:
    return "\n".join(
        [
            f"tool {value.name} ({value.id})",
            f"paused: {'yes' if value.paused else 'no'}",
            f"daily cap: {_cap(value, currency=currency)}",
            f"spent today: {money(value.spent_today_nanos, currency)}",
            f"reserved: {money(value.reserved_nanos, currency)}",
            f"cost estimate: {money(value.cost_estimate_nanos, currency)}",
            f"max attempts: {value.max_attempts}",
            f"max in flight: {_optional(value, 'max_in_flight')}",
            f"resource key: {_optional(value, 'resource_key', f'{value.name} (its name)')}",
            f"account group: {_optional(value, 'account_group', f'{value.name} (its name)')}",
            f"lease: {_optional(value, 'lease_seconds', 'GENQ_LEASE_SECONDS')}"
            + (" s" if value.HasField("lease_seconds") else ""),
            f"backoff: {value.backoff_base_seconds} s doubling up to {value.backoff_max_seconds} s",
        ]
    )


def resource_key(value: task_pb2.GetResourceKeyResponse) -> str:
    lapsed = value.cooling_until.seconds and not value.cooling
    return "\n".join(
        [
            f"resource key: {value.resource_key}",
            f"cooling: yes, until {when(value.cooling_until)}"
            if value.cooling
            else "cooling: no"
            + (f" (it cooled until {when(value.cooling_until)})" if lapsed else ""),
            # A cooldown starts the count again: while cooling it counts the failures since.
            f"failures in a row{' since it started cooling' if value.cooling else ''}: "
            f"{value.consecutive_failures}",
            f"max in flight: {_optional(value, 'max_in_flight')}",
            "rate limit: "
            + (rate_limit(value.rate_limit) if value.HasField("rate_limit") else "-"),
        ]
    )


def rate_limit(value: task_pb2.RateLimit) -> str:
    """A rate limit on one line: its bounds per window, what the window holds, and when the next
    slot frees while it is at its limit."""
    window = duration(value.window.ToTimedelta().total_seconds())
    bounds = []
    if value.HasField("max_calls"):
        bounds.append(f"{value.calls}/{value.max_calls} calls")
    if value.HasField("max_units"):
        bounds.append(f"{value.units}/{value.max_units} units")
    shown = f"{', '.join(bounds)} per {window}"
    if value.HasField("limited_until"):
        shown += f"; at its limit until {when(value.limited_until)}"
    return shown


def status(value: task_pb2.Status, verdict: str) -> str:
    s = value.settings
    cur = s.currency
    cap = s.cap_override_nanos if s.HasField("cap_override_nanos") else s.daily_cap_nanos
    used = s.spent_today_nanos + s.reserved_nanos
    parts = [
        f"queue: {verdict}",
        f"switch: {'on' if s.enabled else 'OFF'}"
        + (" (GENQ_DISABLED: off whatever is stored)" if s.disabled_by_environment else ""),
        f"daily cap: {money(cap, cur) if cap else 'none (nothing runs)'}"
        + (" (GENQ_DAILY_CAP_NANOS)" if s.HasField("cap_override_nanos") else ""),
        f"today ({s.local_day}): spent {money(s.spent_today_nanos, cur)}, "
        f"reserved {money(s.reserved_nanos, cur)}"
        + (f", left {money(max(cap - used, 0), cur)}" if cap else ""),
    ]
    if value.tools:
        parts += [
            "",
            table(
                ["TOOL", "ID", "PAUSED", "QUEUED", "SPENT", "CAP", "LAST CLAIM", ""],
                [
                    (
                        t.name,
                        t.tool_id,
                        "yes" if t.paused else "no",
                        t.queued,
                        money(t.spent_today_nanos),
                        _cap(t),
                        ago(t.last_claim_at),
                        "no worker seen" if t.no_worker_seen else "",
                    )
                    for t in value.tools
                ],
            ),
        ]
    if value.depths:
        parts += [
            "",
            table(
                ["TOOL", "STATUS", "COUNT", "OLDEST"],
                [
                    (
                        d.tool_name,
                        status_name(d.status),
                        d.count,
                        duration(d.oldest_age.ToTimedelta().total_seconds()),
                    )
                    for d in value.depths
                ],
            ),
        ]
    parts.append("")
    for c in value.cooling:
        parts.append(
            f"cooling: {c.resource_key} until {when(c.cooling_until)} "
            f"({c.consecutive_failures} failures)"
        )
    for h in value.holds:
        parts.append(f"held: {h.account_group} until {when(h.held_until)} ({h.reason or '-'})")
    for r in value.rate_limits:
        parts.append(f"rate limit: {r.resource_key}: {rate_limit(r)}")
    completed = sum(m.completed for m in value.last_hour)
    failed = sum(m.failed for m in value.last_hour)
    parts.append(f"stale tasks: {value.stale_tasks}")
    parts.append(f"last hour: {completed} completed, {failed} failed or retried")
    return "\n".join(parts)


def tasks(values: Sequence[task_pb2.Task], tool_names: Mapping[str, str]) -> str:
    """The tasks of a page; CREATED is exact, so it can be copied into `--before`."""
    if not values:
        return "no tasks"
    return table(
        ["ID", "TOOL", "STATUS", "PRI", "RETRIES", "CREATED", "SOURCE", "ERROR"],
        [
            (
                t.id,
                tool_names.get(t.tool_id, t.tool_id),
                status_name(t.status),
                t.priority,
                f"{t.retry_count}/{t.max_retries}",
                exact(t.created_at),
                t.source or "-",
                t.error[:40],
            )
            for t in values
        ],
    )


def task(value: task_pb2.Task) -> str:
    """One task, a field a line: JSON values compact, money in units, timestamps in UTC."""
    lines = []
    document = json_format.MessageToDict(value, preserving_proto_field_name=True)
    for name, shown in _flatten(document):
        if name == "status":
            shown = status_name(value.status)
        elif name.endswith("_nanos"):
            name, shown = name.removesuffix("_nanos"), money(int(shown))
        lines.append(f"{name}: {shown}")
    return "\n".join(lines)


def _flatten(document: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in document.items():
        if key in {"input", "output", "details"}:
            out.append((prefix + key, json.dumps(_whole(value), sort_keys=True)))
        elif isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append((prefix + key, value))
    return out


def _whole(value: Any) -> Any:
    """A Struct's numbers are doubles: show 2.0 as 2."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _whole(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_whole(item) for item in value]
    return value


def stats(values: Sequence[task_pb2.DayStats], currency: str) -> str:
    if not values:
        return "no attempts in these days"
    total = sum(d.cost_nanos for d in values)
    return "\n".join(
        [
            table(
                ["DAY", "TOOL", "ATTEMPTS", "COMPLETED", "FAILED", "LOST", "COST"],
                [
                    (
                        d.local_day,
                        d.tool_name,
                        d.attempts,
                        d.completed,
                        d.failed,
                        d.lost,
                        money(d.cost_nanos, currency),
                    )
                    for d in values
                ],
            ),
            f"total cost: {money(total, currency)}",
        ]
    )


def audit(values: Sequence[task_pb2.AuditEntry]) -> str:
    if not values:
        return "no audit entries"
    return table(
        ("ID", "AT", "ACTOR", "ACTION", "DETAIL"),
        (
            (
                value.id,
                when(value.at),
                value.actor,
                value.action,
                json.dumps(json_format.MessageToDict(value.detail), sort_keys=True),
            )
            for value in values
        ),
    )
