"""Alembic, driven from code: `genq migrate` and the server's start both call `upgrade`.

The revisions live in the repository's top-level alembic/ folder. The wheel ships that folder as
the package `genq_migrations` (pyproject.toml maps it; it must not be installed as `alembic`,
the library's own name), so an installed genq migrates from any working directory. No
alembic.ini is read here: that file only serves an `alembic` command run in the repository.

alembic/env.py holds a Postgres advisory lock on LOCK_KEY while it migrates, so replicas that
start at once take turns: the first migrates, the others then find head and carry on.

Alembic logs each step at INFO (and its plugins at import): held back unless the migration fails
(service/logs.py), and summed up in one line, the revision before and after.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from service import logs

if TYPE_CHECKING:
    from alembic.config import Config

log = logging.getLogger(__name__)

PACKAGE = "genq_migrations"
ROOT = Path(__file__).resolve().parent.parent

LOCK_KEY = 0x67656E71  # "genq" in ASCII, 1734700657: pg_advisory_lock(bigint) around a migration


def sqlalchemy_url(url: str) -> str:
    """The same database, addressed through SQLAlchemy's psycopg 3 dialect."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url.removeprefix(prefix)
    return url


def script_location() -> Path:
    """The folder holding env.py and versions/: the installed `genq_migrations` package, else
    (an editable install made before that package existed) alembic/ beside `service`."""
    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / "env.py").is_file():
            return Path(folder)
    checkout = ROOT / "alembic"
    if (checkout / "env.py").is_file():
        return checkout
    raise RuntimeError(f"no migrations found: neither the package {PACKAGE} nor {checkout}")


def _config(url: str) -> Config:
    from alembic.config import Config

    config = Config()
    # ConfigParser interpolates %: a path holding one must escape it.
    config.set_main_option("script_location", str(script_location()).replace("%", "%%"))
    config.attributes["database_url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> None:
    with _migrating(url, f"upgrade to {revision}"):
        from alembic import command  # here, held back: alembic logs its plugins at import

        command.upgrade(_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """To `revision` ("base" drops everything): always explicit, there is no default."""
    with _migrating(url, f"downgrade to {revision}"):
        from alembic import command

        command.downgrade(_config(url), revision)


@contextmanager
def _migrating(url: str, what: str) -> Iterator[None]:
    """Alembic held back while the block migrates; then one line: the revision now and before."""
    with logs.held_back(f"the migration ({what})", "alembic"):
        before = current_revision(url)
        yield
        after = current_revision(url)
    if before == after:
        log.info("database schema at revision %s: nothing to migrate", after or "base")
    else:
        log.info("database schema at revision %s (was %s)", after or "base", before or "base")


def current_revision(url: str) -> str | None:
    """The database's alembic revision (None: not migrated, or at base)."""
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine, pool

    engine = create_engine(sqlalchemy_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            revision: str | None = MigrationContext.configure(connection).get_current_revision()
            return revision
    finally:
        engine.dispose()
