"""Bad input is refused with INVALID_ARGUMENT or NOT_FOUND (never INTERNAL) and writes nothing.

Every case checks three things: the gRPC status code, the ErrorInfo reason clients branch on, and,
through a direct database connection, that no row was written or changed.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import psycopg
import pytest
from google.protobuf import duration_pb2, json_format, struct_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from generation.task.v1 import task_pb2, task_pb2_grpc
from service.api import errors
from service.api.validation import MAX_AMOUNT, MAX_DEPTH
from service.settings import Settings
from workers_sdk.errors import GenqError, Reason, from_rpc_error

Stub = task_pb2_grpc.GenerationDataServiceStub
Db = psycopg.Connection[dict[str, Any]]

INVALID = (grpc.StatusCode.INVALID_ARGUMENT, Reason.INVALID_ARGUMENT)
TASK_NOT_FOUND = (grpc.StatusCode.NOT_FOUND, Reason.TASK_NOT_FOUND)
TOOL_NOT_FOUND = (grpc.StatusCode.NOT_FOUND, Reason.TOOL_NOT_FOUND)

# Strings Python's uuid.UUID refuses (it accepts braces, urn:uuid: and bare hex, so those are not
# here). The empty string is a missing field, tested on its own.
MALFORMED_UUIDS = [
    pytest.param("not-a-uuid", id="word"),
    pytest.param("1234", id="short"),
    pytest.param("12345678-1234-5678-1234-56781234567", id="one-digit-short"),
    pytest.param("12345678-1234-5678-1234-5678123456789", id="one-digit-long"),
    pytest.param("12345678-1234-5678-1234-56781234567g", id="non-hex"),
    pytest.param("12345678-1234-5678-1234-56781234567\x00", id="nul"),
    pytest.param("12345678-1234-5678-1234-567812345678; DROP TABLE x", id="trailing-sql"),
]

VALID_TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
MALFORMED_TRACEPARENTS = [
    pytest.param("not-a-traceparent", id="word"),
    pytest.param("00-00000000000000000000000000000000-00f067aa0ba902b7-01", id="zero-trace-id"),
    pytest.param("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", id="zero-parent-id"),
    pytest.param("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", id="version-ff"),
    pytest.param("00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01", id="uppercase"),
    pytest.param("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", id="short-trace-id"),
    pytest.param("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", id="no-flags"),
    pytest.param(VALID_TRACEPARENT + "-extra", id="extra-field"),
    pytest.param(" " + VALID_TRACEPARENT, id="leading-space"),
    pytest.param(VALID_TRACEPARENT + " ", id="trailing-space"),
    pytest.param(VALID_TRACEPARENT + "\n", id="trailing-newline"),
    pytest.param("00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01", id="underscores"),
]


@dataclass(frozen=True)
class Claimed:
    task_id: str
    lease_token: str


def struct(value: dict[str, Any]) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(value)
    return message


def refused(call: Callable[..., Any], request: Message) -> GenqError:
    with pytest.raises(grpc.RpcError) as caught:
        call(request, timeout=10)
    return from_rpc_error(caught.value)


def assert_refused(
    call: Callable[..., Any], request: Message, expected: tuple[grpc.StatusCode, Reason]
) -> None:
    error = refused(call, request)
    assert (error.code, error.reason) == expected, f"{error.code} {error.reason}: {error}"


def assert_invalid_field(call: Callable[..., Any], request: Message, field: str) -> None:
    """Refused as INVALID_ARGUMENT, the ErrorInfo's `field` metadata and the message naming it."""
    with pytest.raises(grpc.RpcError) as caught:
        call(request, timeout=10)
    error = from_rpc_error(caught.value)
    assert (error.code, error.reason) == INVALID, f"{error.code} {error.reason}: {error}"
    status = rpc_status.from_call(caught.value)
    assert status is not None
    fields = []
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            fields.append(info.metadata.get("field"))
    assert fields == [field], f"{fields}: {error}"
    assert field in str(error)


def task_count(db: Db) -> int:
    found = db.execute("SELECT count(*) AS n FROM generation.tasks").fetchone()
    assert found is not None
    return int(found["n"])


