"""In-process wake-ups: parked claims per tool, event watchers per task.

A waiter registers *before* it reads the database and waits *after*: a notify that lands while
it reads is not lost (the spec's clear-before-sweep). Waking is best effort; every waiter also
re-reads on a short timer, so correctness never depends on a wake arriving. Wakes from other
processes and replicas (Postgres NOTIFY, Redis) arrive here through service/api/signals.py.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict


class Wake:
    def __init__(self) -> None:
        self._waiters: dict[str, list[asyncio.Future[None]]] = defaultdict(list)

    def register(self, key: str) -> asyncio.Future[None]:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[key].append(waiter)
        return waiter

    def discard(self, key: str, waiter: asyncio.Future[None]) -> None:
        waiters = self._waiters.get(key)
        if waiters and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[key]
        waiter.cancel()

    async def wait(self, waiter: asyncio.Future[None], seconds: float) -> None:
        """Returns when the waiter is woken or `seconds` pass, whichever is first."""
        if seconds > 0:
            await asyncio.wait([waiter], timeout=seconds)

    def notify(self, key: str, count: int | None = 1) -> None:
        """Wakes the `count` longest-parked waiters of `key` (all of them when None)."""
        waiters = self._waiters.get(key, [])
        while waiters and (count is None or count > 0):
            waiter = waiters.pop(0)
            if not waiter.done():
                waiter.set_result(None)
                count = None if count is None else count - 1
        if not waiters:
            self._waiters.pop(key, None)

    def notify_all(self) -> None:
        """Wakes every waiter of every key: after wakes may have been missed (a lost channel)."""
        for key in list(self._waiters):
            self.notify(key, count=None)
