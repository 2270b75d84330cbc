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
from workers_sdk.gateway import GatewayClient

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


def test_enqueue_to_an_unknown_tool_is_not_found(service: ServiceProcess) -> None:
    async def scenario(gateway: GatewayClient, client: GenqClient) -> None:
        await gateway.enqueue(str(uuid.uuid4()), {})

    with pytest.raises(GenqError) as caught:
        run_with_gateway(service, scenario)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert caught.value.reason is Reason.TOOL_NOT_FOUND


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
