"""The hop: the service without its middleware, to tell what the middleware costs from what
grpcio, psycopg, the bindings and the statements cost (docs/BENCHMARKS.md, "Floors and parts").

    DATABASE_URL=... GENQ_PORT=... .venv/bin/python bench/hop.py

It reads the settings `genq serve` reads (the database, the port, GENQ_PROCESSES, the pool's
size) and serves every unary RPC of GenerationDataService the way the service runs it, minus all
that is not the statement: grpc.aio (GENQ_PROCESSES processes on one port, as `genq serve`), the
service's own psycopg pool (`Database`) per process, used directly, and for each call the
service's own `BINDINGS` (check and bind the request, answer from the rows) around its `sql`
option. Nothing else: no caller check, scope or audit, no metrics, tracing or logs, no error
mapping (a failure is UNKNOWN), no claim shield, no waits (a claim that finds nothing answers at
once) and no wakes. Health answers SERVING once every process listens, so the benches start it
as they start `genq serve`. One lean implementation, not the least any design could be.

Not a server to run anything on: it is for `bench/claim_complete.py --phases hop` and
`bench/drain.py --hop`, which drive it with the very clients they drive the service with.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import psycopg
from google.protobuf import message_factory
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from psycopg_pool import AsyncConnectionPool

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script

from service.api.messages import Row
from service.api.rpcs import BINDINGS, SERVICE, STATEMENTS
from service.database import Database
from service.settings import Settings


def handlers(
    pool: AsyncConnectionPool[psycopg.AsyncConnection[Row]], settings: Settings
) -> grpc.GenericRpcHandler:
    """Every unary method: bind, run its statement on a pooled connection, answer."""
    methods = {}
    for method in SERVICE.methods:
        if method.server_streaming:
            continue
        statement, binding = STATEMENTS[method.name], BINDINGS[method.name]

        async def handle(
            request: Any, context: Any, statement: str = statement, binding: Any = binding
        ) -> Any:
            params = binding.bind(request, settings)
            async with pool.connection() as connection:
                cursor = await connection.execute(statement, params)
                rows = await cursor.fetchall()
            return binding.respond(rows)

        methods[method.name] = grpc.unary_unary_rpc_method_handler(
            handle,
            request_deserializer=message_factory.GetMessageClass(method.input_type).FromString,
            response_serializer=lambda message: message.SerializeToString(),
        )
    return grpc.method_handlers_generic_handler(SERVICE.full_name, methods)


Handlers = Callable[[Settings], AbstractAsyncContextManager[grpc.GenericRpcHandler]]
"""A hop's methods for one process: entered once the process starts, left when it stops."""


@asynccontextmanager
async def service_handlers(settings: Settings) -> AsyncIterator[grpc.GenericRpcHandler]:
    # The service's own pool (size, session settings, keepalives), without Database.fetch's
    # bounds around each statement.
    pool = Database(settings.database_url or "", settings).pool
    await pool.open(wait=True)
    try:
        yield handlers(pool, settings)
    finally:
        await pool.close()


async def serve(settings: Settings, methods: Handlers, ready: Connection | None) -> None:
    """One process: serves until stopped; says "ready" over `ready` once it listens."""
    async with methods(settings) as handler:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
        server.add_generic_rpc_handlers((handler,))
        checks = health.aio.HealthServicer()
        await checks.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
        server.add_insecure_port(f"{settings.host}:{settings.port}")
        await server.start()
        try:
            if ready is None:
                await server.wait_for_termination()
                return
            ready.send("ready")
            # A child ends with its parent, even a killed one: the pipe then reads as closed.
            closed = asyncio.Event()
            asyncio.get_running_loop().add_reader(ready.fileno(), closed.set)
            await closed.wait()
        finally:
            await server.stop(None)


def run(settings: Settings, methods: Handlers, ready: Connection | None = None) -> None:
    # Stopped as `genq serve` is (SIGTERM), it exits 0, so a bench reads a clean stop as one.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    asyncio.run(serve(settings, methods, ready))


def main(methods: Handlers = service_handlers) -> None:
    """Serves `methods` in GENQ_PROCESSES processes on GENQ_PORT, as `genq serve` runs (also
    bench/pgq_hop.py's)."""
    settings = Settings.from_env()
    if not settings.database_url or not settings.port:
        raise SystemExit("set DATABASE_URL and GENQ_PORT (a port of its own, not 0)")
    spawn = multiprocessing.get_context("spawn")
    # Children of this process, so a bench's CPU meter counts them with it (as `genq serve`'s).
    # The parent listens (and answers health) only once every child does, so no client's
    # connection lands on a port fewer processes share.
    pipes = [spawn.Pipe() for _ in range(settings.processes - 1)]
    for _, theirs in pipes:
        spawn.Process(target=run, args=(settings, methods, theirs), daemon=True).start()
    for ours, _ in pipes:
        if not ours.poll(60) or ours.recv() != "ready":
            raise SystemExit("a hop process did not start")
    run(settings, methods)


if __name__ == "__main__":
    main()
