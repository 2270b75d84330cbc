"""Runs the revisions against DATABASE_URL (or the URL `service.migrations` passes in).

Under a Postgres advisory lock (service.migrations.LOCK_KEY), so that replicas migrating at once
take turns: the first migrates, the others wait, then find head and change nothing.
"""

import os

from sqlalchemy import create_engine, pool, text

from alembic import context
from service.migrations import LOCK_KEY, sqlalchemy_url

url = context.config.attributes.get("database_url") or os.environ["DATABASE_URL"]
engine = create_engine(sqlalchemy_url(url), poolclass=pool.NullPool)
with engine.connect() as connection:
    # A session lock on the connection alembic uses, taken (and its transaction ended) before
    # alembic reads the version table: a replica that waited reads what the first one committed.
    # Closing the connection releases it too, should a revision fail.
    connection.execute(text(f"SELECT pg_advisory_lock({LOCK_KEY})"))
    connection.commit()
    # The version table lives in public, outside the schema the revisions create and drop.
    context.configure(connection=connection, transactional_ddl=True)
    with context.begin_transaction():
        context.run_migrations()
    connection.execute(text(f"SELECT pg_advisory_unlock({LOCK_KEY})"))
    connection.commit()
engine.dispose()
