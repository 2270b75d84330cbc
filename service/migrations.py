"""Alembic, driven from code: `genq migrate` and the server's start both call `upgrade`.

The revisions live in the repository's top-level alembic/ folder. The wheel ships that folder as
the package `genq_migrations` (pyproject.toml maps it; it must not be installed as `alembic`,
the library's own name), so an installed genq migrates from any working directory. No
alembic.ini is read here: that file only serves an `alembic` command run in the repository.

alembic/env.py holds a Postgres advisory lock on LOCK_KEY while it migrates, so replicas that
start at once take turns: the first migrates, the others then find head and carry on.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from alembic.config import Config

from alembic import command

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
    config = Config()
    # ConfigParser interpolates %: a path holding one must escape it.
    config.set_main_option("script_location", str(script_location()).replace("%", "%%"))
    config.attributes["database_url"] = url
    return config


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """To `revision` ("base" drops everything): always explicit, there is no default."""
    command.downgrade(_config(url), revision)
