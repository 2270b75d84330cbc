"""The connection pool and the one way statements run through it."""

from __future__ import annotations

from typing import Any

import psycopg
import psycopg_pool
from psycopg.rows import dict_row

from service.errors import from_database
from service.messages import Row
from service.settings import Settings


class Database:
    """An async psycopg pool of autocommit connections; each RPC is one statement.

    Statements are prepared on first use on each connection (prepare_threshold=0).
    """

    def __init__(self, url: str, settings: Settings) -> None:
        async def configure(connection: psycopg.AsyncConnection[Any]) -> None:
            await connection.execute(
                f"SET statement_timeout = {int(settings.statement_timeout_ms)}"
            )
            # Short statements only: compiling one with JIT costs more than running it.
            await connection.execute("SET jit = off")

        self.pool: psycopg_pool.AsyncConnectionPool[psycopg.AsyncConnection[Row]] = (
            psycopg_pool.AsyncConnectionPool(
                url,
                min_size=settings.pool_min_size,
                max_size=settings.pool_max_size,
                timeout=settings.pool_timeout_seconds,
                kwargs={"autocommit": True, "prepare_threshold": 0, "row_factory": dict_row},
                configure=configure,
                open=False,
                name="genq",
            )
        )

    async def open(self) -> None:
        # wait=False: the service starts (and answers UNAVAILABLE) even while Postgres is down.
        await self.pool.open(wait=False)

    async def close(self) -> None:
        await self.pool.close()

    async def fetch(self, sql: str, params: dict[str, Any]) -> list[Row]:
        """Runs one statement; a database failure comes out as a ServiceError when it means one."""
        try:
            async with self.pool.connection() as connection:
                cursor = await connection.execute(sql, params)
                return await cursor.fetchall() if cursor.description else []
        except (psycopg.Error, psycopg_pool.PoolTimeout) as error:
            translated = from_database(error)
            if translated is None:
                raise
            raise translated from error

    async def ping(self) -> bool:
        try:
            await self.fetch("SELECT 1", {})
        except Exception:
            return False
        return True
