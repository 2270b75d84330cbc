"""The drain's floor: PGQueuer's own dequeue and log statements behind the thinnest gRPC hop
this stack allows, to tell what putting a Python gRPC service between the workers and Postgres
costs a drain before any of genq's own work (docs/BENCHMARKS.md, "Batch path and enqueue").

    DATABASE_URL=... GENQ_PORT=... .venv/bin/python bench/pgq_hop.py

On a database PGQueuer installed (`pgq install`), it serves, in GENQ_PROCESSES processes on one
port (SO_REUSEPORT, as `genq serve` runs), each with an asyncpg pool of GENQ_POOL_MAX_SIZE
connections (PGQueuer's own driver):

- `pgq_hop.Hop/Dequeue`: the request a 4-byte batch size, the answer the picked jobs' ids as
  int64s; PGQueuer's dequeue statement as its QueueManager builds it for one entrypoint "noop"
  with no limits (`build_dequeue_query`, the SQL built once per batch size);
- `pgq_hop.Hop/Log`: the request those ids, the answer empty; PGQueuer's log statement
  (`build_log_job_query`), every job `successful`;
- `pgq_hop.Hop/Drain`: both on one bidirectional stream (`C` + batch size answered with the ids,
  `L` + ids answered with nothing; logs run beside the next dequeue, as they would on two calls).

Raw bytes, no protobuf, no checks, auth, metrics, logs or error mapping: no service can do less
per call on grpc.aio and stay a service. bench/hop.py's `main` runs it (processes, port, health:
SERVING once every process listens), so the benches start it as they start `genq serve`.

Not a server to run anything on: it is for `bench/drain.py`'s floor lines.
"""

from __future__ import annotations

import asyncio
import struct
import sys
import uuid
from array import array
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import grpc
from pgqueuer.adapters.persistence.qb import QueryQueueBuilder
from pgqueuer.types import QueueEntrypoint, QueueManagerId

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script

from bench import hop
from service.settings import Settings

SERVICE = "pgq_hop.Hop"
ENTRYPOINT = "noop"
"""The one entrypoint the drain's jobs have (bench/drain.py's TOOL)."""


def ids_of(data: bytes) -> list[int]:
    found = array("q")
    found.frombytes(data)
    return found.tolist()


class Hop:
    """One process's statements: PGQueuer's dequeue (per batch size) and log, on one pool."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.builder = QueryQueueBuilder()
        self.manager = QueueManagerId(uuid.uuid4())
        self.dequeues: dict[int, tuple[str, tuple[object, ...]]] = {}
        self.log_sql = self.builder.build_log_job_query()

    async def dequeue(self, batch: int) -> bytes:
        if batch not in self.dequeues:
            query = self.builder.build_dequeue_query(
                batch_size=batch,
                entrypoints=[QueueEntrypoint(ENTRYPOINT)],
                concurrency_limits=[0],
                queue_manager_id=self.manager,
                global_concurrency_limit=None,
                heartbeat_timeout=timedelta(seconds=30),  # QueueManager.run's default
            )
            self.dequeues[batch] = (query.sql, query.args)
        statement, params = self.dequeues[batch]
        rows = await self.pool.fetch(statement, *params)
        return array("q", [row["id"] for row in rows]).tobytes()

    async def log(self, ids: list[int]) -> None:
        n = len(ids)
        await self.pool.execute(self.log_sql, ids, ["successful"] * n, [None] * n)


def handlers(hop: Hop) -> grpc.GenericRpcHandler:
    async def dequeue(request: bytes, context: Any) -> bytes:
        return await hop.dequeue(struct.unpack("<I", request)[0])

    async def log(request: bytes, context: Any) -> bytes:
        await hop.log(ids_of(request))
        return b""

    async def drain(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        logging: set[asyncio.Task[None]] = set()
        async for request in requests:
            if request[:1] == b"C":
                yield await hop.dequeue(struct.unpack("<I", request[1:])[0])
            else:
                task = asyncio.create_task(hop.log(ids_of(request[1:])))
                logging.add(task)
                task.add_done_callback(logging.discard)
        await asyncio.gather(*logging)

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Dequeue": grpc.unary_unary_rpc_method_handler(dequeue),
            "Log": grpc.unary_unary_rpc_method_handler(log),
            "Drain": grpc.stream_stream_rpc_method_handler(drain),
        },
    )


@asynccontextmanager
async def pgq_handlers(settings: Settings) -> AsyncIterator[grpc.GenericRpcHandler]:
    size = settings.pool_max_size
    pool = await asyncpg.create_pool(settings.database_url, min_size=size, max_size=size)
    try:
        yield handlers(Hop(pool))
    finally:
        await pool.close()


def main() -> None:
    hop.main(pgq_handlers)  # bench/hop.py's processes, ports and health, these methods


if __name__ == "__main__":
    main()
