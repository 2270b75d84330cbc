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

Many at once: `enqueue_many(tool_id, items)` queues a list of tasks with QueueTasks, up to 1,000
(and 2 MiB) a call, one statement each, and returns them in order with how many were skipped for
an idempotency key already used:

        queued = await gateway.enqueue_many(tool.id, [{"prompt": p} for p in prompts])
        queued.tasks, queued.skipped

Idempotency: `idempotency_key` makes the enqueue idempotent per tool and is also stored as the
task's `billing_idempotency_key`, the key the gateway's billing uses for the reservation. A
retried enqueue after an ambiguous failure (a deadline, or UNAVAILABLE after the request was
sent) answers with the task the first try created.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import trace

from generation.task.v1 import task_pb2
from workers_sdk.client import GenqClient, current_traceparent
from workers_sdk.errors import GenqError

MAX_ENQUEUE_BATCH = 1_000
"""Most tasks one QueueTasks takes (the service's limit); `enqueue_many` splits bigger inputs."""

MAX_ENQUEUE_BYTES = 2 * 1024 * 1024
"""Most bytes of items in one QueueTasks: well under the service's receive limit
(GENQ_MAX_MESSAGE_BYTES, 4 MiB); an item bigger than this goes in a call of its own."""

ENQUEUE_CONCURRENCY = 4
"""QueueTasks calls `enqueue_many` keeps in flight by default. One at a time, the SDK, the
service and Postgres take turns on each call (25 to 40 ms a call of 1,000); four keep
them all busy: 1.1 to 1.7 x PGQueuer's batched enqueue on the bench's two cores, against 0.6
to 1.2 x one at a time (docs/BENCHMARKS.md). The price is the order between calls in flight
together: `concurrency=1` keeps the items' order across calls too."""


@dataclass(frozen=True)
class NewTask:
    """One task for `enqueue_many` with options of its own; a field left None takes the value the
    call gives for all (its keyword arguments)."""

    input: Mapping[str, Any]
    priority: int | None = None
    max_retries: int | None = None
    reserved_token_amount: int | None = None
    idempotency_key: str | None = None
    rate_units: int | None = None
    """The units its run is expected to use (tokens, say), for its resource key's rate limit."""


@dataclass
class Enqueued:
    """What `enqueue_many` queued."""

    tasks: list[task_pb2.Task] = field(default_factory=list)
    """The tasks created, in the order of the items (those skipped left out): what the service
    set (id, status, times, retries) with what each item sent (input, reservation, keys)."""
    skipped: int = 0
    """Items not queued because their idempotency_key was already used (the task it made
    stands)."""
    existing: list[task_pb2.Task] = field(default_factory=list)
    """The tasks of the skipped items, in item order, in brief (id, tool_id, status,
    idempotency_key; `get` reads one whole): after a lost answer, sending the items again with
    their keys answers what the lost call created here. An item whose key an earlier item of
    the same call used is skipped with its task among `tasks`, not here; a key another call
    committed while this one ran is skipped without its task here."""


REFUSED_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
"""Codes with which the service refuses a call before or instead of committing anything: its
items were not queued. Any other failure (UNAVAILABLE, a deadline, INTERNAL...) may have come
after the commit."""


