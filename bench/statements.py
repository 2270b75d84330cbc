"""Lighter statements (issue 9 item 6): pgbench of the service's claim + complete statements
against pgbench of the spec's own two statements on the spec's own table and claim index.

    .venv/bin/python bench/statements.py [--tasks 150000] [--clients 8] [--seconds 15]

In one run, each line on a database of its own (created, synchronous_commit = on, dropped at the
end), all loaded the same way: TRUNCATE, `--tasks` queued tasks round-robin over the 4 tools
00000000-0000-0000-0000-00000000000{1..4}, created_at (and run_at) 1 ms apart, VACUUM ANALYZE of
the whole database, CHECKPOINT. Each line is `pgbench -n -M prepared -c 8 -j 2 -T 18` (2 s of
warm-up, then 15 s measured from pgbench's per-transaction log, as bench/claim_complete.py does;
its session settings jit=off and the service's statement_timeout for every line):

1. spec: ../shared/peers/claim_complete.sql (the spec's claim UPDATE ... FOR UPDATE SKIP LOCKED
   in a transaction, then its complete) on seed A's table: generation.tasks with the columns of
   seed A's table, the generation.task_status enum (queued, dispatched, processing, completed,
   failed), tool_id a foreign key to a generation.tools (id, name), and seed A's partial claim
   index idx_gen_tasks_queue (tool_id, status DESC, priority DESC, created_at ASC) WHERE status
   IN ('queued', 'processing'). Seed A gives the columns, the enum and the index, not the DDL
   text: SPEC_DDL below is written from them.
2. service: the service's ClaimNextTask and CompleteTask statements (service.api.rpcs.STATEMENTS)
   bound as the service binds them (bench/claim_complete.py's `pgbench_script`), unpaid: no cost
   estimate on the tools, cost_nanos 0 on every completion, on the service's schema
   (proto/generation/task/v1/schema.sql, migrated with service.migrations, a global daily cap no
   run reaches).
3. service paid: the same, with a cost estimate (`--estimate-nanos`) on every tool (so on every
   task) and a cost (`--cost-nanos`) on every completion, under the same unreachable cap.

4. floor: what any design keeping the service's records must write, as two single statements
   on the service's schema (FLOOR_SCRIPT below): the claim picks the head of the queue, starts
   its run, opens its attempt and appends the `started` event; the complete ends the run if the
   lease holds, closes the attempt and appends the terminal event. No gates, spend, limits,
   cooldowns or polls: an upper bound for the service line, not a design (planned like the
   service's transitions: enable_seqscan off, generic plans).
5. rules: the service's own unpaid fast paths (claim_tasks_v1 steps A-E, complete_task_v1 steps
   A-D) taken out of their functions, one plain statement each (RULES_SCRIPT below): the floor's
   writes (without its two event rows: the attempt row carries both events), the day lock, the
   gate read, the checks on the picked tasks' keys and groups, the poll note, the failure reset
   of the key and the whole task in each answer. No PL/pgSQL, no fallback for the paths that
   need it, no event JSON, the lock, poll note and reset folded into the two statements: an
   upper bound for the service line that keeps its rules (planned like the floor).
6. tool row: the rules line with its gate answered by the tool's row alone (not paused, no
   concurrency limit, no estimate) and every other rule taken out: no day lock, settings or cap,
   no check on the picked tasks' keys, no poll note, no attempt check, no failure reset
   (TOOL_ROW_PIECES below): the most a gate kept on the tool's row could reach, before the rules
   it must still keep (planned like the floor).

`--tasks` must exceed what the fastest line (the spec's) drains in warm-up + seconds: a claim that
finds the queue empty makes pgbench abort its run (its gset gets no row), and the program stops.

It prints tasks/s (claim + complete pairs) of each with the CPU each party used, and the ratios.
The bar: service tasks/s >= 0.7 x spec tasks/s (the paid ratio is printed beside it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import string
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: the project's packages, not an installed copy

from bench.claim_complete import (  # noqa: E402
    TOOL_IDS,
    Result,
    bench_database,
    describe,
    load_queue,
    report,
    run_pgbench,
)
from bench.drain import database, execute  # noqa: E402
from service.settings import Settings  # noqa: E402

SPEC_SCRIPT = ROOT.parent / "shared" / "peers" / "claim_complete.sql"
BAR = 0.7
"""Issue 9 item 6: the service's statements >= 0.7 x the spec's, pgbench, one run."""

SPEC_DDL = """
CREATE SCHEMA generation;
CREATE TYPE generation.task_status AS ENUM
    ('queued', 'dispatched', 'processing', 'completed', 'failed');
