"""The gateway SDK (workers_sdk.gateway) against the running service: enqueue with trace context,
get, and following a task's events from replay to the terminal one.

The worker side is driven with plain RPCs (claim, publish, complete, fail) so each event is
published exactly when the test says.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from generation.task.v1 import task_pb2
from tests.conftest import ServiceProcess
from workers_sdk.client import GenqClient
from workers_sdk.errors import GenqError, Reason
from workers_sdk.gateway import Enqueued, EnqueueIncomplete, GatewayClient, NewTask

Db = psycopg.Connection[dict[str, Any]]
EVENT_TIMEOUT = 10.0
"""Longest wait for one event; a watch that hangs fails the test instead of the run."""


def run_with_gateway(
    service: ServiceProcess,
    scenario: Callable[[GatewayClient, GenqClient], Awaitable[Any]],
    **gateway_options: Any,
) -> Any:
    """Runs an async scenario with a fresh client (grpc.aio channels belong to one event loop)."""

    async def main() -> Any:
        async with GenqClient(service.address) as client:
            return await scenario(GatewayClient(client, **gateway_options), client)

    return asyncio.run(main())


def row(db: Db, task_id: str) -> dict[str, Any]:
    found = db.execute("SELECT * FROM generation.tasks WHERE id = %s", [task_id]).fetchone()
    assert found is not None
    return found


async def claim(client: GenqClient, tool_id: str) -> task_pb2.ClaimNextTaskResponse:
    claimed = await client.call("ClaimNextTask", task_pb2.ClaimNextTaskRequest(tool_id=tool_id))
    assert claimed.HasField("task")
    return claimed


async def publish(
    client: GenqClient, claimed: task_pb2.ClaimNextTaskResponse, progress: float
) -> task_pb2.TaskEvent:
    response = await client.call(
        "PublishTaskEvent",
        task_pb2.PublishTaskEventRequest(
            task_id=claimed.task.id,
            lease_token=claimed.lease_token,
            kind=task_pb2.TASK_EVENT_KIND_PROGRESS,
            data={"progress": progress},
        ),
    )
    return response.event


async def fail(client: GenqClient, claimed: task_pb2.ClaimNextTaskResponse, error: str) -> None:
    await client.call(
        "FailTask",
        task_pb2.FailTaskRequest(
            task_id=claimed.task.id,
            lease_token=claimed.lease_token,
            error=error,
            increment_retry=True,
        ),
    )


class Follower:
    """Follows a task in the background and hands each event over as it arrives."""

    def __init__(self, gateway: GatewayClient, task_id: str, after_sequence: int = 0) -> None:
        self.events: asyncio.Queue[task_pb2.TaskEvent] = asyncio.Queue()
        self.done = asyncio.create_task(self._follow(gateway, task_id, after_sequence))

    async def _follow(self, gateway: GatewayClient, task_id: str, after_sequence: int) -> None:
        async for event in gateway.follow(task_id, after_sequence, timeout=60):
            await self.events.put(event)

    async def next(self) -> task_pb2.TaskEvent:
        return await asyncio.wait_for(self.events.get(), EVENT_TIMEOUT)

    async def finished(self) -> None:
        """The watch ended by itself (after the terminal event), with nothing more to hand over."""
        await asyncio.wait_for(self.done, EVENT_TIMEOUT)
        assert self.events.empty()


def test_enqueue_stores_the_traceparent_of_its_span(
    service: ServiceProcess, db: Db, tool_id: str
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def scenario(gateway: GatewayClient, client: GenqClient) -> tuple[Any, task_pb2.Task]:
        with provider.get_tracer("test").start_as_current_span("handle chat message") as request:
            task = await gateway.enqueue(tool_id, {"prompt": "a cat"})
        return request.get_span_context(), task

    request, task = run_with_gateway(service, scenario, tracer_provider=provider)

    (enqueue,) = [s for s in exporter.get_finished_spans() if s.name.startswith("enqueue")]
    assert enqueue.name == f"enqueue {tool_id}"
    assert enqueue.kind == trace.SpanKind.PRODUCER
    assert enqueue.parent is not None and enqueue.parent.span_id == request.span_id
    assert enqueue.context.trace_id == request.trace_id
    assert enqueue.attributes is not None
    assert enqueue.attributes["genq.task_id"] == task.id
    # The worker continues the caller's trace, as a child of the enqueue.
    span = enqueue.context
    expected = f"00-{request.trace_id:032x}-{span.span_id:016x}-{span.trace_flags:02x}"
    assert span.trace_flags.sampled
    assert task.w3c_traceparent == expected
    assert row(db, task.id)["w3c_traceparent"] == expected


def test_enqueue_without_tracing_stores_no_traceparent(
    service: ServiceProcess, db: Db, tool_id: str
) -> None:
    async def scenario(gateway: GatewayClient, client: GenqClient) -> task_pb2.Task:
        return await gateway.enqueue(tool_id, {"prompt": "a cat"})

    task = run_with_gateway(service, scenario, tracer_provider=trace.NoOpTracerProvider())

    assert row(db, task.id)["w3c_traceparent"] in (None, "")


def test_enqueue_stores_its_options_and_unset_ones_take_the_defaults(
    service: ServiceProcess, db: Db, tool_id: str
) -> None:
    key = f"bill-{uuid.uuid4()}"

    async def scenario(gateway: GatewayClient, client: GenqClient) -> list[task_pb2.Task]:
        return [
            await gateway.enqueue(
                tool_id,
                {"prompt": "a dog", "n": 2, "style": {"tone": "warm"}},
                priority=7,
                max_retries=5,
                reserved_token_amount=1_500,
                idempotency_key=key,
            ),
            await gateway.enqueue(tool_id, {}),
            await gateway.enqueue(
                tool_id,
                {"prompt": "a dog", "n": 2, "style": {"tone": "warm"}},
                reserved_token_amount=1_500,
                idempotency_key=key,
            ),
        ]

    with_options, plain, retried = run_with_gateway(service, scenario)
    assert retried.id == with_options.id, "the same key and input answer with the same task"

    stored = row(db, with_options.id)
    assert stored["input"] == {"prompt": "a dog", "n": 2, "style": {"tone": "warm"}}
    assert (stored["priority"], stored["max_retries"]) == (7, 5)
    assert stored["reserved_token_amount"] == 1_500
    assert stored["billing_idempotency_key"] == key
    assert stored["status"] == "queued"
    stored = row(db, plain.id)
    assert (stored["priority"], stored["max_retries"], stored["reserved_token_amount"]) == (0, 3, 0)


def test_enqueue_many_splits_into_calls_of_a_thousand_and_keeps_the_order(
    service: ServiceProcess, db: Db, tool_id: str
) -> None:
    """2,500 items: three QueueTasks (1,000, 1,000, 500), the tasks back in item order, stored
    with their options; items whose idempotency key is used already are skipped and counted;
    every task stores the traceparent of the one enqueue_many span."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    keys = [f"many-{uuid.uuid4()}" for _ in range(3)]
    items: list[dict[str, Any] | NewTask] = [{"n": n} for n in range(2_500)]
    items[10] = NewTask({"n": 10}, priority=5, max_retries=1, idempotency_key=keys[0])
    items[1_500] = NewTask({"n": 1_500}, reserved_token_amount=0, idempotency_key=keys[1])
    items[2_499] = NewTask({"n": 2_499}, idempotency_key=keys[2])

    async def scenario(gateway: GatewayClient, client: GenqClient) -> tuple[Enqueued, ...]:
        calls: list[int] = []
        call = client.call

        async def counted(method: str, request: Any, **options: Any) -> Any:
            calls.append(len(request.tasks))
            return await call(method, request, **options)

        client.call = counted  # type: ignore[method-assign]
        first = await gateway.enqueue_many(tool_id, items, reserved_token_amount=3)
        assert calls == [1_000, 1_000, 500]
        # The same keys again, among new items: those three are skipped, the rest queued.
        again = await gateway.enqueue_many(
            tool_id, [items[10], {"n": "new"}, items[2_499]], concurrency=2
        )
        return first, again

    first, again = run_with_gateway(service, scenario, tracer_provider=provider)
    assert first.skipped == 0 and len(first.tasks) == 2_500
    assert [task.input["n"] for task in first.tasks] == list(range(2_500))
    assert len({task.id for task in first.tasks}) == 2_500
    assert (again.skipped, [dict(task.input) for task in again.tasks]) == (2, [{"n": "new"}])
    assert [(task.id, task.idempotency_key) for task in again.existing] == [
        (first.tasks[10].id, keys[0]),
        (first.tasks[2_499].id, keys[2]),
    ]
    assert {task.status for task in again.existing} == {task_pb2.TASK_STATUS_QUEUED}

    stored = {
        r["id"]: r
        for r in db.execute(
            "SELECT id::text AS id, input, priority, max_retries, reserved_token_amount, "
            "idempotency_key, billing_idempotency_key, w3c_traceparent "
            "FROM generation.tasks WHERE tool_id = %s",
            [tool_id],
        ).fetchall()
    }
    assert len(stored) == 2_501
    special = first.tasks[10]
    assert (stored[special.id]["priority"], stored[special.id]["max_retries"]) == (5, 1)
    assert stored[special.id]["billing_idempotency_key"] == keys[0]
    assert stored[special.id]["reserved_token_amount"] == 3, "a None field takes the call's"
    assert stored[first.tasks[1_500].id]["reserved_token_amount"] == 0, "its own 0 wins"
    plain = stored[first.tasks[0].id]
    assert (plain["priority"], plain["max_retries"], plain["reserved_token_amount"]) == (0, 3, 3)
    assert plain["idempotency_key"] is None or plain["idempotency_key"] == ""
    [span, _] = [s for s in exporter.get_finished_spans() if s.name == f"enqueue_many {tool_id}"]
    assert span.context is not None and span.attributes is not None
    assert span.attributes["genq.count"] == 2_500
    parents = {stored[t.id]["w3c_traceparent"].rsplit("-", 1)[0] for t in first.tasks}
    assert parents == {f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}"}


