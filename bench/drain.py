"""Batch path at the same batch: genq's WorkerFleet with N lanes against PGQueuer's QueueManager
with dequeue batch N, the same no-op tasks, in one run on the same Postgres (issue #29, bars
"drain", "WAL" and "enqueue").

    .venv/bin/python bench/drain.py [--batches 10,100] [--tasks 20000] [--workers 1]

PGQueuer is the bench's own dependency, the `bench` extra (never the service's):

    .venv/bin/pip install -e '.[bench]'

For each N in `--batches`, one run, PGQueuer first (all N), then genq (all N):

- PGQueuer: a database of its own (`pgq install --durability durable`: every table logged), one
  process that enqueues `--tasks` jobs with `Queries.enqueue`, 1,000 a call, one call at a time,
  then drains them with `QueueManager.run(batch_size=N)` (continuous, as a production worker
  runs; stopped once the bench has read the drain's figures) and an entrypoint that returns at
  once. PGQueuer dequeues the next batch while the last one runs, so batch N may run 2N jobs and
  more at once; a second drain holds it to N (the entrypoint's `concurrency_limit=N`), as genq's
  N lanes are held: printed as a reference beside the bar, not as one.
- genq: a database of its own (migrated, a daily cap no run reaches), `python -m service serve`
  on a free port with its defaults (`--service-env NAME=VALUE` to change them; `--hop`: bench/
  hop.py instead, the service without its middleware), one tool "noop", warmed by one enqueue
  of WARM_UP_TASKS. The same number of tasks enqueued with `GatewayClient.enqueue_many` and its
  defaults (QueueTasks of 1,000, ENQUEUE_CONCURRENCY calls in flight; `--enqueue-concurrency`),
  then drained by `--workers` processes (1), each one `WorkerFleet(client)` with its defaults
  hosting "noop" with `concurrency=N` lanes and a handler that returns at once.

Each side starts on an empty queue (a fresh PGQueuer database; genq's tables TRUNCATEd), after
one CHECKPOINT, and no CHECKPOINT runs between its enqueue and its drain (the first change of
each page after a checkpoint writes the whole page into the WAL: both sides start alike); a
side whose windows a checkpoint still fell into (the server's timed one, or another client's) is
run again, up to CHECKPOINT_RETRIES times. The worker processes are started and have imported
everything before the enqueue; the drain runs from their release to the last task's end (genq:
`max(completed_at)`; PGQueuer: the last `successful` row of `pgqueuer_log`), both read from the
database, not from the workers' exit.

Durability: synchronous_commit = on for both (set on each database, read back from each side's
own connections and printed); every table of both sides is asserted logged (relpersistence p).

Printed, per N and side (a Markdown table), then the ratios genq / PGQueuer against the bars
(drain >= 1x, WAL <= 1x; the enqueue ratio plain, its bar's line is below):

- enqueue tasks/s (the one enqueue before that drain) and drain tasks/s;
- WAL bytes per task, enqueue to done: the enqueue's and the drain's windows (`pg_current_wal_
  lsn()` before and after; the ANALYZE between them, as autovacuum would run it, is outside).
  WAL is the cluster's: with `pg_walinspect` (created in a database of the bench's own) each
  window's records are counted for this side's database only, exactly (the records with a block
  in it, and every record of the transactions that wrote one, commits included, each padded to
  8 bytes as in the WAL; page headers left out). Without it the LSN difference is printed, which
  counts whatever else writes on the cluster. A temporary physical replication slot, held by the
  bench's own connection, keeps the windows' WAL until it is read. The LSN figure is printed
  beside it, with the WAL of others in the same windows, and a warning when others wrote or a
  checkpoint fell inside a window;
- CPU µs per task during the drain: the service (its process and children), the worker
  process(es), and Postgres: the backends connected to this side's database (the bench's own
  polling connection left out; the server's background processes, WAL writer and checkpointer,
  are shared and left out too). `other` is the rest of the machine: a run with other above 0.25
  core is flagged as disturbed.
- enqueue, the bar's line: after the drains, `--enqueue-rounds` (5) enqueues of `--tasks` on each
  side, alternating (PGQueuer's `Queries.enqueue` of 1,000 a call and genq's `enqueue_many` as
  above; PGQueuer first in the odd rounds, genq in the even ones), each from a fresh process of
  its own (connected and warmed by two enqueues of 10 before the clock starts) into an emptied
  queue (PGQueuer's jobs and log), right after VACUUM ANALYZE and a CHECKPOINT as before a drain:
  the median of each side's rounds, their ratio, and each round's two rates. One enqueue lasts
  a fraction of a second, and the machine's speed drifts more than that between the drains' own
  enqueues, PGQueuer's taken a minute before genq's.

What bounds genq's side, after the table (the drain bar's reasons, measured in the same run):

- the cycle: a lane claims for its free slots, then confirms the claim, before any handler runs,
  so a worker drains at most the tasks a claim took / (median claim + median confirm);
- the cores: genq's CPU a task (service + workers + Postgres) times PGQueuer's drain rate, the
  cores genq would need to keep PGQueuer's pace, against the machine's;
- the ceiling (`--no-ceiling` skips it): for each N one more drain of the same tasks by a bench
  loop that drives the service with PGQueuer's protocol instead of the SDK's (ClaimTasks of N
  back to back, each claim's tasks completed at once in one CompleteTasks sent without waiting
  for it; no ConfirmClaim, no bound on the tasks in flight): what the service drains for a
  client that keeps none of the fleet's rules.

The floor (`--floor`, instead of the above): for each N, `--floor-rounds` (3) rounds in turn of
PGQueuer's drain (as above) and of its own statements behind bench/pgq_hop.py, the thinnest gRPC
hop in Python (raw bytes, PGQueuer's dequeue and log SQL on an asyncpg pool, GENQ_PROCESSES as
`genq serve`), driven by `floor_worker` (a dequeue of N at a time, back to back, each batch
logged at once without waiting: PGQueuer's statements, but its logs overlap the next dequeue
without bound, where PGQueuer runs both on one connection, one at a time), on unary calls and on
one bidirectional stream: each drain, then the medians and their ratios to PGQueuer's. What a
service between the workers and Postgres costs the drain before any of genq's own work.

    .venv/bin/python bench/drain.py --floor [--batches 10,100] [--tasks 10000] [--floor-rounds 3]

Paid vs unpaid (issue 9, bar "paid drain >= 0.7 x unpaid drain"):

    .venv/bin/python bench/drain.py --paid [--batches 10,100] [--tasks 20000] [--workers 1]

runs, instead of the above, on one genq database and service (the daily cap 10**17 nanos, which
no run reaches, and no tool cap), for each N, three drains of the same tasks by `--workers`
processes, each a WorkerFleet with its defaults and N lanes a tool:

- unpaid, 1 tool: tool "noop", no cost estimate, a handler that reports no cost (as above);
- unpaid, 8 tools: tasks/8 on each of the tools "noop-1".."noop-8", no estimate, no cost: the
  control, to tell the 8 tools' share of the difference from the money's;
- paid, 8 tools: the same 8 tools configured (ConfigureTool) with a cost estimate
  (`--estimate-nanos`, so every claim is admitted against the cap with it) and a handler that
  reports a cost on every task (`ctx.report_usage(cost_nanos=--cost-nanos)`).

It prints each drain, the cost the attempts recorded, and the ratios paid / unpaid 1 tool (the
bar) and paid / unpaid 8 tools.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import multiprocessing
import os
import signal
import statistics
import struct
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import psycopg
from google.protobuf import duration_pb2
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the project's packages, not an installed copy

from bench.claim_complete import ADMIN_URL, HOP, Service, split, url_for  # noqa: E402
from generation.task.v1 import task_pb2  # noqa: E402
from service import migrations  # noqa: E402
from workers_sdk import GatewayClient, GenqClient, TaskContext, WorkerFleet  # noqa: E402
from workers_sdk.gateway import ENQUEUE_CONCURRENCY  # noqa: E402

CAP = 10**17
"""Global daily cap in nanos (the largest the service takes): without one nothing is claimed."""
TOOL = "noop"
PGQ_HOP = Path(__file__).resolve().parent / "pgq_hop.py"
"""The floor's server (its docstring)."""
ENQUEUE_CALL = 1_000
"""Tasks a batched enqueue call carries, on both sides (QueueTasks' default size in the SDK)."""
DRAIN_BAR, WAL_BAR, ENQUEUE_BAR = 1.0, 1.0, 1.0
TIMES, DASH = "\u00d7", "\u2013"
"""The ratio's sign and an empty cell's, as docs/BENCHMARKS.md writes them."""
DISTURBED = 0.25
"""Cores used by others during a drain above which its line is flagged."""
GENQ_TABLES = ("tasks", "task_events", "attempts")
"""What TRUNCATE empties between genq's runs (those of them the schema has)."""

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
    names = [
        "server_version",
        "synchronous_commit",
        "fsync",
        "full_page_writes",
        "wal_compression",
        "autovacuum",
        "shared_buffers",
    ]
    with psycopg.connect(url, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT name, current_setting(name) FROM unnest(%s::text[]) AS name", [names]
        ).fetchall()
    return ", ".join(f"{name}={value}" for name, value in rows)


