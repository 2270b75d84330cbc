"""Batch path: N no-op tasks enqueued with `GatewayClient.enqueue_many`, then drained by
`WorkerFleet` with its defaults, against PGQueuer's QueueManager (batch 10) on the same Postgres,
in one run (GUIDE.md section 4, bars "batch path" and "enqueue").

    .venv/bin/python bench/drain.py [--tasks 20000] [--concurrency 100] [--workers 1,2]

PGQueuer is the bench's own dependency, the `bench` extra (never the service's):

    .venv/bin/pip install -e '.[bench]'

`--pgqueuer-python` ($GENQ_BENCH_PGQ_PYTHON; by default this interpreter when it has pgqueuer,
else /tmp/pgq/bin/python, an environment of its own) names the interpreter that runs it; without
one the PGQueuer line is skipped. It runs the peers' own baseline, `../shared/peers/
pgqueuer_drain.py` (`--pgqueuer-script`), on a database of its own (durable tables, `pgq
install`), which enqueues N jobs 1,000 a call and drains them with QueueManager in drain mode.

One run, in this order, each phase on a quiet database (CHECKPOINT first):

1. pgqueuer: the peer script, once per `--pgqueuer-batch` (default 10).
2. genq: a database of its own (migrated, a daily cap no run reaches), `python -m service serve`
   on a free port with its defaults (GENQ_PROCESSES included; `--service-env NAME=VALUE` to
   change them), one tool "noop", warmed by one enqueue of WARM_UP_TASKS (its statement
   prepared on the pooled connections, as in a service that has been running). For each worker
   count W in `--workers`:
   - the queue emptied (TRUNCATE), then N tasks enqueued with `enqueue_many` and its defaults
     (QueueTasks of 1,000, ENQUEUE_CONCURRENCY calls in flight): enqueue tasks/s;
   - ANALYZE (as autovacuum would after such a load; this server runs none), CHECKPOINT;
   - W worker processes, each one `WorkerFleet(address)` with its defaults hosting "noop"
     (`--concurrency` slots, a handler that returns at once), started and imported first, then
     let go at once: drain tasks/s from that moment to the last task's `completed_at`.
   Each worker counts its RPCs by method; the run prints them per 1,000 tasks, and the CPU the
   service, the workers and the whole machine used (with psutil, which the service extra has).
3. genq enqueue with `--enqueue-concurrency` calls in flight (default 1: the items' order kept
   across calls too), once more, alone.

With `--hop`, steps 2 and 3 run against `bench/hop.py` (same settings) instead of `genq serve`:
the same clients in front of the service without its middleware (the same statements and
bindings), so the ratios tell what the middleware costs the drain and the enqueue.

Durability stays on for both: synchronous_commit = on for each bench database. The ratios
printed are the bars: drain >= 2 x PGQueuer batch 10, enqueue >= 1 x PGQueuer's enqueue.

Paid vs unpaid (issue 9, bar "paid drain >= 0.7 x unpaid drain"):

    .venv/bin/python bench/drain.py --paid [--tasks 20000] [--workers 1]

runs, instead of all the above, on one genq database and service (the daily cap 10**17 nanos
set as above, which no run reaches, and no tool cap), for each W in `--workers`, three drains of
the same N tasks by W worker processes, each a WorkerFleet with its defaults:

- unpaid, 1 tool: tool "noop", no cost estimate, a handler that reports no cost (as above);
- unpaid, 8 tools: N/8 tasks on each of the tools "noop-1".."noop-8" (`--concurrency` slots each),
  no estimate, no cost: the control, to tell the 8 tools' share of the difference from the money's;
- paid, 8 tools: the same 8 tools configured (ConfigureTool) with a cost estimate
  (`--estimate-nanos`, so every claim is admitted against the cap with it) and a handler that
  reports a cost on every task (`ctx.report_usage(cost_nanos=--cost-nanos)`, recorded on the
  task's attempt by its CompleteTasks).

It prints each drain as above, the cost the attempts recorded, and the ratios paid / unpaid
1 tool (the bar) and paid / unpaid 8 tools.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the project's packages, not an installed copy

from bench.claim_complete import ADMIN_URL, HOP, Service, split, url_for  # noqa: E402
from generation.task.v1 import task_pb2  # noqa: E402
from service import migrations  # noqa: E402
from workers_sdk import GatewayClient, GenqClient, TaskContext, WorkerFleet  # noqa: E402
from workers_sdk.gateway import ENQUEUE_CONCURRENCY  # noqa: E402

PGQ_PYTHON = os.environ.get("GENQ_BENCH_PGQ_PYTHON") or (
    sys.executable if importlib.util.find_spec("pgqueuer") else "/tmp/pgq/bin/python"
)
PGQ_SCRIPT = ROOT.parent / "shared" / "peers" / "pgqueuer_drain.py"
CAP = 10**17
"""Global daily cap in nanos (the largest the service takes): without one nothing is claimed."""
TOOL = "noop"
DRAIN_BAR, ENQUEUE_BAR = 2.0, 1.0
CPU_PARTIES = ("service", "postgres", "workers", "machine", "other")
EMPTY_QUEUE = "TRUNCATE generation.tasks, generation.task_events"
"""The queue emptied between phases: the tasks and their events (no foreign key to cascade)."""

try:
    import psutil  # type: ignore[import-untyped,unused-ignore]
except ImportError:  # pragma: no cover - psutil comes with the service extra
    psutil = None


# --- databases ----------------------------------------------------------------------------------


@contextmanager
def database(prefix: str) -> Iterator[str]:
    """A fresh database with synchronous_commit on; dropped on the way out, whatever happens."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        admin.execute(
            sql.SQL("ALTER DATABASE {} SET synchronous_commit = on").format(sql.Identifier(name))
        )
    try:
        yield url_for(name)
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def execute(url: str, *statements: str) -> None:
    with psycopg.connect(url, autocommit=True) as connection:
        for statement in statements:
            connection.execute(statement.encode())


