"""The asyncio connection to GenerationDataService that workers, gateways and reconcilers share.

It adds to the generated stub: typed errors (`GenqError`, `LeaseLost`) instead of raw RpcErrors,
a default deadline on every call, and the caller's current trace context as a `traceparent`
header, so the service's spans join the caller's trace. Answers of any size are taken (gRPC's
default refuses any over 4 MiB): a ClaimTasks of 100 tasks with large inputs is bigger, and the
service sizes what it sends, not the client.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import grpc
from google.protobuf.message import Message
from opentelemetry import propagate

from generation.task.v1 import task_pb2_grpc
from workers_sdk.errors import from_rpc_error

DEFAULT_TARGET = "localhost:50051"
CHANNEL_OPTIONS = (("grpc.max_receive_message_length", -1),)
"""No limit on an answer's size: the service bounds it (at most 100 claimed tasks, each input
within GENQ_MAX_INPUT_BYTES), and an answer refused here would be lost after it committed."""


class GenqClient:
    """One channel to the data plane. Use `await client.call("QueueTask", request)`."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float = 10.0) -> None:
        self.target = target
        self.timeout = timeout
        self.channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.stub = task_pb2_grpc.GenerationDataServiceStub(self.channel)

    async def call(self, method: str, request: Message, *, timeout: float | None = None) -> Any:
        """Calls a unary RPC; a failure raises GenqError (LeaseLost for a lost lease)."""
        try:
            return await getattr(self.stub, method)(
                request, timeout=timeout or self.timeout, metadata=trace_metadata()
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    async def stream(
        self, method: str, request: Message, *, timeout: float | None = None
    ) -> AsyncGenerator[Any, None]:
        """Calls a server-streaming RPC and yields its messages; errors as in `call`."""
        try:
            async for message in getattr(self.stub, method)(
                request, timeout=timeout, metadata=trace_metadata()
            ):
                yield message
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> GenqClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """The current span's W3C trace context as gRPC metadata (empty without a span)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def current_traceparent() -> str:
    """The current span's W3C traceparent, to store with a task at enqueue ("" without a span)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")