def test_enqueue_many_keeps_each_call_under_the_message_limit(
    service: ServiceProcess, tool_id: str
) -> None:
    """Seven 600 KB inputs would make one 4.2 MB QueueTasks, over the service's 4 MiB limit: they
    go in calls of at most 2 MiB (three, three and one), all queued in order."""
    blob = "x" * 600_000

    async def scenario(gateway: GatewayClient, client: GenqClient) -> tuple[Enqueued, list[int]]:
        calls: list[int] = []
        call = client.call

        async def counted(method: str, request: Any, **options: Any) -> Any:
            calls.append(len(request.tasks))
            return await call(method, request, **options)

        client.call = counted  # type: ignore[method-assign]
        items = [{"blob": blob, "n": n} for n in range(7)]
        return await gateway.enqueue_many(tool_id, items), calls

    queued, calls = run_with_gateway(service, scenario)
    assert calls == [3, 3, 1]
    assert [task.input["n"] for task in queued.tasks] == list(range(7))
    assert queued.skipped == 0


def test_enqueue_to_an_unknown_tool_is_not_found(service: ServiceProcess) -> None:
    async def scenario(gateway: GatewayClient, client: GenqClient) -> None:
        await gateway.enqueue(str(uuid.uuid4()), {})

    with pytest.raises(GenqError) as caught:
        run_with_gateway(service, scenario)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert caught.value.reason is Reason.TOOL_NOT_FOUND