def server_settings(url: str) -> str:
    names = ["server_version", "synchronous_commit", "fsync", "autovacuum", "shared_buffers"]
    with psycopg.connect(url, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT name, current_setting(name) FROM unnest(%s::text[]) AS name", [names]
        ).fetchall()
    return ", ".join(f"{name}={value}" for name, value in rows)


# --- PGQueuer -----------------------------------------------------------------------------------


@dataclass
class Peer:
    enqueue: float | None = None
    """Jobs/s of its batched enqueue (1,000 a call)."""
    drain: dict[int, float] = field(default_factory=dict)
    """Jobs/s of its drain, by dequeue batch size."""


def pgqueuer(args: argparse.Namespace) -> Peer | None:
    python, script = Path(args.pgqueuer_python), Path(args.pgqueuer_script)
    if not python.exists() or not script.exists():
        print(f"pgqueuer: skipped ({python} or {script} missing; see this program's docstring)")
        return None
    peer = Peer()
    for batch in args.pgqueuer_batch:
        with database("pgq_bench") as url:
            env = {**os.environ, "PGDSN": url, "PGQ_DSN": url}
            pgq = python.parent / "pgq"
            subprocess.run([str(pgq), "install"], env=env, check=True, capture_output=True)
            execute(url, "CHECKPOINT")
            done = subprocess.run(
                [str(python), str(script), str(args.tasks), str(batch)],
                env=env,
                check=True,
                capture_output=True,
                text=True,
                timeout=600,
            )
        for line in done.stdout.splitlines():
            print(f"  {line}")
        if found := re.search(r"enqueue .*?: (\d+) jobs/s", done.stdout):
            peer.enqueue = max(peer.enqueue or 0.0, float(found[1]))
        if found := re.search(r"drain .*= (\d+) jobs/s", done.stdout):
            peer.drain[batch] = float(found[1])
    return peer


# --- the service --------------------------------------------------------------------------------


