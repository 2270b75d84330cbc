"""Flat claim (GUIDE X2): a claim touches a small, constant number of buffers whatever the backlog
and the tasks in flight, with fresh statistics, with none (right after a bulk load), and with the
generic plan a prepared statement ends up on.

The claim is generation.claim_tasks_v1, one statement when no gate applies (as here); auto_explain
(nested statements, sent to the client as notices) shows the plan of that statement, whose
`chosen` CTE is the pick, and EXPLAIN of the call counts the buffers of all of it."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from service.api.rpcs import STATEMENTS
from tests.conftest import Databases, url_for

IN_FLIGHT = 20_000
BACKLOG = 200_000
# The whole claim: the pick's B-tree descent, a few heap pages, the UPDATE, the attempt's row and
# its five index entries, the `started` event, the gates (settings, overrides, cooldown, hold)
# and the poll note. Measured 63-71 with 10 tasks and with 220,000.
BUFFER_BUDGET = 90
PICK_BUDGET = 20  # the locked, index-ordered top-1 alone


@pytest.fixture(scope="module")
def loaded(databases: Databases) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    """A database of its own, autovacuum off so nothing analyzes behind the test's back."""
    url = url_for(databases.create("claim_plan"))
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as connection:
        connection.execute("ALTER TABLE generation.tasks SET (autovacuum_enabled = false)")
        yield connection


def make_tool(connection: psycopg.Connection[dict[str, Any]]) -> uuid.UUID:
    found = connection.execute(
        "INSERT INTO generation.tools (name) VALUES (%s) RETURNING id", [uuid.uuid4().hex]
    ).fetchone()
    assert found is not None
    return uuid.UUID(str(found["id"]))


def bulk_load(connection: psycopg.Connection[dict[str, Any]], tool: uuid.UUID) -> None:
    connection.execute(
        "INSERT INTO generation.tasks (tool_id, priority, created_at) "
        "SELECT %s, (i %% 7) - 3, now() - make_interval(secs => i) "
        "FROM generate_series(1, %s) AS i",
        [tool, BACKLOG],
    )
    connection.execute(
        "INSERT INTO generation.tasks (tool_id, status, lease_token, claim_expires_at, started_at) "
        "SELECT %s, 'processing', gen_random_uuid(), now() + interval '2 minutes', now() "
        "FROM generate_series(1, %s)",
        [tool, IN_FLIGHT],
    )


def claim_plan(
    connection: psycopg.Connection[dict[str, Any]], tool: uuid.UUID, generic: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """EXPLAIN (ANALYZE, BUFFERS) of the service's own claim statement, and the plan of the pick
    inside it, rolled back. The first call of a session also fills plpgsql's plan cache (as a
    pooled connection did long ago): it runs once unmeasured."""
    notices: list[str] = []

    def keep(diagnostic: psycopg.errors.Diagnostic) -> None:
        notices.append(diagnostic.message_primary or "")

    connection.add_notice_handler(keep)
    try:
        for _ in range(2):
            notices.clear()
            plan = _explained_claim(connection, tool, generic)
    finally:
        connection.remove_notice_handler(keep)
    picks = [
        json.loads(text[text.index("{") :])
        for text in notices
        if "FOR NO KEY UPDATE OF q SKIP LOCKED" in text and "{" in text
    ]
    assert len(picks) == 1, notices
    return plan, cte(picks[0]["Plan"], "chosen")


def cte(plan: dict[str, Any], name: str) -> dict[str, Any]:
    """The node of the statement's CTE `name`."""
    if plan.get("Subplan Name") == f"CTE {name}":
        return plan
    for child in plan.get("Plans", []):
        try:
            return cte(child, name)
        except LookupError:
            pass
    raise LookupError(f"no CTE {name}")


def _explained_claim(
    connection: psycopg.Connection[dict[str, Any]], tool: uuid.UUID, generic: bool
) -> dict[str, Any]:
    params = {
        "tool_id": tool,
        "lease_seconds": 120,
        "disabled_override": False,
        "cap_override": None,
        "mirror": False,
    }
    with connection.transaction(force_rollback=True):
        connection.execute("SET LOCAL jit = off")  # as in the service's sessions
        connection.execute("LOAD 'auto_explain'")
        for name, value in {
            "log_min_duration": "0",
            "log_nested_statements": "on",
            "log_analyze": "on",
            "log_buffers": "on",
            "log_format": "json",
            "log_level": "notice",
        }.items():
            connection.execute(f"SET LOCAL auto_explain.{name} = '{value}'")
        if generic:
            names: list[str] = []

            def number(match: re.Match[str]) -> str:
                if match.group(1) not in names:
                    names.append(match.group(1))
                return f"${names.index(match.group(1)) + 1}"

            positional = re.sub(r"%\((\w+)\)s", number, STATEMENTS["ClaimNextTask"])
            connection.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            types = ", ".join(
                {
                    "tool_id": "uuid",
                    "lease_seconds": "int",
                    "disabled_override": "boolean",
                    "cap_override": "bigint",
                    "mirror": "boolean",
                }[n]
                for n in names
            )
            connection.execute(f"PREPARE claim_generic ({types}) AS {positional}")
            arguments = sql.SQL(", ").join(sql.Literal(params[name]) for name in names)
            explained = connection.execute(
                sql.SQL(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE claim_generic ({})"
                ).format(arguments)
            ).fetchone()
            connection.execute("DEALLOCATE claim_generic")
        else:
            explained = connection.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + STATEMENTS["ClaimNextTask"], params
            ).fetchone()
        claimed = connection.execute(
            "SELECT count(*) AS n FROM generation.attempts WHERE tool_id = %s", [tool]
        ).fetchone()
    assert claimed == {"n": 1}, "the explained claim took no task"
    assert explained is not None
    plan: dict[str, Any] = explained["QUERY PLAN"][0]["Plan"]
    return plan


