"""Wake (GUIDE A10): a parked claim returns as soon as a task for its tool is committed — in the
same process directly, across replicas through Redis — and Redis trouble never fails an enqueue.

The services here re-check only every 30 s, so a claim that returns with the task well inside
its wait was woken, not found by the floor.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from google.protobuf import duration_pb2

from generation.task.v1 import task_pb2
from tests.conftest import REDIS_URL, ServiceProcess, free_port, wait_for

SLOW_FLOOR = {"GENQ_RECHECK_SECONDS": "30"}
WAIT = duration_pb2.Duration(seconds=20)
PARK_SETTLE_SECONDS = 0.5  # lets the claim reach its park; the assertions do not depend on it


def new_tool(service: ServiceProcess) -> str:
    request = task_pb2.UpsertToolRequest(name=f"tool-{uuid.uuid4().hex[:8]}")
    return str(service.stub.UpsertTool(request).tool.id)


class ParkedClaim:
    """A ClaimNextTask with a wait, running in a thread."""

    def __init__(self, service: ServiceProcess, tool_id: str) -> None:
        self.answer: Any = None
        self.returned_at = 0.0
        request = task_pb2.ClaimNextTaskRequest(tool_id=tool_id, wait=WAIT)

        def run() -> None:
            self.answer = service.stub.ClaimNextTask(request, timeout=60)
            self.returned_at = time.monotonic()

        self.thread = threading.Thread(target=run)
        self.thread.start()
        time.sleep(PARK_SETTLE_SECONDS)
        assert self.thread.is_alive(), "the claim returned before any task was queued"

    def result(self) -> Any:
        self.thread.join(timeout=WAIT.seconds + 10)
        return self.answer


@pytest.fixture
def slow_floor_service(database_url: str, tmp_path: Path) -> Iterator[ServiceProcess]:
    process = ServiceProcess(database_url, tmp_path / "serve.log", **SLOW_FLOOR)
    yield process
    process.stop()


def test_parked_claim_wakes_on_enqueue_in_the_same_process(
    slow_floor_service: ServiceProcess,
) -> None:
    tool_id = new_tool(slow_floor_service)
    parked = ParkedClaim(slow_floor_service, tool_id)
    queued_at = time.monotonic()
    task = slow_floor_service.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id)).task

    answer = parked.result()

    assert answer.task.id == task.id
    assert parked.returned_at - queued_at < WAIT.seconds / 2, "woken by the floor, not the wake"


def test_parked_claim_with_nothing_queued_returns_empty_after_its_wait(
    service: ServiceProcess, tool_id: str
) -> None:
    request = task_pb2.ClaimNextTaskRequest(
        tool_id=tool_id, wait=duration_pb2.Duration(nanos=300_000_000)
    )
    assert not service.stub.ClaimNextTask(request, timeout=10).HasField("task")


def test_wake_crosses_replicas_through_redis(
    database_url: str, redis_environment: str, tmp_path: Path
) -> None:
    env = {**SLOW_FLOOR, "REDIS_ADDR": REDIS_URL, "ENVIRONMENT": redis_environment}
    replica_a = ServiceProcess(database_url, tmp_path / "a.log", **env)
    replica_b = ServiceProcess(database_url, tmp_path / "b.log", **env)
    try:
        tool_id = new_tool(replica_a)
        parked = ParkedClaim(replica_a, tool_id)
        queued_at = time.monotonic()
        task = replica_b.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id)).task
        answer = parked.result()
        assert answer.task.id == task.id
        assert parked.returned_at - queued_at < WAIT.seconds / 2, "the wake did not cross"
    finally:
        replica_a.stop()
        replica_b.stop()


def test_enqueue_publishes_the_tool_id_after_commit(
    redis_service: ServiceProcess, redis_environment: str
) -> None:
    subscriber = redis.Redis.from_url(REDIS_URL).pubsub(ignore_subscribe_messages=True)
    subscriber.subscribe(f"{redis_environment}:common:task:wake")
    try:
        tool_id = new_tool(redis_service)
        redis_service.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id))
        message = wait_for(
            lambda: subscriber.get_message(timeout=0.1), what="the wake on the Redis channel"
        )
        assert message["data"].decode() == tool_id
    finally:
        subscriber.close()


def test_redis_down_never_fails_an_enqueue(database_url: str, tmp_path: Path) -> None:
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    service = ServiceProcess(database_url, tmp_path / "serve.log", REDIS_ADDR=dead_redis)
    try:
        tool_id = new_tool(service)
        for _ in range(3):
            service.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id), timeout=10)
        claimed = service.stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id))
        assert claimed.HasField("task")
    finally:
        service.stop()


def test_claim_wait_longer_than_the_limit_is_refused(service: ServiceProcess, tool_id: str) -> None:
    request = task_pb2.ClaimNextTaskRequest(tool_id=tool_id, wait=duration_pb2.Duration(seconds=31))
    with pytest.raises(grpc.RpcError) as caught:
        service.stub.ClaimNextTask(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
