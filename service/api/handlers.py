"""The handlers: every RPC is identify and admit the caller -> parse -> scope -> validate -> its
statement (with its audit row when audited) -> map the rows (redacted for a viewer), and every
failure leaves through one boundary as a gRPC status with an ErrorInfo. What a caller may do is
decided in service/api/auth.py.

Two RPCs add a loop around their statement: a claim with `wait` re-runs it when woken, and
WatchTaskEvents re-runs its page query until the terminal event.

Every statement is bounded by the caller's deadline, but a claim: it runs shielded from the
caller going away, so that what it claimed is known and, when the answer can no longer reach the
caller, handed straight back (rpcs.HAND_BACK_SQL) instead of waiting out a lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import DecodeError, Message
from opentelemetry import propagate, trace

from generation.task.v1 import task_pb2
from service.api import messages
from service.api.auth import Guard
from service.api.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    ServiceError,
    TaskNotFound,
    rpc_status_of,
)
from service.api.messages import Row
from service.api.metrics import Metrics
from service.api.rpcs import (
    BINDINGS,
    HAND_BACK_SQL,
    SERVICE,
    STATEMENTS,
    WATCH,
    Binding,
    Params,
    signal_requeue,
    signal_started,
)
from service.api.signals import TERMINAL_EVENTS, Signals
from service.database import Database
from service.settings import Settings

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("genq.service")
UNTRACED_PROVIDERS = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
RATE_SLOT_MARGIN_SECONDS = 0.01
"""A parked claim whose key is rate-limited claims again this long at least after the moment the
next slot frees by the database (a slot frees strictly after it)."""
"""The API's own providers: no tracer provider is set up, every span would be a no-op."""
_UNTRACED = contextlib.nullcontext()

Context: TypeAlias = grpc.aio.ServicerContext  # untyped: grpc ships no stubs


