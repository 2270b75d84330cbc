"""Runs the revisions against DATABASE_URL (or the URL `service.migrations` passes in)."""

import os

from sqlalchemy import create_engine, pool

from alembic import context
from service.migrations import sqlalchemy_url

url = context.config.attributes.get("database_url") or os.environ["DATABASE_URL"]
engine = create_engine(sqlalchemy_url(url), poolclass=pool.NullPool)
with engine.connect() as connection:
    # The version table lives in public, outside the schema the revisions create and drop.
    context.configure(connection=connection, transactional_ddl=True)
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