def assert_durable(url: str, side: str, schema: str) -> None:
    """Every table of `schema` logged, and synchronous_commit on for a new connection."""
    with psycopg.connect(url, autocommit=True) as connection:
        found = connection.execute(
            "SELECT current_setting('synchronous_commit'), count(*), "
            "array_agg(c.relname) FILTER (WHERE c.relpersistence <> 'p') "
            "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relkind IN ('r', 'p')",
            [schema],
        ).fetchone()
    assert found is not None
    commit, tables, unlogged = found
    assert commit == "on", f"{side}: synchronous_commit = {commit}"
    assert tables and not unlogged, f"{side}: {tables} tables, not logged: {unlogged}"


def database_oid(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as connection:
        found = connection.execute(
            "SELECT oid FROM pg_database WHERE datname = current_database()"
        ).fetchone()
    assert found is not None
    return int(found[0])


# --- WAL ----------------------------------------------------------------------------------------


@dataclass
class Wal:
    lsn_bytes: int = 0
    """pg_current_wal_lsn() difference: the cluster's WAL, whoever wrote it."""
    own_bytes: int | None = None
    """The records of this side's database (pg_walinspect); None without it."""
    others_bytes: int | None = None
    """The records of the same windows that are not this side's (other databases, the server)."""
    checkpoints: int = 0
    """Windows with a checkpoint's redo point inside them (pg_control_checkpoint())."""

    def __add__(self, other: Wal) -> Wal:
        def both(a: int | None, b: int | None) -> int | None:
            return None if a is None or b is None else a + b

        return Wal(
            self.lsn_bytes + other.lsn_bytes,
            both(self.own_bytes, other.own_bytes),
            both(self.others_bytes, other.others_bytes),
            self.checkpoints + other.checkpoints,
        )

    @property
    def bytes(self) -> int:
        return self.lsn_bytes if self.own_bytes is None else self.own_bytes


WAL_RECORDS = """
WITH r AS MATERIALIZED (
  SELECT xid::text::bigint AS x, (record_length + 7) / 8 * 8 AS n,
         coalesce(block_ref LIKE %(pattern)s, false) AS ours
  FROM pg_get_wal_records_info(%(start)s::pg_lsn, %(end)s::pg_lsn)),
xs AS (SELECT DISTINCT x FROM r WHERE ours AND x <> 0)
SELECT coalesce(sum(r.n) FILTER (WHERE r.ours OR xs.x IS NOT NULL), 0),
       coalesce(sum(r.n) FILTER (WHERE NOT r.ours AND xs.x IS NULL), 0)
FROM r LEFT JOIN xs ON xs.x = r.x
"""
"""A window's record bytes (padded to 8) of one database and of everyone else: a record is the
database's when one of its blocks is in it ("rel spc/db/rel" in block_ref), or its transaction
wrote such a block (its commit record has no block)."""


class WalMeter:
    """Windows of the cluster's WAL, counted per database with pg_walinspect when it is there.
    Holds one connection to a database of its own (where the extension is created), and on it a
    temporary physical replication slot that keeps the WAL from being recycled before it is read
    (dropped with the connection)."""

    def __init__(self, url: str) -> None:
        self.connection = psycopg.connect(url, autocommit=True)
        self.inspect = True
        try:
            self.connection.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        except psycopg.Error as error:
            print(f"WAL: pg_walinspect unavailable ({error}); LSN differences only")
            self.inspect = False
        if self.inspect:
            slot = f"genq_bench_{uuid.uuid4().hex[:8]}"
            self.connection.execute(
                "SELECT pg_create_physical_replication_slot(%s, true, true)", [slot]
            )

    def close(self) -> None:
        self.connection.close()

    def begin(self) -> str:
        found = self.connection.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert found is not None
        return str(found[0])

    def end(self, start: str, oid: int) -> Wal:
        """The window from `start` (begin's) to now, of the database `oid`."""
        found = self.connection.execute(
            "SELECT pg_current_wal_lsn()::text, pg_current_wal_lsn() - %s::pg_lsn, "
            "(SELECT redo_lsn > %s::pg_lsn FROM pg_control_checkpoint())",
            [start, start],
        ).fetchone()
        assert found is not None
        end = str(found[0])
        wal = Wal(int(found[1]), checkpoints=int(bool(found[2])))
        if not self.inspect:
            return wal
        deadline = time.monotonic() + 10
        while True:  # pg_walinspect reads only WAL flushed to disk
            flushed = self.connection.execute(
                "SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn", [end]
            ).fetchone()
            if (flushed and flushed[0]) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        counted = self.connection.execute(
            WAL_RECORDS.encode(), {"pattern": f"% rel %/{oid}/%", "start": start, "end": end}
        ).fetchone()
        assert counted is not None
        wal.own_bytes, wal.others_bytes = int(counted[0]), int(counted[1])
        return wal


# --- CPU ----------------------------------------------------------------------------------------


class CpuMeter:
    """CPU seconds between `begin` and `end` of the service (its process and children), the
    worker processes, and the Postgres backends connected to the side's database (but the
    bench's own `looker` backend), and the whole machine's busy time."""

    def __init__(self, url: str, service: Service | None, workers: list[int], looker: int) -> None:
        self.url, self.service, self.workers, self.looker = url, service, workers, looker
        self.groups: dict[str, list[int]] = {}
        self.start: dict[int, float] = {}
        self.busy = 0.0

    def _pids(self) -> dict[str, list[int]]:
        with psycopg.connect(self.url, autocommit=True) as connection:
            rows = connection.execute(
                "SELECT pid FROM pg_stat_activity WHERE pid NOT IN (pg_backend_pid(), %s) "
                "AND datname = current_database()",
                [self.looker],
            ).fetchall()
        service = []
        if self.service is not None:
            root = psutil.Process(self.service.process.pid)
            service = [root.pid, *(child.pid for child in root.children(recursive=True))]
        return {
            "service": service,
            "workers": list(self.workers),
            "postgres": [int(pid) for (pid,) in rows],
        }

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
        for group in ("service", "workers", "postgres"):
            pids = sorted(set(self.groups[group]) | set(later[group]))
            now = self._seconds(pids)  # one that started meanwhile counts from zero
            used[group] = sum(now[pid] - self.start.get(pid, 0.0) for pid in now)
        used["machine"] = busy
        return used


# --- one side's run -----------------------------------------------------------------------------


@dataclass
class Run:
    side: str
    batch: int
    tasks: int
    enqueue_per_second: float
    drain_seconds: float
    enqueue_wal: Wal
    drain_wal: Wal
    cpu: dict[str, float]
    """CPU seconds during the drain: service, workers, postgres, machine."""
    calls: Counter[str] = field(default_factory=Counter)
    """genq: RPCs by method, all workers together."""
    seconds: dict[str, list[float]] = field(default_factory=dict)
    """genq: the seconds each of those calls took, by method (a parked claim's wait included:
    the workers' first claims park until the release, so a median is printed, not a mean)."""

    @property
    def per_second(self) -> float:
        return self.tasks / self.drain_seconds

    @property
    def wal(self) -> Wal:
        return self.enqueue_wal + self.drain_wal

    def micros(self, party: str) -> float | None:
        return 1e6 * self.cpu[party] / self.tasks if party in self.cpu else None

    @property
    def other_cores(self) -> float | None:
        if "machine" not in self.cpu:
            return None
        parties = sum(self.cpu[name] for name in ("service", "workers", "postgres"))
        return (self.cpu["machine"] - parties) / self.drain_seconds


POLL_SECONDS = 0.25
"""How often a drain looks whether it is done, on one connection: the drain's figure is read
from the last task's end, not from the look."""


def wait_done(looking: psycopg.Connection[Any], query: str, tasks: int, timeout: float) -> float:
    """Polls `query` (count, epoch of the last end) until `tasks` are done; the last end."""
    deadline = time.monotonic() + timeout
    while True:
        found = looking.execute(query.encode()).fetchone()
        assert found is not None
        if int(found[0]) >= tasks:
            assert found[1] is not None
            return float(found[1])
        if time.monotonic() > deadline:
            raise SystemExit(f"drain timed out: {found[0]} of {tasks} done")
        time.sleep(POLL_SECONDS)


def backend_pid(connection: psycopg.Connection[Any]) -> int:
    found = connection.execute("SELECT pg_backend_pid()").fetchone()
    assert found is not None
    return int(found[0])


def started(pipes: list[Connection], what: str) -> list[Any]:
    answers = []
    for pipe in pipes:
        if not pipe.poll(120):
            raise SystemExit(f"{what} did not answer")
        answers.append(pipe.recv())
    return answers


def stop(processes: Sequence[BaseProcess]) -> None:
    for process in processes:
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join()


# --- PGQueuer -----------------------------------------------------------------------------------

PGQ_DONE = (
    "SELECT count(*), extract(epoch FROM max(created))::float FROM pgqueuer_log "
    "WHERE status = 'successful'"
)


async def pgq_enqueue(queries: Any, tasks: int) -> float:
    """`tasks` no-op jobs with PGQueuer's `Queries.enqueue`, ENQUEUE_CALL a call, one call at a
    time; returns jobs/s."""
    begun = time.perf_counter()
    for first in range(0, tasks, ENQUEUE_CALL):
        n = min(ENQUEUE_CALL, tasks - first)
        await queries.enqueue([TOOL] * n, [None] * n, [0] * n)
    return tasks / (time.perf_counter() - begun)


def pgqueuer_process(url: str, tasks: int, batch: int, cap: int, pipe: Connection) -> None:
    """PGQueuer's side in a process of its own: enqueue on "enqueue", then a QueueManager as it
    runs in production (continuous) from "drain" to "stop", which the bench sends once it has read
    the drain's figures: the process and its connections are alive while their CPU is read.
    `cap`: the entrypoint's concurrency_limit (0: none, PGQueuer's default)."""

    async def main() -> None:
        import asyncpg
        from pgqueuer import QueueManager
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.queries import Queries
        from pgqueuer.types import QueueExecutionMode

        enqueuing = await asyncpg.connect(url)
        draining = await asyncpg.connect(url)
        commits = [
            await each.fetchval("SELECT current_setting('synchronous_commit')")
            for each in (enqueuing, draining)
        ]
        queries = Queries(AsyncpgDriver(enqueuing))
        manager = QueueManager(Queries(AsyncpgDriver(draining)))

        @manager.entrypoint(TOOL, concurrency_limit=cap)
        async def noop(job: Any) -> None:
            return None

        pipe.send(("ready", commits))
        await asyncio.to_thread(pipe.recv)  # "enqueue"
        pipe.send(await pgq_enqueue(queries, tasks))
        await asyncio.to_thread(pipe.recv)  # "drain"
        running = asyncio.create_task(
            manager.run(
                batch_size=batch,
                mode=QueueExecutionMode.continuous,
                dequeue_timeout=timedelta(seconds=1),
            )
        )
        await asyncio.to_thread(pipe.recv)  # "stop": measured while its connections are open
        manager.shutdown.set()
        await running
        await enqueuing.close()
        pipe.send("stopped")

    asyncio.run(main())


def pgqueuer(args: argparse.Namespace, batch: int, wal: WalMeter | None, cap: int = 0) -> Run:
    """PGQueuer's enqueue and drain of `args.tasks` jobs at dequeue batch `batch`, on a
    database of its own (WAL not read without `wal`); `cap`: at most that many jobs at once."""
    if importlib.util.find_spec("pgqueuer") is None:
        raise SystemExit(
            "PGQueuer is missing: .venv/bin/pip install -e '.[bench]' (see the docstring)"
        )
    with database("pgq_bench") as url:
        env = {**os.environ, "PGDSN": url, "PGQ_DSN": url}
        pgq = Path(sys.executable).parent / "pgq"
        install = [str(pgq), "install", "--durability", "durable"]
        subprocess.run(install, env=env, check=True, capture_output=True)
        assert_durable(url, "pgqueuer", "public")
        oid = database_oid(url)
        spawn = multiprocessing.get_context("spawn")
        ours, theirs = spawn.Pipe()
        process = spawn.Process(target=pgqueuer_process, args=(url, args.tasks, batch, cap, theirs))
        process.start()
        try:
            ((_, commits),) = started([ours], "the PGQueuer process")
            assert set(commits) == {"on"}, f"pgqueuer: synchronous_commit {commits}"
            execute(url, "VACUUM ANALYZE", "CHECKPOINT")
            began = wal.begin() if wal else None
            ours.send("enqueue")
            (enqueue_rate,) = started([ours], "PGQueuer's enqueue")
            enqueued = wal.end(began, oid) if wal and began else Wal()
            execute(url, "ANALYZE")
            with psycopg.connect(url, autocommit=True) as looking:
                assert process.pid is not None
                meter = CpuMeter(url, None, [process.pid], backend_pid(looking))
                meter.begin()
                began = wal.begin() if wal else None
                go = time.time()
                ours.send("drain")
                last = wait_done(looking, PGQ_DONE, args.tasks, args.timeout)
                cpu = meter.end()
                drained = wal.end(began, oid) if wal and began else Wal()
            ours.send("stop")
            started([ours], "PGQueuer's stop")
        finally:
            stop([process])
    side = f"PGQueuer, at most {cap} at once" if cap else "PGQueuer"
    return Run(side, batch, args.tasks, enqueue_rate, last - go, enqueued, drained, cpu)


# --- genq ---------------------------------------------------------------------------------------


class CountingClient(GenqClient):
    """A GenqClient that counts calls by method (for the RPCs per 1,000 tasks), and the seconds
    each took."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.calls: Counter[str] = Counter()
        self.seconds: dict[str, list[float]] = {}

    async def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        self.calls[method] += 1
        started = time.perf_counter()
        try:
            return await super().call(method, request, timeout=timeout)
        finally:
            took = time.perf_counter() - started
            self.seconds.setdefault(method, []).append(took)


async def noop(task: Any, ctx: TaskContext) -> None:
    return None


def paid_noop(cost_nanos: int) -> Any:
    """A handler that does nothing but report what it cost (sent with its CompleteTask)."""

    async def handler(task: Any, ctx: TaskContext) -> None:
        ctx.report_usage(token_amount=1, cost_nanos=cost_nanos)

    return handler


def worker(
    address: str,
    lanes: int,
    pipe: Connection,
    tools: tuple[str, ...] = (TOOL,),
    cost_nanos: int = 0,
) -> None:
    """One worker process: a WorkerFleet with its defaults hosting `tools` with `lanes` each (a
    handler reporting `cost_nanos` on every task if not 0); runs from "go" until SIGTERM."""

    async def main() -> None:
        client = CountingClient(address)
        fleet = WorkerFleet(client)  # the defaults a user who changes nothing gets
        handler = paid_noop(cost_nanos) if cost_nanos else noop
        for tool in tools:
            fleet.register(tool, handler, concurrency=lanes)
        pipe.send("ready")
        await asyncio.to_thread(pipe.recv)  # "go"
        await fleet.run()
        await client.close()
        pipe.send((dict(client.calls), dict(client.seconds)))

    asyncio.run(main())


def ceiling_worker(
    address: str,
    batch: int,
    pipe: Connection,
    tools: tuple[str, ...] = (TOOL,),
    cost_nanos: int = 0,
) -> None:
    """One worker process that drives the service with PGQueuer's protocol instead of the
    SDK's (the ceiling line): ClaimTasks of `batch` back to back, one at a time, each claim's tasks
    completed at once in one CompleteTasks, sent without waiting for it; no ConfirmClaim and no
    bound on the tasks in flight. Not a worker anyone should run (a run it loses is never
    charged, nothing holds it to free slots): what the service drains for a client that keeps
    no rule of the fleet's. Runs from "go" until SIGTERM; `worker`'s arguments and answer."""
    assert tools == (TOOL,) and not cost_nanos, "the ceiling runs the unpaid drain only"

    async def main() -> None:
        client = CountingClient(address)
        tool_id = str((await GatewayClient(client).upsert_tool(TOOL)).id)
        stopping = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
        park = duration_pb2.Duration()
        park.FromMilliseconds(100)
        claim = task_pb2.ClaimTasksRequest(tool_id=tool_id, limit=batch, wait=park)
        reports: set[asyncio.Task[Any]] = set()

        def reported(report: asyncio.Task[Any]) -> None:
            # A lost report leaves its tasks leased: say so, or the drain only looks slow.
            reports.discard(report)
            if not report.cancelled() and report.exception() is not None:
                print(f"ceiling: a CompleteTasks failed: {report.exception()}", file=sys.stderr)

        pipe.send("ready")
        await asyncio.to_thread(pipe.recv)  # "go"
        while not stopping.is_set():
            claimed = await client.call("ClaimTasks", claim, timeout=client.timeout + 0.1)
            if not claimed.tasks:
                continue
            done = task_pb2.CompleteTasksRequest(
                tasks=[
                    task_pb2.CompleteTaskRequest(task_id=item.task.id, lease_token=item.lease_token)
                    for item in claimed.tasks
                ]
            )
            report = asyncio.create_task(client.call("CompleteTasks", done))
            reports.add(report)
            report.add_done_callback(reported)
        await asyncio.gather(*reports)
        await client.close()
        pipe.send((dict(client.calls), dict(client.seconds)))

    asyncio.run(main())


FLOOR_MODES = ("unary", "stream")
"""How the floor's worker calls bench/pgq_hop.py: Dequeue and Log calls on two connections, or
both on one bidirectional Drain stream."""


def floor_worker(address: str, batch: int, mode: str, pipe: Connection) -> None:
    """The floor's worker, in a process of its own, through bench/pgq_hop.py: a dequeue of
    `batch` at a time, back to back; each batch's ids logged at once, not waited for (no bound
    on the logs in flight); nothing run between; by `mode` (FLOOR_MODES). Runs from "go" until
    SIGTERM."""
    import grpc

    async def main() -> None:
        stopping = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)
        want = struct.pack("<I", batch)
        # A subchannel pool of its own each, as GenqClient's two connections.
        channels = [
            grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(2)
        ]
        logs: set[asyncio.Future[Any]] = set()
        pipe.send("ready")
        await asyncio.to_thread(pipe.recv)  # "go"
        if mode == "unary":
            dequeue = channels[0].unary_unary("/pgq_hop.Hop/Dequeue")
            log = channels[1].unary_unary("/pgq_hop.Hop/Log")
            while not stopping.is_set():
                ids = await dequeue(want)
                if ids:
                    task = asyncio.ensure_future(log(ids))
                    logs.add(task)
                    task.add_done_callback(logs.discard)
            await asyncio.gather(*logs)
        else:
            stream = channels[0].stream_stream("/pgq_hop.Hop/Drain")()
            while not stopping.is_set():
                await stream.write(b"C" + want)
                ids = await stream.read()
                if ids:
                    await stream.write(b"L" + ids)
            await stream.done_writing()
        for channel in channels:
            await channel.close()
        pipe.send("stopped")

    asyncio.run(main())


def floor_run(args: argparse.Namespace, batch: int, mode: str) -> Run:
    """The floor's drain of `args.tasks` jobs at batch `batch`: a database of its own installed
    as PGQueuer's side is, the jobs enqueued as PGQueuer's side enqueues them, bench/pgq_hop.py
    serving it (GENQ_PROCESSES as `genq serve`'s, with --service-env) and one floor_worker."""
    env = dict(item.split("=", 1) for item in args.service_env)
    with database("pgq_floor") as url:
        install = [str(Path(sys.executable).parent / "pgq"), "install", "--durability", "durable"]
        subprocess.run(install, env={**os.environ, "PGDSN": url}, check=True, capture_output=True)
        assert_durable(url, "pgqueuer", "public")
        service = Service(url, env, PGQ_HOP)
        spawn = multiprocessing.get_context("spawn")
        ours, theirs = spawn.Pipe()
        process = spawn.Process(target=floor_worker, args=(service.address, batch, mode, theirs))
        try:
            service.wait_serving()
            process.start()
            assert started([ours], "the floor's worker") == ["ready"]
            execute(url, "VACUUM ANALYZE", "CHECKPOINT")
            enqueue_rate = asyncio.run(floor_enqueue(url, args.tasks))
            execute(url, "ANALYZE")
            with psycopg.connect(url, autocommit=True) as looking:
                assert process.pid is not None
                meter = CpuMeter(url, service, [process.pid], backend_pid(looking))
                meter.begin()
                go = time.time()
                ours.send("go")
                last = wait_done(looking, PGQ_DONE, args.tasks, args.timeout)
                cpu = meter.end()
            os.kill(process.pid, signal.SIGTERM)
            started([ours], "the floor's worker's stop")
        finally:
            stop([process])
            service.stop()
    return Run(f"floor, {mode}", batch, args.tasks, enqueue_rate, last - go, Wal(), Wal(), cpu)


async def floor_enqueue(url: str, tasks: int) -> float:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    connection = await asyncpg.connect(url)
    try:
        return await pgq_enqueue(Queries(AsyncpgDriver(connection)), tasks)
    finally:
        await connection.close()


def floor(args: argparse.Namespace) -> None:
    """--floor: for each N, `args.floor_rounds` rounds of PGQueuer's drain and the floor's
    (each of FLOOR_MODES), in turn, then the medians and their ratios to PGQueuer's."""
    for batch in args.batches:
        rounds: dict[str, list[Run]] = {}
        for round_ in range(args.floor_rounds):
            for run in (
                partial(pgqueuer, args, batch, None),
                *(partial(floor_run, args, batch, mode) for mode in FLOOR_MODES),
            ):
                result = run()
                rounds.setdefault(result.side, []).append(result)
                print(
                    f"  N={batch} round {round_ + 1}, {result.side}: {result.per_second:,.0f} "
                    f"tasks/s; CPU µs/task: hop {number(result.micros('service'))}, worker "
                    f"{number(result.micros('workers'))}, Postgres "
                    f"{number(result.micros('postgres'))}; other {result.other_cores or 0:.2f} core"
                )
        peer = statistics.median(run.per_second for run in rounds["PGQueuer"])
        for side, runs in rounds.items():
            rate = statistics.median(run.per_second for run in runs)
            print(
                f"N={batch}: {side}: median {rate:,.0f} tasks/s, {rate / peer:.2f}{TIMES} "
                f"PGQueuer's median; rounds " + ", ".join(f"{run.per_second:,.0f}" for run in runs)
            )


async def enqueue(address: str, tool_id: str, tasks: int, concurrency: int | None = None) -> float:
    """Enqueues `tasks` no-op tasks with enqueue_many (`concurrency` calls in flight; None: its
    default); returns tasks/s."""
    async with GenqClient(address, timeout=60) as client:
        return await timed_enqueue(GatewayClient(client), tool_id, tasks, concurrency)


async def timed_enqueue(
    gateway: GatewayClient, tool_id: str, tasks: int, concurrency: int | None
) -> float:
    """`enqueue()` on a gateway already connected: tasks/s of its enqueue_many alone."""
    items: list[dict[str, Any]] = [{} for _ in range(tasks)]
    options = {} if concurrency is None else {"concurrency": concurrency}
    begun = time.perf_counter()
    queued = await gateway.enqueue_many(tool_id, items, **options)
    seconds = time.perf_counter() - begun
    assert len(queued.tasks) == tasks, (len(queued.tasks), queued.skipped)
    return tasks / seconds


async def upsert_tool(address: str) -> str:
    async with GenqClient(address) as client:
        return str((await GatewayClient(client).upsert_tool(TOOL)).id)


GENQ_DONE = (
    "SELECT count(*), extract(epoch FROM max(completed_at))::float "
    "FROM generation.tasks WHERE status = 'completed'"
)

WARM_UP_TASKS = 4_000
"""Tasks enqueued (and then emptied with the queue) before genq's first measured run: each
pooled connection prepares the statement and loads the table's catalog entries on its first
QueueTasks, as in a service that has been running."""


@dataclass
class Genq:
    url: str
    service: Service
    tool_id: str
    oid: int
    empty: str
    """TRUNCATE of the queue's tables."""


def genq_run(
    args: argparse.Namespace,
    genq: Genq,
    lanes: int,
    wal: WalMeter | None,
    tools: dict[str, str] | None = None,
    cost_nanos: int = 0,
    target: Callable[..., None] = worker,
) -> Run:
    """One drain by `args.workers` processes of `lanes` lanes a tool. `tools` (name -> id;
    default {TOOL: tool_id}): the tasks are spread evenly over them (enqueued tool after tool)
    and every worker hosts them all. `target`: the worker processes' program (`worker`, or
    `ceiling_worker` with `lanes` its claim batch)."""
    tools = tools or {TOOL: genq.tool_id}
    execute(genq.url, genq.empty, "VACUUM ANALYZE", "CHECKPOINT")
    spawn = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for _ in range(args.workers):
        ours, theirs = spawn.Pipe()
        process = spawn.Process(
            target=target,
            args=(genq.service.address, lanes, theirs, tuple(tools), cost_nanos),
        )
        process.start()
        pipes.append(ours)
        processes.append(process)
    try:
        assert started(pipes, "a worker") == ["ready"] * args.workers
        began = wal.begin() if wal else None
        shares = split(args.tasks, len(tools))
        begun = time.perf_counter()
        for share, each in zip(shares, tools.values(), strict=True):
            asyncio.run(enqueue(genq.service.address, each, share, args.enqueue_concurrency))
        enqueue_rate = args.tasks / (time.perf_counter() - begun)
        enqueued = wal.end(began, genq.oid) if wal and began else Wal()
        execute(genq.url, "ANALYZE")
        with psycopg.connect(genq.url, autocommit=True) as looking:
            pids = [process.pid for process in processes if process.pid is not None]
            meter = CpuMeter(genq.url, genq.service, pids, backend_pid(looking))
            meter.begin()
            began = wal.begin() if wal else None
            go = time.time()
            for pipe in pipes:
                pipe.send("go")
            last = wait_done(looking, GENQ_DONE, args.tasks, args.timeout)
            cpu = meter.end()
            drained = wal.end(began, genq.oid) if wal and began else Wal()
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        calls: Counter[str] = Counter()
        seconds: dict[str, list[float]] = {}
        for counted, took in started(pipes, "a worker's drain"):
            calls.update(counted)
            for method, spent in took.items():
                seconds.setdefault(method, []).extend(spent)
    finally:
        stop(processes)
    side = "genq" if target is worker else "genq, ceiling"
    return Run(
        side, lanes, args.tasks, enqueue_rate, last - go, enqueued, drained, cpu, calls, seconds
    )


@contextmanager
def genq_service(args: argparse.Namespace) -> Iterator[Genq]:
    """A migrated genq database (the cap no run reaches), `genq serve` on it (with
    --service-env), the tool "noop", warmed; stopped and dropped after."""
    env = dict(item.split("=", 1) for item in args.service_env)
    with database("genq_bench") as url:
        migrations.upgrade(url)
        execute(url, f"UPDATE generation.settings SET daily_cap_nanos = {CAP}")
        assert_durable(url, "genq", "generation")
        with psycopg.connect(url, autocommit=True) as connection:
            tables = [
                name
                for name in GENQ_TABLES
                if connection.execute("SELECT to_regclass(%s)", [f"generation.{name}"]).fetchone()
                != (None,)
            ]
        empty = "TRUNCATE " + ", ".join(f"generation.{name}" for name in tables)
        service = Service(url, env, HOP if args.hop else None)
        service.wait_serving()
        try:
            processes = env.get("GENQ_PROCESSES", str(os.cpu_count() or 1))
            default = "" if "GENQ_PROCESSES" in env else " (its default)"
            serve = "bench/hop.py (--hop)" if args.hop else "genq serve"
            print(
                f"genq: {serve}, GENQ_PROCESSES={processes}{default}; {args.workers} worker "
                f"process(es); enqueue_many {ENQUEUE_CALL:,} a call, "
                f"{args.enqueue_concurrency or ENQUEUE_CONCURRENCY} in flight"
            )
            tool_id = asyncio.run(upsert_tool(service.address))
            asyncio.run(enqueue(service.address, tool_id, WARM_UP_TASKS))
            yield Genq(url, service, tool_id, database_oid(url), empty)
        finally:
            service.stop()


# --- the comparison -----------------------------------------------------------------------------


def number(value: float | None) -> str:
    return DASH if value is None else f"{value:,.0f}"


def verdict(ratio: float, bar: float, at_least: bool) -> str:
    met = ratio >= bar if at_least else ratio <= bar
    sign = "≥" if at_least else "≤"
    return f"**{ratio:.2f}{TIMES}** ({sign} {bar:g}{TIMES}: {'met' if met else 'not met'})"


def table(pairs: list[tuple[Run, Run]]) -> None:
    print()
    print(
        "| N | side | enqueue tasks/s | drain tasks/s | WAL B/task | CPU µs/task: service "
        "| workers | Postgres |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for peer, ours in pairs:
        for run in (peer, ours):
            print(
                f"| {run.batch} | {run.side} | {number(run.enqueue_per_second)} "
                f"| {number(run.per_second)} | {number(run.wal.bytes / run.tasks)} "
                f"| {number(run.micros('service')) if run.side == 'genq' else DASH} "
                f"| {number(run.micros('workers'))} | {number(run.micros('postgres'))} |"
            )
        print(
            f"| {ours.batch} | genq / PGQueuer "
            f"| {ours.enqueue_per_second / peer.enqueue_per_second:.2f}{TIMES} "
            f"| {verdict(ours.per_second / peer.per_second, DRAIN_BAR, True)} "
            f"| {verdict(ours.wal.bytes / peer.wal.bytes, WAL_BAR, False)} | | | |"
        )
    print()


def notes(runs: list[Run], inspected: bool) -> None:
    how = (
        "pg_walinspect, each side's database only"
        if inspected
        else "pg_current_wal_lsn() differences: the whole cluster's WAL (no pg_walinspect)"
    )
    print(f"WAL B/task above: {how}; enqueue + drain windows, ANALYZE between them left out.")
    for run in runs:
        wal = run.wal
        line = (
            f"  N={run.batch} {run.side}: enqueue {run.enqueue_wal.bytes / run.tasks:,.0f} + "
            f"drain {run.drain_wal.bytes / run.tasks:,.0f} B/task; by LSN (the cluster's) "
            f"{wal.lsn_bytes / run.tasks:,.0f}"
        )
        if wal.others_bytes is not None:
            line += f"; others' records in the windows {wal.others_bytes:,} B"
        print(line)
        if wal.others_bytes and wal.own_bytes and wal.others_bytes > 0.01 * wal.own_bytes:
            print(
                "    warning: others wrote WAL on the shared cluster meanwhile: the LSN figure "
                "counts it, the per-database one does not"
            )
        if wal.checkpoints:
            print(
                "    warning: a checkpoint began inside a window: full-page writes inflate this "
                "side's WAL; run again"
            )
        other = run.other_cores
        if other is not None and other > DISTURBED:
            print(f"    warning: others used {other:.2f} core during the drain (disturbed)")


def cycle_bound(run: Run, workers: int) -> float | None:
    """genq's drain at most, estimated from its own calls: a lane (one tool, N slots) claims for
    its free slots, then confirms the claim, before any handler runs, and claims again only once
    they free; the reports overlap the next claim. So a worker has one claim in flight and a
    cycle lasts about the median claim plus the median ConfirmClaim, for the tasks a claim took
    on average."""
    method = "ClaimTasks" if run.seconds.get("ClaimTasks") else "ClaimNextTask"
    claim, confirm = run.seconds.get(method), run.seconds.get("ConfirmClaim")
    if not claim or not confirm or not run.calls[method]:
        return None
    per_claim = run.tasks / run.calls[method]
    return workers * per_claim / (statistics.median(claim) + statistics.median(confirm))


def cpu_per_task(run: Run) -> float:
    """µs a task of the service, the workers and Postgres together (those measured)."""
    return sum(run.micros(name) or 0.0 for name in ("service", "workers", "postgres"))


def peer_cores(run: Run) -> float:
    """Cores PGQueuer's workers and Postgres used during its drain."""
    return cpu_per_task(run) * run.per_second / 1e6


def genq_detail(run: Run) -> None:
    thousands = run.tasks / 1000
    calls = ", ".join(
        f"{method} {count / thousands:.1f} ({1000 * statistics.median(run.seconds[method]):.1f} ms)"
        for method, count in sorted(run.calls.items())
    )
    cores = {name: used / run.drain_seconds for name, used in run.cpu.items()}
    print(
        f"  {run.side} N={run.batch}: drain {run.tasks:,} in {run.drain_seconds:.2f} s; RPCs "
        f"per 1,000 tasks (median ms a call, as the worker saw it): {calls}"
    )
    if cores:
        other = run.other_cores or 0.0
        print(
            "    cores: "
            + ", ".join(f"{name} {cores[name]:.2f}" for name in ("service", "workers", "postgres"))
            + f", other {other:.2f}, of {os.cpu_count()}"
        )


CHECKPOINT_RETRIES = 2
"""Runs of a side again when a checkpoint (the server's timed one, or anyone's) began inside its
WAL windows: its full-page writes would not compare. The last run is kept, with a warning."""


def unhit(run: Callable[[], Run]) -> Run:
    """`run()`, again while a checkpoint fell inside its WAL windows (CHECKPOINT_RETRIES)."""
    for _ in range(CHECKPOINT_RETRIES):
        result = run()
        if not result.wal.checkpoints:
            return result
        print(f"  {result.side} N={result.batch}: a checkpoint began inside a window; again")
    return run()


def compare(args: argparse.Namespace, wal: WalMeter) -> None:
    peers = []
    for batch in args.batches:
        run = unhit(partial(pgqueuer, args, batch, wal))
        peers.append(run)
        print(
            f"  PGQueuer batch {batch}: enqueue {run.enqueue_per_second:,.0f}/s, drain "
            f"{run.tasks:,} in {run.drain_seconds:.2f} s = {run.per_second:,.0f}/s"
        )
    capped = []
    for batch in args.batches:
        # Like genq's N lanes: PGQueuer's batch N runs the next batch before the last one ends,
        # so it may run 2N and more at once; this line holds it to N (not a bar, a reference).
        run = unhit(partial(pgqueuer, args, batch, None, batch))
        capped.append(run)
        print(
            f"  PGQueuer batch {batch}, at most {batch} at once: drain {run.tasks:,} in "
            f"{run.drain_seconds:.2f} s = {run.per_second:,.0f}/s"
        )
    ours = []
    with genq_service(args) as genq:
        for batch in args.batches:
            run = unhit(partial(genq_run, args, genq, batch, wal))
            ours.append(run)
            genq_detail(run)
        ceilings = []
        for batch in args.batches if args.ceiling else ():
            run = genq_run(args, genq, batch, None, target=ceiling_worker)
            ceilings.append(run)
            genq_detail(run)
        rounds = enqueue_rounds(args, genq)
    if args.hop:
        print("the genq lines below are the hop's (bench/hop.py), not the service's:")
    table(list(zip(peers, ours, strict=True)))
    for limited, run in zip(capped, ours, strict=True):
        print(
            f"N={run.batch}: genq / PGQueuer held to {run.batch} at once (a reference, not a "
            f"bar): drain {run.per_second / limited.per_second:.2f}{TIMES}; PGQueuer's CPU "
            f"µs/task so held: workers {number(limited.micros('workers'))}, Postgres "
            f"{number(limited.micros('postgres'))}"
        )
    for peer, run in zip(peers, ours, strict=True):
        if (bound := cycle_bound(run, args.workers)) is not None:
            print(
                f"N={run.batch}: genq's cycle (claim, then its ConfirmClaim, before a handler "
                f"runs) bounds it at about {args.workers} worker(s) x tasks a claim / (median "
                f"claim + median confirm) = {bound:,.0f} tasks/s: "
                f"{bound / peer.per_second:.2f}{TIMES} PGQueuer; genq drained "
                f"{run.per_second / bound:.0%} of it"
            )
    for peer, run in zip(peers, ours, strict=True):
        print(
            f"N={run.batch}: at PGQueuer's {peer.per_second:,.0f} tasks/s, genq's CPU a task "
            f"(service + workers + Postgres, {number(cpu_per_task(run))} µs) would take "
            f"{cpu_per_task(run) * peer.per_second / 1e6:.2f} of the machine's "
            f"{os.cpu_count()} cores (PGQueuer's own took {peer_cores(peer):.2f})"
        )
    for peer, run in zip(peers, ceilings, strict=args.ceiling):
        print(
            f"N={run.batch}: the ceiling line (one claim of N at a time, like PGQueuer's "
            f"dequeue; no ConfirmClaim, no bound on tasks in flight): {run.per_second:,.0f} "
            f"tasks/s, {run.per_second / peer.per_second:.2f}{TIMES} PGQueuer; CPU µs/task: "
            f"service {number(run.micros('service'))}, worker {number(run.micros('workers'))}, "
            f"Postgres {number(run.micros('postgres'))}"
        )
    print_enqueue_rounds(rounds)
    notes([run for pair in zip(peers, ours, strict=True) for run in pair], wal.inspect)


# --- enqueue, side by side ----------------------------------------------------------------------


WARM_ENQUEUES = 2
"""Small enqueues (10 items) each side's enqueue process makes before "ready": its connections
open, its statements prepare and the backends' caches warm (genq's client has two channels,
one enqueue call on each) before the timed enqueue; the queue is emptied after them."""


def enqueue_process(
    side: str, target: str, tool: str, tasks: int, flight: int | None, pipe: Connection
) -> None:
    """One side's enqueue of `tasks` in a process of its own, timed from "go" (its imports,
    connections and WARM_ENQUEUES before "ready"); sends tasks/s. PGQueuer (`target` its
    database's URL): `Queries.enqueue` of 1,000 a call, one call at a time, as its side of the
    drain enqueues. genq (`target` the service's address, `tool` the tool's id):
    `timed_enqueue` with `flight` calls in flight (None: the SDK's default), as `enqueue()`."""

    async def pgqueuer_side() -> float:
        import asyncpg
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.queries import Queries

        connection = await asyncpg.connect(target)
        queries = Queries(AsyncpgDriver(connection))
        for _ in range(WARM_ENQUEUES):
            await queries.enqueue([TOOL] * 10, [None] * 10, [0] * 10)
        pipe.send("ready")
        await asyncio.to_thread(pipe.recv)  # "go"
        rate = await pgq_enqueue(queries, tasks)
        await connection.close()
        return rate

    async def genq_side() -> float:
        async with GenqClient(target, timeout=60) as client:
            gateway = GatewayClient(client)
            for _ in range(WARM_ENQUEUES):
                await gateway.enqueue_many(tool, [{}] * 10)
            pipe.send("ready")
            await asyncio.to_thread(pipe.recv)  # "go"
            return await timed_enqueue(gateway, tool, tasks, flight)

    pipe.send(asyncio.run(pgqueuer_side() if side == "PGQueuer" else genq_side()))


def enqueue_rounds(args: argparse.Namespace, genq: Genq) -> list[tuple[float, float]]:
    """`args.enqueue_rounds` enqueues of `args.tasks` on each side, alternating (PGQueuer first
    in the odd rounds, genq in the even ones), each from a process of its own into an emptied
    queue (PGQueuer's jobs and log, genq's tables) right after a CHECKPOINT, so both sides meet
    the machine as it is at the moment. (PGQueuer, genq) tasks/s per round."""
    rates: list[tuple[float, float]] = []
    if args.enqueue_rounds <= 0:
        return rates
    spawn = multiprocessing.get_context("spawn")
    with database("pgq_bench") as url:
        env = {**os.environ, "PGDSN": url, "PGQ_DSN": url}
        install = [str(Path(sys.executable).parent / "pgq"), "install", "--durability", "durable"]
        subprocess.run(install, env=env, check=True, capture_output=True)
        assert_durable(url, "pgqueuer", "public")
        sides = (
            ("PGQueuer", url, "", url, "TRUNCATE pgqueuer, pgqueuer_log"),
            ("genq", genq.service.address, genq.tool_id, genq.url, genq.empty),
        )
        for each_round in range(args.enqueue_rounds):
            rate: dict[str, float] = {}
            # Each round's first side alternates, so neither always meets what the other left.
            for side, target, tool, database_url, empty in sides[:: -1 if each_round % 2 else 1]:
                ours, theirs = spawn.Pipe()
                process = spawn.Process(
                    target=enqueue_process,
                    args=(side, target, tool, args.tasks, args.enqueue_concurrency, theirs),
                )
                process.start()
                theirs.close()  # the child's end: a child that dies closes the pipe
                try:
                    assert started([ours], f"{side}'s enqueue process") == ["ready"]
                    execute(database_url, empty, "VACUUM ANALYZE", "CHECKPOINT")
                    ours.send("go")
                    (rate[side],) = started([ours], f"{side}'s enqueue")
                finally:
                    stop([process])
                    ours.close()
            rates.append((rate["PGQueuer"], rate["genq"]))
    return rates


def print_enqueue_rounds(rates: list[tuple[float, float]]) -> None:
    """The enqueue bar's line: the median of each side's rounds, and their ratio."""
    if not rates:
        return
    peer = statistics.median(rate for rate, _ in rates)
    ours = statistics.median(rate for _, rate in rates)
    print(
        f"enqueue, {len(rates)} rounds of {ENQUEUE_CALL:,} a call, alternating (the bar's line; "
        f"the table's enqueue is one round each): PGQueuer {peer:,.0f}/s, genq {ours:,.0f}/s "
        f"(medians): {verdict(ours / peer, ENQUEUE_BAR, True)}; rounds (PGQueuer / genq, "
        "tasks/s): " + ", ".join(f"{of:,.0f} / {rate:,.0f}" for of, rate in rates)
    )


# --- paid ---------------------------------------------------------------------------------------

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
            "JOIN generation.tasks t ON t.id = a.task_id"
        ).fetchone()
    assert found is not None
    return f"{found[0]:,} attempts, {found[1]:,} with an estimate, {found[2]:,} cost nanos recorded"


def genq_paid(args: argparse.Namespace) -> None:
    """Unpaid on 1 tool, unpaid on 8, paid on 8: same tasks, same service, one run, per N."""
    with genq_service(args) as genq:
        for batch in args.batches:
            figures = {}
            for label, tools, estimate, cost in (
                ("unpaid, 1 tool", None, 0, 0),
                (f"unpaid, {PAID_TOOLS} tools", True, 0, 0),
                (f"paid, {PAID_TOOLS} tools", True, args.estimate_nanos, args.cost_nanos),
            ):
                named = asyncio.run(paid_tools(genq.service.address, estimate)) if tools else None
                run = genq_run(args, genq, batch, None, named, cost)
                print(
                    f"-- N={batch}, {label} (estimate {estimate}, cost {cost} nanos a task): "
                    f"{run.per_second:,.0f} tasks/s; {recorded_cost(genq.url)}"
                )
                genq_detail(run)
                figures[label] = run.per_second
            paid = figures[f"paid, {PAID_TOOLS} tools"]
            for base in ("unpaid, 1 tool", f"unpaid, {PAID_TOOLS} tools"):
                ratio = paid / figures[base]
                shown = (
                    verdict(ratio, PAID_BAR, True)
                    if base == "unpaid, 1 tool"
                    else f"{ratio:.2f}{TIMES}"
                )
                print(f"N={batch}: paid {PAID_TOOLS} tools / {base}: {shown}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batches",
        type=lambda v: [int(n) for n in v.split(",")],
        default=[10, 100],
        help="N: genq's lanes and PGQueuer's dequeue batch (10,100)",
    )
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=1, help="genq worker processes (1)")
    parser.add_argument(
        "--enqueue-concurrency",
        type=int,
        default=None,
        help=f"genq QueueTasks calls in flight (the SDK's default, {ENQUEUE_CONCURRENCY})",
    )
    parser.add_argument(
        "--enqueue-rounds",
        type=int,
        default=5,
        help="alternating enqueues of --tasks on each side after the drains, for the enqueue "
        "bar (5; 0: none)",
    )
    parser.add_argument("--timeout", type=float, default=300, help="longest drain, seconds")
    parser.add_argument("--service-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument(
        "--hop",
        action="store_true",
        help="serve genq's side with bench/hop.py instead of genq serve: the service without "
        "its middleware, around the same statements (see its docstring)",
    )
    parser.add_argument(
        "--no-ceiling",
        dest="ceiling",
        action="store_false",
        help="skip the ceiling drains (a bench loop with PGQueuer's protocol; see the docstring)",
    )
    parser.add_argument(
        "--paid", action="store_true", help="only the paid vs unpaid drains (see the docstring)"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="only PGQueuer's drain against its own statements behind bench/pgq_hop.py",
    )
    parser.add_argument(
        "--floor-rounds", type=int, default=3, help="--floor: rounds of each drain (3)"
    )
    parser.add_argument("--estimate-nanos", type=int, default=1000, help="--paid: tool estimate")
    parser.add_argument("--cost-nanos", type=int, default=1000, help="--paid: cost of each task")
    args = parser.parse_args()

    print(
        f"{args.tasks:,} no-op tasks, N = {', '.join(map(str, args.batches))}; machine: "
        f"{os.cpu_count()} CPUs; postgres: {server_settings(ADMIN_URL)}"
    )
    if args.paid:
        genq_paid(args)
        return
    if args.floor:
        floor(args)
        return
    with database("genq_bench_wal") as url:
        wal = WalMeter(url)
        try:
            compare(args, wal)
        finally:
            wal.close()


if __name__ == "__main__":
    main()