CREATE TABLE generation.tools (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name text NOT NULL UNIQUE
);
CREATE TABLE generation.tasks (
    id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tool_id uuid NOT NULL REFERENCES generation.tools (id),
    status generation.task_status NOT NULL DEFAULT 'queued',
    input jsonb NOT NULL DEFAULT '{}',
    output jsonb,
    error text,
    claim_expires_at timestamptz,
    retry_count integer NOT NULL DEFAULT 0,
    max_retries integer NOT NULL DEFAULT 3,
    priority integer NOT NULL DEFAULT 0,
    reserved_token_amount bigint NOT NULL DEFAULT 0,
    billing_idempotency_key text,
    w3c_traceparent text,
    created_at timestamptz NOT NULL DEFAULT now(),
    started_at timestamptz,
    completed_at timestamptz
);
CREATE INDEX idx_gen_tasks_queue
    ON generation.tasks (tool_id, status DESC, priority DESC, created_at ASC)
    WHERE status IN ('queued', 'processing');
"""
"""Seed A's table, enum and claim index (its "columns that make it a queue" and the other
columns its RPCs read and write: input, output, error, started_at, completed_at)."""


FLOOR_SCRIPT = """\\set t random(1, 4)
WITH picked AS (
  SELECT q.id FROM generation.tasks AS q
  WHERE q.tool_id = ('00000000-0000-0000-0000-00000000000' || :t)::uuid AND q.status = 'queued'
    AND q.retry_count < q.max_retries AND q.run_at <= now()
  ORDER BY q.reclaimed DESC, q.priority DESC, q.run_at LIMIT 1 FOR NO KEY UPDATE SKIP LOCKED),
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
SELECT started.id, started.lease_token FROM started
\\gset c_
WITH done AS (
  UPDATE generation.tasks AS q
  SET status = 'completed', output = '{"ok": true}', completed_at = now(), claim_expires_at = NULL,
      lease_token = NULL, lease_confirmed = false, last_event_seq = q.last_event_seq + 1
  WHERE q.id = :c_id AND q.status = 'processing' AND q.lease_token = :c_lease_token
    AND q.claim_expires_at > now() RETURNING q.*),
closed AS (
  UPDATE generation.attempts AS a SET outcome = 'completed', ended_at = now()
  FROM done WHERE a.task_id = done.id AND a.attempt = done.attempt_count)
INSERT INTO generation.task_events (task_id, sequence, kind)
SELECT id, last_event_seq, 'completed' FROM done;
"""
"""The floor line: the rows the service's claim + complete must write, and nothing else."""

RULES_TEMPLATE = string.Template(
    """\\set t random(1, 4)
${gate}chosen AS MATERIALIZED (
  SELECT q.id, q.reclaimed, q.priority, q.run_at, COALESCE(q.cost_estimate_nanos, 0) AS estimate,
         COALESCE(q.resource_key, gate.default_key) AS resource_key,
         COALESCE(q.account_group, gate.default_group) AS account_group
  FROM gate, generation.tasks AS q
  WHERE q.tool_id = ('00000000-0000-0000-0000-00000000000' || :t)::uuid AND q.status = 'queued'
    AND q.retry_count < q.max_retries AND q.run_at <= now()
    AND (q.expires_at IS NULL OR q.expires_at > now())
    AND (q.resource_key IS NULL OR NOT EXISTS (
          SELECT 1 FROM generation.cooldowns AS c
          WHERE c.resource_key = q.resource_key AND c.cooling_until > now()))
    AND (q.account_group IS NULL OR NOT EXISTS (
          SELECT 1 FROM generation.holds AS h
          WHERE h.account_group = q.account_group AND h.held_until > now()))
  ORDER BY q.reclaimed DESC, q.priority DESC, q.run_at LIMIT 1
  FOR NO KEY UPDATE OF q SKIP LOCKED),
${free}started AS (
  UPDATE generation.tasks AS t
  SET status = 'processing', started_at = COALESCE(t.started_at, now()),
      claim_expires_at = now() + make_interval(secs => gate.lease),
      lease_token = gen_random_uuid(), lease_confirmed = false, reclaimed = false,
      attempt_count = t.attempt_count + 1, last_event_seq = t.last_event_seq + 1
  FROM gate WHERE t.id = ANY (ARRAY(SELECT free.id FROM free)) RETURNING t.*),
attempt AS (
  INSERT INTO generation.attempts
    (task_id, attempt, lease_token, tool_id, resource_key, account_group, local_day,
     estimate_nanos, started_seq)
  SELECT started.id, started.attempt_count, started.lease_token, started.tool_id,
         free.resource_key, free.account_group, gate.today, 0, started.last_event_seq
  FROM gate, started JOIN free ON free.id = started.id)${poll}
SELECT started.*, gate.lease FROM gate, started JOIN free ON free.id = started.id
ORDER BY free.reclaimed DESC, free.priority DESC, free.run_at
\\gset c_
WITH ended AS (
  UPDATE generation.tasks AS q
  SET status = CASE WHEN q.cancel_requested_at IS NULL THEN 'completed'
                    ELSE 'cancelled' END::generation.task_status,
      output = CASE WHEN q.cancel_requested_at IS NULL THEN '{"ok": true}'::jsonb END,
      reported_usage = '{"token_amount": 1, "cost_nanos": 0, "details": {}}',
      completed_at = now(), claim_expires_at = NULL,
      error = CASE WHEN q.cancel_requested_at IS NULL THEN NULL ELSE 'cancelled' END,
      lease_token = NULL, lease_confirmed = false, last_event_seq = q.last_event_seq + 1
  WHERE q.id = :c_id AND q.status = 'processing' AND q.lease_token = :c_lease_token
    AND q.claim_expires_at > now()
${attempt_check}  RETURNING q.*),
closed AS (
  UPDATE generation.attempts AS r
  SET outcome = ended.status::text::generation.attempt_outcome,
      resource_key = COALESCE(NULL::text, r.resource_key), ended_at = now(),
      ended_seq = ended.last_event_seq
  FROM ended
  WHERE r.task_id = :c_id AND r.lease_token = :c_lease_token AND r.outcome = 'running'
  RETURNING r.task_id, r.resource_key, r.outcome),
event AS (
  INSERT INTO generation.task_events (task_id, sequence, kind, data)
  SELECT ended.id, ended.last_event_seq, ended.status::text::generation.task_event_kind, '{}'
  FROM ended WHERE NOT EXISTS (SELECT 1 FROM closed))${reset}
SELECT true AS task_found, ended.* FROM ended;
"""
)
"""The rules line's two statements, with its rules as pieces (RULE_PIECES, TOOL_ROW_PIECES)."""

