"""What the service does after a statement commits: wake parked claims and event watchers here,
and, when Redis is configured, tell the other replicas and mirror events into Redis Streams.

Nothing here can fail a call. Redis work runs after the commit, off the call's path; its errors
are logged and dropped, and the short re-check of every parked reader is the floor.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import Any

import redis.asyncio as redis

from service.settings import Settings
from service.wake import Wake

log = logging.getLogger(__name__)

TERMINAL_EVENTS = {"completed", "failed", "cancelled", "expired"}
STREAM_MAXLEN = 10_000
STREAM_TTL_SECONDS = 7 * 86_400


class Signals:
    def __init__(self, settings: Settings) -> None:
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

    def events_stream(self, task_id: str) -> str:
        return f"{self.environment}:common:task:{task_id}:events"

    def task_queued(self, tool_id: str, count: int = 1) -> None:
        self.tools.notify(tool_id, count)
        if self.redis is not None:
            self._spawn(self.redis.publish(self.wake_channel, tool_id))

    def event_added(self, event: dict[str, Any]) -> None:
        task_id = str(event["task_id"])
        self.tasks.notify(task_id, count=None)
        if self.redis is not None:
            self._spawn(self._mirror(task_id, event))

    async def _mirror(self, task_id: str, event: dict[str, Any]) -> None:
        assert self.redis is not None
        stream = self.events_stream(task_id)
        fields = {
            "sequence": str(event["sequence"]),
            "kind": event["kind"],
            "data": json.dumps(event["data"]),
            "created_at": str(event["created_at"]),
        }
        await self.redis.xadd(stream, fields, maxlen=STREAM_MAXLEN, approximate=True)  # type: ignore[arg-type]
        if event["kind"] in TERMINAL_EVENTS:
            await self.redis.expire(stream, STREAM_TTL_SECONDS)

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.warning("redis signal dropped: %s", error)

    async def listen(self) -> None:
        """Wakes parked claims for tasks queued through other replicas; runs until cancelled."""
        if self._redis_url is None:
            return
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

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=2)
        if self.redis is not None:
            await self.redis.aclose()
