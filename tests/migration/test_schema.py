"""schema.sql is the schema (GUIDE A2): the baseline migration builds exactly it, base is empty
again, and every function in it is one something runs."""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from generation.task.v1 import task_pb2
from service import migrations
from service.api.rpcs import STATEMENTS
from tests.conftest import ROOT, Databases, url_for
from tests.integration.test_semantics import Db, Stub, claim, queue

SCHEMA_SQL = ROOT / "proto" / "generation" / "task" / "v1" / "schema.sql"
SERVICE = ROOT / "service"

CATALOG = {
    "columns": """
        SELECT table_name, column_name, udt_name, is_nullable, column_default,
               row_number() OVER (PARTITION BY table_name ORDER BY ordinal_position) AS position
        FROM information_schema.columns WHERE table_schema = 'generation'
        ORDER BY table_name, ordinal_position""",
    "constraints": """
        SELECT conrelid::regclass::text AS rel, conname, pg_get_constraintdef(oid) AS def
        FROM pg_constraint WHERE connamespace = 'generation'::regnamespace ORDER BY 1, 2""",
    "indexes": """
        SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'generation' ORDER BY 1""",
    "enums": """
        SELECT t.typname, e.enumsortorder, e.enumlabel FROM pg_enum e JOIN pg_type t
        ON t.oid = e.enumtypid WHERE t.typnamespace = 'generation'::regnamespace ORDER BY 1, 2""",
    "functions": """
        SELECT p.proname, pg_get_functiondef(p.oid) AS def FROM pg_proc p
        WHERE p.pronamespace = 'generation'::regnamespace ORDER BY 1""",
    "storage": """
        SELECT relname, relkind, reloptions FROM pg_class
        WHERE relnamespace = 'generation'::regnamespace ORDER BY 1""",
    "triggers": """
        SELECT tgname, pg_get_triggerdef(oid) AS def FROM pg_trigger
        WHERE tgrelid IN (SELECT oid FROM pg_class WHERE relnamespace = 'generation'::regnamespace)
        ORDER BY 1""",
    "views": """
        SELECT viewname, definition FROM pg_views WHERE schemaname = 'generation' ORDER BY 1""",
}

OBJECTS = r"""
    WITH ns AS (
        SELECT oid, nspname FROM pg_namespace
        WHERE nspname NOT LIKE 'pg\_%' AND nspname <> 'information_schema')
    SELECT 'schema' AS kind, nspname AS name FROM ns
    UNION ALL SELECT 'relation', c.oid::regclass::text
              FROM pg_class AS c JOIN ns ON ns.oid = c.relnamespace
    UNION ALL SELECT 'function', p.oid::regprocedure::text
              FROM pg_proc AS p JOIN ns ON ns.oid = p.pronamespace
    UNION ALL SELECT 'type', t.oid::regtype::text
              FROM pg_type AS t JOIN ns ON ns.oid = t.typnamespace
    UNION ALL SELECT 'extension', extname FROM pg_extension
    UNION ALL SELECT 'event trigger', evtname FROM pg_event_trigger
    ORDER BY 1, 2"""
"""Everything a database holds outside the system catalogs."""


def catalog(url: str) -> dict[str, list[dict[str, Any]]]:
    with psycopg.connect(url, row_factory=dict_row) as connection:
        return {name: connection.execute(query).fetchall() for name, query in CATALOG.items()}


def objects(url: str) -> set[tuple[str, str]]:
    with psycopg.connect(url) as connection:
        return {(kind, name) for kind, name in connection.execute(OBJECTS).fetchall()}


