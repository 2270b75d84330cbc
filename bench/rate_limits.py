"""What a rate limit costs the claim: the service's ClaimTasks statement for a key without a
rate limit against the same statement for a key with one whose window already holds K
admissions (docs/OPERATIONS.md, "Rate limits": "Its cost").

    .venv/bin/python bench/rate_limits.py [--claims 2000] [--limit 10] [--windows 0,1000,10000]

On a database of its own (bench/claim_complete.py's: migrated, synchronous_commit on, 4 tools),
with 20,000 queued tasks on each tool. Each line runs `--claims` claims of `--limit` tasks, one
after another on one connection, each in a transaction rolled back afterwards, so that the queue,
the ledger and the window stay as they were (no commit: this measures the statement, not the
WAL flush). The first line claims for a tool whose key has no rate limit (the one-statement
path); each other line for a tool whose key has a rate limit of 10^6 calls a minute, never
reached, with K admissions in its window. It prints the mean and p50 microseconds per claim and
the ratio to the first line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the project's packages, not an installed copy

from bench.claim_complete import TOOL_IDS, bench_database  # noqa: E402
from service.api.rpcs import STATEMENTS  # noqa: E402

QUEUED = 20_000


def claims(url: str, tool_id: object, count: int, limit: int) -> list[float]:
    """Microseconds of each of `count` ClaimTasks statements, each rolled back."""
    params = {
        "tool_id": tool_id,
        "limit": limit,
        "lease_seconds": 120,
        "disabled_override": False,
        "cap_override": None,
        "mirror": False,
    }
    spent = []
    with psycopg.connect(url) as connection:
        for _ in range(count):
            started = time.perf_counter()
            rows = connection.execute(STATEMENTS["ClaimTasks"], params).fetchall()
            spent.append((time.perf_counter() - started) * 1e6)
            assert rows and rows[0][0] is not None, "the claim claimed nothing"
            connection.rollback()
    return spent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=2000, help="claims per line (2000)")
    parser.add_argument("--limit", type=int, default=10, help="tasks per claim (10)")
    parser.add_argument(
        "--windows", default="0,1000,10000", help="admissions in the window, per line"
    )
    args = parser.parse_args(argv)
    windows = [int(n) for n in args.windows.split(",")]
    if len(windows) > len(TOOL_IDS) - 1:
        raise SystemExit(f"at most {len(TOOL_IDS) - 1} windows")
    with bench_database() as url:
        with psycopg.connect(url, autocommit=True) as connection:
            for tool_id in TOOL_IDS:
                connection.execute(
                    "INSERT INTO generation.tasks (tool_id) SELECT %s FROM generate_series(1, %s)",
                    [tool_id, QUEUED],
                )
            for tool_id, admitted in zip(TOOL_IDS[1:], windows, strict=False):
                key = connection.execute(
                    "SELECT name FROM generation.tools WHERE id = %s", [tool_id]
                ).fetchone()
                assert key is not None
                connection.execute(
                    "INSERT INTO generation.rate_limits (resource_key, max_calls, window_seconds) "
                    "VALUES (%s, 1000000, 60)",
                    [key[0]],
                )
                # The window's runs, spread over its last 50 one-second slices.
                connection.execute(
                    "INSERT INTO generation.rate_slices (resource_key, slice_end, calls, units) "
                    "SELECT %s, date_trunc('second', now()) - g * interval '1 second', %s, 0 "
                    "FROM generate_series(0, 49) AS g WHERE %s > 0",
                    [key[0], admitted // 50, admitted],
                )
            connection.execute("VACUUM ANALYZE")
        lines = [("no rate limit", TOOL_IDS[0])] + [
            (f"rate limit, {admitted:,} in the window", tool_id)
            for tool_id, admitted in zip(TOOL_IDS[1:], windows, strict=False)
        ]
        base = None
        print(f"{args.claims} claims of {args.limit} per line, each rolled back")
        for label, tool_id in lines:
            claims(url, tool_id, 100, args.limit)  # warm the plans and the cache
            spent = claims(url, tool_id, args.claims, args.limit)
            mean, p50 = statistics.fmean(spent), statistics.median(spent)
            base = base or mean
            print(f"{label:<34} mean {mean:7.0f} µs  p50 {p50:7.0f} µs  ratio {mean / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