def tool_count(db: Db) -> int:
    found = db.execute("SELECT count(*) AS n FROM generation.tools").fetchone()
    assert found is not None
    return int(found["n"])


def tasks_of(db: Db, tool_id: str) -> list[dict[str, Any]]:
    return db.execute(
        "SELECT * FROM generation.tasks WHERE tool_id = %s ORDER BY id", [tool_id]
    ).fetchall()


def row(db: Db, task_id: str) -> dict[str, Any]:
    found = db.execute("SELECT * FROM generation.tasks WHERE id = %s", [task_id]).fetchone()
    assert found is not None
    return found


@pytest.fixture
def claimed(stub: Stub, tool_id: str) -> Claimed:
    """A task of this test's tool, claimed: status processing, lease held."""
    queued = stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id, input=struct({"n": 1}))).task
    response = stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id))
    assert response.task.id == queued.id
    return Claimed(queued.id, response.lease_token)


@pytest.fixture
def unchanged(db: Db, claimed: Claimed) -> Iterator[Claimed]:
    """The claimed task, checked to be byte-for-byte the same row (and still held) afterwards."""
    before = row(db, claimed.task_id)
    assert before["status"] == "processing"
    yield claimed
    assert row(db, claimed.task_id) == before


@pytest.fixture
def no_new_task(db: Db, tool_id: str) -> Iterator[str]:
    """This test's tool, checked to have gained no task (and the table no row) afterwards."""
    total, before = task_count(db), tasks_of(db, tool_id)
    yield tool_id
    assert tasks_of(db, tool_id) == before
    assert task_count(db) == total


def queue_request(tool_id: str, **fields: Any) -> task_pb2.QueueTaskRequest:
    return task_pb2.QueueTaskRequest(tool_id=tool_id, input=struct({"prompt": "a cat"}), **fields)


# Each fenced write, built from a task id and a lease token.
FENCED_WRITES: dict[str, Callable[[str, str], Message]] = {
    "HeartbeatTask": lambda task_id, token: task_pb2.HeartbeatTaskRequest(
        task_id=task_id, lease_token=token
    ),
    "CompleteTask": lambda task_id, token: task_pb2.CompleteTaskRequest(
        task_id=task_id, lease_token=token, output=struct({"url": "s3://bucket/out.png"})
    ),
    "FailTask": lambda task_id, token: task_pb2.FailTaskRequest(
        task_id=task_id, lease_token=token, error="boom", increment_retry=True
    ),
}


# --- malformed, missing and unknown ids ------------------------------------------------------


@pytest.mark.parametrize("bad", MALFORMED_UUIDS)
def test_queue_task_malformed_tool_id(stub: Stub, db: Db, bad: str) -> None:
    total = task_count(db)
    assert_refused(stub.QueueTask, queue_request(bad), INVALID)
    assert task_count(db) == total


@pytest.mark.parametrize("bad", MALFORMED_UUIDS)
def test_claim_next_task_malformed_tool_id(stub: Stub, db: Db, tool_id: str, bad: str) -> None:
    stub.QueueTask(queue_request(tool_id))
    before = tasks_of(db, tool_id)
    assert_refused(stub.ClaimNextTask, task_pb2.ClaimNextTaskRequest(tool_id=bad), INVALID)
    assert tasks_of(db, tool_id) == before
    assert [task["status"] for task in before] == ["queued"]


@pytest.mark.parametrize("bad", MALFORMED_UUIDS)
def test_get_task_malformed_task_id(stub: Stub, no_new_task: str, bad: str) -> None:
    assert_refused(stub.GetTask, task_pb2.GetTaskRequest(task_id=bad), INVALID)


@pytest.mark.parametrize("method", FENCED_WRITES)
@pytest.mark.parametrize("bad", MALFORMED_UUIDS)
def test_fenced_write_malformed_task_id(
    stub: Stub, unchanged: Claimed, method: str, bad: str
) -> None:
    request = FENCED_WRITES[method](bad, unchanged.lease_token)
    assert_refused(getattr(stub, method), request, INVALID)


@pytest.mark.parametrize("method", FENCED_WRITES)
@pytest.mark.parametrize("bad", MALFORMED_UUIDS)
def test_fenced_write_malformed_lease_token(
    stub: Stub, unchanged: Claimed, method: str, bad: str
) -> None:
    request = FENCED_WRITES[method](unchanged.task_id, bad)
    assert_refused(getattr(stub, method), request, INVALID)


