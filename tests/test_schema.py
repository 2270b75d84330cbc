"""Alembic owns the schema (GUIDE A2): head is exactly schema.sql, and base is empty again."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from generation.task.v1 import task_pb2
from service import migrations
from service.rpcs import STATEMENTS
from tests.conftest import ROOT, Databases, url_for
from tests.test_semantics import Db, Stub, claim, queue

SCHEMA_SQL = ROOT / "proto" / "generation" / "task" / "v1" / "schema.sql"

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
}


def catalog(url: str) -> dict[str, list[dict[str, Any]]]:
    with psycopg.connect(url, row_factory=dict_row) as connection:
        return {name: connection.execute(query).fetchall() for name, query in CATALOG.items()}


def test_alembic_head_is_exactly_schema_sql(databases: Databases) -> None:
    migrated = url_for(databases.create("drift_alembic", template=None))
    migrations.upgrade(migrated)
    applied = url_for(databases.create("drift_sql", template=None))
    with psycopg.connect(applied, autocommit=True) as connection:
        connection.execute(SCHEMA_SQL.read_text())

    from_alembic, from_sql = catalog(migrated), catalog(applied)

    assert from_alembic["columns"], "the migration built nothing"
    for part in CATALOG:
        assert from_alembic[part] == from_sql[part], f"{part} differ between alembic and schema.sql"


def test_downgrade_to_base_and_back(databases: Databases) -> None:
    url = url_for(databases.create("downgrade", template=None))
    migrations.upgrade(url)
    migrations.downgrade(url, "base")
    with psycopg.connect(url) as connection:
        left = connection.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname = 'generation'"
        ).fetchone()
        assert left == (0,)
    migrations.upgrade(url)
    assert catalog(url)["columns"]


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
    """Alembic 0015: tasks name their tool without a foreign key, so nothing may remove a tool
    from under them or renumber it: a DELETE, a TRUNCATE (which would also have skipped the key)
    or an UPDATE of its id. Its other columns still change (ConfigureTool)."""
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


def test_every_transition_is_planned_once_and_by_key(db: Db) -> None:
    """Alembic 0010 and 0014: each PL/pgSQL function of the schema carries the three settings;
    one added without them would replan every call, keep a seq-scan plan made while a table was
    small, or be JIT-compiled (for the 10^10 a disabled scan costs) in a session with JIT on."""
    unset = db.execute(
        "SELECT p.proname FROM pg_proc AS p JOIN pg_language AS l ON l.oid = p.prolang "
        "WHERE p.pronamespace = 'generation'::regnamespace AND l.lanname = 'plpgsql' "
        "AND NOT (p.proconfig @> ARRAY['plan_cache_mode=force_generic_plan', "
        "'enable_seqscan=off', 'jit=off'])"
    ).fetchall()
    assert unset == []