def test_the_migrated_database_is_exactly_schema_sql(databases: Databases) -> None:
    """`genq migrate` runs the packaged copy of schema.sql (generation/task/v1/schema.sql), the
    same as proto/'s: catalogs and function bodies alike."""
    migrated = url_for(databases.create("drift_alembic", template=None))
    migrations.upgrade(migrated)
    applied = url_for(databases.create("drift_sql", template=None))
    with psycopg.connect(applied, autocommit=True) as connection:
        connection.execute(SCHEMA_SQL.read_text())

    from_alembic, from_sql = catalog(migrated), catalog(applied)

    assert from_alembic["columns"], "the migration built nothing"
    for part in CATALOG:
        assert from_alembic[part] == from_sql[part], f"{part} differ between alembic and schema.sql"


def test_the_baseline_downgrades_to_empty_and_back(databases: Databases) -> None:
    """Down to base leaves the database as it was before the first migration, but for alembic's
    own version table (empty), and the baseline then builds the whole schema again."""
    empty = objects(url_for(databases.create("empty", template=None)))
    url = url_for(databases.create("downgrade", template=None))
    migrations.upgrade(url)
    assert ("schema", "generation") in objects(url)
    migrations.downgrade(url, "base")

    left = {(kind, name) for kind, name in objects(url) if "alembic_version" not in name}
    assert left == empty
    with psycopg.connect(url) as connection:
        assert connection.execute("SELECT count(*) FROM alembic_version").fetchone() == (0,)
    migrations.upgrade(url)
    assert catalog(url) == catalog(url_for(databases.template))


def test_queue_table_is_tuned_for_a_hot_queue(db: Db) -> None:
    found = db.execute(
        "SELECT reloptions FROM pg_class WHERE oid = 'generation.tasks'::regclass"
    ).fetchone()
    assert found is not None
    options = dict(option.split("=") for option in found["reloptions"])
    assert int(options["fillfactor"]) < 100
    assert float(options["autovacuum_vacuum_scale_factor"]) == 0.0
    assert int(options["autovacuum_vacuum_threshold"]) <= 5000


def test_a_tool_is_never_deleted(stub: Stub, db: Db, tool_id: str) -> None:
    """Tasks name their tool without a foreign key, so nothing may remove a tool from under them
    or renumber it: a DELETE, a TRUNCATE (which would also skip a key) or an UPDATE of its id.
    Its other columns still change (ConfigureTool)."""
    task = queue(stub, tool_id)
    for statement in (
        "DELETE FROM generation.tools WHERE id = %(tool)s",
        "TRUNCATE generation.tools CASCADE",
        "UPDATE generation.tools SET id = gen_random_uuid() WHERE id = %(tool)s",
    ):
        with pytest.raises(psycopg.errors.RestrictViolation, match="never deleted"):
            db.execute(statement, {"tool": tool_id})
    kept = db.execute(
        "SELECT t.id FROM generation.tasks AS t JOIN generation.tools AS o ON o.id = t.tool_id "
        "WHERE t.id = %s",
        [task.id],
    ).fetchall()
    assert len(kept) == 1
    stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, paused=True))


def test_heartbeat_is_a_hot_update(stub: Stub, db: Db, tool_id: str) -> None:
    """A heartbeat changes no indexed column, so Postgres updates the row in place (HOT)."""
    task = queue(stub, tool_id)
    claimed = claim(stub, tool_id)
    with db.transaction():
        for _ in range(3):
            beat = db.execute(
                STATEMENTS["HeartbeatTask"],
                {"task_id": task.id, "lease_token": claimed.lease_token, "lease_seconds": 120},
            ).fetchone()
            assert beat is not None and beat["claim_expires_at"] is not None
        counts = db.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables "
            "WHERE relid = 'generation.tasks'::regclass"
        ).fetchone()
    assert counts == {"n_tup_upd": 3, "n_tup_hot_upd": 3}