@pytest.mark.parametrize("bad", MALFORMED_UUIDS)
def test_forced_fail_malformed_lease_token(stub: Stub, unchanged: Claimed, bad: str) -> None:
    request = task_pb2.FailTaskRequest(task_id=unchanged.task_id, lease_token=bad, error="reaped")
    assert_refused(stub.FailTask, request, INVALID)


def test_queue_task_missing_tool_id(stub: Stub, db: Db) -> None:
    total = task_count(db)
    assert_refused(stub.QueueTask, queue_request(""), INVALID)
    assert task_count(db) == total


def test_claim_next_task_missing_tool_id(stub: Stub, db: Db, tool_id: str) -> None:
    stub.QueueTask(queue_request(tool_id))
    before = tasks_of(db, tool_id)
    assert_refused(stub.ClaimNextTask, task_pb2.ClaimNextTaskRequest(), INVALID)
    assert tasks_of(db, tool_id) == before


@pytest.mark.parametrize("method", FENCED_WRITES)
def test_fenced_write_missing_task_id(stub: Stub, unchanged: Claimed, method: str) -> None:
    request = FENCED_WRITES[method]("", unchanged.lease_token)
    assert_refused(getattr(stub, method), request, INVALID)


@pytest.mark.parametrize("method", ["HeartbeatTask", "CompleteTask"])
def test_fenced_write_missing_lease_token(stub: Stub, unchanged: Claimed, method: str) -> None:
    request = FENCED_WRITES[method](unchanged.task_id, "")
    assert_refused(getattr(stub, method), request, INVALID)


def test_queue_task_unknown_tool(stub: Stub, db: Db) -> None:
    unknown = str(uuid.uuid4())
    total = task_count(db)
    assert_refused(stub.QueueTask, queue_request(unknown), TOOL_NOT_FOUND)
    assert task_count(db) == total
    assert tasks_of(db, unknown) == []


def test_get_task_unknown_task(stub: Stub, no_new_task: str) -> None:
    request = task_pb2.GetTaskRequest(task_id=str(uuid.uuid4()))
    assert_refused(stub.GetTask, request, TASK_NOT_FOUND)


@pytest.mark.parametrize("method", FENCED_WRITES)
def test_fenced_write_unknown_task(stub: Stub, unchanged: Claimed, method: str) -> None:
    request = FENCED_WRITES[method](str(uuid.uuid4()), unchanged.lease_token)
    assert_refused(getattr(stub, method), request, TASK_NOT_FOUND)


def test_forced_fail_unknown_task(stub: Stub, no_new_task: str) -> None:
    request = task_pb2.FailTaskRequest(task_id=str(uuid.uuid4()), error="reaped")
    assert_refused(stub.FailTask, request, TASK_NOT_FOUND)


# --- sizes and ranges ------------------------------------------------------------------------


def struct_of_size(size: int) -> struct_pb2.Struct:
    """A Struct {"blob": "xxx..."} whose serialized size is exactly `size` bytes."""
    value = struct_pb2.Struct()
    length = size
    while True:
        value.update({"blob": "x" * length})
        if value.ByteSize() <= size:
            break
        length -= value.ByteSize() - size
    assert value.ByteSize() == size
    return value


MAX_INPUT_BYTES = Settings.from_env().max_input_bytes
"""The cap the service runs with: it inherits this process's environment (GENQ_MAX_INPUT_BYTES)."""
MAX_MESSAGE_BYTES = Settings.from_env().max_message_bytes


def test_queue_task_input_over_the_cap(stub: Stub, no_new_task: str) -> None:
    oversized = struct_of_size(MAX_INPUT_BYTES + 1)
    request = task_pb2.QueueTaskRequest(tool_id=no_new_task, input=oversized)
    # Under the gRPC receive limit, so it is the service's cap that refuses it.
    assert request.ByteSize() < MAX_MESSAGE_BYTES
    assert_refused(stub.QueueTask, request, INVALID)


