"""Single-task path: ClaimNextTask + CompleteTask over gRPC against the same two SQL statements.

    .venv/bin/python bench/claim_complete.py --clients 8 --seconds 15

In one run, on a database of its own (dropped at the end):

1. grpc: the real service (`python -m service serve`, a subprocess) and K concurrent client loops,
   each doing ClaimNextTask(tool) then CompleteTask(task_id, lease_token), one task per call.
2. raw: the very statements the service runs (`service.api.rpcs.STATEMENTS`), bound with the very
   parameters the service binds (`service.api.rpcs.BINDINGS`), straight through psycopg: K
   connections, autocommit, prepared statements, the session settings of the service's pool.
3. pgbench (if installed): the same two statements from pgbench, in C, as the guide's bar
   names it (`-M prepared`, same client count); tells how much the Python client costs in 2.
4. hop: the grpc phase's clients against `bench/hop.py` instead of the service: the service
   without its middleware (grpc.aio, a psycopg pool and the service's own `BINDINGS` around the
   same statements, nothing else), which tells what the middleware costs.

Before each phase the queue is reloaded (TRUNCATE, the same N tasks over 4 tools, VACUUM ANALYZE
of the database, CHECKPOINT), so each sees the same backlog. synchronous_commit is forced on for
the database. Tasks/s counts pairs completed inside the measured window, after a warm-up
(connections, pool growth, prepared statements). Latency is that of a whole claim + complete pair
as a client sees it. With psutil (installed with the service extra), it also prints the CPU each
party used.

The bar (docs/BENCHMARKS.md, GUIDE.md section 4): grpc tasks/s >= 0.5 x raw tasks/s.

    .venv/bin/python bench/claim_complete.py --processes 1,2 --clients 8 --seconds 15

instead runs only the grpc phase, once per value, each time with a service of its own started at
GENQ_PROCESSES=value (the queue reloaded before each), and prints each ratio to the first: the
bar of issue 9, GENQ_PROCESSES=2 vs 1 on the single-task path, > 1 x. The service's CPU counts
all its processes (the parent and the children it spawns).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import psycopg
from grpc_health.v1 import health_pb2, health_pb2_grpc
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from generation.task.v1 import task_pb2
from service import migrations
from service.api.rpcs import BINDINGS, STATEMENTS
from service.settings import Settings

try:
    import psutil  # type: ignore[import-untyped,unused-ignore]
except ImportError:  # pragma: no cover - psutil comes with the service extra
    psutil = None

ROOT = Path(__file__).resolve().parent.parent
ADMIN_URL = os.environ.get("GENQ_BENCH_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
TOOLS = 4
# pgbench cannot bind a uuid picked at random, so the tools get fixed ids (as in shared/peers/).
TOOL_IDS = [uuid.UUID(int=n) for n in range(1, TOOLS + 1)]
OUTPUT = {"ok": True}
USAGE_TOKENS = 1
CAP = 10**18
"""Global daily cap in nanos set where the schema has spend control: never reached here."""
UNSET_FOR_SERVICE = {"REDIS_ADDR", "REDIS_URL", "GENQ_POOL_MAX_SIZE", "GENQ_POOL_MIN_SIZE"}
"""Not inherited by the service: it runs on its defaults, one replica without Redis (pass them
with --service-env to measure them)."""
IDLE_CORES = 0.05
NOISE_CORES = 0.25
"""Cores used by neither party above which a phase's figure is flagged as disturbed."""
PHASES = ("grpc", "raw", "pgbench", "hop")
BAR = 0.5
"""GUIDE.md section 4: grpc tasks/s >= 0.5 x raw SQL doing the same two statements."""
METHOD = "/generation.task.v1.GenerationDataService/{}"
HOP = Path(__file__).resolve().parent / "hop.py"
"""The hop phase's server (its docstring)."""


# --- the database -------------------------------------------------------------------------------


def url_for(database: str) -> str:
    return urlsplit(ADMIN_URL)._replace(path=f"/{database}").geturl()


