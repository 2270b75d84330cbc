"""Sustained load: the single-task path at 70 % of its peak for minutes (GUIDE.md section 4,
bars "sustained" and "memory"; issue 9).

    .venv/bin/python bench/sustained.py [--minutes 10] [--clients 8] [--share 0.7] [--shared]

By default it starts a Postgres of its own (the embedded server `genq serve` uses, in a temporary
directory, its defaults: autovacuum on), because the dead-tuple bar is a bar on autovacuum keeping
up, and a shared server may run without it; `--shared` uses $GENQ_BENCH_ADMIN_URL's server
instead (127.0.0.1:5432 by default).

In one run, on a database of its own (bench/claim_complete.py's: migrated, 4 tools, a global daily
cap no run reaches, synchronous_commit = on; dropped at the end), with the real service (`python -m
service serve`, its defaults: GENQ_PROCESSES included; `--service-env NAME=VALUE` to change them):

1. peak: bench/claim_complete.py's grpc phase (`--clients` loops of ClaimNextTask + CompleteTask,
   cost `--cost-nanos`, over 2 client processes) for `--peak-seconds` on a fresh backlog: the
   peak tasks/s.
2. sustained: the queue reloaded with enough tasks for the whole run (`load_queue`: one INSERT ...
   SELECT, VACUUM ANALYZE, CHECKPOINT), then the same loops paced to `--share` (0.7) x peak pairs
   a second in all (each loop starts its pairs on a fixed schedule; one that falls behind catches
   up by at most a second, so an overloaded service shows as lost throughput, not a burst), for
   `--minutes`.

Every minute it prints: tasks completed in that minute (counted in the database), n_dead_tup of
generation.tasks, generation.attempts and generation.task_events (pg_stat_user_tables; autovacuum
is whatever the server runs, printed at the start), the RSS of each service process (the parent
and its children) and the CPU cores each party used (service, clients, postgres, other).

Bars: every minute's throughput within 10 % of the first minute's; dead tuples bounded, meaning
here that in the second half of the run no table's n_dead_tup exceeds the highest it reached in
the first half by more than 10 % (a plateau: vacuum keeps up, it does not grow with the run); and
each service process's RSS <= 200 MB all along.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the project's packages, not an installed copy

from bench import claim_complete  # noqa: E402
from bench.claim_complete import (  # noqa: E402
    TOOL_IDS,
    CpuMeter,
    Rpcs,
    Service,
    bench_database,
    complete_request,
    describe,
    load_queue,
    reap,
    report,
    run_clients,
    spawn,
    split,
)
from generation.task.v1 import task_pb2  # noqa: E402
from service import embedded  # noqa: E402

try:
    import psutil  # type: ignore[import-untyped,unused-ignore]
except ImportError:  # pragma: no cover - psutil comes with the service extra
    psutil = None

THROUGHPUT_BAR = 0.10
"""Every minute within 10 % of the first."""
DEAD_BAR = 1.10
"""Second half's n_dead_tup at most 1.1 x the first half's highest, per table."""
RSS_BAR_MB = 200.0
TABLES = ("tasks", "attempts", "task_events")


@dataclass(frozen=True)
class Pace:
    loops: int
    target: str
    per_second: float
    """This process's share of the pairs a second."""
    begin: float
    end: float
    cost_nanos: int


async def paced(pace: Pace) -> Counter[str]:
    """`pace.loops` loops over one channel, pair n of loop i due at begin + (n * loops + i) /
    per_second; returns errors and empty claims counted."""
    counts: Counter[str] = Counter()
    interval = pace.loops / pace.per_second
    claims = [task_pb2.ClaimNextTaskRequest(tool_id=str(tool_id)) for tool_id in TOOL_IDS]
    template = complete_request(pace.cost_nanos)
    async with grpc.aio.insecure_channel(pace.target) as channel:
        rpcs = Rpcs(channel)

        async def loop(index: int) -> None:
            due = pace.begin + index * interval / pace.loops
            n = index
            while due < pace.end:
                now = time.monotonic()
                if due > now:
                    await asyncio.sleep(due - now)
                due = max(due + interval, time.monotonic() - 1.0)  # catch up by 1 s at most
                n += 1
                try:
                    claim = await rpcs.claim(claims[n % len(claims)])
                    if not claim.lease_token:
                        counts["empty claims"] += 1
                        continue
                    request = task_pb2.CompleteTaskRequest()
                    request.CopyFrom(template)
                    request.task_id, request.lease_token = claim.task.id, claim.lease_token
                    await rpcs.complete(request)
                except grpc.aio.AioRpcError as error:
                    counts[f"{error.code().name}: {error.details()}"] += 1

        await asyncio.gather(*(loop(i) for i in range(pace.loops)))
    return counts