RULE_PIECES = {
    "gate": """WITH day_lock AS MATERIALIZED (SELECT pg_advisory_xact_lock_shared(1734700658)),
gate AS MATERIALIZED (
  SELECT COALESCE(tl.resource_key, tl.name) AS default_key,
         COALESCE(tl.account_group, tl.name) AS default_group,
         COALESCE(tl.lease_seconds, 120) AS lease, local.day AS today
  FROM day_lock, generation.tools AS tl, generation.settings AS st,
       generation.gates_v1(false, NULL::bigint) AS gt,
       LATERAL (SELECT (now() AT TIME ZONE st.timezone)::date AS day) AS local
  WHERE tl.id = ('00000000-0000-0000-0000-00000000000' || :t)::uuid AND gt.running
    AND NOT tl.paused AND gt.cap > 0 AND tl.max_in_flight IS NULL AND tl.cost_estimate_nanos = 0
    AND (tl.daily_cap_nanos IS NULL OR tl.daily_cap_nanos > 0)
    AND (tl.spent_day IS DISTINCT FROM local.day OR tl.spent_nanos + tl.reserved_nanos = 0)
    AND CASE WHEN st.granted_day = local.day THEN st.granted_nanos ELSE 0 END < gt.cap
    AND NOT EXISTS (SELECT 1 FROM generation.resource_limits AS l
                    WHERE l.resource_key = COALESCE(tl.resource_key, tl.name))
    AND NOT EXISTS (SELECT 1 FROM generation.rate_limits AS r
                    WHERE r.resource_key = COALESCE(tl.resource_key, tl.name))
    AND NOT EXISTS (SELECT 1 FROM generation.cooldowns AS c
                    WHERE c.resource_key = COALESCE(tl.resource_key, tl.name)
                      AND c.cooling_until > now())
    AND NOT EXISTS (SELECT 1 FROM generation.holds AS h
                    WHERE h.account_group = COALESCE(tl.account_group, tl.name)
                      AND h.held_until > now())),
""",
    "free": """free AS (
  SELECT * FROM chosen
  WHERE NOT EXISTS (
    SELECT 1 FROM chosen AS o
    WHERE o.estimate <> 0
       OR EXISTS (SELECT 1 FROM generation.resource_limits AS l
                  WHERE l.resource_key = o.resource_key)
       OR EXISTS (SELECT 1 FROM generation.rate_limits AS r
                  WHERE r.resource_key = o.resource_key))),
""",
    "poll": """,
poll AS (
  INSERT INTO generation.tool_polls AS p (tool_id, polled_at)
  SELECT ('00000000-0000-0000-0000-00000000000' || :t)::uuid, now()
  WHERE EXISTS (SELECT 1 FROM started) AND NOT EXISTS (SELECT 1 FROM generation.tool_polls AS x
                    WHERE x.tool_id = ('00000000-0000-0000-0000-00000000000' || :t)::uuid
                      AND x.polled_at > now() - interval '5 seconds')
  ON CONFLICT (tool_id) DO UPDATE SET polled_at = EXCLUDED.polled_at)""",
    "attempt_check": """    AND EXISTS (SELECT 1 FROM generation.attempts AS x
                WHERE x.task_id = :c_id AND x.lease_token = :c_lease_token
                  AND x.outcome = 'running' AND x.estimate_nanos = 0)
""",
    "reset": """,
reset AS (
  UPDATE generation.cooldowns AS c SET consecutive_failures = 0
  FROM closed
  WHERE closed.outcome = 'completed' AND c.resource_key = closed.resource_key
    AND c.consecutive_failures > 0)""",
}
"""Every rule of the service's unpaid fast paths."""

