"""The gateway's side of the queue: register tools, enqueue tasks, read them, follow their events.

A gateway (the consumer path, or an agent server) runs its pricing and reserve pipeline, then
enqueues the task with the tokens it reserved. Settling that reservation once the task is terminal
is the reconciler's job (`workers_sdk.reconciler`), not this client's.

    async with GenqClient("genq:50051") as client:
        gateway = GatewayClient(client)
        tool = await gateway.upsert_tool("image-gen")
        task = await gateway.enqueue(tool.id, {"prompt": "a cat"}, reserved_token_amount=100)
        async for event in gateway.follow(task.id):
            ...

Idempotency: `idempotency_key` makes the enqueue idempotent per tool and is also stored as the
task's `billing_idempotency_key`, the key the gateway's billing uses for the reservation. A
retried enqueue after an ambiguous failure (a deadline, or UNAVAILABLE after the request was
sent) answers with the task the first try created.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

from google.protobuf.struct_pb2 import Struct
from opentelemetry import trace

from generation.task.v1 import task_pb2
from workers_sdk.client import GenqClient, current_traceparent

TERMINAL_EVENTS = frozenset(
    {
        task_pb2.TASK_EVENT_KIND_COMPLETED,
        task_pb2.TASK_EVENT_KIND_FAILED,
        task_pb2.TASK_EVENT_KIND_CANCELLED,
        task_pb2.TASK_EVENT_KIND_EXPIRED,
    }
)


class GatewayClient:
    """Enqueue and observe tasks over a `GenqClient`; the caller owns (and closes) the client.

    `tracer_provider`: where the enqueue spans go; None means OpenTelemetry's global provider
    (a no-op until the application installs an SDK), as with any OpenTelemetry instrumentation.
    """

    def __init__(
        self, client: GenqClient, *, tracer_provider: trace.TracerProvider | None = None
    ) -> None:
        self.client = client
        self.tracer = trace.get_tracer(__name__, tracer_provider=tracer_provider)

    async def upsert_tool(self, name: str) -> task_pb2.Tool:
        """Registers a tool by name, or returns the existing one: safe to call at every start."""
        response = await self.client.call("UpsertTool", task_pb2.UpsertToolRequest(name=name))
        tool: task_pb2.Tool = response.tool
        return tool

    async def enqueue(
        self,
        tool_id: str,
        input: Mapping[str, Any],
        *,
        priority: int | None = None,
        max_retries: int | None = None,
        reserved_token_amount: int = 0,
        idempotency_key: str | None = None,
    ) -> task_pb2.Task:
        """Queues one task and returns it as stored.

        Runs in a span "enqueue <tool_id>"; that span's W3C traceparent is stored with the task,
        so the worker's spans continue the caller's trace as children of the enqueue. Unset
        `priority` and `max_retries` take the service's defaults (0 and the tool's
        max_attempts). `idempotency_key` makes the enqueue idempotent per tool: the same key and
        input answer with the task already queued (a different input is ALREADY_EXISTS); it is
        also stored as the billing key the gateway settles against.
        """
        with self.tracer.start_as_current_span(
            f"enqueue {tool_id}",
            kind=trace.SpanKind.PRODUCER,
            attributes={"genq.tool_id": tool_id},
        ) as span:
            request = task_pb2.QueueTaskRequest(
                tool_id=tool_id,
                input=_struct(input),
                reserved_token_amount=reserved_token_amount,
                idempotency_key=idempotency_key or "",
                billing_idempotency_key=idempotency_key or "",
                # Taken inside the span, so it names the enqueue span; with no tracing SDK
                # installed it is the caller's own context (or "" when there is none).
                w3c_traceparent=current_traceparent(),
            )
            # Optional fields: leaving them unset is what selects the service's default.
            if priority is not None:
                request.priority = priority
            if max_retries is not None:
                request.max_retries = max_retries
            response = await self.client.call("QueueTask", request)
            task: task_pb2.Task = response.task
            span.set_attribute("genq.task_id", task.id)
            return task

    async def get(self, task_id: str) -> task_pb2.Task:
        """Reads one task; an unknown id raises GenqError (NOT_FOUND, reason TASK_NOT_FOUND)."""
        response = await self.client.call("GetTask", task_pb2.GetTaskRequest(task_id=task_id))
        task: task_pb2.Task = response.task
        return task

    async def follow(
        self, task_id: str, after_sequence: int = 0, *, timeout: float | None = None
    ) -> AsyncIterator[task_pb2.TaskEvent]:
        """Yields the task's events after `after_sequence` (0: all of them), then the live ones,
        and ends after the terminal event (COMPLETED, FAILED, CANCELLED or EXPIRED). A REQUEUED
        event is not the end (the task runs again, each run opening with STARTED), nor is
        CANCEL_REQUESTED (CANCELLED follows once the running worker stops).

        `timeout` bounds the whole watch (None: until the terminal event). If the stream breaks
        (GenqError, e.g. UNAVAILABLE), call again with the last `sequence` seen to resume
        without repeats.
        """
        request = task_pb2.WatchTaskEventsRequest(task_id=task_id, after_sequence=after_sequence)
        # aclosing: leaving early (here, or the caller breaking out) cancels the gRPC call now
        # rather than whenever the garbage collector finalizes the generator.
        stream = self.client.stream("WatchTaskEvents", request, timeout=timeout)
        async with aclosing(stream):
            async for response in stream:
                event: task_pb2.TaskEvent = response.event
                yield event
                # The service ends the stream here too; stopping ourselves keeps the contract
                # ("until terminal") in this one place for the caller.
                if event.kind in TERMINAL_EVENTS:
                    return


def _struct(values: Mapping[str, Any]) -> Struct:
    struct = Struct()
    struct.update(values)
    return struct