@contextmanager
def bench_database() -> Iterator[str]:
    """A fresh, migrated database with the 4 tools; dropped on the way out, whatever happens."""
    name = f"genq_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        # Durability as in production, whatever the server's default: every commit waits for WAL.
        admin.execute(
            sql.SQL("ALTER DATABASE {} SET synchronous_commit = on").format(sql.Identifier(name))
        )
    try:
        url = url_for(name)
        migrations.upgrade(url)
        with psycopg.connect(url, autocommit=True) as connection:
            for n, tool_id in enumerate(TOOL_IDS, 1):
                connection.execute(
                    "INSERT INTO generation.tools (id, name) VALUES (%s, %s)",
                    (tool_id, f"bench-tool-{n}"),
                )
            if "daily_cap_nanos" in columns(connection, "settings"):
                # Without a global daily cap nothing is claimed (spend control fails closed).
                connection.execute("UPDATE generation.settings SET daily_cap_nanos = %s", [CAP])
        yield url
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def columns(connection: psycopg.Connection[Any], table: str) -> set[str]:
    """The columns of generation.<table> (empty when there is no such table)."""
    rows = connection.execute(
        "SELECT column_name FROM information_schema.columns "
        "WHERE table_schema = 'generation' AND table_name = %s",
        [table],
    ).fetchall()
    return {str(name) for (name,) in rows}


def load_queue(url: str, tasks: int) -> None:
    """The same backlog for every phase: N queued tasks round-robin over the tools, FIFO-distinct
    created_at (1 ms apart), then VACUUM ANALYZE and a CHECKPOINT so no phase inherits the
    previous one's dead rows, missing statistics or pending dirty pages."""
    with psycopg.connect(url, autocommit=True) as connection:
        # The tasks and, on the service's schema, their events (no foreign key to cascade).
        events = ", generation.task_events" if columns(connection, "task_events") else ""
        connection.execute(f"TRUNCATE generation.tasks{events}")
        # The claim orders by created_at, or by run_at where the schema has it: both 1 ms apart.
        times = [name for name in ("created_at", "run_at") if name in columns(connection, "tasks")]
        when = "now() - make_interval(secs => (%(n)s - i) / 1000.0)"
        connection.execute(
            sql.SQL(
                "INSERT INTO generation.tasks (tool_id, input, {columns}) "
                "SELECT (%(tools)s::uuid[])[1 + i %% cardinality(%(tools)s::uuid[])], "
                "       jsonb_build_object('prompt', 'a cat', 'n', i), {values} "
                "FROM generate_series(1, %(n)s) AS i"
            ).format(
                columns=sql.SQL(", ").join(map(sql.Identifier, times)),
                values=sql.SQL(", ").join(sql.SQL(when) for _ in times),
            ),
            {"tools": TOOL_IDS, "n": tasks},
        )
        # Every table, not only the tasks: the previous phase left dead versions of the rows
        # each completion updates (the one-row settings, the tools), and the tables the
        # statements read (one-row settings, empty holds...) need statistics as autovacuum would
        # give them, or the planner guesses hundreds of rows each (and JIT-compiles the claim).
        connection.execute("VACUUM ANALYZE")
        connection.execute("CHECKPOINT")


def describe(url: str) -> str:
    """The server's version and its durability/vacuum settings, as a line's opening."""
    config = server_settings(url)
    return (
        f"PostgreSQL {config.pop('server_version')} "
        f"({', '.join(f'{name}={value}' for name, value in config.items())})"
    )


def server_settings(url: str) -> dict[str, str]:
    names = ["synchronous_commit", "fsync", "autovacuum", "shared_buffers", "server_version"]
    with psycopg.connect(url, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT name, current_setting(name) FROM unnest(%s::text[]) AS name", [names]
        ).fetchall()
    return {str(name): str(value) for name, value in rows}


# --- the service --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    """`python -m service serve` as an operator runs it, on a free port; its log in a temp file."""

    def __init__(self, url: str, env: dict[str, str], script: Path | None = None) -> None:
        """`script`: a program run instead of `-m service serve` (bench/hop.py), same settings."""
        self.address = f"127.0.0.1:{free_port()}"
        inherited = {k: v for k, v in os.environ.items() if k not in UNSET_FOR_SERVICE}
        self.env = {
            **inherited,
            "GENQ_HOST": "127.0.0.1",
            "GENQ_PORT": self.address.rsplit(":", 1)[1],
            "GENQ_HTTP_PORT": "0",  # its status page on a free port, whatever else runs here
            "DATABASE_URL": url,
            **env,
        }
        self.log_path = Path(tempfile.mkstemp(prefix="genq_bench_serve_", suffix=".log")[1])
        self.log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, str(script)] if script else [sys.executable, "-m", "service", "serve"],
            env=self.env,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def settings(self) -> Settings:
        """What the service read from its environment: the raw phase binds the same values."""
        return Settings.from_env(self.env)

    def wait_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if self.process.poll() is not None:
                    raise SystemExit(f"genq serve exited:\n{self.log_path.read_text()[-3000:]}")
                try:
                    response = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if response.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"genq serve not SERVING after {timeout} s ({self.log_path})")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        if self.process.returncode == 0:
            self.log_path.unlink(missing_ok=True)
        else:
            print(f"genq serve exited with {self.process.returncode}; log: {self.log_path}")