def test_queue_task_input_at_the_cap_is_accepted(stub: Stub, db: Db, tool_id: str) -> None:
    """The control for the case above: one byte less is stored whole."""
    request = task_pb2.QueueTaskRequest(tool_id=tool_id, input=struct_of_size(MAX_INPUT_BYTES))
    task = stub.QueueTask(request, timeout=30).task
    assert row(db, task.id)["input"] == {"blob": request.input["blob"]}


def test_complete_task_output_over_the_cap(stub: Stub, unchanged: Claimed) -> None:
    request = task_pb2.CompleteTaskRequest(
        task_id=unchanged.task_id,
        lease_token=unchanged.lease_token,
        output=struct_of_size(MAX_INPUT_BYTES + 1),
    )
    assert_refused(stub.CompleteTask, request, INVALID)


@pytest.mark.parametrize("priority", [-101, 101, -(2**31), 2**31 - 1])
def test_queue_task_priority_out_of_range(stub: Stub, no_new_task: str, priority: int) -> None:
    assert_refused(stub.QueueTask, queue_request(no_new_task, priority=priority), INVALID)


@pytest.mark.parametrize("max_retries", [-1, 101, -(2**31), 2**31 - 1])
def test_queue_task_max_retries_out_of_range(
    stub: Stub, no_new_task: str, max_retries: int
) -> None:
    request = queue_request(no_new_task, max_retries=max_retries)
    assert_refused(stub.QueueTask, request, INVALID)


@pytest.mark.parametrize("amount", [-1, -(2**63)])
def test_queue_task_negative_reserved_token_amount(
    stub: Stub, no_new_task: str, amount: int
) -> None:
    request = queue_request(no_new_task, reserved_token_amount=amount)
    assert_refused(stub.QueueTask, request, INVALID)


@pytest.mark.parametrize("field", ["token_amount", "cost_nanos"])
@pytest.mark.parametrize("amount", [-1, -(2**63)])
def test_complete_task_negative_reported_usage(
    stub: Stub, unchanged: Claimed, field: str, amount: int
) -> None:
    usage: dict[str, Any] = {field: amount}
    request = task_pb2.CompleteTaskRequest(
        task_id=unchanged.task_id,
        lease_token=unchanged.lease_token,
        output=struct({"url": "s3://bucket/out.png"}),
        reported_usage=task_pb2.ReportedUsage(**usage),
    )
    assert_refused(stub.CompleteTask, request, INVALID)


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"limit": -1}, id="negative-limit"),
        pytest.param({"limit": 10_001}, id="limit-over-10000"),
    ],
)
def test_list_stale_tasks_out_of_range(stub: Stub, fields: dict[str, int]) -> None:
    assert_refused(stub.ListStaleTasks, task_pb2.ListStaleTasksRequest(**fields), INVALID)


# --- values the database cannot hold: money past MAX_AMOUNT, deep Structs, bad Durations ------

# Amounts a bigint column holds but whose sums (spent + reserved + estimate) could overflow it.
TOO_MUCH = [
    pytest.param(MAX_AMOUNT + 1, id="max-amount+1"),
    pytest.param(2**62, id="2^62"),
    pytest.param(2**63 - 1, id="int64-max"),
]


def tool_row(db: Db, tool_id: str) -> dict[str, Any]:
    found = db.execute("SELECT * FROM generation.tools WHERE id = %s", [tool_id]).fetchone()
    assert found is not None
    return found


def settings_row(db: Db) -> dict[str, Any]:
    """The stored settings, less the spend counters (a rescue may release a reservation)."""
    found = db.execute("SELECT * FROM generation.settings").fetchone()
    assert found is not None
    return {
        k: v for k, v in found.items() if k not in {"spent_day", "spent_nanos", "reserved_nanos"}
    }


@pytest.mark.parametrize("field", ["cost_estimate_nanos", "reserved_token_amount"])
@pytest.mark.parametrize("amount", TOO_MUCH)
def test_queue_task_amount_too_large(stub: Stub, no_new_task: str, field: str, amount: int) -> None:
    request = queue_request(no_new_task, **{field: amount})
    assert_invalid_field(stub.QueueTask, request, field)


