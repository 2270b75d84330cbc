"""The docs stay true: every setting the service reads is in docs/OPERATIONS.md, and the SQL of
docs/SCALING.md runs against the schema."""

from __future__ import annotations

import re
from dataclasses import fields

import psycopg

from service.settings import Settings, env_names
from tests.conftest import ROOT, Databases, url_for


def test_every_setting_is_documented() -> None:
    operations = (ROOT / "docs" / "OPERATIONS.md").read_text()
    for field in fields(Settings):
        for name in env_names(field.name):
            assert f"`{name}`" in operations, f"{name} is missing from docs/OPERATIONS.md"


# The Citus calls of docs/SCALING.md, as no-ops that still resolve their arguments: a table or a
# function named there must exist in the schema (regclass and regprocedure check it).
CITUS_STUBS = """
CREATE FUNCTION pg_temp.create_distributed_table(
    t regclass, col text, colocate_with text DEFAULT 'default') RETURNS void
    LANGUAGE sql AS 'SELECT';
CREATE FUNCTION pg_temp.create_reference_table(t regclass) RETURNS void LANGUAGE sql AS 'SELECT';
CREATE FUNCTION pg_temp.create_distributed_function(
    f regprocedure, arg text, colocate_with text) RETURNS void LANGUAGE sql AS 'SELECT';
"""


def test_the_sql_in_scaling_runs_against_the_schema(databases: Databases) -> None:
    page = (ROOT / "docs" / "SCALING.md").read_text()
    blocks = re.findall(r"```sql\n(.*?)```", page, re.DOTALL)
    assert blocks, "SCALING.md shows its SQL"
    with psycopg.connect(url_for(databases.create("scaling"))) as db:  # its own: DDL locks
        db.execute(CITUS_STUBS)
        for block in blocks:
            db.execute(block.replace("SELECT create_", "SELECT pg_temp.create_"))
        db.rollback()