class CpuMeter:
    """CPU seconds between `begin` and `end` of the service (all its processes), Postgres (the
    bench database's backends and the server's background processes, Postgres being local) and
    the whole machine. The workers measure their own (time.process_time)."""

    def __init__(self, service: Service, url: str) -> None:
        self.service = service
        self.url = url
        self.groups: dict[str, list[int]] = {}
        self.start: dict[int, float] = {}
        self.busy = 0.0

    def _pids(self) -> dict[str, list[int]]:
        with psycopg.connect(self.url, autocommit=True) as connection:
            rows = connection.execute(
                "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                "AND (datname = current_database() OR datname IS NULL)"
            ).fetchall()
        root = psutil.Process(self.service.process.pid)
        service = [root.pid, *(child.pid for child in root.children(recursive=True))]
        return {"service": service, "postgres": [int(pid) for (pid,) in rows]}

    @staticmethod
    def _seconds(pids: list[int]) -> dict[int, float]:
        seconds = {}
        for pid in pids:
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            seconds[pid] = float(times.user + times.system)
        return seconds

    @staticmethod
    def _busy() -> float:
        times = psutil.cpu_times()
        return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))

    def begin(self) -> None:
        if psutil is None:
            return
        self.groups = self._pids()
        self.start = self._seconds([pid for pids in self.groups.values() for pid in pids])
        self.busy = self._busy()

    def end(self) -> dict[str, float]:
        """CPU seconds per party, and the machine's busy total."""
        if psutil is None:
            return {}
        busy = self._busy() - self.busy
        later = self._pids()
        used = {}
        for group in ("service", "postgres"):
            pids = sorted(set(self.groups[group]) | set(later[group]))
            now = self._seconds(pids)  # one that started meanwhile counts from zero
            used[group] = sum(now[pid] - self.start.get(pid, 0.0) for pid in now)
        used["machine"] = busy
        return used


# --- worker processes ---------------------------------------------------------------------------


