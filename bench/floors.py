"""What the stack the service must run on costs a single-task pair on this machine, and the most
it leaves the single-task bar (issue 9: claim + complete over gRPC >= 0.5 x pgbench of the same
statements, 8 clients).

    .venv/bin/python bench/floors.py [--clients 8] [--seconds 10] [--calls 4000] [--wait-ms 4]

In one run:

1. pgbench of the service's two statements, as bench/claim_complete.py's pgbench phase runs them
   (a database of its own, the queue loaded, synchronous_commit on): pairs/s, and the CPU per
   pair of Postgres (P) and of pgbench itself (B).
2. gRPC: grpc.aio, as the service and the SDK use it, answering a unary call with its request (a
   400-byte message, about a claimed task's size) in `--processes` processes sharing one port
   (SO_REUSEPORT, as `genq serve` runs GENQ_PROCESSES; by default as many as CPUs, its default),
   and `--clients` loops in this one, each on a connection of its own, calling it `--calls` times
   in all: the CPU per call of the servers (S) and of the client (C). Each call is answered after
   `--wait-ms` (4: about a statement's time under pgbench's load), as a call waits for its
   statement: a server whose loop has nothing to do between calls pays more per call than one
   answering back to back. No service code runs on either side.
3. psycopg: `--clients` loops taking a connection from a psycopg_pool pool (as the service's
   Database does) and running a prepared `SELECT 1`: the CPU per statement (D).

A gRPC pair is two calls of one statement each, so where both lines use every core, the gRPC
line reaches at most (P + B) / (P + 2 (S + C + D)) of pgbench's pairs/s, with nothing of the
service between the call and its statement: no checks, no bindings, no answers, no auth. It
prints each figure and that bound beside the bar. CPU is read with psutil (the service extra).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import resource
import sys
import time
from pathlib import Path

import grpc
import psutil  # type: ignore[import-untyped,unused-ignore]
from psycopg_pool import AsyncConnectionPool

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script

from bench.claim_complete import bench_database, free_port, load_queue, run_pgbench
from service.settings import Settings

BAR = 0.5
PAYLOAD = b"x" * 400
METHOD = "/floors.Echo/Call"


def own_cpu() -> float:
    """CPU seconds this process has used (user and system)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def echo_server(port: int, wait: float) -> None:
    """One echo process (the others listen on the same port), answering after `wait` s."""

    async def serve() -> None:
        async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            if wait:
                await asyncio.sleep(wait)
            return request

        handler = grpc.method_handlers_generic_handler(
            "floors.Echo", {"Call": grpc.unary_unary_rpc_method_handler(call)}
        )
        server = grpc.aio.server(options=(("grpc.so_reuseport", 1),))
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


async def grpc_floor(
    processes: int, clients: int, calls: int, wait: float
) -> tuple[float, float, float]:
    """(calls/s, servers' CPU s per call, client CPU s per call)."""
    port = free_port()
    spawn = multiprocessing.get_context("spawn")
    servers = [spawn.Process(target=echo_server, args=(port, wait)) for _ in range(processes)]
    for server in servers:
        server.start()
    try:
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(clients)]
        stubs = [channel.unary_unary(METHOD) for channel in channels]
        for stub in stubs:  # connected and warm
            await stub(PAYLOAD, wait_for_ready=True, timeout=30)
        meters = [psutil.Process(server.pid) for server in servers]

        def served() -> float:
            return sum(sum(meter.cpu_times()[:2]) for meter in meters)

        async def loop(stub: grpc.aio.UnaryUnaryMultiCallable) -> None:
            for _ in range(calls // clients):
                await stub(PAYLOAD)

        before, mine, started = served(), own_cpu(), time.perf_counter()
        await asyncio.gather(*(loop(stub) for stub in stubs))
        seconds = time.perf_counter() - started
        done = calls // clients * clients
        server_cpu = (served() - before) / done
        client_cpu = (own_cpu() - mine) / done
        for channel in channels:
            await channel.close()
        return done / seconds, server_cpu, client_cpu
    finally:
        for server in servers:
            server.terminate()
            server.join()


async def psycopg_floor(url: str, clients: int, calls: int) -> float:
    """CPU s per pooled, prepared statement."""
    async with AsyncConnectionPool(
        url, min_size=clients, max_size=clients, kwargs={"autocommit": True}, open=False
    ) as pool:
        await pool.wait()

        async def loop(count: int) -> None:
            for _ in range(count):
                async with pool.connection() as connection:
                    await connection.execute("SELECT 1", prepare=True)

        await asyncio.gather(*(loop(10) for _ in range(clients)))  # prepared everywhere
        mine = own_cpu()
        await asyncio.gather(*(loop(calls // clients) for _ in range(clients)))
        return (own_cpu() - mine) / (calls // clients * clients)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seconds", type=float, default=10.0, help="pgbench's window (10)")
    parser.add_argument("--calls", type=int, default=4000, help="gRPC calls and statements")
    parser.add_argument("--wait-ms", type=float, default=4.0, help="each echo's wait (4)")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; {args.clients} clients; {args.processes} echo processes")
    with bench_database() as url:
        settings = Settings.from_env({**os.environ, "DATABASE_URL": url})
        load_queue(url, 60_000)
        bench = argparse.Namespace(
            clients=args.clients, seconds=args.seconds, warmup=2.0, cost_nanos=0
        )
        pgbench = run_pgbench(bench, url, settings)
        pairs = pgbench.tasks_per_second
        postgres = pgbench.cores["postgres"] / pairs
        own = pgbench.cores["clients"] / pairs
        statement = asyncio.run(psycopg_floor(url, args.clients, args.calls))
    rate, server, client = asyncio.run(
        grpc_floor(args.processes, args.clients, args.calls, args.wait_ms / 1000)
    )
    micros = 1e6
    print(f"pgbench, the service's two statements: {pairs:,.0f} pairs/s")
    print(f"  P postgres CPU per pair          {postgres * micros:7.0f} us")
    print(f"  B pgbench CPU per pair           {own * micros:7.0f} us")
    print(f"gRPC echo, grpc.aio, answering after {args.wait_ms:g} ms: {rate:,.0f} calls/s")
    print(f"  S server CPU per call            {server * micros:7.0f} us")
    print(f"  C client CPU per call            {client * micros:7.0f} us")
    print("psycopg pool + prepared SELECT 1")
    print(f"  D CPU per statement              {statement * micros:7.0f} us")
    bound = (postgres + own) / (postgres + 2 * (server + client + statement))
    print(
        f"most a gRPC line can reach, (P + B) / (P + 2 (S + C + D)): {bound:.2f} x pgbench "
        f"(bar {BAR})"
    )


if __name__ == "__main__":
    main()