def test_an_attempts_close_is_a_hot_update(stub: Stub, db: Db, tool_id: str) -> None:
    """Closing a run's attempt changes no indexed column (no index holds its outcome, end, cost
    or key) and its page has room for the new version: every way a run ends, one statement or
    set-wise, updates the attempt in place (HOT), writing no index entry."""
    runs = []
    for _ in range(4):
        task = queue(stub, tool_id)
        runs.append((task.id, claim(stub, tool_id).lease_token))
    (one, token_one), (many, token_many), (failed, token_failed), (released, token_released) = runs
    with db.transaction():
        db.execute(
            "SELECT * FROM generation.complete_task_v1(%s, %s, '{}', NULL, 0, NULL)",
            [one, token_one],
        )
        db.execute(
            "SELECT * FROM generation.complete_tasks_v1(%s)",
            [Jsonb([{"ordinal": 0, "task_id": many, "lease_token": token_many, "output": {}}])],
        )
        db.execute(
            "SELECT * FROM generation.fail_task_v1(%s, %s, 'retryable', 'boom', 0, NULL)",
            [failed, token_failed],
        )
        db.execute(
            "SELECT * FROM generation.release_task_v1(%s, %s, 0, false)",
            [released, token_released],
        )
        counts = db.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables "
            "WHERE relid = 'generation.attempts'::regclass"
        ).fetchone()
    assert counts == {"n_tup_upd": 4, "n_tup_hot_upd": 4}


def test_a_keys_runs_in_flight_are_its_processing_tasks(stub: Stub, db: Db, tool_id: str) -> None:
    """generation.key_running_v1 counts a key's runs from the tasks processing under it (their
    own key, or their tool's), as the ledger's running attempts of the key count them, up to
    the limit asked."""
    name = db.execute("SELECT name FROM generation.tools WHERE id = %s", [tool_id]).fetchone()
    assert name is not None
    tool_key, own = name["name"], f"own-{tool_id}"
    for key in (None, None, tool_key, own, own):
        queue(stub, tool_id, **({} if key is None else {"resource_key": key}))
    claims = [claim(stub, tool_id) for _ in range(5)]

    def running(key: str, limit: int = 100) -> tuple[int, int]:
        found = db.execute(
            "SELECT generation.key_running_v1(%(key)s, %(limit)s) AS counted, "
            "(SELECT count(*) FROM generation.attempts WHERE tool_id = %(tool)s "
            " AND resource_key = %(key)s AND outcome = 'running') AS ledger",
            {"key": key, "limit": limit, "tool": tool_id},
        ).fetchone()
        assert found is not None
        return found["counted"], found["ledger"]

    assert running(tool_key) == (3, 3) and running(own) == (2, 2)
    assert running(tool_key, limit=2)[0] == 2
    for done in claims[::2]:
        stub.CompleteTask(
            task_pb2.CompleteTaskRequest(task_id=done.task.id, lease_token=done.lease_token)
        )
    assert running(tool_key) == (1, 1) and running(own) == (1, 1)


def test_the_attempts_ended_since_a_time_are_exactly_those(db: Db, tool_id: str) -> None:
    """generation.attempts_ended_since_v1 reads the runs started since 10 minutes before the
    window and the long runs, not the whole ledger; together they are every run that ended in
    the window, each once, whatever it lasted."""
    # (started, ended) minutes ago: short and long runs, inside and outside a 60-minute window,
    # on either side of the 10 minutes before it, and one still running.
    spans = [(5, 1), (65, 59), (69, 50), (71, 59), (75, 62), (300, 2), (300, 61), (59, 59)]
    spans.append((3, None))
    with db.transaction(force_rollback=True):
        read, expected = ended_in_the_last_hour(db, tool_id, spans)
    assert read == expected
    assert len(expected) == 6