def buffers(plan: dict[str, Any]) -> int:
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


def node_types(plan: dict[str, Any]) -> list[str]:
    return [plan["Node Type"], *(t for child in plan.get("Plans", []) for t in node_types(child))]


def test_claim_is_flat_before_analyze_after_bulk_load(
    loaded: psycopg.Connection[dict[str, Any]],
) -> None:
    small = make_tool(loaded)
    loaded.execute(
        "INSERT INTO generation.tasks (tool_id) SELECT %s FROM generate_series(1, 10)", [small]
    )
    big = make_tool(loaded)
    bulk_load(loaded, big)
    never_analyzed = loaded.execute(
        "SELECT last_analyze IS NULL AND last_autoanalyze IS NULL AS fresh "
        "FROM pg_stat_user_tables WHERE relid = 'generation.tasks'::regclass"
    ).fetchone()
    assert never_analyzed == {"fresh": True}

    baseline, _ = claim_plan(loaded, small)
    for plan, pick in (claim_plan(loaded, big), claim_plan(loaded, big, generic=True)):
        assert "Sort" not in node_types(pick), json.dumps(pick, indent=1)
        assert buffers(pick) <= PICK_BUDGET, json.dumps(pick, indent=1)
        assert buffers(plan) <= BUFFER_BUDGET, json.dumps(plan, indent=1)
        assert buffers(plan) <= buffers(baseline) + 10


def test_claim_is_flat_with_statistics(loaded: psycopg.Connection[dict[str, Any]]) -> None:
    big = make_tool(loaded)
    bulk_load(loaded, big)
    loaded.execute("ANALYZE generation.tasks")
    for plan, pick in (claim_plan(loaded, big), claim_plan(loaded, big, generic=True)):
        assert "Sort" not in node_types(pick), json.dumps(pick, indent=1)
        assert buffers(pick) <= PICK_BUDGET, json.dumps(pick, indent=1)
        assert buffers(plan) <= BUFFER_BUDGET, json.dumps(plan, indent=1)


def test_a_claim_a_gate_holds_is_flat_too(loaded: psycopg.Connection[dict[str, Any]]) -> None:
    """When a gate applies (here a pause; a paid tool that has spent today is the same), the
    one-statement claim must not walk the tool's queue looking for rows its gate would pass: it
    goes on with claim_tasks_v1's step-by-step rules, which say why, within the same budget."""
    big = make_tool(loaded)
    bulk_load(loaded, big)
    loaded.execute("UPDATE generation.tools SET paused = true WHERE id = %s", [big])
    params = {
        "tool_id": big,
        "lease_seconds": 120,
        "disabled_override": False,
        "cap_override": None,
        "mirror": False,
    }
    with loaded.transaction(force_rollback=True):
        loaded.execute("SET LOCAL jit = off")
        for _ in range(2):  # the second call, with plpgsql's plans cached
            explained = loaded.execute(
                "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + STATEMENTS["ClaimNextTask"], params
            ).fetchone()
        answer = loaded.execute(STATEMENTS["ClaimNextTask"], params).fetchone()
    assert answer is not None and answer["idle_reason"] == "paused"
    assert explained is not None
    assert buffers(explained["QUERY PLAN"][0]["Plan"]) <= BUFFER_BUDGET


