"""The baseline: the generation schema as proto/generation/task/v1/schema.sql declares it.

The upgrade runs that file itself, read from the installed package `generation.task.v1`
(proto/build.py copies it there), so a database migrated to this revision is exactly schema.sql;
tests/migration/test_schema.py checks it. The downgrade drops the schema: schema.sql creates nothing
outside it.

Revision ID: 0001
Revises:
Create Date: 2026-12-04
"""

from importlib.resources import files

import psycopg

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema = files("generation.task.v1").joinpath("schema.sql").read_text(encoding="utf-8")
    # On psycopg's own connection, inside alembic's transaction, with no parameters: the text
    # runs as written, its % and : never taken for placeholders.
    connection = op.get_bind().connection.driver_connection
    assert isinstance(connection, psycopg.Connection)
    connection.execute(schema)


def downgrade() -> None:
    op.execute("DROP SCHEMA generation CASCADE")
