"""The connection pool and the one way statements run through it.

Every call is bounded client-side: a frozen or vanished Postgres costs a caller at most its
deadline (or a default bound from the settings), never a hang. See `Database.fetch`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
import psycopg_pool
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import ExecStatus, TransactionStatus
from psycopg.rows import dict_row

from service.api.errors import DatabaseUnavailable, from_database
from service.api.messages import Row
from service.settings import Settings

log = logging.getLogger(__name__)

STOP_STATEMENT_SECONDS = 2.0
"""The bound on what a stop writes (giving the leader lease up, withdrawing overrides) and on the
hand-backs it waits for: each lapses or ages out on its own, and a frozen database must not hold
a stop for the pool's whole bound (17 s)."""
KEEPALIVE_PROBES = 3
DEADLOCK_RETRIES = 3
"""Runs again of a statement Postgres rolled back to break a deadlock, before the caller sees
UNAVAILABLE (each run waits deadlock_timeout, 1 s by default, before it is chosen)."""


def connection_kwargs(url: str, settings: Settings) -> dict[str, Any]:
    """libpq parameters that make a dead or frozen server noticed, unless the URL sets its own.

    connect_timeout bounds every new connection. Keepalives and tcp_user_timeout drop a TCP
    connection whose peer vanished (they do nothing on a Unix socket, nor against a server that is
    alive but stopped: its kernel still acknowledges; the client-side bound of `fetch` covers that).
    """
    given = conninfo_to_dict(url)
    wanted: dict[str, Any] = {
        "connect_timeout": max(2, int(settings.connect_timeout_seconds)),
        "keepalives": 1,
        "keepalives_idle": settings.tcp_keepalive_seconds,
        "keepalives_interval": max(1, settings.tcp_keepalive_seconds // KEEPALIVE_PROBES),
        "keepalives_count": KEEPALIVE_PROBES,
        "tcp_user_timeout": settings.tcp_user_timeout_ms,
    }
    return {name: value for name, value in wanted.items() if name not in given}


class Database:
    """An async psycopg pool of autocommit connections; each RPC is one statement (an audited
    one with its audit row, in one transaction).

    Statements are prepared on first use on each connection (prepare_threshold=0).
    """

    def __init__(self, url: str, settings: Settings) -> None:
        async def configure(connection: psycopg.AsyncConnection[Any]) -> None:
            await connection.execute(
                f"SET statement_timeout = {int(settings.statement_timeout_ms)}"
            )
            # Short statements only: compiling one with JIT costs more than running it.
            await connection.execute("SET jit = off")

        self.pool_timeout = settings.pool_timeout_seconds
        # The longest a call may take when the caller gives no deadline: the wait for a
        # connection, the statement as long as Postgres lets it run, and a margin for the trip.
        self.default_timeout = (
            settings.pool_timeout_seconds
            + settings.statement_timeout_ms / 1000
            + settings.statement_margin_seconds
        )
        self.ping_timeout = settings.ping_timeout_seconds
        # Statements given up on, still unwinding (see `_abandon`); kept so none is collected.
        self._abandoned: set[asyncio.Future[list[Row]]] = set()
        self.pool: psycopg_pool.AsyncConnectionPool[psycopg.AsyncConnection[Row]] = (
            psycopg_pool.AsyncConnectionPool(
                url,
                min_size=settings.pool_min_size,
                max_size=settings.pool_max_size,
                timeout=settings.pool_timeout_seconds,
                kwargs={
                    "autocommit": True,
                    "prepare_threshold": 0,
                    "row_factory": dict_row,
                    **connection_kwargs(url, settings),
                },
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

    async def fetch(
        self,
        sql: str,
        params: dict[str, Any],
        timeout: float | None = None,
        then: tuple[str, dict[str, Any]] | None = None,
        rerun_deadlocks: bool = False,
    ) -> list[Row]:
        """Runs one statement; a database failure comes out as a ServiceError when it means one.

        `then`, a second statement and its parameters (an audit row), runs after it in the same
        transaction: both commit or neither does. The rows are the first statement's. A bound
        that passes after the commit loses the answer but not the change: the caller's retry
        runs the statement again (each transition answers its own retry) and writes a second
        audit row, for a second call.

        `rerun_deadlocks`: the statement can wait in a cycle by design; when Postgres rolls it
        back to break one, it runs again (DEADLOCK_RETRIES times at most).

        The whole call, the wait for a pool connection and the statement, takes at most `timeout`
        seconds (the caller's remaining deadline) and never more than `default_timeout`; the wait
        for a connection at most the pool timeout too. Past that it raises DatabaseUnavailable
        at once: the statement is cancelled in the background, its connection dropped when
        Postgres does not confirm the cancel, so a frozen server cannot hold the caller.
        """
        bound = self.default_timeout if timeout is None else min(timeout, self.default_timeout)
        if bound <= 0:
            raise DatabaseUnavailable("deadline exceeded before the database was asked")
        # A task of its own: cancelling psycopg mid-statement waits for the server (it sends
        # a cancel request and reads the answer), which a frozen server never gives.
        work = asyncio.ensure_future(
            self._fetch(sql, params, min(bound, self.pool_timeout), then, rerun_deadlocks)
        )
        try:
            done, _ = await asyncio.wait((work,), timeout=bound)
        except BaseException:  # the caller was cancelled (its RPC ended): it does not wait
            self._abandon(work)
            raise
        if not done:
            self._abandon(work)
            raise DatabaseUnavailable(
                f"the database did not answer within {bound:.1f} s, retry later"
            )
        return work.result()

    async def _fetch(
        self,
        sql: str,
        params: dict[str, Any],
        wait: float,
        then: tuple[str, dict[str, Any]] | None,
        rerun_deadlocks: bool,
    ) -> list[Row]:
        stale = deadlocks = 0
        try:
            while True:
                try:
                    return await self._run(sql, params, wait, then)
                except psycopg.errors.FeatureNotSupported as error:
                    # A migration changed a table under statements prepared on the pooled
                    # connections (a rolling deploy: docs/OPERATIONS.md, "Upgrading"). Nothing
                    # ran, and _run dropped the connection with its prepared statements: run it
                    # again, on the next one.
                    if "cached plan must not change result type" not in str(error):
                        raise
                    stale += 1
                    if stale > self.pool.max_size:
                        raise
                except psycopg.errors.DeadlockDetected:
                    # Postgres chose this statement to break a wait cycle and rolled all of it
                    # back, so running it again is the caller's own retry; the other side has
                    # gone on, and the second run waits for it, not in a cycle. Only for a
                    # statement that can meet such a cycle by design (an enqueue's new keys):
                    # any other deadlock is a break of the lock order and must be seen.
                    deadlocks += 1
                    if not rerun_deadlocks or deadlocks > DEADLOCK_RETRIES:
                        raise
                    log.info("statement lost a deadlock; running it again")
        except (psycopg.Error, psycopg_pool.PoolTimeout) as error:
            translated = from_database(error)
            if translated is None:
                raise
            raise translated from error

    async def _run(
        self,
        sql: str,
        params: dict[str, Any],
        wait: float,
        then: tuple[str, dict[str, Any]] | None,
    ) -> list[Row]:
        async with self.pool.connection(timeout=wait) as connection:
            try:
                if then is None:
                    cursor = await connection.execute(sql, params)
                    return await _rows(cursor)
                async with connection.transaction():
                    cursor = await connection.execute(sql, params)
                    rows = await _rows(cursor)
                    await connection.execute(*then)
                return rows
            except psycopg.errors.FeatureNotSupported:
                await connection.close()
                raise
            except BaseException:
                # Interrupted mid-statement (cancelled, or the cancel was not confirmed): drop
                # the connection rather than hand the next caller a busy one. The pool sees it
                # closed and opens a replacement.
                if connection.pgconn.transaction_status != TransactionStatus.IDLE:
                    await connection.close()
                raise

    def _abandon(self, work: asyncio.Future[list[Row]]) -> None:
        """Cancels a statement nobody waits for any more and lets it unwind on its own.

        psycopg answers the cancellation by asking the server to cancel the statement (5 s at
        most) and waiting for it to end (5 s more), then closes the connection if it did not;
        the connection is returned to the pool only if it came back idle.
        """
        work.cancel()
        self._abandoned.add(work)
        work.add_done_callback(self._forget)

    def _forget(self, work: asyncio.Future[list[Row]]) -> None:
        self._abandoned.discard(work)
        if not work.cancelled() and (error := work.exception()) is not None:
            log.debug("a statement given up on ended with %r", error)

    async def ping(self) -> bool:
        """True when a pool connection answers SELECT 1 within `ping_timeout` seconds."""
        try:
            await self.fetch("SELECT 1", {}, timeout=self.ping_timeout)
        except Exception:
            return False
        return True


async def _rows(cursor: psycopg.AsyncCursor[Row]) -> list[Row]:
    """The statement's rows, none for a statement that returns none. Asked of its result's
    status, not of `cursor.description`, which makes an object per column on every call: 33 µs
    for a task's 34 columns."""
    result = cursor.pgresult
    if result is None or result.status != ExecStatus.TUPLES_OK:
        return []
    return await cursor.fetchall()
