"""Where one QueueTasks of 1,000 items spends its time, part by part, in one process (what bounds
the enqueue bar: docs/BENCHMARKS.md, "Floors and parts").

    .venv/bin/python bench/enqueue_parts.py [--items 1000] [--rounds 15]

On a database of its own (bench/claim_complete.py's: migrated, dropped at the end,
synchronous_commit on), for items with an
empty input and with a small one, it prints the median milliseconds of each part, in the order a
call goes through them:

1. sdk build: `enqueue_many`'s QueueTasks request for the items (workers_sdk.gateway `_batches`);
2. bind: the service's `BINDINGS["QueueTasks"].bind` on the parsed request (the checks per item
   and the items' JSON);
3. statement: the QueueTasks `sql` option run with those parameters on one autocommit connection
   (prepared, jit off), rows fetched: psycopg sending the items and reading the rows, and
   Postgres parsing them and running the insert, its index entries and the commit;
4. statement, items with nulls: the same with every item carrying every key, the unset ones as
   null, as the service sent them before (an ablation: what leaving them out saves);
5. answer: `BINDINGS["QueueTasks"].respond` on the rows;
6. sdk merge: `enqueue_many` putting each item's fields back into its answered task.

Parts 3 and 4 alternate round by round, each going first every other round, so a machine that
slows down slows both. gRPC itself is
not in it (bench/drain.py measures the whole call against PGQueuer).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script

from bench.claim_complete import TOOL_IDS, bench_database
from generation.task.v1 import task_pb2
from service.api.rpcs import BINDINGS, STATEMENTS
from service.settings import Settings
from workers_sdk import gateway

INPUTS: dict[str, dict[str, Any]] = {
    "empty input": {},
    "small input": {"prompt": "a lighthouse at dusk", "steps": 20, "seed": 7},
}
COLUMNS = STATEMENTS["QueueTasks"].split("AS item(")[1].split(")")[0]
"""The item columns of the statement's recordset, `name type, ...`."""


def median_ms(run: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def with_nulls(params: dict[str, Any]) -> dict[str, Any]:
    """The parameters with every item carrying every column, the unset ones as null."""
    names = [column.split()[0] for column in COLUMNS.split(",")]
    items = [{**dict.fromkeys(names), **item} for item in params["items"].obj]
    return {**params, "items": Jsonb(items)}


def parts(
    connection: psycopg.Connection[dict[str, Any]],
    tool_id: str,
    document: dict[str, Any],
    items: int,
    rounds: int,
) -> dict[str, float]:
    """Median milliseconds of each part (the module's docstring) for `items` items of `document`."""
    settings = Settings.from_env({})
    binding, statement = BINDINGS["QueueTasks"], STATEMENTS["QueueTasks"]
    defaults = gateway.NewTask({})

    def build() -> task_pb2.QueueTasksRequest:
        (batch,) = gateway._batches(tool_id, [document] * items, defaults, "")
        return batch

    def run(params: dict[str, Any]) -> list[dict[str, Any]]:
        return connection.execute(statement, params, prepare=True).fetchall()

    sent = build()
    requests = sent.tasks
    request = task_pb2.QueueTasksRequest.FromString(sent.SerializeToString())
    params = binding.bind(request, settings)
    nulls = with_nulls(params)
    run(params), run(nulls)  # prepared, warm
    times: dict[str, list[float]] = {"lean": [], "nulls": []}
    forms = {"lean": params, "nulls": nulls}
    for round_ in range(rounds):  # alternated, so a machine slowing down slows both
        for form in ("lean", "nulls") if round_ % 2 else ("nulls", "lean"):
            started = time.perf_counter()
            run(forms[form])
            times[form].append((time.perf_counter() - started) * 1000)
    rows = run(params)
    answer = binding.respond(rows)
    assert isinstance(answer, task_pb2.QueueTasksResponse)
    return {
        "sdk build": median_ms(build, rounds),
        "bind": median_ms(lambda: binding.bind(request, settings), rounds),
        "statement": statistics.median(times["lean"]),
        "statement, items with nulls": statistics.median(times["nulls"]),
        "answer": median_ms(lambda: binding.respond(rows), rounds),
        "sdk merge": median_ms(lambda: gateway._created(requests, answer.tasks), rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with (
        bench_database() as url,
        psycopg.connect(url, autocommit=True, row_factory=dict_row, options="-c jit=off") as db,
    ):
        for label, document in INPUTS.items():
            measured = parts(db, str(TOOL_IDS[0]), document, args.items, args.rounds)
            print(f"{label}, {args.items:,} items (median of {args.rounds}, ms):")
            for name, ms in measured.items():
                print(f"  {name:<30} {ms:7.1f}")
            db.execute("TRUNCATE generation.tasks, generation.task_events")


if __name__ == "__main__":
    main()