TOOL_ROW_PIECES = {
    "gate": """WITH gate AS MATERIALIZED (
  SELECT COALESCE(tl.resource_key, tl.name) AS default_key,
         COALESCE(tl.account_group, tl.name) AS default_group,
         COALESCE(tl.lease_seconds, 120) AS lease, current_date AS today
  FROM generation.tools AS tl
  WHERE tl.id = ('00000000-0000-0000-0000-00000000000' || :t)::uuid
    AND NOT tl.paused AND tl.max_in_flight IS NULL AND tl.cost_estimate_nanos = 0),
""",
    "free": "free AS (SELECT * FROM chosen),\n",
    "poll": "",
    "attempt_check": "",
    "reset": "",
}
"""The tool-row line's: the gate is the tool's row alone (not paused, no concurrency limit, no
estimate), and no other rule: no day lock, settings or cap, no check on the picked tasks' keys,
no poll note, no attempt check, no failure reset."""

RULES_SCRIPT = RULES_TEMPLATE.substitute(RULE_PIECES)
"""The rules line: the service's unpaid fast paths with every rule they apply, each one plain
statement (what the service's functions run for a free tool's task, without PL/pgSQL). A copy of
claim_tasks_v1's steps A-E and complete_task_v1's A-D: a change to either belongs here too.
Where it differs, it is cheaper: the day lock and the poll note are CTEs of the claim, not
statements before and after it (so the lock guards no read here), and the key's failure reset
is a CTE of the completion, reading the key its attempt closed with, not a statement of its
own that sees failures committed while the completion waited."""


TOOL_ROW_SCRIPT = RULES_TEMPLATE.substitute(TOOL_ROW_PIECES)
"""The tool-row line: the rules line with its gate answered by the tool's row alone and every
other rule taken out (TOOL_ROW_PIECES): the most a gate the tool's row answers alone could let
the service's records and answers reach, before any rule it must still keep."""


def spec_database_loaded(url: str, tasks: int) -> None:
    """Seed A's schema with the 4 tools, then the queue loaded as `load_queue` loads the
    service's (it adapts to the columns it finds: created_at here)."""
    with psycopg.connect(url, autocommit=True) as connection:
        connection.execute(SPEC_DDL.encode())
        for n, tool_id in enumerate(TOOL_IDS, 1):
            connection.execute(
                "INSERT INTO generation.tools (id, name) VALUES (%s, %s)",
                (tool_id, f"bench-tool-{n}"),
            )
    load_queue(url, tasks)


PLANNED_LIKE_THE_FUNCTIONS = {"enable_seqscan": "off", "plan_cache_mode": "force_generic_plan"}
"""The `SET` clauses of the service's transitions (jit is off in every bench session already)."""


@contextmanager
def planned_like_the_functions(url: str) -> Iterator[None]:
    """Plain statements on the service's database planned as its functions are
    (PLANNED_LIKE_THE_FUNCTIONS), for the sessions a line opens; reset after it."""
    database = sql.Identifier(str(conninfo_to_dict(url)["dbname"]))
    with psycopg.connect(url, autocommit=True) as connection:
        for name, value in PLANNED_LIKE_THE_FUNCTIONS.items():
            connection.execute(
                sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                    database, sql.Identifier(name), sql.Literal(value)
                )
            )
    try:
        yield
    finally:
        with psycopg.connect(url, autocommit=True) as connection:
            for name in PLANNED_LIKE_THE_FUNCTIONS:
                connection.execute(
                    sql.SQL("ALTER DATABASE {} RESET {}").format(database, sql.Identifier(name))
                )


