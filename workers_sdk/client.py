"""The asyncio connection to GenerationDataService that workers, gateways and reconcilers share.

It adds to the generated stub: typed errors (`GenqError`, `LeaseLost`) instead of raw RpcErrors,
a default deadline on every call, the caller's token (`authorization: Bearer`) and TLS
(`Credentials`, read from the environment unless given), and the caller's current trace context
as a `traceparent` header, so the service's spans join the caller's trace. Answers of any size
are taken (gRPC's default refuses any over 4 MiB): a ClaimTasks of 100 tasks with large inputs
is bigger, and the service sizes what it sends, not the client.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message
from opentelemetry import propagate

from generation.task.v1 import task_pb2_grpc
from workers_sdk.errors import from_rpc_error

DEFAULT_TARGET = "localhost:50051"
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_reconnect_backoff_ms", 5_000),
)
"""No limit on an answer's size: the service bounds it (at most 100 claimed tasks, each input
within GENQ_MAX_INPUT_BYTES), and an answer refused here would be lost after it committed.
Reconnects at least every 5 s: gRPC's own backoff grows to 120 s, so that after an outage of a
minute a channel would go on failing calls for tens of seconds once the service was back, while
the reports of finished tasks waited on it."""


@dataclass(frozen=True)
class Credentials:
    """How a client proves who it is and checks whom it talks to. TLS is on as soon as a CA or
    a client certificate is given (for a service with a publicly signed certificate, name the
    system's CA bundle). A token without TLS is sent in the clear: fine on loopback only."""

    token: str | None = None
    """GENQ_TOKEN (else the contents of the file GENQ_TOKEN_FILE): sent as
    `authorization: Bearer <token>` on every call."""
    ca_file: str | None = None
    """GENQ_TLS_CA_FILE: PEM CA certificates the service's certificate must be signed by."""
    client_cert_file: str | None = None
    """GENQ_TLS_CLIENT_CERT_FILE: this client's PEM certificate, for mutual TLS."""
    client_key_file: str | None = None
    """GENQ_TLS_CLIENT_KEY_FILE: its PEM private key."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **given: str | None) -> Credentials:
        """From the environment; a value in `given` (not None) wins over its variable."""
        env = os.environ if env is None else env
        token = given.get("token") or env.get("GENQ_TOKEN") or None
        if token is None and env.get("GENQ_TOKEN_FILE"):
            token = Path(env["GENQ_TOKEN_FILE"]).read_text().strip()
        found = cls(
            token=token,
            ca_file=env.get("GENQ_TLS_CA_FILE") or None,
            client_cert_file=env.get("GENQ_TLS_CLIENT_CERT_FILE") or None,
            client_key_file=env.get("GENQ_TLS_CLIENT_KEY_FILE") or None,
        )
        return cls(**{**found.__dict__, **{k: v for k, v in given.items() if v is not None}})

    @property
    def tls(self) -> bool:
        return bool(self.ca_file or self.client_cert_file)

    def channel(self, target: str, options: tuple[tuple[str, Any], ...] = ()) -> grpc.aio.Channel:
        # Checked before TLS is decided: a key alone must not leave the link in plaintext.
        if bool(self.client_cert_file) != bool(self.client_key_file):
            raise ValueError(
                "a client certificate and its key go together "
                "(GENQ_TLS_CLIENT_CERT_FILE, GENQ_TLS_CLIENT_KEY_FILE)"
            )
        if not self.tls:
            return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS + options)
        return grpc.aio.secure_channel(
            target,
            grpc.ssl_channel_credentials(
                root_certificates=_read(self.ca_file),
                private_key=_read(self.client_key_file),
                certificate_chain=_read(self.client_cert_file),
            ),
            options=CHANNEL_OPTIONS + options,
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


class GenqClient:
    """The connections to the data plane. Use `await client.call("QueueTask", request)`.

    `credentials` default to `Credentials.from_env()` (GENQ_TOKEN, GENQ_TLS_CA_FILE, ...).
    `connections` (2): HTTP/2 connections the unary calls take turns on. A connection stays with
    the service process (`GENQ_PROCESSES`) or replica it first reached, so one connection would
    give a whole fleet to one process; streams use the first.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout: float = 10.0,
        credentials: Credentials | None = None,
        connections: int = 2,
    ) -> None:
        if connections < 1:
            raise ValueError("connections must be at least 1")
        self.target = target
        self.timeout = timeout
        self.credentials = Credentials.from_env() if credentials is None else credentials
        # A subchannel pool of its own each: grpcio otherwise shares one connection between
        # channels to the same target.
        self.channels = [
            self.credentials.channel(target, (("grpc.use_local_subchannel_pool", 1),))
            for _ in range(connections)
        ]
        self.channel = self.channels[0]
        self.stub = task_pb2_grpc.GenerationDataServiceStub(self.channel)
        self._stubs = itertools.cycle(
            [task_pb2_grpc.GenerationDataServiceStub(channel) for channel in self.channels]
        )
        self._auth = self.credentials.metadata()

    async def call(self, method: str, request: Message, *, timeout: float | None = None) -> Any:
        """Calls a unary RPC; a failure raises GenqError (LeaseLost for a lost lease)."""
        try:
            return await getattr(next(self._stubs), method)(
                request, timeout=timeout or self.timeout, metadata=self._auth + trace_metadata()
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    async def stream(
        self, method: str, request: Message, *, timeout: float | None = None
    ) -> AsyncGenerator[Any, None]:
        """Calls a server-streaming RPC and yields its messages; errors as in `call`."""
        try:
            async for message in getattr(self.stub, method)(
                request, timeout=timeout, metadata=self._auth + trace_metadata()
            ):
                yield message
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

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