# --- client workers (each a process of its own) ------------------------------------------------


@dataclass(frozen=True)
class Window:
    """Monotonic clock (system-wide on Linux): loops start at `begin`, pairs that complete in
    [measure, end] are counted, loops stop starting new pairs at `end`."""

    begin: float
    measure: float
    end: float


@dataclass
class Tally:
    pairs: list[float] = field(default_factory=list)
    """Seconds of each claim + complete pair completed inside the window."""
    claims: list[float] = field(default_factory=list)
    """Seconds of the claim of each of those pairs."""
    empty_claims: int = 0
    errors: Counter[str] = field(default_factory=Counter)

    def merge(self, other: Tally) -> None:
        self.pairs += other.pairs
        self.claims += other.claims
        self.empty_claims += other.empty_claims
        self.errors.update(other.errors)


@dataclass(frozen=True)
class Job:
    kind: str
    """grpc or raw."""
    loops: int
    target: str
    """The service's address (grpc) or the database URL (raw)."""
    settings: Settings
    seed: int
    cost_nanos: int
    """reported_usage.cost_nanos of each CompleteTask."""


def session_options(settings: Settings) -> str:
    """The session settings the service's pool gives each connection (service/database.py), for
    the raw and pgbench sessions: same planner (no JIT), same timeout."""
    return f"-c jit=off -c statement_timeout={int(settings.statement_timeout_ms)}"


def complete_request(cost_nanos: int) -> Any:
    """The CompleteTaskRequest every phase sends (OUTPUT, USAGE); task and lease filled in later."""
    request = task_pb2.CompleteTaskRequest(
        task_id=str(uuid.uuid4()),
        lease_token=str(uuid.uuid4()),
        reported_usage=task_pb2.ReportedUsage(token_amount=USAGE_TOKENS, cost_nanos=cost_nanos),
    )
    request.output.update(OUTPUT)
    return request


def tally_pair(tally: Tally, window: Window, start: float, claimed: float, end: float) -> None:
    if window.measure <= end <= window.end:
        tally.pairs.append(end - start)
        tally.claims.append(claimed - start)


class Rpcs:
    """The two methods, bound as the generated stub binds them (registered methods)."""

    def __init__(self, channel: Any) -> None:
        def method(name: str, response: Any) -> Any:
            return channel.unary_unary(
                METHOD.format(name),
                request_serializer=lambda message: message.SerializeToString(),
                response_deserializer=response.FromString,
                _registered_method=True,
            )

        self.claim = method("ClaimNextTask", task_pb2.ClaimNextTaskResponse)
        self.complete = method("CompleteTask", task_pb2.CompleteTaskResponse)


async def grpc_loop(rpcs: Rpcs, job: Job, rng: random.Random, window: Window, tally: Tally) -> None:
    claims = [task_pb2.ClaimNextTaskRequest(tool_id=str(tool_id)) for tool_id in TOOL_IDS]
    template = complete_request(job.cost_nanos)
    await asyncio.sleep(max(0.0, window.begin - time.monotonic()))
    while (start := time.monotonic()) < window.end:
        try:
            claim = await rpcs.claim(rng.choice(claims))
            if not claim.lease_token:
                tally.empty_claims += 1
                continue
            claimed = time.monotonic()
            request = task_pb2.CompleteTaskRequest()
            request.CopyFrom(template)
            request.task_id, request.lease_token = claim.task.id, claim.lease_token
            await rpcs.complete(request)
        except grpc.aio.AioRpcError as error:
            tally.errors[f"{error.code().name}: {error.details()}"] += 1
            continue
        tally_pair(tally, window, start, claimed, time.monotonic())