def test_queue_task_amount_at_the_bound_is_accepted(stub: Stub, db: Db, tool_id: str) -> None:
    """The control for the case above: MAX_AMOUNT itself is stored."""
    request = queue_request(
        tool_id, cost_estimate_nanos=MAX_AMOUNT, reserved_token_amount=MAX_AMOUNT
    )
    stored = row(db, stub.QueueTask(request).task.id)
    assert (stored["cost_estimate_nanos"], stored["reserved_token_amount"]) == (
        MAX_AMOUNT,
        MAX_AMOUNT,
    )


@pytest.mark.parametrize("field", ["cost_estimate_nanos", "daily_cap_nanos"])
@pytest.mark.parametrize("amount", TOO_MUCH)
def test_configure_tool_amount_too_large(
    stub: Stub, db: Db, tool_id: str, field: str, amount: int
) -> None:
    before = tool_row(db, tool_id)
    request = task_pb2.ConfigureToolRequest(tool_id=tool_id, **{field: amount})
    assert_invalid_field(stub.ConfigureTool, request, field)
    assert tool_row(db, tool_id) == before


@pytest.mark.parametrize("amount", TOO_MUCH)
def test_update_settings_daily_cap_too_large(stub: Stub, db: Db, amount: int) -> None:
    before = settings_row(db)
    request = task_pb2.UpdateSettingsRequest(daily_cap_nanos=amount)
    assert_invalid_field(stub.UpdateSettings, request, "daily_cap_nanos")
    assert settings_row(db) == before


@pytest.mark.parametrize("amount", TOO_MUCH)
def test_complete_task_token_amount_too_large(stub: Stub, unchanged: Claimed, amount: int) -> None:
    request = task_pb2.CompleteTaskRequest(
        task_id=unchanged.task_id,
        lease_token=unchanged.lease_token,
        reported_usage=task_pb2.ReportedUsage(token_amount=amount),
    )
    assert_invalid_field(stub.CompleteTask, request, "reported_usage.token_amount")


def nested(depth: int, *, lists: bool = False) -> dict[str, Any]:
    """A document `depth` levels deep, the outer object being level 1; with `lists`, every other
    level is a one-element list (lists count as levels too)."""
    document: Any = {"leaf": 1}
    for level in range(depth - 1, 0, -1):
        document = [document] if lists and level % 2 == 0 else {"a": document}
    assert isinstance(document, dict)
    return document


TOO_DEEP = [
    pytest.param(nested(MAX_DEPTH + 1), id="max-depth+1"),
    pytest.param(nested(MAX_DEPTH + 1, lists=True), id="max-depth+1-with-lists"),
    pytest.param(nested(33), id="33"),
]


@pytest.mark.parametrize("document", TOO_DEEP)
def test_queue_task_input_too_deep(stub: Stub, no_new_task: str, document: dict[str, Any]) -> None:
    request = task_pb2.QueueTaskRequest(tool_id=no_new_task, input=struct(document))
    assert_invalid_field(stub.QueueTask, request, "input")


@pytest.mark.parametrize("document", TOO_DEEP)
def test_complete_task_output_too_deep(
    stub: Stub, unchanged: Claimed, document: dict[str, Any]
) -> None:
    request = task_pb2.CompleteTaskRequest(
        task_id=unchanged.task_id, lease_token=unchanged.lease_token, output=struct(document)
    )
    assert_invalid_field(stub.CompleteTask, request, "output")


@pytest.mark.parametrize(
    "document",
    [
        pytest.param(nested(15), id="15"),
        pytest.param(nested(MAX_DEPTH), id="max-depth"),
        pytest.param(nested(MAX_DEPTH, lists=True), id="max-depth-with-lists"),
    ],
)
def test_queue_task_input_as_deep_as_allowed_is_readable(
    stub: Stub, db: Db, tool_id: str, document: dict[str, Any]
) -> None:
    """The control for the cases above: stored, and read back whole by GetTask and a claim."""
    task = stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id, input=struct(document))).task
    assert row(db, task.id)["input"] == document
    fetched = stub.GetTask(task_pb2.GetTaskRequest(task_id=task.id)).task
    assert json_format.MessageToDict(fetched.input) == document
    claimed = stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id)).task
    assert claimed.id == task.id
    assert json_format.MessageToDict(claimed.input) == document