class EnqueueIncomplete(GenqError):
    """Some calls of an `enqueue_many` failed. It is the error of the failed call earliest in
    item order (its code, reason and message, as a GenqError) and says what became of every
    item, by its index in the items given: calling again with the items of `not_queued` (fixed,
    if they were refused) queues what is missing; those of `unknown` are queued again only with
    idempotency keys, which skip what the lost call did queue."""

    def __init__(
        self, error: GenqError, enqueued: Enqueued, not_queued: list[int], unknown: list[int]
    ) -> None:
        super().__init__(error.code, str(error), error.reason)
        self.enqueued = enqueued
        """The tasks the calls that answered created, in item order, and what they skipped."""
        self.not_queued = not_queued
        """Items not queued: their call was refused, or never sent once a call had failed."""
        self.unknown = unknown
        """Items whose call failed without an answer (UNAVAILABLE, a deadline): maybe queued."""


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
        rate_units: int = 0,
    ) -> task_pb2.Task:
        """Queues one task and returns it as stored.

        Runs in a span "enqueue <tool_id>"; that span's W3C traceparent is stored with the task,
        so the worker's spans continue the caller's trace as children of the enqueue. Unset
        `priority` and `max_retries` take the service's defaults (0 and the tool's
        max_attempts). `idempotency_key` makes the enqueue idempotent per tool: the same key and
        input answer with the task already queued (a different input is ALREADY_EXISTS); it is
        also stored as the billing key the gateway settles against. `rate_units` is what its run
        is expected to use (tokens, say), counted against its resource key's rate limit.
        """
        with self.tracer.start_as_current_span(
            f"enqueue {tool_id}",
            kind=trace.SpanKind.PRODUCER,
            attributes={"genq.tool_id": tool_id},
        ) as span:
            item = NewTask(
                input, priority, max_retries, reserved_token_amount, idempotency_key, rate_units
            )
            # The traceparent is taken inside the span, so it names the enqueue span; with no
            # tracing SDK installed it is the caller's own context (or "" when there is none).
            request = _queue_request(tool_id, item, NewTask({}), current_traceparent())
            response = await self.client.call("QueueTask", request)
            task: task_pb2.Task = response.task
            span.set_attribute("genq.task_id", task.id)
            return task

    async def enqueue_many(
        self,
        tool_id: str,
        items: Iterable[Mapping[str, Any] | NewTask],
        *,
        priority: int | None = None,
        max_retries: int | None = None,
        reserved_token_amount: int = 0,
        concurrency: int = ENQUEUE_CONCURRENCY,
    ) -> Enqueued:
        """Queues many tasks of one tool: each item is a task's input, or a `NewTask` with
        options of its own (those it leaves None take this call's). Sent as QueueTasks of up to
        1,000 items and 2 MiB each (one statement a call), `concurrency` calls at a time.

        Returns the tasks created in item order, and how many items were skipped because their
        `idempotency_key` was already used: unlike `enqueue`, a used key is never an error here,
        whatever the input (the service's QueueTasks skips it). Runs in one span "enqueue_many
        <tool_id>", whose traceparent every task stores.

        Calls in flight together (up to `concurrency`, ENQUEUE_CONCURRENCY by default) commit
        in no set order: FIFO among equal priorities holds within each call of 1,000 and between
        calls that were not in flight together; `concurrency=1` keeps the items' order
        throughout, at about two thirds of the speed. When a call fails, no further call is
        sent, the calls in flight are let finish (a call cancelled on the wire might commit
        unseen), and `EnqueueIncomplete` is raised: the GenqError of the failed call earliest
        in item order, with the tasks created and which items were not queued or may have
        been. Cancelling `enqueue_many` itself cancels its calls in flight, which may then
        commit unseen: bound it with the client's `timeout` instead. Two calls in
        flight together that insert the same new idempotency keys in opposite orders wait on
        each other; Postgres rolls one back after its deadlock_timeout (1 s) and
        the service runs that one again (3 times at most, within the call's deadline), so both
        succeed, about a second late.
        """
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        with self.tracer.start_as_current_span(
            f"enqueue_many {tool_id}",
            kind=trace.SpanKind.PRODUCER,
            attributes={"genq.tool_id": tool_id},
        ) as span:
            defaults = NewTask({}, priority, max_retries, reserved_token_amount)
            chunks = _batches(tool_id, items, defaults, current_traceparent())
            span.set_attribute("genq.count", sum(len(chunk.tasks) for chunk in chunks))
            # Each call's answer or error; None for a call not sent because one had failed.
            answers: list[task_pb2.QueueTasksResponse | GenqError | None] = [None] * len(chunks)
            calls = asyncio.Semaphore(concurrency)

            async def send(index: int) -> None:
                async with calls:
                    if any(isinstance(answer, GenqError) for answer in answers):
                        return
                    try:
                        answers[index] = await self.client.call("QueueTasks", chunks[index])
                    except GenqError as error:
                        answers[index] = error
                    except Exception as error:  # a bug, not an answer: maybe queued, say so
                        unexpected = GenqError(grpc.StatusCode.UNKNOWN, repr(error), None)
                        unexpected.__cause__ = error
                        answers[index] = unexpected

            if concurrency == 1:
                for index in range(len(chunks)):
                    await send(index)
            else:
                await asyncio.gather(*(send(index) for index in range(len(chunks))))
            queued = Enqueued()
            not_queued: list[int] = []
            unknown: list[int] = []
            failed: GenqError | None = None
            start = 0
            for chunk, answer in zip(chunks, answers, strict=True):
                indexes = range(start, start + len(chunk.tasks))
                start = indexes.stop
                if isinstance(answer, task_pb2.QueueTasksResponse):
                    queued.tasks.extend(_created(chunk.tasks, answer.tasks))
                    queued.skipped += answer.skipped
                    queued.existing.extend(answer.existing)
                    continue
                failed = failed or answer
                if answer is None or answer.code in REFUSED_CODES:
                    not_queued.extend(indexes)
                else:
                    unknown.extend(indexes)
            span.set_attribute("genq.skipped", queued.skipped)
            if failed is not None:
                raise EnqueueIncomplete(failed, queued, not_queued, unknown) from failed
            return queued

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