async def raw_loop(
    connection: psycopg.AsyncConnection[dict[str, Any]],
    job: Job,
    rng: random.Random,
    window: Window,
    tally: Tally,
) -> None:
    claim_sql, complete_sql = STATEMENTS["ClaimNextTask"], STATEMENTS["CompleteTask"]
    # Exactly the parameters the service binds from the equivalent requests.
    claim_params = [
        BINDINGS["ClaimNextTask"].bind(
            task_pb2.ClaimNextTaskRequest(tool_id=str(tool_id)), job.settings
        )
        for tool_id in TOOL_IDS
    ]
    complete_params = BINDINGS["CompleteTask"].bind(complete_request(job.cost_nanos), job.settings)
    await asyncio.sleep(max(0.0, window.begin - time.monotonic()))
    while (start := time.monotonic()) < window.end:
        try:
            cursor = await connection.execute(claim_sql, rng.choice(claim_params), prepare=True)
            row = await cursor.fetchone()
            if row is None or row["lease_token"] is None:  # nothing claimed
                tally.empty_claims += 1
                continue
            claimed = time.monotonic()
            params = {**complete_params, "task_id": row["id"], "lease_token": row["lease_token"]}
            cursor = await connection.execute(complete_sql, params, prepare=True)
            (done,) = await cursor.fetchall()
            if done["id"] is None:
                tally.errors["complete refused (lease lost)"] += 1
                continue
        except psycopg.Error as error:
            tally.errors[f"{type(error).__name__}: {error}"] += 1
            continue
        tally_pair(tally, window, start, claimed, time.monotonic())


async def run_job(job: Job, pipe: Connection) -> Tally:
    tallies = [Tally() for _ in range(job.loops)]
    rngs = [random.Random(job.seed * 1000 + n) for n in range(job.loops)]
    if job.kind == "grpc":
        # A connection per loop, as pgbench and the raw phase have: grpcio would otherwise share
        # one between a process's channels, and a process's loops would all land on whichever
        # service process SO_REUSEPORT gave that one connection to.
        channels = [
            grpc.aio.insecure_channel(job.target, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(job.loops)
        ]
        try:
            for channel in channels:
                await asyncio.wait_for(channel.channel_ready(), 10)
            pipe.send("ready")
            window: Window = await asyncio.to_thread(pipe.recv)
            await asyncio.gather(
                *(
                    grpc_loop(Rpcs(channel), job, rng, window, t)
                    for channel, rng, t in zip(channels, rngs, tallies, strict=True)
                )
            )
            await asyncio.to_thread(pipe.recv)  # "finish": the CPU meter has read its end
        finally:
            for channel in channels:
                await channel.close()
    else:
        connections = [
            await psycopg.AsyncConnection.connect(
                job.target,
                autocommit=True,
                prepare_threshold=0,
                row_factory=dict_row,
                options=session_options(job.settings),
            )
            for _ in range(job.loops)
        ]
        try:
            pipe.send("ready")
            window = await asyncio.to_thread(pipe.recv)
            await asyncio.gather(
                *(
                    raw_loop(connection, job, rng, window, t)
                    for connection, rng, t in zip(connections, rngs, tallies, strict=True)
                )
            )
            # Connections stay open (their backends alive) until the CPU meter has read its end.
            await asyncio.to_thread(pipe.recv)
        finally:
            for connection in connections:
                await connection.close()
    total = Tally()
    for tally in tallies:
        total.merge(tally)
    return total


def worker(job: Job, pipe: Connection) -> None:
    """A client process: "ready", then the window, loops, "finish" and its tally, over the pipe."""
    try:
        pipe.send(asyncio.run(run_job(job, pipe)))
    except BaseException as error:
        pipe.send(error)
        raise
    finally:
        pipe.close()


# --- CPU accounting -----------------------------------------------------------------------------


class CpuMeter:
    """CPU seconds used between two snapshots by the service, the clients, Postgres (the backends
    of the bench database and the server's background processes), and the whole machine."""

    def __init__(self, service_pid: int | None, client_pids: list[int], url: str | None):
        self.groups: dict[str, list[int]] = {"service": [service_pid] if service_pid else []}
        self.groups["clients"] = client_pids
        self.url = url
        self.start: dict[int, float] = {}
        self.start_busy = 0.0
        self.start_time = 0.0

    @staticmethod
    def _busy() -> float:
        times = psutil.cpu_times()
        return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))

    def _postgres_pids(self) -> list[int]:
        """Backends of the bench database and the background processes, when Postgres is local."""
        if self.url is None or urlsplit(self.url).hostname not in {"127.0.0.1", "localhost", None}:
            return []
        with psycopg.connect(self.url, autocommit=True) as connection:
            rows = connection.execute(
                "SELECT pid FROM pg_stat_activity "
                "WHERE datname = current_database() OR datname IS NULL"
            ).fetchall()
        return [int(pid) for (pid,) in rows]

    def _service_pids(self) -> list[int]:
        """The service's process and its children (GENQ_PROCESSES > 1 spawns one per process)."""
        pids = list(self.groups["service"])
        for pid in self.groups["service"]:
            with _quiet():
                pids += [child.pid for child in psutil.Process(pid).children(recursive=True)]
        return pids

    def _snapshot(self, postgres: list[int]) -> dict[int, float]:
        seconds: dict[int, float] = {}
        for pid in [*self.groups["service"], *self.groups["clients"], *postgres]:
            with _quiet():
                times = psutil.Process(pid).cpu_times()
                seconds[pid] = float(times.user + times.system)
        return seconds

    def begin(self) -> None:
        if psutil is None:
            return
        self.postgres = self._postgres_pids()
        self.groups["service"] = self._service_pids()
        self.start, self.start_busy = self._snapshot(self.postgres), self._busy()
        self.start_time = time.monotonic()

    def end(self) -> dict[str, float]:
        """Cores used (CPU seconds per second) per party, plus the machine's busy total."""
        if psutil is None:
            return {}
        elapsed, busy = time.monotonic() - self.start_time, self._busy()
        # A process that started in the window counts from zero; one that ended in it is lost.
        postgres = sorted(set(self.postgres) | set(self._postgres_pids()))
        now = self._snapshot(postgres)
        groups = {**self.groups, "postgres": postgres}
        cores = {
            group: sum(now[p] - self.start.get(p, 0.0) for p in pids if p in now) / elapsed
            for group, pids in groups.items()
        }
        cores["machine busy"] = (busy - self.start_busy) / elapsed
        cores["other"] = cores["machine busy"] - sum(
            cores[g] for g in ("service", "clients", "postgres")
        )
        return cores