def test_close_reads_the_ledger_by_key_after_it_grew(databases: Databases) -> None:
    """A connection keeps its plans: ones made while the attempts ledger was analyzed empty must
    not scan the whole ledger once it has grown (enable_seqscan = off)."""
    url = url_for(databases.create("ledger_plan"))
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as connection:
        tool = make_tool(connection)
        connection.execute(
            "INSERT INTO generation.tasks (tool_id) SELECT %s FROM generate_series(1, 20)", [tool]
        )
        connection.execute("VACUUM ANALYZE generation.attempts")

        def pair() -> None:
            claimed = connection.execute(
                STATEMENTS["ClaimNextTask"],
                {
                    "tool_id": tool,
                    "lease_seconds": 120,
                    "disabled_override": False,
                    "cap_override": None,
                    "mirror": False,
                },
                prepare=True,
            ).fetchone()
            assert claimed is not None and claimed["id"] is not None
            done = connection.execute(
                STATEMENTS["CompleteTask"],
                {
                    "task_id": claimed["id"],
                    "lease_token": claimed["lease_token"],
                    "output": None,
                    "reported_usage": None,
                    "cost_nanos": 0,
                    "resource_key": None,
                },
                prepare=True,
            ).fetchone()
            assert done is not None and done["status"] == "completed"

        for _ in range(8):  # past the five custom plans a cached statement starts with
            pair()
        connection.execute(
            "INSERT INTO generation.attempts (task_id, attempt, lease_token, tool_id, "
            "resource_key, account_group, local_day, estimate_nanos, outcome) "
            "SELECT gen_random_uuid(), 1, gen_random_uuid(), %s, 'k', 'g', current_date, 0, "
            "'completed' FROM generate_series(1, 20000)",
            [tool],
        )
        with connection.transaction():
            pair()
            scans = connection.execute(
                "SELECT seq_scan FROM pg_stat_xact_user_tables "
                "WHERE relid = 'generation.attempts'::regclass"
            ).fetchone()
    assert scans == {"seq_scan": 0}