def test_enqueue_many_to_an_unknown_tool_raises_the_calls_error(service: ServiceProcess) -> None:
    """With its default calls in flight, a failed call raises its GenqError, not a group of
    them, as one call at a time does."""

    async def scenario(gateway: GatewayClient, client: GenqClient) -> None:
        await gateway.enqueue_many(str(uuid.uuid4()), [{"n": n} for n in range(2_500)])

    with pytest.raises(GenqError) as caught:
        run_with_gateway(service, scenario)
    assert caught.value.reason is Reason.TOOL_NOT_FOUND


def test_enqueue_many_says_which_items_a_refused_call_left_out(
    service: ServiceProcess, db: Db, tool_id: str
) -> None:
    """One bad item in the second of three calls, all in flight together: that call is refused
    and queues nothing; the two others are let finish, not cancelled, and their tasks come back
    in the error beside the items left out, which can then be sent again on their own."""
    items: list[dict[str, Any] | NewTask] = [{"n": n} for n in range(2_500)]
    items[1_500] = NewTask({"n": 1_500}, priority=500)

    async def scenario(gateway: GatewayClient, client: GenqClient) -> EnqueueIncomplete:
        with pytest.raises(EnqueueIncomplete) as caught:
            await gateway.enqueue_many(tool_id, items)
        left_out = caught.value.not_queued
        again = [items[i] if i != 1_500 else {"n": 1_500} for i in left_out]
        assert len((await gateway.enqueue_many(tool_id, again)).tasks) == len(left_out)
        return caught.value

    incomplete = run_with_gateway(service, scenario)
    assert incomplete.reason is Reason.INVALID_ARGUMENT
    assert incomplete.not_queued == list(range(1_000, 2_000)) and incomplete.unknown == []
    assert [t.input["n"] for t in incomplete.enqueued.tasks] == [
        *range(1_000),
        *range(2_000, 2_500),
    ]
    stored = db.execute(
        "SELECT (input ->> 'n')::numeric::int AS n FROM generation.tasks "
        "WHERE tool_id = %s ORDER BY 1",
        [tool_id],
    ).fetchall()
    assert [r["n"] for r in stored] == list(range(2_500)), "each item queued once"