def ended_in_the_last_hour(
    db: Db, tool_id: str, spans: list[tuple[int, int | None]]
) -> tuple[list[str], list[str]]:
    """Runs of the tool started and ended these minutes ago: those the function reads as ended
    in the last hour, and those that did."""
    tokens = []
    for started, ended in spans:
        found = db.execute(
            "INSERT INTO generation.attempts (task_id, attempt, lease_token, tool_id, "
            "resource_key, account_group, local_day, estimate_nanos, started_at, ended_at, "
            "outcome) VALUES (gen_random_uuid(), 1, gen_random_uuid(), %s, 'k', 'g', "
            "current_date, 0, now() - make_interval(mins => %s), "
            "now() - make_interval(mins => %s), "
            "CASE WHEN %s::integer IS NULL THEN 'running' ELSE 'completed' END"
            "::generation.attempt_outcome) RETURNING lease_token",
            [tool_id, started, ended, ended],
        ).fetchone()
        assert found is not None
        tokens.append(found["lease_token"])
    window = "now() - interval '1 hour'"
    read = db.execute(
        f"SELECT lease_token FROM generation.attempts_ended_since_v1({window}) "
        "WHERE lease_token = ANY(%s)",
        [tokens],
    ).fetchall()
    expected = db.execute(
        f"SELECT lease_token FROM generation.attempts WHERE ended_at > {window} "
        "AND lease_token = ANY(%s)",
        [tokens],
    ).fetchall()
    return sorted(str(r["lease_token"]) for r in read), sorted(
        str(r["lease_token"]) for r in expected
    )


def test_every_transition_is_planned_once_and_by_key(db: Db) -> None:
    """Each PL/pgSQL function of the schema carries the three settings; one added without them
    would replan every call, keep a seq-scan plan made while a table was small, or be
    JIT-compiled (for the 10^10 a disabled scan costs) in a session with JIT on."""
    unset = db.execute(
        "SELECT p.proname FROM pg_proc AS p JOIN pg_language AS l ON l.oid = p.prolang "
        "WHERE p.pronamespace = 'generation'::regnamespace AND l.lanname = 'plpgsql' "
        "AND NOT (p.proconfig @> ARRAY['plan_cache_mode=force_generic_plan', "
        "'enable_seqscan=off', 'jit=off'])"
    ).fetchall()
    assert unset == []


FUNCTION = re.compile(r"^CREATE FUNCTION generation\.(\w+)\(.*?^\$\$;$", re.MULTILINE | re.DOTALL)
TRIGGER = re.compile(r"EXECUTE FUNCTION generation\.(\w+)\(")


def calls(text: str, names: set[str]) -> set[str]:
    """The functions of `names` that `text` calls: `generation.<name>(`."""
    return {name for name in names if f"generation.{name}(" in text}


def unreachable(schema: str, statements: list[str]) -> set[str]:
    """The functions schema.sql creates that nothing runs: reached from no RPC's `sql` option,
    no statement of the service, no trigger, and no function reached so."""
    bodies = {
        match.group(1): re.sub(r"--[^\n]*", "", match.group(0))
        for match in FUNCTION.finditer(schema)
    }
    names = set(bodies)
    outside = FUNCTION.sub("", schema)
    reached = set(TRIGGER.findall(outside)) & names
    for text in statements:
        reached |= calls(text, names)
    todo = list(reached)
    while todo:
        for name in calls(bodies[todo.pop()], names) - reached:
            reached.add(name)
            todo.append(name)
    return names - reached


def test_every_function_is_one_something_runs() -> None:
    """Each function of schema.sql is reached from an RPC's SQL, a statement of the service (any
    module under service/), a trigger, or another function so reached; and each is the `_v1`
    0.1.0 ships, so a change cannot leave the version it replaced behind."""
    schema = SCHEMA_SQL.read_text()
    service = [path.read_text() for path in sorted(SERVICE.rglob("*.py"))]
    names = {match.group(1) for match in FUNCTION.finditer(schema)}
    assert {"claim_tasks_v1", "complete_task_v1", "keep_tools_v1"} <= names, "the parse found them"

    assert unreachable(schema, [*STATEMENTS.values(), *service]) == set()
    assert sorted(name for name in names if not name.endswith("_v1")) == []

    dead = "CREATE FUNCTION generation.dead_v1() RETURNS void\nLANGUAGE sql\nAS $$\n$$;\n"
    assert unreachable(schema + dead, [*STATEMENTS.values(), *service]) == {"dead_v1"}