def _batches(
    tool_id: str,
    items: Iterable[Mapping[str, Any] | NewTask],
    defaults: NewTask,
    traceparent: str,
) -> list[task_pb2.QueueTasksRequest]:
    """The items in order as QueueTasks requests of at most MAX_ENQUEUE_BATCH items and
    MAX_ENQUEUE_BYTES each (each at least one item), every item built in its request: built
    apart and copied into its batch, a thousand items took twice as long. The items leave
    `tool_id` unset; their batch names the tool once."""
    batches: list[task_pb2.QueueTasksRequest] = []
    size = 0
    for item in items:
        if not batches or len(batches[-1].tasks) == MAX_ENQUEUE_BATCH:
            batches.append(task_pb2.QueueTasksRequest(tool_id=tool_id))
            size = 0
        tasks = batches[-1].tasks
        request = tasks.add()
        _fill(request, item, defaults)
        if traceparent:
            request.w3c_traceparent = traceparent
        weight = request.ByteSize()
        if size + weight > MAX_ENQUEUE_BYTES and len(tasks) > 1:
            moved = tasks.pop()
            batches.append(task_pb2.QueueTasksRequest(tool_id=tool_id, tasks=[moved]))
            size = 0
        size += weight
    return batches


def _created(
    sent: Iterable[task_pb2.QueueTaskRequest], tasks: Iterable[task_pb2.Task]
) -> list[task_pb2.Task]:
    """The created tasks whole: QueueTasks answers each with what the service set, in item order
    and without the items it skipped (those have an idempotency key, and a created task carries
    its key), so each task meets its item in order; the item gives the fields it sent."""
    created = []
    answered = iter(tasks)
    task = next(answered, None)
    for request in sent:
        if task is None:
            break
        if request.idempotency_key and task.idempotency_key != request.idempotency_key:
            continue  # skipped: the key was used already
        # Only what was set: a thousand items with an empty input and no keys copy nothing.
        if request.HasField("input"):
            task.input.CopyFrom(request.input)
        if request.reserved_token_amount:
            task.reserved_token_amount = request.reserved_token_amount
        if request.billing_idempotency_key:
            task.billing_idempotency_key = request.billing_idempotency_key
        if request.w3c_traceparent:
            task.w3c_traceparent = request.w3c_traceparent
        created.append(task)
        task = next(answered, None)
    return created


def _queue_request(
    tool_id: str, item: NewTask, defaults: NewTask, traceparent: str
) -> task_pb2.QueueTaskRequest:
    """A QueueTask request."""
    request = task_pb2.QueueTaskRequest(tool_id=tool_id, w3c_traceparent=traceparent)
    _fill(request, item, defaults)
    return request


def _fill(
    request: task_pb2.QueueTaskRequest, item: NewTask | Mapping[str, Any], defaults: NewTask
) -> None:
    """Sets a QueueTask request's (or QueueTasks item's) fields from `item` (a NewTask, or a
    plain input with nothing else of its own), then `defaults`. Fields left unset are what
    selects the service's defaults. A plain input is not wrapped in a NewTask, and an empty one
    or a 0 is not set: a thousand items with empty inputs build in 1.4 ms, not 4.4."""
    own, document = (item, item.input) if isinstance(item, NewTask) else (_NONE_OF_ITS_OWN, item)
    if document:
        request.input.update(document)
    reserved = own.reserved_token_amount
    if reserved is None:
        reserved = defaults.reserved_token_amount
    if reserved:
        request.reserved_token_amount = reserved
    if key := own.idempotency_key:
        request.idempotency_key = key
        request.billing_idempotency_key = key
    priority = defaults.priority if own.priority is None else own.priority
    if priority is not None:
        request.priority = priority
    max_retries = defaults.max_retries if own.max_retries is None else own.max_retries
    if max_retries is not None:
        request.max_retries = max_retries
    if units := own.rate_units:
        request.rate_units = units


_NONE_OF_ITS_OWN = NewTask({})
"""A plain input's options: none, so the call's apply."""