def test_enqueue_many_says_which_items_a_lost_answer_may_have_queued(
    service: ServiceProcess, db: Db, tool_id: str
) -> None:
    """The second call commits but its answer is lost (UNAVAILABLE after the commit): its items
    are reported unknown and the third call is never sent. With idempotency keys, sending the
    unknown and the unsent items again queues only what is missing."""
    items = [NewTask({"n": n}, idempotency_key=f"{tool_id}-{n}") for n in range(2_500)]

    async def scenario(gateway: GatewayClient, client: GenqClient) -> tuple[Any, Enqueued]:
        call = client.call
        calls = 0

        async def answer_lost_once(method: str, request: Any, **options: Any) -> Any:
            nonlocal calls
            answer = await call(method, request, **options)
            calls += 1
            if calls == 2:
                raise GenqError(grpc.StatusCode.UNAVAILABLE, "connection lost", None)
            return answer

        client.call = answer_lost_once  # type: ignore[method-assign]
        with pytest.raises(EnqueueIncomplete) as caught:
            await gateway.enqueue_many(tool_id, items, concurrency=1)
        incomplete = caught.value
        again = [items[i] for i in incomplete.unknown + incomplete.not_queued]
        return incomplete, await gateway.enqueue_many(tool_id, again, concurrency=1)

    incomplete, again = run_with_gateway(service, scenario)
    assert incomplete.code == grpc.StatusCode.UNAVAILABLE
    assert incomplete.unknown == list(range(1_000, 2_000))
    assert incomplete.not_queued == list(range(2_000, 2_500)), "not sent after the failure"
    assert len(incomplete.enqueued.tasks) == 1_000
    assert (again.skipped, len(again.tasks)) == (1_000, 500), "the lost call had queued its own"
    lost = db.execute(
        "SELECT id::text AS id FROM generation.tasks WHERE tool_id = %s "
        "AND idempotency_key = ANY(%s) ORDER BY created_at, id",
        [tool_id, [items[i].idempotency_key for i in incomplete.unknown]],
    ).fetchall()
    assert sorted(task.id for task in again.existing) == sorted(r["id"] for r in lost), (
        "the retry answers what the lost call created"
    )
    assert [task.idempotency_key for task in again.existing] == [
        items[i].idempotency_key for i in incomplete.unknown
    ]
    stored = db.execute(
        "SELECT count(*) AS n FROM generation.tasks WHERE tool_id = %s", [tool_id]
    ).fetchone()
    assert stored == {"n": 2_500}