def pace_worker(pace: Pace, pipe: Connection) -> None:
    try:
        pipe.send(asyncio.run(paced(pace)))
    except BaseException as error:
        pipe.send(error)
        raise
    finally:
        pipe.close()


def dead_tuples(connection: psycopg.Connection[tuple[str, int]]) -> dict[str, int]:
    rows = connection.execute(
        "SELECT relname, n_dead_tup FROM pg_stat_user_tables "
        "WHERE schemaname = 'generation' AND relname = ANY(%s)",
        [list(TABLES)],
    ).fetchall()
    return {str(name): int(dead) for name, dead in rows}


def completed(connection: psycopg.Connection[tuple[int]]) -> int:
    found = connection.execute(
        "SELECT count(*) FROM generation.tasks WHERE status = 'completed'"
    ).fetchone()
    return int(found[0]) if found else 0


def service_rss(service: Service) -> dict[int, float]:
    """MB of resident memory of each service process (the parent, then its children)."""
    if psutil is None:
        return {}
    root = psutil.Process(service.process.pid)
    rss = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            rss[process.pid] = process.memory_info().rss / 2**20
        except psutil.Error:
            continue
    return rss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=int, default=10, help="sustained minutes (10)")
    parser.add_argument("--share", type=float, default=0.7, help="of the peak (0.7)")
    parser.add_argument("--clients", type=int, default=8, help="pair loops (8)")
    parser.add_argument("--client-procs", type=int, default=2, help="client processes (2)")
    parser.add_argument("--peak-seconds", type=float, default=10.0, help="peak measured (10)")
    parser.add_argument("--warmup", type=float, default=2.0, help="before the peak window (2)")
    parser.add_argument("--peak-tasks", type=int, default=60_000, help="backlog for the peak")
    parser.add_argument("--cost-nanos", type=int, default=1000, help="cost of each completion")
    parser.add_argument("--service-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument(
        "--interval", type=float, default=60.0, help="seconds a 'minute' lasts (60; smoke runs)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--shared", action="store_true", help="$GENQ_BENCH_ADMIN_URL's server, not a private one"
    )
    args = parser.parse_args(argv)
    if args.shared:
        return run(args)
    with tempfile.TemporaryDirectory(prefix="genq_bench_sustained_") as directory:
        # bench_database creates its database on claim_complete.ADMIN_URL's server.
        private = embedded.start(Path(directory))
        claim_complete.ADMIN_URL = urlsplit(private)._replace(path="/postgres").geturl()
        return run(args)


def run(args: argparse.Namespace) -> int:
    service_env = dict(item.split("=", 1) for item in args.service_env)
    procs = min(args.client_procs, args.clients)

    with bench_database() as url:
        print(
            f"{describe(url)}, {os.cpu_count()} CPUs; "
            f"{args.clients} clients in {procs} process(es); "
            f"cost {args.cost_nanos} nanos a completion"
        )
        service = Service(url, service_env)
        try:
            service.wait_serving()
            processes = service_env.get("GENQ_PROCESSES", str(os.cpu_count() or 1))
            print(f"genq serve, GENQ_PROCESSES={processes}")
            load_queue(url, args.peak_tasks)
            peak_args = argparse.Namespace(**{**vars(args), "seconds": args.peak_seconds})
            peak = run_clients(
                "grpc", peak_args, service.address, service.settings(), service.process.pid, url
            )
            peak.name = "grpc peak"
            report(peak, args.clients)
            rate = args.share * peak.tasks_per_second
            tasks = math.ceil(rate * args.interval * args.minutes * 1.2) + 10_000
            print(
                f"sustained: {rate:,.0f} pairs/s ({args.share:g} x peak) for {args.minutes} "
                f"min; {tasks:,} tasks loaded"
            )
            load_queue(url, tasks)
            return sustain(args, service, url, rate, procs)
        finally:
            service.stop()