def test_batch_reports_read_their_own_rows_whatever_is_in_flight(databases: Databases) -> None:
    """A report batch reads its own tasks and attempts by key, not every run in flight: with the
    statistics taken while nothing ran (the partial indexes of processing tasks and running
    attempts then look empty), a CompleteTasks and a HeartbeatTasks of 100 among 2,000 in flight
    must not fetch every running row per batch."""
    url = url_for(databases.create("report_plan"))
    in_flight, batch = 2_000, 100
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as connection:
        tool = make_tool(connection)
        connection.execute(
            "INSERT INTO generation.tasks (tool_id) SELECT %s FROM generate_series(1, %s)",
            [tool, in_flight],
        )
        connection.execute("VACUUM ANALYZE")
        claim = {
            "tool_id": tool,
            "limit": batch,
            "lease_seconds": 120,
            "disabled_override": False,
            "cap_override": None,
            "mirror": False,
        }
        held = [
            row
            for _ in range(in_flight // batch)
            for row in connection.execute(STATEMENTS["ClaimTasks"], claim).fetchall()
        ]
        assert len(held) == in_flight

        def items(rows: list[dict[str, Any]], **extra: Any) -> psycopg.types.json.Jsonb:
            return psycopg.types.json.Jsonb(
                [
                    {"ordinal": n, "task_id": str(r["id"]), "lease_token": str(r["lease_token"])}
                    | extra
                    for n, r in enumerate(rows)
                ]
            )

        def fetched() -> dict[str, int]:
            # This backend's counts not yet flushed: they grow within a transaction.
            return {
                r["relname"]: r["idx_tup_fetch"]
                for r in connection.execute(
                    "SELECT relname, idx_tup_fetch FROM pg_stat_xact_user_tables "
                    "WHERE relname IN ('tasks', 'attempts')"
                ).fetchall()
            }

        for first in (0, 2 * batch):  # the second pair runs on the plans the first cached
            beats, ends = held[first : first + batch], held[first + batch : first + 2 * batch]
            with connection.transaction():
                before = fetched()
                beaten = connection.execute(
                    STATEMENTS["HeartbeatTasks"], {"items": items(beats), "lease_seconds": 120}
                ).fetchall()
                ended = connection.execute(
                    STATEMENTS["CompleteTasks"], {"items": items(ends, cost_nanos=0)}
                ).fetchall()
                after = fetched()
            read = {name: after[name] - before.get(name, 0) for name in after}
            assert all(r["claim_expires_at"] is not None for r in beaten)
            assert [r["status"] for r in ended] == ["completed"] * batch
            # Each batch reads its 100 tasks and attempts a few times over (locks, updates, the
            # lookups of refused items), never the 1,800 others in flight.
            assert read["tasks"] <= 6 * batch and read["attempts"] <= 6 * batch, read


def test_a_free_claim_and_its_completion_run_in_one_statement_each(databases: Databases) -> None:
    """The default path is the fast one: with no gate, limit or money in play, ClaimNextTask and
    CompleteTask each run their one-statement path (the claim after its gate statement, the
    completion before its key's reset) and none of the step-by-step rules they fall back to (in
    claim_tasks_v1, complete_task_v1); a paid claim and a costed completion run those."""
    url = url_for(databases.create("one_statement"))
    with psycopg.connect(url, row_factory=dict_row) as connection:
        free, paid = make_tool(connection), make_tool(connection)
        connection.execute(
            "UPDATE generation.tools SET cost_estimate_nanos = 10 WHERE id = %s", [paid]
        )
        connection.execute("INSERT INTO generation.tasks (tool_id) VALUES (%s), (%s)", [free, paid])
        connection.commit()
        notices: list[str] = []
        connection.add_notice_handler(lambda d: notices.append(d.message_primary or ""))

        def ran(statement: str, params: dict[str, Any]) -> tuple[dict[str, Any], str]:
            """The answer, and the text of every statement it ran (auto_explain), rolled back."""
            notices.clear()
            connection.execute("LOAD 'auto_explain'")
            connection.execute("SET LOCAL auto_explain.log_min_duration = 0")
            connection.execute("SET LOCAL auto_explain.log_nested_statements = on")
            connection.execute("SET LOCAL auto_explain.log_level = notice")
            found = connection.execute(statement, params).fetchone()
            assert found is not None
            connection.rollback()
            return found, "\n".join(notices)

        fast_claim, step_2 = "WITH chosen AS MATERIALIZED", "tool.cost_estimate_nanos) AS estimate"
        gates = {
            "lease_seconds": 120,
            "disabled_override": False,
            "cap_override": None,
            "mirror": False,
        }
        claimed, texts = ran(STATEMENTS["ClaimNextTask"], {"tool_id": free, **gates})
        assert claimed["id"] is not None
        assert fast_claim in texts and step_2 not in texts
        claimed, texts = ran(STATEMENTS["ClaimNextTask"], {"tool_id": paid, **gates})
        assert claimed["id"] is not None
        assert fast_claim not in texts and step_2 in texts, "money moves: the planned steps decide"

        connection.execute(STATEMENTS["ClaimNextTask"], {"tool_id": free, **gates})
        lease = connection.execute(
            "SELECT id, lease_token FROM generation.tasks WHERE tool_id = %s", [free]
        ).fetchone()
        assert lease is not None
        connection.commit()
        report = {
            "task_id": lease["id"],
            "lease_token": lease["lease_token"],
            "output": None,
            "reported_usage": None,
            "cost_nanos": 0,
            "resource_key": None,
        }
        fast_complete, locked_first = "WITH ended AS", "WHERE id = p_task FOR NO KEY UPDATE"
        completed, texts = ran(STATEMENTS["CompleteTask"], report)
        assert completed["status"] == "completed"
        assert fast_complete in texts and locked_first not in texts
        costed, texts = ran(STATEMENTS["CompleteTask"], {**report, "cost_nanos": 5})
        assert costed["status"] == "completed"
        assert fast_complete not in texts and locked_first in texts, (
            "money moves: the locked steps decide"
        )