class Handlers:
    def __init__(
        self,
        database: Database,
        signals: Signals,
        settings: Settings,
        metrics: Metrics | None = None,
    ) -> None:
        self.database = database
        self.signals = signals
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.guard = Guard(database, settings)
        self._hand_backs: set[asyncio.Task[None]] = set()
        self._stopping = False

    def stop(self) -> None:
        """The service is stopping: parked claims answer now, as if their wait ran out, rather
        than hold the stop for its whole grace and then fail UNAVAILABLE."""
        self._stopping = True
        self.signals.tools.notify_all()

    async def hand_backs_done(self, seconds: float) -> None:
        """Waits up to `seconds` for the hand-backs of claims whose callers went away, so that
        they are not cut off by the pool's close (their tasks would wait out their lease)."""
        if self._hand_backs:
            await asyncio.wait(set(self._hand_backs), timeout=seconds)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """GenerationDataService, each method bound to the statement in its `sql` option.

        Requests arrive as bytes and are parsed in the handler, so a malformed one is
        INVALID_ARGUMENT like any other bad input.
        """
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        for method in SERVICE.methods:
            if method.server_streaming:
                handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                    self.watch_events(method)
                )
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                    self.unary(method, BINDINGS[method.name])
                )
        return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)

    def unary(
        self, method: MethodDescriptor, binding: Binding
    ) -> Callable[[bytes, Context], Awaitable[bytes]]:
        sql = STATEMENTS[method.name]
        parse = _parser(method)

        async def handle(payload: bytes, context: Context) -> bytes:
            with _server_span(method, context):
                return await run(payload, context)

        async def run(payload: bytes, context: Context) -> bytes:
            self.metrics.rpc_started(method.name)
            started = time.perf_counter()
            code = grpc.StatusCode.CANCELLED  # unless it ends otherwise: the caller went away
            try:
                caller = await self.guard.caller(context, _remaining(context))
                self.guard.admit(caller, method.name)
                request = parse(payload)
                await self.guard.scope(caller, method.name, request, _remaining(context))
                params = binding.bind(request, self.settings)
                if binding.park is not None:
                    tool, seconds = binding.park(request, params, self.settings)
                    rows = await self._claim_waiting(sql, params, tool, seconds, context)
                else:
                    rows = await self.database.fetch(
                        sql,
                        params,
                        timeout=_remaining(context),
                        then=self.guard.audit(caller, method.name, request),
                        rerun_deadlocks=binding.rerun_deadlocks,
                    )
                if binding.after is not None:
                    binding.after(self.signals, rows)
                response = binding.respond(rows)
                self.guard.learn(caller, response)
                self.guard.redact(caller, method.name, response)
                code = grpc.StatusCode.OK
                return response.SerializeToString()
            except Exception as error:  # the one error boundary
                code = _code_of(error)
                await _abort(context, method, error)
                raise AssertionError("unreachable: abort() raises") from error
            finally:
                self.metrics.observe_rpc(method.name, code.name, time.perf_counter() - started)

        return handle

    async def _claim_waiting(
        self, sql: str, params: Params, tool: str, seconds: float, context: Context
    ) -> list[Row]:
        """Runs the claim; when it finds nothing, parks until woken or re-check, up to `seconds`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        wake = self.signals.tools
        while True:
            waiter = wake.register(tool)  # before the read: a wake during it is not lost
            try:
                rows = await self._claim(sql, params, context)
                remaining = deadline - loop.time()
                if rows[0]["id"] is not None or rows[0]["idle_reason"] == "unknown_tool":
                    return rows
                if remaining <= 0 or self._stopping:
                    return rows
                # A rate-limited claim looks again when the key's next slot frees.
                again = self.settings.recheck_seconds
                if rows[0]["idle_seconds"] is not None:
                    again = min(again, max(rows[0]["idle_seconds"], RATE_SLOT_MARGIN_SECONDS))
                await wake.wait(waiter, min(remaining, again))
                if self._stopping:
                    return rows
            finally:
                wake.discard(tool, waiter)

    async def _claim(self, sql: str, params: Params, context: Context) -> list[Row]:
        """One claim statement, shielded from the caller: if the caller goes away while it runs
        (its deadline passes, the link drops), the statement still finishes and what it claimed
        is handed back at once; so is a claim that finishes after the caller's deadline."""
        claim = asyncio.ensure_future(self.database.fetch(sql, params))
        try:
            rows = await asyncio.shield(claim)
        except asyncio.CancelledError:
            claim.add_done_callback(self._hand_back_claimed)
            raise
        left = _remaining(context)
        if left is not None and left <= 0:
            self._hand_back_claimed(claim)
            raise DeadlineExceeded("the deadline passed before the claim's answer could be sent")
        return rows

    def _hand_back_claimed(self, claim: asyncio.Future[list[Row]]) -> None:
        if claim.cancelled() or claim.exception() is not None:
            return  # nothing known to be claimed: an unconfirmed lease lapses and costs nothing
        signal_started(self.signals, claim.result())  # the `started` events, before their end
        for row in claim.result():
            if row["id"] is not None:
                job = asyncio.ensure_future(self._hand_back(row))
                self._hand_backs.add(job)
                job.add_done_callback(self._hand_backs.discard)

    async def _hand_back(self, claimed: Row) -> None:
        try:
            rows = await self.database.fetch(
                HAND_BACK_SQL, {"task_id": claimed["id"], "lease_token": claimed["lease_token"]}
            )
        except Exception as error:
            log.warning(
                "hand-back of task %s failed (%s); its lease will lapse", claimed["id"], error
            )
            return
        log.info("task %s: claim answer undeliverable, handed back", claimed["id"])
        signal_requeue(self.signals, rows)

    def watch_events(
        self, method: MethodDescriptor
    ) -> Callable[[bytes, Context], AsyncIterator[bytes]]:
        sql = STATEMENTS[method.name]
        parse = _parser(method)

        async def handle(payload: bytes, context: Context) -> AsyncIterator[bytes]:
            self.metrics.rpc_started(method.name)
            code = grpc.StatusCode.CANCELLED
            try:
                caller = await self.guard.caller(context, _remaining(context))
                self.guard.admit(caller, method.name)
                request = parse(payload)
                await self.guard.scope(caller, method.name, request, _remaining(context))
                params = WATCH(request, self.settings)  # type: ignore[arg-type]
                async for event in self._follow(sql, params):
                    yield task_pb2.WatchTaskEventsResponse(event=event).SerializeToString()
                code = grpc.StatusCode.OK
            except Exception as error:  # the one error boundary
                code = _code_of(error)
                await _abort(context, method, error)
            finally:
                self.metrics.observe_rpc(method.name, code.name, None)

        return handle

    async def _follow(self, sql: str, params: Params) -> AsyncIterator[task_pb2.TaskEvent]:
        task_id = str(params["task_id"])
        wake = self.signals.tasks
        while True:
            waiter = wake.register(task_id)
            try:
                rows = await self.database.fetch(sql, params)
                if not rows[0]["task_found"]:
                    raise TaskNotFound("task not found")
                events = [row["event"] for row in rows if row["event"] is not None]
                for event in events:
                    yield messages.task_event(event)
                    params = {**params, "after_sequence": event["sequence"]}
                    if event["kind"] in TERMINAL_EVENTS:
                        return
                if not events:
                    await wake.wait(waiter, self.settings.recheck_seconds)
            finally:
                wake.discard(task_id, waiter)


def _server_span(method: MethodDescriptor, context: Context) -> Any:
    """A server span for the call, child of the caller's `traceparent` header when it sent one.

    Spans go to the global OpenTelemetry tracer provider, which the standard `OTEL_*` variables
    configure (service/tracing.py). With none set up (the API's default, its spans no-ops) no
    span is made at all: nothing in the service reads the current span, and the no-op span and
    the header's parsing took 10 µs a call.
    """
    if isinstance(trace.get_tracer_provider(), UNTRACED_PROVIDERS):
        return _UNTRACED
    parent = propagate.extract(dict(context.invocation_metadata() or ()))
    return _tracer.start_as_current_span(
        f"{SERVICE.full_name}/{method.name}",
        context=parent,
        kind=trace.SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.method": method.name},
    )


def _parser(method: MethodDescriptor) -> Callable[[bytes], Message]:
    request_class = message_factory.GetMessageClass(method.input_type)

    def parse(payload: bytes) -> Message:
        try:
            return request_class.FromString(payload)
        except DecodeError:
            raise InvalidArgument("the request is not a valid protobuf message") from None

    return parse


def _remaining(context: Context) -> float | None:
    """Seconds left of the caller's deadline; None when it set none."""
    left = context.time_remaining()
    return None if left is None else float(left)


def _code_of(error: Exception) -> Any:
    """The gRPC code `_abort` answers `error` with."""
    return error.code if isinstance(error, ServiceError) else grpc.StatusCode.INTERNAL


async def _abort(context: Context, method: MethodDescriptor, error: Exception) -> None:
    if not isinstance(error, ServiceError):
        log.error("unexpected error in %s", method.name, exc_info=error)
        error = Internal("internal error")
    status = rpc_status_of(error)
    await context.abort(status.code, status.details, status.trailing_metadata)
