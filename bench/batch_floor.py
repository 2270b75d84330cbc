"""What Postgres alone leaves the drain bar (issue #29: WorkerFleet drain >= 1 x PGQueuer's
QueueManager at the same batch): the records a drained batch of 100 must write, driven by
pgbench, beside PGQueuer's own drain at batch 100, in one run.

    .venv/bin/python bench/batch_floor.py [--tasks 20000] [--clients 1,2,4] [--rounds 2]

Each round runs PGQueuer's side of bench/drain.py (`pgqueuer`, dequeue batch BATCH; the `bench`
extra), then, for
each client count K, on the service's schema (bench/claim_complete.py's database: migrated,
synchronous_commit on) loaded with `--tasks` queued tasks over 4 tools (TRUNCATE, VACUUM
ANALYZE, CHECKPOINT first), `pgbench -n -M prepared -c K` of BATCH_SCRIPT, each client
`--tasks` / 100 / K + 2 times, on a tool picked at random each time (so a few hundred tasks are
usually left queued; the rate counts those completed): one statement claims up to 100 tasks
of a tool (the claim index, SKIP LOCKED) and writes
what a claim must (each run started, its attempt, its `started` event); a second completes those
100 (each run ended if its lease holds, its attempt closed, its terminal event). No gates,
spend, limits, confirmations, polls, gRPC or Python: what any service keeping these records
would still cost Postgres, driven by a C client. Tasks/s are read from the tasks themselves
(completed, first started_at to last completed_at).

If this line is not well above PGQueuer, no service on this schema and machine meets the
drain bar; if it is, what bounds the bar is above Postgres (the service, the SDK, the statements'
gates). Session settings as the service's pool sets them (jit off, and enable_seqscan off, as its
transitions run).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the project's packages, not an installed copy

from bench.claim_complete import TOOLS, bench_database, load_queue  # noqa: E402
from bench.drain import execute, pgqueuer  # noqa: E402

BATCH = 100
BATCH_SCRIPT = f"""\\set t random(1, {TOOLS})
WITH picked AS (
  SELECT q.id FROM generation.tasks AS q
  WHERE q.tool_id = ('00000000-0000-0000-0000-00000000000' || :t)::uuid AND q.status = 'queued'
    AND q.retry_count < q.max_retries AND q.run_at <= now()
  ORDER BY q.reclaimed DESC, q.priority DESC, q.run_at LIMIT {BATCH}
  FOR NO KEY UPDATE SKIP LOCKED),
started AS (
  UPDATE generation.tasks AS t
  SET status = 'processing', started_at = COALESCE(t.started_at, now()),
      claim_expires_at = now() + interval '120 seconds', lease_token = gen_random_uuid(),
      lease_confirmed = false, reclaimed = false, attempt_count = t.attempt_count + 1,
      last_event_seq = t.last_event_seq + 1
  FROM picked WHERE t.id = picked.id RETURNING t.*),
attempt AS (
  INSERT INTO generation.attempts
    (task_id, attempt, lease_token, tool_id, resource_key, account_group, local_day, estimate_nanos)
  SELECT id, attempt_count, lease_token, tool_id, 'key', 'group', current_date, 0 FROM started),
event AS (
  INSERT INTO generation.task_events (task_id, sequence, kind, data)
  SELECT id, last_event_seq, 'started', jsonb_build_object('attempt', attempt_count) FROM started)
SELECT COALESCE(array_agg(started.id), '{{}}') AS ids,
       COALESCE(array_agg(started.lease_token), '{{}}') AS tokens
FROM started
\\gset c_
WITH done AS (
  UPDATE generation.tasks AS q
  SET status = 'completed', output = '{{"ok": true}}', completed_at = now(),
      claim_expires_at = NULL, lease_token = NULL, lease_confirmed = false,
      last_event_seq = q.last_event_seq + 1
  FROM unnest(:c_ids::uuid[], :c_tokens::uuid[]) AS i(id, token)
  WHERE q.id = i.id AND q.status = 'processing' AND q.lease_token = i.token
    AND q.claim_expires_at > now() RETURNING q.*),
closed AS (
  UPDATE generation.attempts AS a SET outcome = 'completed', ended_at = now()
  FROM done WHERE a.task_id = done.id AND a.attempt = done.attempt_count)
INSERT INTO generation.task_events (task_id, sequence, kind)
SELECT id, last_event_seq, 'completed' FROM done;
"""
"""A drained batch's records, claim and complete, 100 tasks at a time."""


def drained(url: str, tasks: int, clients: int, script: Path) -> tuple[int, float]:
    """Loads the queue, drains it with pgbench; the tasks completed and their tasks/s."""
    load_queue(url, tasks)
    execute(url, "CHECKPOINT")
    # Each client's share of the batches, and a few more: a claim that finds its tool's queue
    # empty claims nothing and completes nothing.
    per_client = tasks // BATCH // clients + 2
    options = "-c jit=off -c enable_seqscan=off"
    done = subprocess.run(
        [
            *("pgbench", "-n", "-M", "prepared", "-c", str(clients), "-j", str(min(clients, 2))),
            *("-t", str(per_client), "-f", str(script), url),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PGOPTIONS": options},
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"pgbench failed: {done.stderr[-800:]}")
    with psycopg.connect(url) as connection:
        row = connection.execute(
            "SELECT count(*), extract(epoch FROM max(completed_at) - min(started_at))::float "
            "FROM generation.tasks WHERE status = 'completed'"
        ).fetchone()
    assert row is not None and row[1]
    return int(row[0]), row[0] / row[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument(
        "--clients", type=lambda v: [int(n) for n in v.split(",")], default=[1, 2, 4]
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300, help="longest drain, seconds")
    args = parser.parse_args()
    script = Path(f"/tmp/genq_batch_floor_{os.getpid()}.sql")
    script.write_text(BATCH_SCRIPT)
    print(f"{args.tasks} tasks, batches of {BATCH}; machine: {os.cpu_count()} CPUs")
    try:
        with bench_database() as url:
            for round_ in range(1, args.rounds + 1):
                peer = pgqueuer(args, BATCH, None).per_second
                print(f"round {round_}: PGQueuer batch {BATCH} drained {peer:,.0f} jobs/s")
                started = time.perf_counter()
                for clients in args.clients:
                    count, rate = drained(url, args.tasks, clients, script)
                    print(
                        f"round {round_}: records floor, {clients} pgbench client(s): {count} "
                        f"tasks at {rate:,.0f} tasks/s = {rate / peer:.2f} x PGQueuer batch "
                        f"{BATCH} (the bar: 1 x)"
                    )
                print(f"  ({time.perf_counter() - started:.0f} s)")
    finally:
        script.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
