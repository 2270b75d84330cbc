"""Pickup latency: from enqueue to a parked worker holding the task (GUIDE §4: p50 <= 5 ms,
p99 <= 25 ms), against the spec's polling worker as the baseline, in one run.

    .venv/bin/python bench/pickup_latency.py [--rounds 300] [--parked 4] [--poll-rounds 20]

It makes its own database, starts `genq serve` four times on it, one process each
(GENQ_PROCESSES=1): two with Redis, two without. It measures, for each round, the time from
sending QueueTask to a parked ClaimNextTask(wait) answering with that task — an upper bound on
commit-to-hold, since it includes the enqueue call itself. Modes:

- same replica: the claim is parked on the replica that takes the enqueue (in-process wake);
- cross replica: parked on replica A, enqueued through replica B (Redis pub/sub wake, and
  NOTIFY too: whichever arrives first);
- cross replica, NOTIFY only: parked on C, enqueued through D, neither with Redis (Postgres
  LISTEN/NOTIFY; also what wakes the processes of one host across each other);
- polling (baseline): a worker without a wake, claiming every poll_interval (2.0 s, jittered).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import psycopg
from google.protobuf import duration_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from generation.task.v1 import task_pb2, task_pb2_grpc
from service import migrations

ROOT = Path(__file__).resolve().parent.parent
ADMIN_URL = os.environ.get("GENQ_BENCH_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("GENQ_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
WAIT = duration_pb2.Duration(seconds=10)


def start_service(
    database_url: str, port: int, environment: str, log: Path, redis: bool = True
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "GENQ_PORT": str(port),
        "GENQ_HOST": "127.0.0.1",
        "GENQ_HTTP_PORT": "0",
        "GENQ_PROCESSES": "1",
        "REDIS_ADDR": REDIS_URL if redis else "",
        "ENVIRONMENT": environment,
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "service", "serve"],
        env=env,
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                return process
        except grpc.RpcError:
            time.sleep(0.1)
    raise SystemExit(f"service on {port} did not start; see {log}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def parked_rounds(
    enqueue_to: task_pb2_grpc.GenerationDataServiceStub,
    park_on: task_pb2_grpc.GenerationDataServiceStub,
    tool_id: str,
    rounds: int,
    parked: int,
) -> tuple[list[float], list[float]]:
    """Per round: `parked` claims wait, one task is queued, the first claim to hold it wins.

    Returns two bounds of commit-to-hold per round: from sending the enqueue (upper; includes
    the enqueue call) and from its answer (lower; the commit happened before the answer).
    """
    upper, lower = [], []
    for _ in range(rounds):
        arrived: list[float] = []
        claims = [
            asyncio.ensure_future(
                park_on.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id, wait=WAIT))
            )
            for _ in range(parked)
        ]
        for claim in claims:
            claim.add_done_callback(lambda _, seen=arrived: seen.append(time.perf_counter()))
        await asyncio.sleep(0.02)  # let them park; the timing below starts after this
        sent = time.perf_counter()
        await enqueue_to.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id))
        answered = time.perf_counter()
        done, pending = await asyncio.wait(claims, return_when=asyncio.FIRST_COMPLETED)
        winner = next(iter(done)).result()
        assert winner.HasField("task"), "a parked claim returned empty"
        upper.append(arrived[0] - sent)
        lower.append(max(0.0, arrived[0] - answered))
        for claim in pending:
            claim.cancel()
        await park_on.CompleteTask(
            task_pb2.CompleteTaskRequest(task_id=winner.task.id, lease_token=winner.lease_token)
        )
    return upper, lower


async def polling_rounds(
    stub: task_pb2_grpc.GenerationDataServiceStub, tool_id: str, rounds: int, poll_interval: float
) -> list[float]:
    """The spec's worker without a wake: it claims, and when empty sleeps a jittered interval;
    tasks arrive at random moments of its cycle."""
    held_at: dict[str, float] = {}
    held = asyncio.Event()

    async def poller() -> None:
        while True:
            answer = await stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id))
            if answer.HasField("task"):
                held_at[answer.task.id] = time.perf_counter()
                held.set()
                await stub.CompleteTask(
                    task_pb2.CompleteTaskRequest(
                        task_id=answer.task.id, lease_token=answer.lease_token
                    )
                )
                continue
            await asyncio.sleep(poll_interval * random.uniform(0.8, 1.2))

    worker = asyncio.ensure_future(poller())
    latencies = []
    try:
        for _ in range(rounds):
            await asyncio.sleep(random.uniform(0, poll_interval))
            held.clear()
            sent = time.perf_counter()
            task = (await stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id))).task
            while task.id not in held_at:
                await held.wait()
                held.clear()
            latencies.append(held_at[task.id] - sent)
    finally:
        worker.cancel()
    return latencies


def summary(name: str, latencies: list[float]) -> str:
    ms = sorted(x * 1000 for x in latencies)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return (
        f"{name:<38} n={len(ms):<5} p50={statistics.median(ms):8.2f} ms  "
        f"p99={p99:8.2f} ms  max={ms[-1]:8.2f} ms"
    )


async def measure(args: argparse.Namespace, ports: list[int]) -> None:
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{ports[0]}") as channel_a,
        grpc.aio.insecure_channel(f"127.0.0.1:{ports[1]}") as channel_b,
        grpc.aio.insecure_channel(f"127.0.0.1:{ports[2]}") as channel_c,
        grpc.aio.insecure_channel(f"127.0.0.1:{ports[3]}") as channel_d,
    ):
        a = task_pb2_grpc.GenerationDataServiceStub(channel_a)
        b = task_pb2_grpc.GenerationDataServiceStub(channel_b)
        c = task_pb2_grpc.GenerationDataServiceStub(channel_c)
        d = task_pb2_grpc.GenerationDataServiceStub(channel_d)
        tool = (await a.UpsertTool(task_pb2.UpsertToolRequest(name="pickup"))).tool.id
        await parked_rounds(a, a, tool, 20, args.parked)  # warm-up: connections, prepared plans
        await parked_rounds(d, c, tool, 20, args.parked)
        same, same_lower = await parked_rounds(a, a, tool, args.rounds, args.parked)
        cross, cross_lower = await parked_rounds(b, a, tool, args.rounds, args.parked)
        notify, notify_lower = await parked_rounds(d, c, tool, args.rounds, args.parked)
        polling = await polling_rounds(a, tool, args.poll_rounds, 2.0)
    print(summary("same replica, from enqueue sent", same))
    print(summary("same replica, from enqueue answered", same_lower))
    print(summary("cross replica, from enqueue sent", cross))
    print(summary("cross replica, from enqueue answered", cross_lower))
    print(summary("NOTIFY only (no Redis), from sent", notify))
    print(summary("NOTIFY only (no Redis), from answered", notify_lower))
    print(summary("polling every 2.0 s (baseline)", polling))
    print(
        f"p50 ratio polling / same replica: "
        f"{statistics.median(polling) / statistics.median(same):.0f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--parked", type=int, default=4, help="parked claims per round")
    parser.add_argument("--poll-rounds", type=int, default=20)
    args = parser.parse_args()

    database = f"genq_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {database}")
    url = urlsplit(ADMIN_URL)._replace(path=f"/{database}").geturl()
    services: list[subprocess.Popen[bytes]] = []
    try:
        migrations.upgrade(url)
        with psycopg.connect(url, autocommit=True) as connection:  # no cap, nothing runs
            connection.execute("UPDATE generation.settings SET daily_cap_nanos = 10^18")
        logs = Path(tempfile.mkdtemp(prefix="genq-bench-"))
        environment = f"bench{uuid.uuid4().hex[:6]}"
        ports = [free_port() for _ in range(4)]
        for index, name in enumerate("abcd"):
            log = logs / f"{name}.log"
            services.append(start_service(url, ports[index], environment, log, redis=index < 2))
        asyncio.run(measure(args, ports))
    finally:
        for process in services:
            process.terminate()
            process.wait(30)
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")


if __name__ == "__main__":
    main()