MALFORMED_DURATIONS = [
    pytest.param(duration_pb2.Duration(nanos=10**9), id="nanos-1e9"),
    pytest.param(duration_pb2.Duration(seconds=1, nanos=2**31 - 1), id="nanos-int32-max"),
    pytest.param(duration_pb2.Duration(nanos=-1), id="nanos-minus-1"),
    pytest.param(duration_pb2.Duration(seconds=1, nanos=-1), id="opposite-signs"),
    pytest.param(duration_pb2.Duration(seconds=-1, nanos=1), id="negative-opposite-signs"),
]


@pytest.mark.parametrize("ttl", MALFORMED_DURATIONS)
def test_queue_task_malformed_ttl(stub: Stub, no_new_task: str, ttl: duration_pb2.Duration) -> None:
    assert_invalid_field(stub.QueueTask, queue_request(no_new_task, ttl=ttl), "ttl")


def test_queue_task_ttl_with_most_nanos_is_accepted(stub: Stub, db: Db, tool_id: str) -> None:
    """The control for the cases above: 999999999 nanos is valid, rounded up to a whole second."""
    ttl = duration_pb2.Duration(seconds=3600, nanos=999_999_999)
    stored = row(db, stub.QueueTask(queue_request(tool_id, ttl=ttl)).task.id)
    assert (stored["expires_at"] - stored["run_at"]).total_seconds() == 3601


@pytest.mark.parametrize("wait", MALFORMED_DURATIONS)
def test_claim_next_task_malformed_wait(
    stub: Stub, db: Db, tool_id: str, wait: duration_pb2.Duration
) -> None:
    stub.QueueTask(queue_request(tool_id))
    before = tasks_of(db, tool_id)
    request = task_pb2.ClaimNextTaskRequest(tool_id=tool_id, wait=wait)
    assert_invalid_field(stub.ClaimNextTask, request, "wait")
    assert tasks_of(db, tool_id) == before
    assert [task["status"] for task in before] == ["queued"]


# --- text: NUL characters, lengths, traceparents ---------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"input": {"prompt": "a\x00cat"}}, id="input-value"),
        pytest.param({"input": {"pro\x00mpt": "a cat"}}, id="input-key"),
        pytest.param({"input": {"a": {"b": ["ok", "n\x00l"]}}}, id="input-nested"),
        pytest.param({"billing_idempotency_key": "bill\x00-1"}, id="billing-key"),
    ],
)
def test_queue_task_nul_character(stub: Stub, no_new_task: str, fields: dict[str, Any]) -> None:
    request = task_pb2.QueueTaskRequest(tool_id=no_new_task, **fields)
    assert_refused(stub.QueueTask, request, INVALID)


def test_queue_task_billing_key_too_long(stub: Stub, no_new_task: str) -> None:
    request = queue_request(no_new_task, billing_idempotency_key="k" * 513)
    assert_refused(stub.QueueTask, request, INVALID)


@pytest.mark.parametrize("increment_retry", [True, False])
def test_fail_task_nul_in_error(stub: Stub, unchanged: Claimed, increment_retry: bool) -> None:
    request = task_pb2.FailTaskRequest(
        task_id=unchanged.task_id,
        lease_token=unchanged.lease_token,
        error="provider\x00said no",
        increment_retry=increment_retry,
    )
    assert_refused(stub.FailTask, request, INVALID)


def test_fail_task_error_too_long(stub: Stub, unchanged: Claimed) -> None:
    request = task_pb2.FailTaskRequest(
        task_id=unchanged.task_id, lease_token=unchanged.lease_token, error="e" * 8_193
    )
    assert_refused(stub.FailTask, request, INVALID)


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"output": {"url": "s3://\x00"}}, id="output-value"),
        pytest.param({"output": {"u\x00rl": "s3://x"}}, id="output-key"),
        pytest.param(
            {"reported_usage": task_pb2.ReportedUsage(details=struct({"model": "m\x001"}))},
            id="usage-details",
        ),
    ],
)
def test_complete_task_nul_character(
    stub: Stub, unchanged: Claimed, fields: dict[str, Any]
) -> None:
    request = task_pb2.CompleteTaskRequest(
        task_id=unchanged.task_id, lease_token=unchanged.lease_token, **fields
    )
    assert_refused(stub.CompleteTask, request, INVALID)