def sustain(args: argparse.Namespace, service: Service, url: str, rate: float, procs: int) -> int:
    begin = time.monotonic() + 3.0  # the client processes start meanwhile
    end = begin + args.interval * args.minutes
    share = rate / args.clients
    workers = [
        spawn(pace_worker, Pace(loops, service.address, share * loops, begin, end, args.cost_nanos))
        for loops in split(args.clients, procs)
    ]
    minutes: list[int] = []
    dead: list[dict[str, int]] = []
    rss_max: dict[int, float] = {}
    try:
        with psycopg.connect(url, autocommit=True) as connection:
            time.sleep(max(0.0, begin - time.monotonic()))
            before = completed(connection)
            for minute in range(1, args.minutes + 1):
                meter = CpuMeter(service.process.pid, [p.pid for p, _ in workers if p.pid], url)
                meter.begin()
                time.sleep(max(0.0, begin + args.interval * minute - time.monotonic()))
                cores = meter.end()
                now = completed(connection)
                minutes.append(now - before)
                before = now
                dead.append(dead_tuples(connection))
                rss = service_rss(service)
                for pid, mb in rss.items():
                    rss_max[pid] = max(rss_max.get(pid, 0.0), mb)
                deviation = minutes[-1] / minutes[0] - 1 if minutes[0] else float("nan")
                per_second = minutes[-1] / args.interval
                print(
                    f"minute {minute:>2}: {minutes[-1]:>7,} tasks ({per_second:,.0f}/s, "
                    f"{deviation:+.1%} vs minute 1); n_dead_tup "
                    + ", ".join(f"{t} {dead[-1].get(t, 0):,}" for t in TABLES)
                    + "; RSS MB "
                    + ", ".join(f"{pid} {mb:.0f}" for pid, mb in rss.items())
                    + "; CPU cores "
                    + ", ".join(
                        f"{name} {cores[name]:.2f}"
                        for name in ("service", "clients", "postgres", "other")
                        if name in cores
                    ),
                    flush=True,
                )
        errors: Counter[str] = Counter()
        for _, pipe in workers:
            if not pipe.poll(120):
                raise SystemExit("a client process did not report")
            counted = pipe.recv()
            if isinstance(counted, BaseException):
                raise SystemExit(f"a client process failed: {counted!r}")
            errors.update(counted)
    finally:
        reap(workers)

    for error, count in errors.most_common(5):
        print(f"ERROR x{count}: {error}")
    worst = max(abs(m / minutes[0] - 1) for m in minutes) if minutes[0] else float("nan")
    verdict = "meets" if worst <= THROUGHPUT_BAR else "MISSES"
    print(
        f"throughput: max deviation from minute 1 {worst:.1%} "
        f"(bar within {THROUGHPUT_BAR:.0%}: {verdict}); target {rate * args.interval:,.0f} a minute"
    )
    half = max(1, len(dead) // 2)
    for table in TABLES:
        first = max(d.get(table, 0) for d in dead[:half])
        second = max((d.get(table, 0) for d in dead[half:]), default=first)
        bounded = second <= DEAD_BAR * first
        print(
            f"n_dead_tup {table}: first half max {first:,}, second half max {second:,} "
            f"(bar: second <= {DEAD_BAR:g} x first: {'meets' if bounded else 'MISSES'})"
        )
    if rss_max:
        top = max(rss_max.values())
        verdict = "meets" if top <= RSS_BAR_MB else "MISSES"
        print(
            "service RSS max per process MB: "
            + ", ".join(f"{pid} {mb:.0f}" for pid, mb in rss_max.items())
            + f" (bar <= {RSS_BAR_MB:.0f} MB: {verdict})"
        )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
