"""The per-task event stream (GUIDE A11): a worker publishes under its lease, the service adds
the terminal event in the same statement as the outcome, a watcher replays from the start and
follows to the terminal event; with Redis, the stream is also kept as a Redis Stream."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Callable
from typing import Any, cast

import grpc
import pytest
import redis
import redis.asyncio as aioredis

from generation.task.v1 import task_pb2
from service.api.rpcs import BINDINGS, STATEMENTS
from service.api.signals import TERMINAL_EVENTS, Signals
from service.settings import Settings
from tests.conftest import REDIS_URL, ServiceProcess, wait_for
from tests.integration.test_semantics import Db, Stub, claim, queue, row
from workers_sdk.client import GenqClient
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
        K.TASK_EVENT_KIND_STARTED,
        K.TASK_EVENT_KIND_PROGRESS,
        K.TASK_EVENT_KIND_STREAMING_URL,
        K.TASK_EVENT_KIND_PARTIAL_OUTPUT,
        K.TASK_EVENT_KIND_COMPLETED,
    ]
    assert dict(events[0].data) == {"attempt": 1.0}
    assert dict(events[1].data) == {"progress": 0.5, "message": "half"}
    assert [e.sequence for e in events] == [1, 2, 3, 4, 5], "numbered per task"
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
        K.TASK_EVENT_KIND_STARTED,
        K.TASK_EVENT_KIND_PROGRESS,
        K.TASK_EVENT_KIND_REQUEUED,
        K.TASK_EVENT_KIND_STARTED,
        K.TASK_EVENT_KIND_FAILED,
    ]
    assert [dict(e.data) for e in seen if e.kind == K.TASK_EVENT_KIND_STARTED] == [
        {"attempt": 1.0},
        {"attempt": 2.0},
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
        "SELECT kind FROM generation.event_stream WHERE task_id = %s ORDER BY sequence", [task.id]
    ).fetchall()
    assert kinds == [{"kind": "started"}, {"kind": "completed"}]


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
    # The same lease releasing again (a retry after a lost answer) is answered, changing nothing.
    stub.ReleaseTask(task_pb2.ReleaseTaskRequest(task_id=task.id, lease_token=claimed.lease_token))
    assert str(row(db, task.id)["lease_token"]) == again.lease_token
    with pytest.raises(grpc.RpcError) as caught:
        stub.ReleaseTask(
            task_pb2.ReleaseTaskRequest(task_id=task.id, lease_token=str(uuid.uuid4()))
        )
    assert from_rpc_error(caught.value).reason == Reason.LEASE_LOST
    assert str(row(db, task.id)["lease_token"]) == again.lease_token


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
        lambda: (found := client.xrange(stream)) and len(found) == 3 and found,
        what="the three events in the Redis Stream",
    )
    assert [fields["kind"] for _, fields in entries] == ["started", "progress", "completed"]
    assert json.loads(entries[1][1]["data"]) == {"progress": 0.25}
    assert client.ttl(stream) > 0, "a finished task's stream expires"


def stream_holds(
    client: redis.Redis, stream: str, count: int
) -> Callable[[], list[dict[str, str]] | None]:
    """A wait_for condition: the stream's entries' fields once it holds `count` of them."""

    def check() -> list[dict[str, str]] | None:
        entries = cast(list[tuple[str, dict[str, str]]], client.xrange(stream))
        found = [fields for _, fields in entries]
        return found if len(found) >= count else None

    return check


def test_many_events_per_task_reach_the_redis_stream_in_sequence_order(
    redis_service: ServiceProcess, redis_environment: str, db: Db, tool_id: str
) -> None:
    """Workers publishing as fast as the service answers, many tasks at once: each task's Redis
    Stream holds its events in sequence order, exactly those in Postgres, the terminal last."""
    tasks, events_per_task = 30, 25

    async def work(client: GenqClient) -> str:
        claimed = await client.call("ClaimNextTask", task_pb2.ClaimNextTaskRequest(tool_id=tool_id))
        assert claimed.HasField("task")
        for i in range(events_per_task):
            await client.call(
                "PublishTaskEvent",
                task_pb2.PublishTaskEventRequest(
                    task_id=claimed.task.id,
                    lease_token=claimed.lease_token,
                    kind=K.TASK_EVENT_KIND_PROGRESS,
                    data={"progress": i / events_per_task},
                ),
            )
        await client.call(
            "CompleteTask",
            task_pb2.CompleteTaskRequest(task_id=claimed.task.id, lease_token=claimed.lease_token),
        )
        return str(claimed.task.id)

    async def main() -> list[str]:
        async with GenqClient(redis_service.address) as client:
            for _ in range(tasks):
                await client.call("QueueTask", task_pb2.QueueTaskRequest(tool_id=tool_id))
            return list(await asyncio.gather(*(work(client) for _ in range(tasks))))

    task_ids = asyncio.run(main())
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    for task_id in task_ids:
        stored = db.execute(
            "SELECT sequence, kind::text FROM generation.event_stream "
            "WHERE task_id = %s ORDER BY sequence",
            [task_id],
        ).fetchall()
        assert len(stored) >= events_per_task + 1
        stream = f"{redis_environment}:common:task:{task_id}:events"
        entries = wait_for(
            stream_holds(client, stream, len(stored)),
            what=f"task {task_id}'s events in its Redis Stream",
        )
        assert [(int(e["sequence"]), e["kind"]) for e in entries] == [
            (r["sequence"], r["kind"]) for r in stored
        ], "in sequence order, none missing, none twice"
        assert entries[-1]["kind"] == "completed"
        assert client.ttl(stream) > 0, "a finished task's stream expires"


def test_the_mirror_orders_events_added_out_of_order_and_drops_late_ones() -> None:
    """signals.py alone: events whose answers came back swapped within one turn of the loop are
    still written in sequence order; one arriving after a later one was written is dropped
    rather than written out of order."""
    environment = f"test{uuid.uuid4().hex[:8]}"
    tasks = [str(uuid.uuid4()) for _ in range(12)]
    per_task = 30

    def event(task_id: str, sequence: int) -> dict[str, Any]:
        kind = "completed" if sequence == per_task else "progress"
        return {
            "task_id": task_id,
            "sequence": sequence,
            "kind": kind,
            "data": {} if kind in TERMINAL_EVENTS else {"progress": sequence / per_task},
            "created_at": "2030-01-01T00:00:00+00:00",
        }

    async def main() -> list[list[dict[str, Any]]]:
        signals = Signals(Settings(redis_url=REDIS_URL, environment=environment))
        reader = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
        try:
            for sequence in range(1, per_task + 1, 2):
                # Two answers of each task processed in the wrong order, in one turn.
                for task_id in tasks:
                    signals.event_added(event(task_id, sequence + 1))
                    signals.event_added(event(task_id, sequence))
                await asyncio.sleep(0.001)
            streams = [signals.events_stream(t) for t in tasks]

            async def all_written() -> bool:
                lengths = [await reader.xlen(s) for s in streams]
                return lengths == [per_task] * len(tasks)

            for _ in range(500):
                if await all_written():
                    break
                await asyncio.sleep(0.01)
            signals.event_added(event(tasks[0], 3))  # late: 30 is written already
            await signals.close()
            written = [await reader.xrange(s) for s in streams]
            return [[dict(f) for _, f in cast(list[tuple[str, Any]], w)] for w in written]
        finally:
            async for key in reader.scan_iter(f"{environment}:*"):
                await reader.delete(key)
            await reader.aclose()

    for entries in asyncio.run(main()):
        assert [int(e["sequence"]) for e in entries] == list(range(1, per_task + 1))
        assert entries[-1]["kind"] == "completed"


def stream_event(db: Db, task_id: str, sequence: int) -> Any:
    found = db.execute(
        "SELECT to_jsonb(e) AS event FROM generation.event_stream AS e "
        "WHERE task_id = %s AND sequence = %s",
        [task_id, sequence],
    ).fetchall()
    assert len(found) == 1, "one event per sequence"
    return found[0]["event"]


def test_the_derived_events_answer_as_the_stream_holds_them(db: Db, tool_id: str) -> None:
    """The claim and a clean completion store no event rows; the JSON they hand the Redis mirror
    is the row generation.event_stream derives from the attempt, exactly."""
    settings = Settings.from_env({})
    db.execute(
        "INSERT INTO generation.tasks (tool_id) SELECT %s FROM generate_series(1, 2)", [tool_id]
    )
    params = BINDINGS["ClaimTasks"].bind(
        task_pb2.ClaimTasksRequest(tool_id=tool_id, limit=2), settings
    )
    assert params["mirror"] is False, "no Redis: the claim answers no event JSON"
    claimed = db.execute(STATEMENTS["ClaimTasks"], {**params, "mirror": True}).fetchall()
    assert len(claimed) == 2
    for got in claimed:
        assert got["event"] == stream_event(db, str(got["id"]), got["last_event_seq"])
        assert got["event"]["kind"] == "started"
    request = task_pb2.CompleteTasksRequest(
        tasks=[
            task_pb2.CompleteTaskRequest(task_id=str(c["id"]), lease_token=str(c["lease_token"]))
            for c in claimed
        ]
    )
    done = db.execute(
        STATEMENTS["CompleteTasks"], BINDINGS["CompleteTasks"].bind(request, settings)
    ).fetchall()
    for got in done:
        sequence = row(db, str(got["id"]))["last_event_seq"]
        assert got["event"] == stream_event(db, str(got["id"]), sequence)
        assert got["event"]["kind"] == "completed"
    stored = db.execute(
        "SELECT count(*) AS n FROM generation.task_events WHERE task_id = ANY (%s::uuid[])",
        [[c["id"] for c in claimed]],
    ).fetchone()
    assert stored == {"n": 0}, "no event row written for a clean run"


def test_a_claim_without_the_mirror_answers_no_event_json(db: Db, tool_id: str) -> None:
    settings = Settings.from_env({})
    db.execute("INSERT INTO generation.tasks (tool_id) VALUES (%s)", [tool_id])
    params = BINDINGS["ClaimNextTask"].bind(
        task_pb2.ClaimNextTaskRequest(tool_id=tool_id), settings
    )
    (claimed,) = db.execute(STATEMENTS["ClaimNextTask"], params).fetchall()
    assert claimed["id"] is not None and claimed["event"] is None
    assert stream_event(db, str(claimed["id"]), claimed["last_event_seq"])["kind"] == "started"