@contextmanager
def _quiet() -> Iterator[None]:
    try:
        yield
    except Exception as error:
        if psutil is None or not isinstance(error, psutil.Error):
            raise


# --- phases -------------------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    tasks_per_second: float
    pairs: int
    p50_ms: float
    p99_ms: float
    claim_p50_ms: float | None
    empty_claims: int
    errors: Counter[str]
    cores: dict[str, float]
    claim_p99_ms: float | None = None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def split(total: int, parts: int) -> list[int]:
    """`total` spread over `parts` as evenly as can be (the first ones get the remainder)."""
    return [total // parts + (n < total % parts) for n in range(parts)]


def spawn(target: Any, argument: Any) -> tuple[BaseProcess, Connection]:
    """`target(argument, pipe)` in a spawned daemon process; our end of the pipe beside it."""
    parent, child = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(
        target=target, args=(argument, child), daemon=True
    )
    process.start()
    child.close()
    return process, parent


def reap(workers: list[tuple[BaseProcess, Connection]]) -> None:
    """Closes the pipes and joins the processes (killed after 10 s)."""
    for process, pipe in workers:
        pipe.close()
        process.join(10)
        if process.is_alive():
            process.kill()


def run_clients(
    kind: str,
    args: argparse.Namespace,
    target: str,
    settings: Settings,
    service_pid: int | None,
    url: str,
) -> Result:
    """K loops over P client processes, all started together on one measured window.
    `kind`: grpc or raw (the hop's clients are the grpc phase's: kind "hop" names the result)."""
    procs = min(args.client_procs, args.clients)
    workers = [
        spawn(
            worker,
            Job(
                "grpc" if kind == "hop" else kind,
                loops,
                target,
                settings,
                args.seed + n,
                args.cost_nanos,
            ),
        )
        for n, loops in enumerate(split(args.clients, procs))
    ]
    try:
        for _, pipe in workers:
            if not pipe.poll(60):
                raise SystemExit(f"{kind} client process not ready after 60 s")
            message = pipe.recv()
            if message != "ready":
                raise SystemExit(f"{kind} client process failed: {message!r}")
        begin = time.monotonic() + 0.2
        window = Window(begin, begin + args.warmup, begin + args.warmup + args.seconds)
        for _, pipe in workers:
            pipe.send(window)
        meter = CpuMeter(service_pid, [p.pid for p, _ in workers if p.pid], url)
        time.sleep(max(0.0, window.measure - time.monotonic()))
        meter.begin()
        time.sleep(max(0.0, window.end - time.monotonic()))
        cores = meter.end()
        for _, pipe in workers:
            pipe.send("finish")
        total = Tally()
        for _, pipe in workers:
            if not pipe.poll(60):
                raise SystemExit(f"{kind} client process did not report after 60 s")
            tally = pipe.recv()
            if isinstance(tally, BaseException):
                raise SystemExit(f"{kind} client process failed: {tally!r}")
            total.merge(tally)
    finally:
        reap(workers)
    return Result(
        name=f"{kind} (psycopg)" if kind == "raw" else kind,
        tasks_per_second=len(total.pairs) / args.seconds,
        pairs=len(total.pairs),
        p50_ms=percentile(total.pairs, 0.5) * 1000,
        p99_ms=percentile(total.pairs, 0.99) * 1000,
        claim_p50_ms=percentile(total.claims, 0.5) * 1000,
        empty_claims=total.empty_claims,
        errors=total.errors,
        cores=cores,
        claim_p99_ms=percentile(total.claims, 0.99) * 1000,
    )


def pgbench_script(settings: Settings, cost_nanos: int) -> tuple[str, list[str]]:
    """The service's two statements for pgbench, bound with the values the service binds: the
    script and its -D variables (bound as parameters with -M prepared). The tool is picked as in
    shared/peers/claim_complete.sql; the claimed row's id and lease token go to the complete."""
    claim_params = BINDINGS["ClaimNextTask"].bind(
        task_pb2.ClaimNextTaskRequest(tool_id=str(TOOL_IDS[0])), settings
    )
    complete_params = BINDINGS["CompleteTask"].bind(complete_request(cost_nanos), settings)
    fixed = {
        "tool_id": f"('{str(TOOL_IDS[0])[:-1]}' || :t)::uuid",
        "task_id": ":c_id",
        "lease_token": ":c_lease_token",
    }
    variables: dict[str, str] = {}

    def placeholder(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in fixed:
            return fixed[name]
        value = {**claim_params, **complete_params}[name]
        if value is None:
            return "NULL"  # pgbench has no NULL variable
        if isinstance(value, Jsonb):
            variables[name] = json.dumps(value.obj)
        elif isinstance(value, bool):
            variables[name] = "true" if value else "false"
        else:
            variables[name] = str(value)
        return f":{name}"

    claim, complete = (
        re.sub(r"%\((\w+)\)s", placeholder, STATEMENTS[name])
        for name in ("ClaimNextTask", "CompleteTask")
    )
    script = f"\\set t random(1, {TOOLS})\n{claim}\n\\gset c_\n{complete}\n"
    return script, [f"{name}={value}" for name, value in variables.items()]


def run_pgbench(
    args: argparse.Namespace,
    url: str,
    settings: Settings,
    bound: tuple[str, list[str]] | None = None,
    name: str = "pgbench",
) -> Result:
    """pgbench logs every transaction (-l): the same window and percentiles as the other phases.
    `bound`: a pgbench script and its -D variables (default: the service's two statements,
    `pgbench_script`); `name`: the result's."""
    pgbench = shutil.which("pgbench")
    assert pgbench is not None
    with tempfile.TemporaryDirectory(prefix="genq_bench_pgbench_") as directory:
        script = Path(directory) / "claim_complete.sql"
        text, variables = bound or pgbench_script(settings, args.cost_nanos)
        script.write_text(text)
        command = [
            pgbench,
            "-n",
            "-M",
            "prepared",
            "-c",
            str(args.clients),
            "-j",
            str(min(args.clients, os.cpu_count() or 1)),
            "-T",
            # A second past the window: its backends are still alive when the CPU meter reads.
            str(math.ceil(args.warmup + args.seconds) + 1),
            "-l",
            *(argument for variable in variables for argument in ("-D", variable)),
            "-f",
            str(script),
            url,
        ]
        process = subprocess.Popen(
            command,
            cwd=directory,
            env={**os.environ, "PGOPTIONS": session_options(settings)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        meter = CpuMeter(None, [process.pid], url)
        started = time.time()
        time.sleep(args.warmup)
        meter.begin()
        time.sleep(args.seconds)
        cores = meter.end()
        stdout, _ = process.communicate()
        if process.returncode != 0:
            raise SystemExit(f"pgbench failed:\n{stdout.decode()}")
        # -l lines: client transaction latency_us script epoch_s epoch_us
        measure, end = started + args.warmup, started + args.warmup + args.seconds
        latencies = []
        for log in Path(directory).glob("pgbench_log.*"):
            for line in log.read_text().splitlines():
                fields = line.split()
                finished = int(fields[4]) + int(fields[5]) / 1e6
                if measure <= finished <= end:
                    latencies.append(int(fields[2]) / 1e6)
    return Result(
        name=name,
        tasks_per_second=len(latencies) / args.seconds,
        pairs=len(latencies),
        p50_ms=percentile(latencies, 0.5) * 1000,
        p99_ms=percentile(latencies, 0.99) * 1000,
        claim_p50_ms=None,
        empty_claims=0,
        errors=Counter(),
        cores=cores,
    )


# --- main ---------------------------------------------------------------------------------------


def report(result: Result, clients: int) -> None:
    claim = f", claim p50 {result.claim_p50_ms:.2f} ms" if result.claim_p50_ms is not None else ""
    print(
        f"{result.name:<15} {result.tasks_per_second:>8,.0f} tasks/s  ({result.pairs:,} pairs, "
        f"{clients} clients)  pair p50 {result.p50_ms:.2f} ms  p99 {result.p99_ms:.2f} ms{claim}"
    )
    if result.cores:
        parts = ", ".join(f"{name} {value:.2f}" for name, value in result.cores.items())
        print(f"{'':<15} CPU cores used: {parts}")
        for party in ("service", "clients"):
            # The service is a party of the grpc phase only; idle, it is not worth a line.
            if result.cores.get(party, 0.0) > IDLE_CORES and result.tasks_per_second:
                micros = result.cores[party] / result.tasks_per_second * 1e6
                print(f"{'':<15} {party} CPU per claim+complete pair: {micros:.0f} us")
    if result.cores.get("other", 0.0) > NOISE_CORES:
        print(f"{'':<15} WARNING: something else used {result.cores['other']:.2f} cores meanwhile")
    if result.empty_claims:
        print(f"{'':<15} WARNING: {result.empty_claims} empty claims: raise --tasks")
    for error, count in result.errors.most_common(5):
        print(f"{'':<15} ERROR x{count}: {error}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Claim+complete, one task per call: gRPC service vs the same SQL via psycopg."
    )
    parser.add_argument("--clients", type=int, default=8, help="concurrent client loops (8)")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured seconds (15)")
    parser.add_argument(
        "--tasks",
        type=int,
        default=150_000,
        help="queued tasks loaded before each phase, over 4 tools (150000: more than the fastest "
        "phase drains in warm-up + seconds, so no phase ever sees an empty queue)",
    )
    parser.add_argument(
        "--warmup", type=float, default=2.0, help="seconds run before measuring (2)"
    )
    parser.add_argument(
        "--client-procs",
        type=int,
        default=2,
        help="client processes the loops are spread over, for grpc and raw alike (2: one Python "
        "process tops out near one core; see docs/BENCHMARKS.md)",
    )
    parser.add_argument(
        "--service-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment for the service, e.g. GENQ_POOL_MAX_SIZE=16 (repeatable)",
    )
    parser.add_argument(
        "--phases",
        type=lambda text: [phase for phase in text.split(",") if phase],
        default=list(PHASES),
        help=f"comma-separated phases to run, in order ({','.join(PHASES)})",
    )
    parser.add_argument(
        "--cost-nanos",
        type=int,
        default=1000,
        help="reported_usage.cost_nanos of each completion (1000; 0 skips the spend accounting)",
    )
    parser.add_argument(
        "--processes",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[],
        metavar="P1,P2",
        help="instead of the phases: the grpc phase once per value, each with a service of its "
        "own at GENQ_PROCESSES=value, e.g. 1,2; prints each ratio to the first",
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the tool choice (1)")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.client_procs < 1 or args.seconds <= 0 or args.tasks < 1:
        parser.error("--clients, --client-procs, --seconds and --tasks must be positive")
    if unknown := set(args.phases) - set(PHASES):
        parser.error(f"unknown phases {sorted(unknown)}; known: {', '.join(PHASES)}")
    if any(n < 1 for n in args.processes):
        parser.error("--processes values must be positive")
    return args


PROCESSES_BAR = 1.0
"""Issue 9: the grpc phase at GENQ_PROCESSES=2 > 1 x the same at GENQ_PROCESSES=1."""


def compare_processes(args: argparse.Namespace, service_env: dict[str, str]) -> int:
    """The grpc phase with the service at each GENQ_PROCESSES of --processes, in one run: one
    database, the queue reloaded before each, a service started afresh for each."""
    results: list[tuple[int, Result]] = []
    with bench_database() as url:
        print(
            f"{describe(url)}, {os.cpu_count()} CPUs; {args.tasks:,} tasks over {TOOLS} tools; "
            f"{args.clients} clients in {min(args.client_procs, args.clients)} client "
            f"process(es); {args.warmup:g} s warm-up + {args.seconds:g} s measured per phase; "
            f"grpc phase at GENQ_PROCESSES={','.join(map(str, args.processes))}"
        )
        for processes in args.processes:
            load_queue(url, args.tasks)
            service = Service(url, {**service_env, "GENQ_PROCESSES": str(processes)})
            try:
                service.wait_serving()
                result = run_clients(
                    "grpc", args, service.address, service.settings(), service.process.pid, url
                )
            finally:
                service.stop()
            result.name = f"grpc P={processes}"
            report(result, args.clients)
            results.append((processes, result))
    first, baseline = results[0]
    for processes, result in results[1:]:
        if baseline.tasks_per_second:
            ratio = result.tasks_per_second / baseline.tasks_per_second
            verdict = "meets" if ratio > PROCESSES_BAR else "MISSES"
            print(
                f"ratio grpc GENQ_PROCESSES={processes} / GENQ_PROCESSES={first}: {ratio:.2f} "
                f"(bar > {PROCESSES_BAR:g} x: {verdict})"
            )
    return 1 if any(r.errors or r.empty_claims for _, r in results) else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    service_env = dict(item.split("=", 1) for item in args.service_env)
    if args.processes:
        return compare_processes(args, service_env)
    phases = args.phases
    if "pgbench" in phases and not shutil.which("pgbench"):
        print("pgbench not found: skipping its phase")
        phases = [phase for phase in phases if phase != "pgbench"]
    results: dict[str, Result] = {}
    with bench_database() as url:
        print(
            f"{describe(url)}, {os.cpu_count()} CPUs; "
            f"{args.tasks:,} tasks over {TOOLS} tools; {args.clients} clients in "
            f"{min(args.client_procs, args.clients)} client process(es); "
            f"{args.warmup:g} s warm-up + {args.seconds:g} s measured per phase"
        )
        service = Service(url, service_env)
        settings = service.settings()
        try:
            service.wait_serving()
            for phase in phases:
                load_queue(url, args.tasks)
                if phase == "grpc":
                    result = run_clients(
                        "grpc", args, service.address, settings, service.process.pid, url
                    )
                elif phase == "raw":
                    result = run_clients("raw", args, url, settings, service.process.pid, url)
                elif phase == "hop":
                    hop = Service(url, service_env, HOP)
                    try:
                        hop.wait_serving()
                        result = run_clients(
                            "hop", args, hop.address, settings, hop.process.pid, url
                        )
                    finally:
                        hop.stop()
                else:
                    result = run_pgbench(args, url, settings)
                report(result, args.clients)
                results[phase] = result
        finally:
            service.stop()
    if "grpc" in results:
        for name, baseline in results.items():
            if name != "grpc" and baseline.tasks_per_second:
                ratio = results["grpc"].tasks_per_second / baseline.tasks_per_second
                print(f"ratio grpc / {baseline.name}: {ratio:.2f}")
                if name == "raw":
                    verdict = "meets" if ratio >= BAR else "MISSES"
                    print(f"bar (grpc >= {BAR} x raw): {verdict} ({ratio:.2f})")
    if "hop" in results:
        for name in ("raw", "pgbench"):
            if name in results and results[name].tasks_per_second:
                ratio = results["hop"].tasks_per_second / results[name].tasks_per_second
                print(f"without the middleware: ratio hop / {results[name].name}: {ratio:.2f}")
    # A missed bar is a figure, not a failure; errors or a drained queue make the run invalid.
    return 1 if any(r.errors or r.empty_claims for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
