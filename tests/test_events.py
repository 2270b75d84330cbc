"""The per-task event stream (GUIDE A11): a worker publishes under its lease, the service adds
the terminal event in the same statement as the outcome, a watcher replays from the start and
follows to the terminal event; with Redis, the stream is also kept as a Redis Stream."""

from __future__ import annotations

import json
import threading
from typing import Any

import grpc
import pytest
import redis

from generation.task.v1 import task_pb2
from tests.conftest import REDIS_URL, ServiceProcess, wait_for
from tests.test_semantics import Db, Stub, claim, queue, row
from workers_sdk.errors import Reason, from_rpc_error

K = task_pb2.TaskEventKind


def publish(stub: Stub, claimed: Any, kind: int, **data: Any) -> task_pb2.TaskEvent:
    request = task_pb2.PublishTaskEventRequest(
        task_id=claimed.task.id, lease_token=claimed.lease_token, kind=kind, data=data
    )
    return stub.PublishTaskEvent(request).event


def watch(stub: Stub, task_id: str, after: int = 0) -> list[task_pb2.TaskEvent]:
    request = task_pb2.WatchTaskEventsRequest(task_id=task_id, after_sequence=after)
    return [answer.event for answer in stub.WatchTaskEvents(request, timeout=30)]


def complete(stub: Stub, claimed: Any) -> None:
    stub.CompleteTask(
        task_pb2.CompleteTaskRequest(task_id=claimed.task.id, lease_token=claimed.lease_token)
    )


def test_replay_from_the_start_ends_at_the_terminal_event(stub: Stub, tool_id: str) -> None:
    task = queue(stub, tool_id)
    claimed = claim(stub, tool_id)
    publish(stub, claimed, K.TASK_EVENT_KIND_PROGRESS, progress=0.5, message="half")
    publish(stub, claimed, K.TASK_EVENT_KIND_STREAMING_URL, url="https://cdn.invalid/s/1")
    publish(stub, claimed, K.TASK_EVENT_KIND_PARTIAL_OUTPUT, frames=3)
    complete(stub, claimed)

    events = watch(stub, task.id)

    assert [e.kind for e in events] == [
        K.TASK_EVENT_KIND_PROGRESS,
        K.TASK_EVENT_KIND_STREAMING_URL,
        K.TASK_EVENT_KIND_PARTIAL_OUTPUT,
        K.TASK_EVENT_KIND_COMPLETED,
    ]
    assert dict(events[0].data) == {"progress": 0.5, "message": "half"}
    assert [e.sequence for e in events] == sorted(e.sequence for e in events)
    assert watch(stub, task.id, after=events[1].sequence) == events[2:]


def test_watch_follows_live_events_until_the_terminal_one(stub: Stub, tool_id: str) -> None:
    task = queue(stub, tool_id)
    seen: list[task_pb2.TaskEvent] = []
    watcher = threading.Thread(target=lambda: seen.extend(watch(stub, task.id)))
    watcher.start()
    claimed = claim(stub, tool_id)
    publish(stub, claimed, K.TASK_EVENT_KIND_PROGRESS, progress=0.1)
    stub.FailTask(
        task_pb2.FailTaskRequest(
            task_id=task.id, lease_token=claimed.lease_token, increment_retry=True, error="E"
        )
    )
    again = claim(stub, tool_id)
    stub.FailTask(
        task_pb2.FailTaskRequest(
            task_id=task.id, lease_token=again.lease_token, increment_retry=False, error="final"
        )
    )
    watcher.join(timeout=30)
    assert not watcher.is_alive(), "the watch did not end at the terminal event"
    assert [e.kind for e in seen] == [
        K.TASK_EVENT_KIND_PROGRESS,
        K.TASK_EVENT_KIND_REQUEUED,
        K.TASK_EVENT_KIND_FAILED,
    ]
    assert dict(seen[-1].data) == {"error": "final", "retry_count": 1.0}


def test_publish_needs_the_lease(stub: Stub, db: Db, tool_id: str) -> None:
    task = queue(stub, tool_id)
    claimed = claim(stub, tool_id)
    complete(stub, claimed)
    with pytest.raises(grpc.RpcError) as caught:
        publish(stub, claimed, K.TASK_EVENT_KIND_PROGRESS, progress=1.0)
    assert from_rpc_error(caught.value).reason == Reason.LEASE_LOST
    kinds = db.execute(
        "SELECT kind FROM generation.task_events WHERE task_id = %s", [task.id]
    ).fetchall()
    assert kinds == [{"kind": "completed"}]


@pytest.mark.parametrize(
    "kind", [K.TASK_EVENT_KIND_COMPLETED, K.TASK_EVENT_KIND_FAILED, K.TASK_EVENT_KIND_UNSPECIFIED]
)
def test_workers_cannot_publish_the_services_events(stub: Stub, tool_id: str, kind: int) -> None:
    queue(stub, tool_id)
    claimed = claim(stub, tool_id)
    with pytest.raises(grpc.RpcError) as caught:
        publish(stub, claimed, kind)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_watching_an_unknown_task_is_not_found(stub: Stub) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        watch(stub, "00000000-0000-0000-0000-00000000abcd")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_release_requeues_without_using_an_attempt(stub: Stub, db: Db, tool_id: str) -> None:
    task = queue(stub, tool_id)
    claimed = claim(stub, tool_id)
    released = stub.ReleaseTask(
        task_pb2.ReleaseTaskRequest(task_id=task.id, lease_token=claimed.lease_token)
    ).task
    assert released.status == task_pb2.TASK_STATUS_QUEUED
    assert released.retry_count == 0
    assert row(db, task.id)["lease_token"] is None
    again = claim(stub, tool_id)
    assert again.task.id == task.id and again.task.retry_count == 0
    with pytest.raises(grpc.RpcError) as caught:
        stub.ReleaseTask(
            task_pb2.ReleaseTaskRequest(task_id=task.id, lease_token=claimed.lease_token)
        )
    assert from_rpc_error(caught.value).reason == Reason.LEASE_LOST


def test_events_are_kept_as_a_redis_stream(
    redis_service: ServiceProcess, redis_environment: str, tool_id: str
) -> None:
    stub = redis_service.stub
    task = queue(stub, tool_id)
    claimed = claim(stub, tool_id)
    publish(stub, claimed, K.TASK_EVENT_KIND_PROGRESS, progress=0.25)
    complete(stub, claimed)
    stream = f"{redis_environment}:common:task:{task.id}:events"
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    entries = wait_for(
        lambda: (found := client.xrange(stream)) and len(found) == 2 and found,
        what="both events in the Redis Stream",
    )
    assert [fields["kind"] for _, fields in entries] == ["progress", "completed"]
    assert json.loads(entries[0][1]["data"]) == {"progress": 0.25}
    assert client.ttl(stream) > 0, "a finished task's stream expires"