@pytest.mark.parametrize("traceparent", MALFORMED_TRACEPARENTS)
def test_queue_task_malformed_traceparent(stub: Stub, no_new_task: str, traceparent: str) -> None:
    request = queue_request(no_new_task, w3c_traceparent=traceparent)
    assert_refused(stub.QueueTask, request, INVALID)


def test_queue_task_valid_traceparent_is_accepted(stub: Stub, db: Db, tool_id: str) -> None:
    """The control for the cases above."""
    task = stub.QueueTask(queue_request(tool_id, w3c_traceparent=VALID_TRACEPARENT)).task
    assert row(db, task.id)["w3c_traceparent"] == VALID_TRACEPARENT


# --- JSON numbers jsonb cannot hold -----------------------------------------------------------


@pytest.mark.parametrize("number", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_queue_task_non_finite_number_in_input(stub: Stub, no_new_task: str, number: float) -> None:
    request = task_pb2.QueueTaskRequest(tool_id=no_new_task, input=struct({"temperature": number}))
    assert_refused(stub.QueueTask, request, INVALID)


@pytest.mark.parametrize("number", [math.nan, math.inf], ids=["nan", "inf"])
def test_complete_task_non_finite_number_in_output(
    stub: Stub, unchanged: Claimed, number: float
) -> None:
    request = task_pb2.CompleteTaskRequest(
        task_id=unchanged.task_id,
        lease_token=unchanged.lease_token,
        output=struct({"score": number}),
    )
    assert_refused(stub.CompleteTask, request, INVALID)


# --- FailTask without a lease, UpsertTool names ----------------------------------------------


def test_fail_task_increment_retry_needs_a_lease_token(stub: Stub, unchanged: Claimed) -> None:
    request = task_pb2.FailTaskRequest(
        task_id=unchanged.task_id, error="provider 503", increment_retry=True
    )
    assert_refused(stub.FailTask, request, INVALID)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("", id="empty"),
        pytest.param("t" * 201, id="201-characters"),
        pytest.param("image\x00gen", id="nul"),
    ],
)
def test_upsert_tool_bad_name(stub: Stub, db: Db, name: str) -> None:
    before = tool_count(db)
    assert_refused(stub.UpsertTool, task_pb2.UpsertToolRequest(name=name), INVALID)
    assert tool_count(db) == before


def test_unparseable_request_is_invalid_argument(service: Any, no_new_task: str) -> None:
    with grpc.insecure_channel(service.address) as channel:
        raw = channel.unary_unary("/generation.task.v1.GenerationDataService/QueueTask")
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\x0a\x05\xff\xfe\xfd\xfc\xfb", timeout=10)  # tool_id: invalid UTF-8
    error = from_rpc_error(caught.value)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == Reason.INVALID_ARGUMENT


# Constraints no request reaches: the service writes these columns itself.
INTERNAL_CONSTRAINTS = {
    "settings_singleton",
    "settings_granted_nonnegative",
    "tasks_lease_held_while_processing",
    "tasks_retry_count_nonnegative",
    "settlements_amounts",
    "settlements_terminal",
    "attempts_money_nonnegative",
    "replica_overrides_cap_nonnegative",
    "tokens_roles_known",
    "tokens_secret_length",
}


def test_every_check_a_request_can_break_has_a_rule_to_tell(db: Db) -> None:
    """Error messages name the rule, not the constraint: each CHECK of the schema is either
    explained in service/api/errors.py RULES or written by the service alone."""
    checks = {
        row["conname"]
        for row in db.execute(
            "SELECT conname FROM pg_constraint "
            "WHERE connamespace = 'generation'::regnamespace AND contype = 'c'"
        ).fetchall()
    }
    assert checks - INTERNAL_CONSTRAINTS == set(errors.RULES)


def test_a_combination_the_database_refuses_names_the_rule(stub: Stub, tool_id: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.ConfigureTool(
            task_pb2.ConfigureToolRequest(
                tool_id=tool_id, backoff_base_seconds=100, backoff_max_seconds=5
            )
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "backoff_max_seconds" in caught.value.details()
    assert "constraint" not in caught.value.details()
    assert "tools_" not in caught.value.details()