def test_enqueue_many_stops_sending_after_a_call_fails_unexpectedly(
    service: ServiceProcess, db: Db, tool_id: str
) -> None:
    """A call that fails with something other than a GenqError (a bug in a wrapper, say) is a
    failure like any other: no further call is sent, the three already in flight finish, and
    its items are reported as maybe queued, the bug chained as the cause."""

    async def scenario(gateway: GatewayClient, client: GenqClient) -> tuple[Any, int]:
        call = client.call
        sent = 0
        all_in_flight = asyncio.Event()

        async def broken_first(method: str, request: Any, **options: Any) -> Any:
            nonlocal sent
            sent += 1
            if sent == 4:
                all_in_flight.set()
            if sent == 1:
                await all_in_flight.wait()  # fails once the other three are on their way
                raise RuntimeError("a bug")
            return await call(method, request, **options)

        client.call = broken_first  # type: ignore[method-assign]
        with pytest.raises(EnqueueIncomplete) as caught:
            await gateway.enqueue_many(tool_id, [{"n": n} for n in range(5_000)])
        return caught.value, sent

    incomplete, sent = run_with_gateway(service, scenario)
    assert sent == 4, "the fifth call was never sent"
    assert incomplete.code == grpc.StatusCode.UNKNOWN
    assert isinstance(incomplete.__cause__.__cause__, RuntimeError)
    assert incomplete.unknown == list(range(1_000))
    assert incomplete.not_queued == list(range(4_000, 5_000))
    assert len(incomplete.enqueued.tasks) == 3_000
    stored = db.execute(
        "SELECT count(*) AS n FROM generation.tasks WHERE tool_id = %s", [tool_id]
    ).fetchone()
    assert stored == {"n": 3_000}


def test_upsert_tool_is_idempotent(service: ServiceProcess) -> None:
    name = f"tool-{uuid.uuid4().hex[:12]}"

    async def scenario(gateway: GatewayClient, client: GenqClient) -> list[task_pb2.Tool]:
        return [await gateway.upsert_tool(name), await gateway.upsert_tool(name)]

    first, second = run_with_gateway(service, scenario)
    assert first.name == name
    assert first.id == second.id


def test_get(service: ServiceProcess, tool_id: str) -> None:
    async def scenario(gateway: GatewayClient, client: GenqClient) -> list[task_pb2.Task]:
        queued = await gateway.enqueue(tool_id, {"prompt": "a cat"}, reserved_token_amount=10)
        await claim(client, tool_id)
        return [queued, await gateway.get(queued.id)]

    queued, read = run_with_gateway(service, scenario)
    assert read.id == queued.id
    assert read.status == task_pb2.TASK_STATUS_PROCESSING
    assert read.reserved_token_amount == 10
    assert dict(read.input) == {"prompt": "a cat"}


def test_get_unknown_task_is_not_found(service: ServiceProcess) -> None:
    async def scenario(gateway: GatewayClient, client: GenqClient) -> None:
        await gateway.get(str(uuid.uuid4()))

    with pytest.raises(GenqError) as caught:
        run_with_gateway(service, scenario)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert caught.value.reason is Reason.TASK_NOT_FOUND


