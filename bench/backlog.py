"""Flat claim: claim latency over gRPC with 1,000,000 queued and 20,000 in flight against 1,000
queued (GUIDE.md section 4, bar "flat claim"; issue 9).

    .venv/bin/python bench/backlog.py [--clients 2] [--seconds 10]
        [--big 1000000] [--in-flight 20000]

In one run, on a database of its own (bench/claim_complete.py's: migrated, 4 tools, a global daily
cap no run reaches, synchronous_commit = on; dropped at the end), with the real service (`python -m
service serve`, its defaults; `--service-env NAME=VALUE` to change them), two cases, same tool
layout (tasks round-robin over the same 4 tools, FIFO 1 ms apart):

1. small: `--small` (1,000) queued tasks, nothing in flight;
2. big: `--big` (1,000,000) queued tasks plus `--in-flight` (20,000) tasks in processing with long
   leases (a day: nothing lapses, the rescuer sweeps them but hands nothing back). They are tasks
   rows only (no attempts rows): the claim and the complete of the measured pairs never read them.

Each case is loaded with bench/claim_complete.py's `load_queue` (one INSERT ... SELECT
generate_series, then VACUUM ANALYZE and CHECKPOINT); the in-flight rows with one more INSERT ...
SELECT, then VACUUM ANALYZE and CHECKPOINT again. Then `--clients` loops (bench/claim_complete.py's
grpc phase: K loops in `--client-procs` processes) each do ClaimNextTask(tool) then CompleteTask
(cost 0), one task per call. A refiller keeps the queue at its depth: every 0.1 s it counts the
finished tasks and inserts as many queued ones at the tail (same statements in both cases).

Measured: the ClaimNextTask latency (the claim half of each pair, as the client sees it) p50 and
p99, and those of the whole pair, over `--seconds` after `--warmup`; with the CPU of each party.
Few clients (2 by default) so that latency is the claim's own, not queueing in a saturated
service. The bar: claim p50 big <= 1.3 x claim p50 small.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the project's packages, not an installed copy

from bench.claim_complete import (  # noqa: E402
    TOOL_IDS,
    Result,
    Service,
    bench_database,
    describe,
    load_queue,
    report,
    run_clients,
)
from bench.drain import execute  # noqa: E402

BAR = 1.3
"""Claim p50 with the big backlog <= 1.3 x with the small one."""
FINISHED = "('completed', 'failed', 'cancelled', 'expired')"


def add_in_flight(url: str, count: int) -> None:
    """`count` tasks in processing, round-robin over the tools, leases a day long."""
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(
            "INSERT INTO generation.tasks (tool_id, input, status, lease_token, "
            "claim_expires_at, started_at, attempt_count, lease_confirmed) "
            "SELECT (%(tools)s::uuid[])[1 + i %% cardinality(%(tools)s::uuid[])], "
            "       jsonb_build_object('prompt', 'a cat', 'n', i), 'processing', "
            "       gen_random_uuid(), now() + interval '1 day', now(), 1, true "
            "FROM generate_series(1, %(n)s) AS i",
            {"tools": TOOL_IDS, "n": count},
        )
    execute(url, "VACUUM ANALYZE", "CHECKPOINT")


class Refiller(threading.Thread):
    """Every 0.1 s, as many queued tasks inserted (round-robin over the tools, at the tail of
    the FIFO) as were finished since the last look: the queue stays at its depth."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stopping = threading.Event()
        self.inserted = 0

    def run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as connection:
            seen = self.finished(connection)
            while not self.stopping.wait(0.1):
                now = self.finished(connection)
                if now > seen:
                    connection.execute(
                        "INSERT INTO generation.tasks (tool_id, input) "
                        "SELECT (%(tools)s::uuid[])[1 + i %% cardinality(%(tools)s::uuid[])], "
                        "       jsonb_build_object('prompt', 'a cat', 'n', i) "
                        "FROM generate_series(%(from)s::int, %(to)s::int) AS i",
                        {"tools": TOOL_IDS, "from": seen + 1, "to": now},
                    )
                    self.inserted += now - seen
                    seen = now

    @staticmethod
    def finished(connection: psycopg.Connection[tuple[int]]) -> int:
        found = connection.execute(
            f"SELECT count(*) FROM generation.tasks WHERE status IN {FINISHED}"
        ).fetchone()
        return int(found[0]) if found else 0

    def stop(self) -> int:
        self.stopping.set()
        self.join(10)
        return self.inserted


def depth(url: str) -> str:
    with psycopg.connect(url, autocommit=True) as connection:
        found = connection.execute(
            "SELECT count(*) FILTER (WHERE status = 'queued'), "
            "count(*) FILTER (WHERE status = 'processing') FROM generation.tasks"
        ).fetchone()
    assert found is not None
    return f"{found[0]:,} queued, {found[1]:,} processing"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=2, help="concurrent pair loops (2)")
    parser.add_argument("--client-procs", type=int, default=1, help="client processes (1)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds (10)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before measuring (2)")
    parser.add_argument("--small", type=int, default=1_000, help="queued, small case (1000)")
    parser.add_argument("--big", type=int, default=1_000_000, help="queued, big case (1000000)")
    parser.add_argument("--in-flight", type=int, default=20_000, help="big case (20000)")
    parser.add_argument("--service-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    args.cost_nanos = 0  # run_clients' completions report no cost
    service_env = dict(item.split("=", 1) for item in args.service_env)

    results: dict[str, Result] = {}
    with bench_database() as url:
        print(
            f"{describe(url)}, {os.cpu_count()} CPUs; "
            f"{args.clients} clients in {args.client_procs} process(es); "
            f"ClaimNextTask + CompleteTask pairs, {args.warmup:g} s warm-up + {args.seconds:g} s "
            f"measured per case"
        )
        service = Service(url, service_env)
        try:
            service.wait_serving()
            processes = service_env.get("GENQ_PROCESSES", str(os.cpu_count() or 1))
            print(f"genq serve, GENQ_PROCESSES={processes}")
            for case, queued, in_flight in (
                ("small", args.small, 0),
                ("big", args.big, args.in_flight),
            ):
                started = time.perf_counter()
                load_queue(url, queued)
                if in_flight:
                    add_in_flight(url, in_flight)
                print(f"{case}: {depth(url)} (loaded in {time.perf_counter() - started:.1f} s)")
                refiller = Refiller(url)
                refiller.start()
                try:
                    result = run_clients(
                        "grpc", args, service.address, service.settings(), service.process.pid, url
                    )
                finally:
                    refilled = refiller.stop()
                result.name = f"grpc {case}"
                report(result, args.clients)
                print(
                    f"{'':<15} claim p50 {result.claim_p50_ms:.2f} ms  "
                    f"p99 {result.claim_p99_ms:.2f} ms; refilled {refilled:,}; after: {depth(url)}"
                )
                results[case] = result
        finally:
            service.stop()

    small, big = results["small"], results["big"]
    assert small.claim_p50_ms and big.claim_p50_ms
    ratio = big.claim_p50_ms / small.claim_p50_ms
    verdict = "meets" if ratio <= BAR else "MISSES"
    print(f"ratio claim p50 big / small: {ratio:.2f} (bar <= {BAR} x: {verdict})")
    if small.claim_p99_ms and big.claim_p99_ms:
        print(f"ratio claim p99 big / small: {big.claim_p99_ms / small.claim_p99_ms:.2f}")
    print(f"ratio pair p50 big / small: {big.p50_ms / small.p50_ms:.2f}")
    return 1 if any(r.errors or r.empty_claims for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
