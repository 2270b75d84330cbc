"""Trying a call again after it fails: one helper, and a named `Policy` for each use.

    REPORT = Policy("report", first=0.2, max_delay=1.0)
    answer = await retry(REPORT, send, retry_on=transient, deadline=lambda: lease_ends)

A failure `retry_on` accepts is followed by a pause, then the call again: the first pause is
`first`, each next one `multiplier` times the last, at most `max_delay`. The last failure is
raised instead when `retry_on` refuses it, when the policy's `attempts` are spent, when the
pause would end at or past `deadline` (loop time; a callable is asked at each failure, so a
deadline brought closer meanwhile counts), or once `stop` is set (it also cuts a pause short).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Policy:
    """How a call is tried again: the pauses between tries, and how many tries at most."""

    name: str
    first: float
    """Pause after the first failure, in seconds."""
    multiplier: float = 2.0
    """Each pause after the first is the last one times this."""
    max_delay: float = math.inf
    """The longest pause."""
    attempts: int | None = None
    """Tries in all (None: no limit; a deadline or `stop` may still end them)."""

    def __post_init__(self) -> None:
        if self.first < 0 or self.multiplier < 1 or self.max_delay < 0:
            raise ValueError(f"policy {self.name}: pauses must be non-negative and not shrink")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"policy {self.name}: attempts must be at least 1")

    def capped(self, max_delay: float) -> Policy:
        """This policy with no pause over `max_delay` (a setting known only where it is used)."""
        return dataclasses.replace(self, max_delay=min(self.max_delay, max_delay))


async def retry(
    policy: Policy,
    call: Callable[[], Awaitable[T]],
    *,
    retry_on: Callable[[Exception], bool],
    deadline: float | Callable[[], float] | None = None,
    stop: asyncio.Event | None = None,
    on_retry: Callable[[Exception, int, float], object] | None = None,
) -> T:
    """Awaits `call()` until it answers, as `policy` says (module docstring). `on_retry(error,
    tries, pause)` is told of each failure that will be tried again, before its pause."""
    loop = asyncio.get_running_loop()
    pause = min(policy.first, policy.max_delay)
    tries = 0
    while True:
        tries += 1
        try:
            return await call()
        except Exception as error:
            ends = deadline() if callable(deadline) else deadline
            if (
                not retry_on(error)
                or tries == policy.attempts
                or (ends is not None and loop.time() + pause >= ends)
                or (stop is not None and stop.is_set())
            ):
                raise
            failure = error
        if on_retry is not None:
            on_retry(failure, tries, pause)
        if stop is None:
            await asyncio.sleep(pause)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pause)
            if stop.is_set():
                raise failure
        pause = min(pause * policy.multiplier, policy.max_delay)
