"""What the service does after a statement commits: wake parked claims and event watchers here,
tell the other processes and replicas through Postgres NOTIFY, and, when Redis is configured,
through Redis too and mirror events into Redis Streams.

Nothing here can fail a call. NOTIFY and Redis work run after the commit, off the call's path;
their errors are logged and dropped, and the short re-check of every parked reader is the floor.

The Postgres wake (`WAKE_CHANNEL`): `task_queued` adds the tool to a pending map (tool id → tasks
queued) and, unless a send is in flight, starts one; while it is in flight more tools and counts
collect, and the next send takes them all. A send is one `SELECT pg_notify(...) FROM unnest(...)`
on a dedicated autocommit connection, never the enqueue's own transaction: a transaction that
notifies takes a database-wide lock at commit, which would serialize every enqueue. The payload
is `{tool_id}:{count}`. Every process LISTENs on a dedicated connection of its own and wakes up to
`count` parked claims of the tool; it skips what its own notifier sent (it woke those claims
in-process already). A lost listener reconnects with backoff and, once back, wakes every parked
claim once, since wakes may have been missed meanwhile.

The event mirror keeps each task's Redis Stream in sequence order, its terminal event last.
`event_added` only appends the event to one bounded queue (O(1), never awaits); one mirror task
drains it in the order the events were added, a batch at a time: within a batch each task's
events are sorted by sequence, and the batch goes out as one pipeline on one connection, which
Redis executes in order, before the next batch is taken. Events of a task are added in commit
order (the statements that add them lock the task's row), so the stream follows the sequence.
An event arriving after a later one of its task was already mirrored (its statement's answer
overtaken by a later one's) is dropped rather than written out of order; Postgres keeps every
event, and `WatchTaskEvents` replays them all. The order holds per service process: with several
replicas writing events of one task, each mirrors its own.

The queue is bounded (`MIRROR_QUEUE_MAX`): when Redis is slower than the events, the newest are
dropped (logged). Each batch sets every stream it wrote to expire `STREAM_TTL_SECONDS` after its
last write, so the expiry follows the terminal event, and a stream whose terminal event was
dropped still expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable
from typing import Any

import psycopg
import redis.asyncio as redis

from service.api.wake import Wake
from service.database import connection_kwargs
from service.settings import Settings

log = logging.getLogger(__name__)

TERMINAL_EVENTS = {"completed", "failed", "cancelled", "expired"}
STREAM_MAXLEN = 10_000
STREAM_TTL_SECONDS = 7 * 86_400

MIRROR_QUEUE_MAX = 10_000
"""Events waiting for the mirror at most; beyond it new ones are dropped."""

MIRROR_BATCH_MAX = 500
"""Events written in one pipeline at most."""

MIRROR_TRACKED_TASKS = 10_000
"""Tasks whose last mirrored sequence is remembered (the most recently written ones)."""

CLOSE_TIMEOUT_SECONDS = 2.0

WAKE_CHANNEL = "genq_wake"
"""The Postgres NOTIFY channel of wakes, payload `{tool_id}:{count}`; per database."""

NOTIFY_SQL = f"SELECT pg_notify('{WAKE_CHANNEL}', w) FROM unnest(%(wakes)s::text[]) AS w"
NOTIFY_TIMEOUT_SECONDS = 2.0
"""A send that takes longer is given up (its wakes dropped) and its connection closed."""

NOTIFY_RETRY_SECONDS = 1.0
"""After a failed send, wakes are dropped (not queued) for this long before connecting again."""

LISTEN_CHECK_SECONDS = 10.0
"""A quiet listener checks its connection this often (SELECT 1 within NOTIFY_TIMEOUT_SECONDS)."""

RECONNECT_MIN_SECONDS, RECONNECT_MAX_SECONDS = 0.1, 5.0


class Signals:
    def __init__(self, settings: Settings, database_url: str | None = None) -> None:
        """With `database_url`, wakes also go to (and come from) every process on the database
        through NOTIFY / LISTEN on `WAKE_CHANNEL`."""
        self.tools = Wake()
        self.tasks = Wake()
        self.environment = settings.environment
        self.wake_channel = f"{settings.environment}:common:task:wake"
        self.redis: redis.Redis | None = (
            redis.Redis.from_url(settings.redis_url, socket_timeout=2, socket_connect_timeout=2)
            if settings.redis_url
            else None
        )
        self._redis_url = settings.redis_url
        self._background: set[asyncio.Task[Any]] = set()
        # The event mirror, started with the first event (it needs the running loop).
        self._mirror_queue: asyncio.Queue[dict[str, Any]] | None = None
        self._mirror_task: asyncio.Task[None] | None = None
        self._mirrored: OrderedDict[str, int] = OrderedDict()
        """Task id → the last sequence written to its stream, least recently written first."""
        self._dropped = 0
        # The Postgres wake.
        self._database_url = database_url
        self._connect_kwargs: dict[str, Any] = (
            {**connection_kwargs(database_url, settings), "autocommit": True}
            if database_url
            else {}
        )
        self._pending: dict[str, int] = {}
        """Tool id → tasks queued, waiting for the next NOTIFY."""
        self._sender: asyncio.Task[None] | None = None
        self._notifier: psycopg.AsyncConnection[Any] | None = None
        self._notifier_pid: int | None = None
        """The notifier's backend pid: a notification from it was woken in-process already."""
        self._notify_retry_at = 0.0
        self._notify_failures = 0
        self._stray: set[asyncio.Future[Any]] = set()

    def events_stream(self, task_id: str) -> str:
        return f"{self.environment}:common:task:{task_id}:events"

    def task_queued(self, tool_id: str, count: int = 1) -> None:
        self.tools.notify(tool_id, count)
        if self._database_url is not None:
            self._pending[tool_id] = self._pending.get(tool_id, 0) + count
            if self._sender is None or self._sender.done():
                self._sender = asyncio.create_task(self._send_wakes(), name="postgres wake sender")
        if self.redis is not None:
            self._spawn(self.redis.publish(self.wake_channel, tool_id))

    def event_added(self, event: dict[str, Any]) -> None:
        self.task_event_added(str(event["task_id"]))
        if self.redis is not None:
            self._mirror_later(event)

    def task_event_added(self, task_id: str) -> None:
        """Wakes the task's followers in this process (an event whose JSON is not at hand)."""
        self.tasks.notify(task_id, count=None)

    # -- the event mirror -------------------------------------------------------------------

    def _mirror_later(self, event: dict[str, Any]) -> None:
        if self._mirror_queue is None:
            self._mirror_queue = asyncio.Queue(MIRROR_QUEUE_MAX)
        if self._mirror_task is None or self._mirror_task.done():
            self._mirror_task = asyncio.create_task(self._mirror(), name="redis event mirror")
        try:
            self._mirror_queue.put_nowait(event)
        except asyncio.QueueFull:
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                log.warning("redis event mirror behind: %d events dropped so far", self._dropped)

    async def _mirror(self) -> None:
        """Drains the queue in order, one batch (one pipeline) at a time; runs until cancelled."""
        queue = self._mirror_queue
        assert queue is not None
        while True:
            batch = [await queue.get()]
            # One turn of the loop, so events whose statements answered together queue up behind
            # the first and are sorted with it.
            await asyncio.sleep(0)
            while len(batch) < MIRROR_BATCH_MAX and not queue.empty():
                batch.append(queue.get_nowait())
            try:
                await self._write(batch)
            except Exception as error:  # the mirror must outlive Redis going away
                log.warning("redis event mirror: %d events dropped: %s", len(batch), error)
            finally:
                for _ in batch:
                    queue.task_done()

    async def _write(self, batch: list[dict[str, Any]]) -> None:
        assert self.redis is not None
        by_task: dict[str, list[dict[str, Any]]] = {}
        for event in batch:
            by_task.setdefault(str(event["task_id"]), []).append(event)
        async with self.redis.pipeline(transaction=False) as pipe:
            commands = 0
            for task_id, events in by_task.items():
                stream = self.events_stream(task_id)
                last = self._mirrored.get(task_id, 0)
                written = False
                for event in sorted(events, key=lambda e: int(e["sequence"])):
                    sequence = int(event["sequence"])
                    if sequence <= last:
                        log.warning(
                            "redis event mirror: task %s event %d came after %d; not mirrored",
                            task_id,
                            sequence,
                            last,
                        )
                        continue
                    fields = {
                        "sequence": str(sequence),
                        "kind": event["kind"],
                        "data": json.dumps(event["data"]),
                        "created_at": str(event["created_at"]),
                    }
                    pipe.xadd(stream, fields, maxlen=STREAM_MAXLEN, approximate=True)  # type: ignore[arg-type]
                    last = sequence
                    written = True
                    commands += 1
                if written:
                    pipe.expire(stream, STREAM_TTL_SECONDS)
                    self._remember(task_id, last)
            if commands:
                await pipe.execute()

    def _remember(self, task_id: str, sequence: int) -> None:
        self._mirrored[task_id] = sequence
        self._mirrored.move_to_end(task_id)
        while len(self._mirrored) > MIRROR_TRACKED_TASKS:
            self._mirrored.popitem(last=False)

    # -- wakes ----------------------------------------------------------------------------------

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.warning("redis signal dropped: %s", error)

    async def listen(self) -> None:
        """Wakes parked claims for tasks queued through other processes and replicas, from
        Postgres and (when configured) Redis; runs until cancelled."""
        listeners = []
        if self._database_url is not None:
            listeners.append(self._listen_postgres())
        if self._redis_url is not None:
            listeners.append(self._listen_redis())
        await asyncio.gather(*listeners)

    async def _listen_redis(self) -> None:
        assert self._redis_url is not None
        # A connection of its own without a read timeout: a quiet channel is not a failure.
        subscriber = redis.Redis.from_url(self._redis_url, health_check_interval=30)
        while True:
            try:
                async with subscriber.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(self.wake_channel)
                    log.info("listening for wakes on %s", self.wake_channel)
                    async for message in pubsub.listen():
                        tool_id = message.get("data")
                        if isinstance(tool_id, bytes):
                            self.tools.notify(tool_id.decode())
            except (redis.RedisError, OSError) as error:
                log.warning("redis wake subscription lost (%s); retrying in 1 s", error)
                await asyncio.sleep(1)

    # -- the Postgres wake ------------------------------------------------------------------

    async def _send_wakes(self) -> None:
        """Sends what is pending, one NOTIFY statement at a time, until nothing is."""
        while self._pending:
            wakes = [f"{tool_id}:{count}" for tool_id, count in self._pending.items()]
            self._pending = {}
            loop = asyncio.get_running_loop()
            if loop.time() < self._notify_retry_at:
                continue  # the last send failed just now: drop these, the re-check covers them
            try:
                await self._notify(wakes)
            except Exception as error:  # a wake must never fail anything
                self._notify_retry_at = loop.time() + NOTIFY_RETRY_SECONDS
                self._notify_failures += 1
                if self._notify_failures == 1 or self._notify_failures % 100 == 0:
                    log.warning(
                        "postgres wake: %d tools not notified (%s; %d failed sends so far)",
                        len(wakes),
                        error or type(error).__name__,
                        self._notify_failures,
                    )
                await self._close_notifier()

    async def _notify(self, wakes: list[str]) -> None:
        if self._notifier is None or self._notifier.closed:
            assert self._database_url is not None
            self._notifier = await asyncio.wait_for(
                psycopg.AsyncConnection.connect(self._database_url, **self._connect_kwargs),
                NOTIFY_TIMEOUT_SECONDS + self._connect_kwargs.get("connect_timeout", 3),
            )
            self._notifier_pid = self._notifier.info.backend_pid
        await self._bounded(self._notifier, self._notifier.execute(NOTIFY_SQL, {"wakes": wakes}))

    async def _bounded(
        self, connection: psycopg.AsyncConnection[Any], work: Awaitable[Any]
    ) -> None:
        """Runs one statement, given up after NOTIFY_TIMEOUT_SECONDS: then the connection is
        closed first (a frozen server never answers psycopg's cancel) and the statement left to
        fail on its own."""
        job = asyncio.ensure_future(work)
        done, _ = await asyncio.wait([job], timeout=NOTIFY_TIMEOUT_SECONDS)
        if job in done:
            job.result()
            return
        await connection.close()
        job.cancel()
        self._stray.add(job)
        job.add_done_callback(self._stray_done)
        raise TimeoutError(f"no answer within {NOTIFY_TIMEOUT_SECONDS:.0f} s")

    def _stray_done(self, job: asyncio.Future[Any]) -> None:
        self._stray.discard(job)
        if not job.cancelled():
            job.exception()  # retrieved: it failed with the closed connection, as expected

    async def _close_notifier(self) -> None:
        notifier, self._notifier, self._notifier_pid = self._notifier, None, None
        if notifier is not None:
            with contextlib.suppress(Exception):
                await notifier.close()

    def _woken(self, notify: psycopg.Notify) -> None:
        if notify.pid == self._notifier_pid:
            return  # sent by this process, whose parked claims were woken in-process
        # Any user of the database may NOTIFY on the channel: a payload this did not send wakes
        # one waiter at most, never ends the listener (isdigit() passes "²", and int() refuses
        # more than 4,300 digits).
        tool_id, _, count = notify.payload.partition(":")
        self.tools.notify(tool_id, int(count) if count.isdecimal() and len(count) <= 6 else 1)

    async def _listen_postgres(self) -> None:
        assert self._database_url is not None
        backoff = RECONNECT_MIN_SECONDS
        lost = False
        while True:
            try:
                connection = await psycopg.AsyncConnection.connect(
                    self._database_url, **self._connect_kwargs
                )
            except (psycopg.Error, OSError) as error:
                if not lost:
                    log.warning("postgres wake listener: cannot connect (%s); retrying", error)
                lost = True
                await asyncio.sleep(backoff)
                backoff = min(RECONNECT_MAX_SECONDS, backoff * 2)
                continue
            try:
                # Bounded like the checks below: a server frozen since the connect would hold
                # the listener here for good, and parked claims would only hear their re-checks.
                await self._bounded(connection, connection.execute(f"LISTEN {WAKE_CHANNEL}"))
                log.info("listening for wakes on Postgres channel %s", WAKE_CHANNEL)
                if lost:
                    self.tools.notify_all()  # wakes sent while it was away are lost: re-read
                lost, backoff = False, RECONNECT_MIN_SECONDS
                while True:
                    async for notify in connection.notifies(timeout=LISTEN_CHECK_SECONDS):
                        self._woken(notify)
                    await self._bounded(connection, connection.execute("SELECT 1"))
            except (psycopg.Error, OSError, TimeoutError) as error:
                log.warning("postgres wake listener lost (%s); reconnecting", error)
                lost = True
                await asyncio.sleep(backoff)
                backoff = min(RECONNECT_MAX_SECONDS, backoff * 2)
            finally:
                with contextlib.suppress(Exception):
                    await connection.close()

    async def close(self) -> None:
        """Gives the mirror and the wakes in flight a moment to finish, then closes Redis and the
        notifier."""
        mirror = self._mirror_task
        if mirror is not None and self._mirror_queue is not None:
            if not mirror.done():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._mirror_queue.join(), CLOSE_TIMEOUT_SECONDS)
            mirror.cancel()
            await asyncio.gather(mirror, return_exceptions=True)
        if self._background:
            await asyncio.wait(self._background, timeout=CLOSE_TIMEOUT_SECONDS)
        if self._sender is not None and not self._sender.done():
            await asyncio.wait([self._sender], timeout=CLOSE_TIMEOUT_SECONDS)
            self._sender.cancel()
        await self._close_notifier()
        if self.redis is not None:
            await self.redis.aclose()
