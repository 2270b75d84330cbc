"""Where the service's side of a drained batch goes, part by part: ClaimTasks, ConfirmClaim
and CompleteTasks of `--items` tasks each (docs/BENCHMARKS.md, "Floors and parts").

    .venv/bin/python bench/batch_parts.py [--items 100] [--rounds 12]

On a database of its own (bench/claim_complete.py's: migrated, dropped at the end,
synchronous_commit on), in one process, each round claims `--items` queued tasks, confirms them
and completes them as a worker's batches would, through the service's own code: each RPC's
request parsed from its bytes, then `BINDINGS[rpc].bind`, its `sql` option run on one
autocommit connection (prepared, jit off) and fetched, `respond`, and the answer serialized. It
prints the median wall time and CPU time (this process's: what the service would spend) of each
part, in ms. The statement's wall time includes Postgres; its CPU time is psycopg's side alone
(sending the items, reading the rows). gRPC itself is not in it (bench/floors.py costs it).
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
from google.protobuf.message import Message
from psycopg.rows import dict_row

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script

from bench.claim_complete import TOOL_IDS, bench_database, load_queue
from bench.floors import own_cpu
from generation.task.v1 import task_pb2
from service.api.rpcs import BINDINGS, STATEMENTS
from service.settings import Settings

Parts = dict[str, list[tuple[float, float]]]


def timed(parts: Parts, name: str, work: Callable[[], Any]) -> Any:
    wall, cpu = time.perf_counter(), own_cpu()
    result = work()
    parts.setdefault(name, []).append(
        ((time.perf_counter() - wall) * 1000, (own_cpu() - cpu) * 1000)
    )
    return result


def call(
    parts: Parts,
    connection: psycopg.Connection[dict[str, Any]],
    method: str,
    request: Message,
    settings: Settings,
) -> Message:
    """One RPC's service side, part by part; returns its answer as a client would parse it."""
    binding, statement = BINDINGS[method], STATEMENTS[method]
    parsed = type(request).FromString(request.SerializeToString())
    params = timed(parts, f"{method} bind", lambda: binding.bind(parsed, settings))
    rows = timed(
        parts,
        f"{method} statement + fetch",
        lambda: connection.execute(statement, params, prepare=True).fetchall(),
    )
    answer = timed(parts, f"{method} answer", lambda: binding.respond(rows))
    payload = timed(parts, f"{method} serialize", answer.SerializeToString)
    parsed_answer: Message = type(answer).FromString(payload)
    return parsed_answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100, help="tasks a batch (100)")
    parser.add_argument("--rounds", type=int, default=12, help="batches of each RPC (12)")
    args = parser.parse_args()
    settings = Settings.from_env({})
    parts: Parts = {}
    with bench_database() as url:
        load_queue(url, len(TOOL_IDS) * args.items * (args.rounds + 2))  # over 4 tools
        with psycopg.connect(
            url, autocommit=True, row_factory=dict_row, options="-c jit=off"
        ) as connection:
            for round_ in range(args.rounds + 2):
                if round_ == 2:
                    parts.clear()  # two rounds to prepare the statements and warm up
                claim = task_pb2.ClaimTasksRequest(tool_id=str(TOOL_IDS[0]), limit=args.items)
                claimed = call(parts, connection, "ClaimTasks", claim, settings)
                assert isinstance(claimed, task_pb2.ClaimTasksResponse) and claimed.tasks
                leases = [(item.task.id, item.lease_token) for item in claimed.tasks]
                confirm = task_pb2.ConfirmClaimRequest(
                    tool_id=str(TOOL_IDS[0]),
                    lease_token=leases[0][1],
                    task_ids=[task for task, _ in leases],
                )
                call(parts, connection, "ConfirmClaim", confirm, settings)
                completes = task_pb2.CompleteTasksRequest(
                    tasks=[
                        task_pb2.CompleteTaskRequest(task_id=task, lease_token=lease)
                        for task, lease in leases
                    ]
                )
                call(parts, connection, "CompleteTasks", completes, settings)
    print(f"{args.items} items a batch, median of {args.rounds} (ms)")
    print(f"  {'part':<36} {'wall':>7} {'CPU':>7}")
    for name, times in parts.items():
        wall = statistics.median(spent[0] for spent in times)
        cpu = statistics.median(spent[1] for spent in times)
        print(f"  {name:<36} {wall:7.2f} {cpu:7.2f}")


if __name__ == "__main__":
    main()