def show(result: Result, clients: int) -> None:
    """`report`'s lines, and what the pair cost Postgres (the party every line shares)."""
    report(result, clients)
    if result.cores.get("postgres") and result.tasks_per_second:
        micros = result.cores["postgres"] / result.tasks_per_second * 1e6
        print(f"{'':<15} postgres CPU per claim+complete pair: {micros:.0f} us")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=150_000, help="queued tasks (150000)")
    parser.add_argument("--clients", type=int, default=8, help="pgbench -c (8)")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured seconds (15)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before measuring (2)")
    parser.add_argument("--estimate-nanos", type=int, default=1000, help="paid: tool estimate")
    parser.add_argument("--cost-nanos", type=int, default=1000, help="paid: cost per completion")
    args = parser.parse_args(argv)
    if not shutil.which("pgbench"):
        raise SystemExit("pgbench not found (PATH)")
    if not SPEC_SCRIPT.exists():
        raise SystemExit(f"{SPEC_SCRIPT} missing")
    spec_script: tuple[str, list[str]] = (SPEC_SCRIPT.read_text(), [])
    # -j: run_pgbench uses min(clients, CPUs), 2 on this machine as the bar's command says.
    jobs = min(args.clients, os.cpu_count() or 1)
    print(
        f"pgbench -n -M prepared -c {args.clients} -j {jobs} -T "
        f"{args.warmup + args.seconds + 1:g} ({args.warmup:g} s warm-up, {args.seconds:g} s "
        f"measured); {args.tasks:,} queued tasks over {len(TOOL_IDS)} tools before each line; "
        f"{os.cpu_count()} CPUs"
    )
    results: dict[str, Result] = {}
    with database("genq_bench_spec") as spec_url, bench_database() as service_url:
        print(describe(service_url))
        # The service's binding values (statement_timeout, lease...) as it reads its env.
        settings = Settings.from_env({**os.environ, "DATABASE_URL": service_url})

        spec_database_loaded(spec_url, args.tasks)
        results["spec"] = run_pgbench(args, spec_url, settings, spec_script, name="spec")
        show(results["spec"], args.clients)

        execute(service_url, "UPDATE generation.tools SET cost_estimate_nanos = 0")
        load_queue(service_url, args.tasks)
        unpaid = argparse.Namespace(**{**vars(args), "cost_nanos": 0})
        results["service"] = run_pgbench(unpaid, service_url, settings, name="service")
        show(results["service"], args.clients)

        # Before the paid line: the spend it leaves today takes the claims off their fast path.
        load_queue(service_url, args.tasks)
        with planned_like_the_functions(service_url):
            results["rules"] = run_pgbench(
                unpaid, service_url, settings, (RULES_SCRIPT, []), name="rules"
            )
        show(results["rules"], args.clients)

        load_queue(service_url, args.tasks)
        with planned_like_the_functions(service_url):
            results["tool row"] = run_pgbench(
                unpaid, service_url, settings, (TOOL_ROW_SCRIPT, []), name="tool row"
            )
        show(results["tool row"], args.clients)

        execute(
            service_url,
            f"UPDATE generation.tools SET cost_estimate_nanos = {int(args.estimate_nanos)}",
        )
        load_queue(service_url, args.tasks)
        results["paid"] = run_pgbench(args, service_url, settings, name="service paid")
        show(results["paid"], args.clients)

        execute(service_url, "UPDATE generation.tools SET cost_estimate_nanos = 0")
        load_queue(service_url, args.tasks)
        with planned_like_the_functions(service_url):
            results["floor"] = run_pgbench(
                unpaid, service_url, settings, (FLOOR_SCRIPT, []), name="floor"
            )
        show(results["floor"], args.clients)

    spec = results["spec"].tasks_per_second
    if not spec:
        print("spec line measured nothing")
        return 1
    for key, label in (("service", "service (unpaid)"), ("paid", "service paid")):
        ratio = results[key].tasks_per_second / spec
        verdict = "meets" if ratio >= BAR else "MISSES"
        print(f"ratio {label} / spec: {ratio:.2f} (bar >= {BAR} x: {verdict})")
    floor = results["floor"].tasks_per_second / spec
    print(f"ratio floor / spec: {floor:.2f} (the most the service line could reach)")
    rules = results["rules"].tasks_per_second / spec
    print(f"ratio rules / spec: {rules:.2f} (the most it could reach keeping its rules)")
    tool_row = results["tool row"].tasks_per_second / spec
    print(
        f"ratio tool row / spec: {tool_row:.2f} (the most a gate the tool's row answers alone "
        "could reach, every other rule taken out)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