def test_follow_replays_earlier_events_then_follows_live_ones_to_completion(
    service: ServiceProcess, tool_id: str
) -> None:
    async def scenario(gateway: GatewayClient, client: GenqClient) -> None:
        task = await gateway.enqueue(tool_id, {"prompt": "a cat"})
        claimed = await claim(client, tool_id)
        earlier = await publish(client, claimed, 0.25)

        follower = Follower(gateway, task.id)
        started = await follower.next()
        assert started.kind == task_pb2.TASK_EVENT_KIND_STARTED
        assert started.data["attempt"] == 1
        replayed = await follower.next()
        assert (replayed.sequence, replayed.kind) == (earlier.sequence, earlier.kind)
        assert dict(replayed.data) == {"progress": 0.25}

        # Published only now that the watch is running: these arrive live.
        await publish(client, claimed, 0.75)
        live = await follower.next()
        assert live.kind == task_pb2.TASK_EVENT_KIND_PROGRESS
        assert dict(live.data) == {"progress": 0.75}
        assert live.sequence > replayed.sequence

        await client.call(
            "CompleteTask",
            task_pb2.CompleteTaskRequest(
                task_id=task.id, lease_token=claimed.lease_token, output={"url": "s3://cat.png"}
            ),
        )
        terminal = await follower.next()
        assert terminal.kind == task_pb2.TASK_EVENT_KIND_COMPLETED
        assert terminal.task_id == task.id
        await follower.finished()

        # A finished task replays to its end, and resuming after a sequence skips what was seen.
        everything = [e async for e in gateway.follow(task.id, timeout=EVENT_TIMEOUT)]
        assert [e.sequence for e in everything] == [1, 2, 3, 4], "per task, in commit order"
        assert [e.sequence for e in everything] == [
            started.sequence,
            replayed.sequence,
            live.sequence,
            terminal.sequence,
        ]
        rest = [e async for e in gateway.follow(task.id, replayed.sequence, timeout=10)]
        assert [e.sequence for e in rest] == [live.sequence, terminal.sequence]

    run_with_gateway(service, scenario)


def test_following_a_failed_task_passes_its_requeue_and_ends_at_failed(
    service: ServiceProcess, tool_id: str
) -> None:
    async def scenario(gateway: GatewayClient, client: GenqClient) -> None:
        task = await gateway.enqueue(tool_id, {"prompt": "a cat"}, max_retries=2)
        follower = Follower(gateway, task.id)

        await fail(client, await claim(client, tool_id), "provider timeout")
        assert (await follower.next()).kind == task_pb2.TASK_EVENT_KIND_STARTED
        requeued = await follower.next()
        assert requeued.kind == task_pb2.TASK_EVENT_KIND_REQUEUED
        assert not follower.done.done(), "a requeue is not the end: the task runs again"

        await fail(client, await claim(client, tool_id), "provider timeout again")
        again = await follower.next()
        assert (again.kind, again.data["attempt"]) == (task_pb2.TASK_EVENT_KIND_STARTED, 2)
        failed = await follower.next()
        assert failed.kind == task_pb2.TASK_EVENT_KIND_FAILED
        assert failed.data["error"] == "provider timeout again"
        await follower.finished()
        assert (await gateway.get(task.id)).status == task_pb2.TASK_STATUS_FAILED

    run_with_gateway(service, scenario)


def test_following_an_unknown_task_is_not_found(service: ServiceProcess) -> None:
    async def scenario(gateway: GatewayClient, client: GenqClient) -> None:
        async for _ in gateway.follow(str(uuid.uuid4()), timeout=EVENT_TIMEOUT):
            raise AssertionError("an unknown task has no events")

    with pytest.raises(GenqError) as caught:
        run_with_gateway(service, scenario)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert caught.value.reason is Reason.TASK_NOT_FOUND