class CountingClient(GenqClient):
    """A GenqClient that counts calls by method (for the RPCs per 1,000 tasks), and the seconds
    they took."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.calls: Counter[str] = Counter()
        self.seconds: dict[str, float] = {}

    async def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        self.calls[method] += 1
        started = time.perf_counter()
        try:
            return await super().call(method, request, timeout=timeout)
        finally:
            took = time.perf_counter() - started
            self.seconds[method] = self.seconds.get(method, 0.0) + took


async def noop(task: Any, ctx: TaskContext) -> None:
    return None


def paid_noop(cost_nanos: int) -> Any:
    """A handler that does nothing but report what it cost (sent with its CompleteTask)."""

    async def handler(task: Any, ctx: TaskContext) -> None:
        ctx.report_usage(token_amount=1, cost_nanos=cost_nanos)

    return handler


def worker(
    address: str,
    concurrency: int,
    pipe: Connection,
    tools: tuple[str, ...] = (TOOL,),
    cost_nanos: int = 0,
) -> None:
    """One worker process: a WorkerFleet with its defaults hosting `tools` (a handler reporting
    `cost_nanos` on every task if not 0); runs from "go" until SIGTERM."""

    async def main() -> None:
        client = CountingClient(address)
        fleet = WorkerFleet(client)  # the defaults a user who changes nothing gets
        handler = paid_noop(cost_nanos) if cost_nanos else noop
        for tool in tools:
            fleet.register(tool, handler, concurrency=concurrency)
        pipe.send("ready")
        await asyncio.to_thread(pipe.recv)  # "go"
        cpu = time.process_time()
        await fleet.run()
        cpu = time.process_time() - cpu
        await client.close()
        pipe.send((dict(client.calls), dict(client.seconds), cpu))

    asyncio.run(main())


@dataclass
class Drain:
    workers: int
    tasks: int
    enqueue_per_second: float
    drain_seconds: float
    calls: Counter[str]
    """RPCs by method, all workers together."""
    seconds: dict[str, float]
    """Seconds those calls took, by method (a parked claim's wait included)."""
    cpu: dict[str, float]
    """CPU seconds of the service, Postgres, the workers and the whole machine."""

    @property
    def per_second(self) -> float:
        return self.tasks / self.drain_seconds


async def enqueue(address: str, tool_id: str, tasks: int, concurrency: int | None = None) -> float:
    """Enqueues `tasks` no-op tasks with enqueue_many (`concurrency` calls in flight; None: its
    default); returns tasks/s."""
    async with GenqClient(address, timeout=60) as client:
        gateway = GatewayClient(client)
        items: list[dict[str, Any]] = [{} for _ in range(tasks)]
        started = time.perf_counter()
        options = {} if concurrency is None else {"concurrency": concurrency}
        queued = await gateway.enqueue_many(tool_id, items, **options)
        seconds = time.perf_counter() - started
    assert len(queued.tasks) == tasks, (len(queued.tasks), queued.skipped)
    return tasks / seconds


async def upsert_tool(address: str) -> str:
    async with GenqClient(address) as client:
        return str((await GatewayClient(client).upsert_tool(TOOL)).id)


def completed(connection: psycopg.Connection[Any]) -> tuple[int, float | None]:
    found = connection.execute(
        "SELECT count(*), extract(epoch FROM max(completed_at))::float "
        "FROM generation.tasks WHERE status = 'completed'"
    ).fetchone()
    assert found is not None
    return int(found[0]), found[1]


WARM_UP_TASKS = 4_000
"""Tasks enqueued (and then emptied with the queue) before genq's first measured phase."""

POLL_SECONDS = 0.25
"""How often a drain looks whether it is done, on one connection: the drain's figure is read
from the last completed_at, not from the look, and a look every 50 ms on a new connection each
took 0.26 to 0.41 cores from the parties measured."""


def drain(
    args: argparse.Namespace,
    service: Service,
    url: str,
    tool_id: str,
    workers: int,
    tools: dict[str, str] | None = None,
    cost_nanos: int = 0,
) -> Drain:
    """`tools` (name -> id; default {TOOL: tool_id}): the N tasks are spread evenly over them
    (enqueued tool after tool) and every worker hosts them all."""
    tools = tools or {TOOL: tool_id}
    execute(url, EMPTY_QUEUE, "VACUUM ANALYZE", "CHECKPOINT")
    shares = split(args.tasks, len(tools))
    started = time.perf_counter()
    for share, each in zip(shares, tools.values(), strict=True):
        asyncio.run(enqueue(service.address, each, share))
    rate = args.tasks / (time.perf_counter() - started)
    execute(url, "ANALYZE", "CHECKPOINT")

    spawn = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for _ in range(workers):
        ours, theirs = spawn.Pipe()
        process = spawn.Process(
            target=worker,
            args=(service.address, args.concurrency, theirs, tuple(tools), cost_nanos),
        )
        process.start()
        pipes.append(ours)
        processes.append(process)
    try:
        for pipe in pipes:
            if not pipe.poll(60):
                raise SystemExit("a worker did not start")
            assert pipe.recv() == "ready"
        meter = CpuMeter(service, url)
        meter.begin()
        go = time.time()
        for pipe in pipes:
            pipe.send("go")
        deadline = time.monotonic() + args.timeout
        with psycopg.connect(url, autocommit=True) as looking:
            while (done := completed(looking))[0] < args.tasks:
                if time.monotonic() > deadline:
                    raise SystemExit(f"drain timed out: {done[0]} of {args.tasks} completed")
                time.sleep(POLL_SECONDS)
        cpu = meter.end()
        last = done[1]
        assert last is not None
        calls: Counter[str] = Counter()
        seconds: dict[str, float] = {}
        worker_cpu = 0.0
        for process in processes:
            assert process.pid is not None
            os.kill(process.pid, signal.SIGTERM)
        for pipe in pipes:
            if not pipe.poll(60):
                raise SystemExit("a worker did not drain")
            counted, took, used = pipe.recv()
            calls.update(counted)
            for method, spent in took.items():
                seconds[method] = seconds.get(method, 0.0) + spent
            worker_cpu += used
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    cpu["workers"] = worker_cpu
    return Drain(workers, args.tasks, rate, last - go, calls, seconds, cpu)


@contextmanager
def genq_service(args: argparse.Namespace) -> Iterator[tuple[str, Service, str]]:
    """A migrated genq database (the cap no run reaches), `genq serve` on it (with
    --service-env) and the tool "noop": (url, service, the tool's id); stopped and dropped after."""
    env = dict(item.split("=", 1) for item in args.service_env)
    with database("genq_bench") as url:
        migrations.upgrade(url)
        execute(url, f"UPDATE generation.settings SET daily_cap_nanos = {CAP}")
        print(f"postgres: {server_settings(url)}")
        service = Service(url, env, HOP if args.hop else None)
        service.wait_serving()
        try:
            processes = env.get("GENQ_PROCESSES", str(os.cpu_count() or 1))
            default = "" if "GENQ_PROCESSES" in env else " (its default)"
            serve = "bench/hop.py (--hop)" if args.hop else "genq serve"
            print(f"{serve} at {service.address}, GENQ_PROCESSES={processes}{default}")
            yield url, service, asyncio.run(upsert_tool(service.address))
        finally:
            service.stop()


def genq(args: argparse.Namespace) -> tuple[list[Drain], float]:
    results = []
    with genq_service(args) as (url, service, tool_id):
        # Warm, as a running service is: each pooled connection prepares the statement and
        # loads the table's catalog entries on its first QueueTasks (the first enqueue of a
        # fresh service ran at 34,000-44,000 tasks/s against 40,000-60,000 for the second).
        asyncio.run(enqueue(service.address, tool_id, WARM_UP_TASKS))
        for workers in args.workers:
            result = drain(args, service, url, tool_id, workers)
            results.append(result)
            report(args, result)
        execute(url, EMPTY_QUEUE, "VACUUM ANALYZE", "CHECKPOINT")
        concurrent = asyncio.run(
            enqueue(service.address, tool_id, args.tasks, args.enqueue_concurrency)
        )
        print(
            f"genq enqueue_many, {args.enqueue_concurrency} calls in flight: "
            f"{concurrent:,.0f} tasks/s"
        )
    return results, concurrent


PAID_BAR = 0.7
"""Issue 9: paid drain (estimate + cost on every task, 8 tools) >= 0.7 x the unpaid drain."""
PAID_TOOLS = 8


async def paid_tools(address: str, estimate_nanos: int) -> dict[str, str]:
    """The tools noop-1..noop-8 (created on first call), configured with `estimate_nanos`."""
    tools = {}
    async with GenqClient(address) as client:
        gateway = GatewayClient(client)
        for n in range(1, PAID_TOOLS + 1):
            tool = await gateway.upsert_tool(f"{TOOL}-{n}")
            await client.call(
                "ConfigureTool",
                task_pb2.ConfigureToolRequest(tool_id=tool.id, cost_estimate_nanos=estimate_nanos),
            )
            tools[tool.name] = str(tool.id)
    return tools


def recorded_cost(url: str) -> str:
    with psycopg.connect(url, autocommit=True) as connection:
        found = connection.execute(
            "SELECT count(*), count(*) FILTER (WHERE a.estimate_nanos > 0), "
            "coalesce(sum(a.cost_nanos), 0) FROM generation.attempts a "
            "JOIN generation.tasks t ON t.id = a.task_id"  # this drain's (TRUNCATE keeps them)
        ).fetchone()
    assert found is not None
    return f"{found[0]:,} attempts, {found[1]:,} with an estimate, {found[2]:,} cost nanos recorded"


def genq_paid(args: argparse.Namespace) -> None:
    """Unpaid on 1 tool, unpaid on 8, paid on 8: same N, same service, one run."""
    with genq_service(args) as (url, service, tool_id):
        for workers in args.workers:
            figures = {}
            for label, tools, estimate, cost in (
                ("unpaid, 1 tool", None, 0, 0),
                (f"unpaid, {PAID_TOOLS} tools", True, 0, 0),
                (f"paid, {PAID_TOOLS} tools", True, args.estimate_nanos, args.cost_nanos),
            ):
                named = asyncio.run(paid_tools(service.address, estimate)) if tools else None
                print(f"-- {label}: estimate {estimate} nanos, cost {cost} nanos a task")
                result = drain(args, service, url, tool_id, workers, named, cost)
                report(args, result)
                print(f"  {recorded_cost(url)}")
                figures[label] = result.per_second
            paid = figures[f"paid, {PAID_TOOLS} tools"]
            for base in ("unpaid, 1 tool", f"unpaid, {PAID_TOOLS} tools"):
                ratio = paid / figures[base]
                bar = ""
                if base == "unpaid, 1 tool":
                    verdict = "met" if ratio >= PAID_BAR else "missed"
                    bar = f" (bar {PAID_BAR:g}: {verdict})"
                print(
                    f"paid ratio, {workers} worker process(es), paid {PAID_TOOLS} tools / "
                    f"{base}: {ratio:.2f}{bar}"
                )


def report(args: argparse.Namespace, result: Drain) -> None:
    thousands = result.tasks / 1000
    calls = ", ".join(
        f"{method} {count / thousands:.1f}" for method, count in sorted(result.calls.items())
    )
    print(
        f"genq enqueue_many (its defaults: 1,000 a call, {ENQUEUE_CONCURRENCY} in flight): "
        f"{result.enqueue_per_second:,.0f} tasks/s"
    )
    print(
        f"genq drain, {result.workers} worker process(es) x {args.concurrency} slots: "
        f"{result.tasks} tasks in {result.drain_seconds:.2f} s = {result.per_second:,.0f} tasks/s"
    )
    print(f"  RPCs per 1,000 tasks: {calls}")
    latency = ", ".join(
        f"{method} {1000 * result.seconds[method] / count:.1f}"
        for method, count in sorted(result.calls.items())
    )
    print(f"  mean ms per call: {latency}")
    if "machine" in result.cpu:
        cores = {name: used / result.drain_seconds for name, used in result.cpu.items()}
        cores["other"] = cores["machine"] - sum(
            cores[name] for name in ("service", "postgres", "workers")
        )
        flag = " (disturbed: other > 0.25)" if cores["other"] > 0.25 else ""
        print(
            "  CPU (cores): "
            + ", ".join(f"{name} {cores[name]:.2f}" for name in CPU_PARTIES)
            + f" of {os.cpu_count()}{flag}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=100, help="slots per worker process")
    parser.add_argument("--workers", type=lambda v: [int(n) for n in v.split(",")], default=[1, 2])
    parser.add_argument("--enqueue-concurrency", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300, help="longest drain, seconds")
    parser.add_argument("--service-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--pgqueuer-python", default=PGQ_PYTHON)
    parser.add_argument("--pgqueuer-script", default=str(PGQ_SCRIPT))
    parser.add_argument(
        "--pgqueuer-batch", type=lambda v: [int(n) for n in v.split(",")], default=[10]
    )
    parser.add_argument("--skip-pgqueuer", action="store_true")
    parser.add_argument(
        "--hop",
        action="store_true",
        help="serve genq's phases with bench/hop.py instead of genq serve: the service without "
        "its middleware, around the same statements (see its docstring)",
    )
    parser.add_argument(
        "--paid", action="store_true", help="only the paid vs unpaid drains (see the docstring)"
    )
    parser.add_argument("--estimate-nanos", type=int, default=1000, help="--paid: tool estimate")
    parser.add_argument("--cost-nanos", type=int, default=1000, help="--paid: cost of each task")
    args = parser.parse_args()

    print(f"{args.tasks} no-op tasks; machine: {os.cpu_count()} CPUs")
    if args.paid:
        genq_paid(args)
        return
    peer = None if args.skip_pgqueuer else pgqueuer(args)
    results, concurrent = genq(args)

    if peer is None:
        return
    if args.hop:
        print("the ratios below are the hop's (bench/hop.py), not the service's:")
    if peer.drain.get(10):
        for result in results:
            ratio = result.per_second / peer.drain[10]
            verdict = "met" if ratio >= DRAIN_BAR else "missed"
            print(
                f"drain ratio, {result.workers} worker process(es) / pgqueuer batch 10: "
                f"{ratio:.2f} (bar {DRAIN_BAR:g}: {verdict})"
            )
    if peer.enqueue:
        rates = [(f"defaults, run {n}", r.enqueue_per_second) for n, r in enumerate(results, 1)]
        rates.append((f"concurrency={args.enqueue_concurrency}", concurrent))
        for name, rate in rates:
            ratio = rate / peer.enqueue
            verdict = "met" if ratio >= ENQUEUE_BAR else "missed"
            print(
                f"enqueue ratio ({name}) / pgqueuer: {ratio:.2f} (bar {ENQUEUE_BAR:g}: {verdict})"
            )


if __name__ == "__main__":
    main()
