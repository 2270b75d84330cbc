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
from google.protobuf import struct_pb2
from google.protobuf.message import Message

from generation.task.v1 import task_pb2, task_pb2_grpc
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
        pytest.param({"processing_grace_seconds": -1}, id="negative-grace"),
        pytest.param({"queued_max_age_seconds": -1}, id="negative-max-age"),
    ],
)
def test_list_stale_tasks_out_of_range(stub: Stub, fields: dict[str, int]) -> None:
    assert_refused(stub.ListStaleTasks, task_pb2.ListStaleTasksRequest(**fields), INVALID)


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
