"""Trying a call again after it fails: one helper, and a named `Policy` for each use.

    REPORT = Policy("report", first=0.2, max_delay=1.0)
    answer = await retry(REPORT, send, retry_on=transient, deadline=lambda: lease_ends)

A failure `retry_on` accepts is followed by a pause, then the call again: the first pause is
`first`, each next one `multiplier` times the last, at most `max_delay`. The last failure is
raised instead when `retry_on` refuses it, when the policy's `attempts` are spent, when the
pause would end at or past `deadline` (loop time; a callable is asked at each failure, so a
deadline brought closer meanwhile counts), or once `stop` is set (it also cuts a pause short).
Calls that one failure ended (the items of a batch, each awaiting its own `retry`) pause until the
same moment, so that they try again in the same loop turn and leave in one batch again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import weakref
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
        await _pause_until(_wake(failure, pause, loop), stop)
        if stop is not None and stop.is_set():
            raise failure
        pause = min(pause * policy.multiplier, policy.max_delay)


_WAKES: weakref.WeakKeyDictionary[BaseException, dict[float, float]] = weakref.WeakKeyDictionary()
"""When the calls one failure ended try again, by pause. A batch's items share its failure: they
wake at the same loop time and leave together again, where pauses begun microseconds apart would
end in different loop turns and split the batch."""


def _wake(failure: BaseException, pause: float, loop: asyncio.AbstractEventLoop) -> float:
    wakes = _WAKES.setdefault(failure, {})
    now = loop.time()
    if wakes.get(pause, -math.inf) <= now:
        # First to pause for this failure, or one raised again after its wake passed: a pause
        # of its own, never none.
        wakes[pause] = now + pause
    return wakes[pause]


async def _pause_until(when: float, stop: asyncio.Event | None) -> None:
    """Sleeps until loop time `when`, or until `stop` is set."""
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not woken.done():
            woken.set_result(None)

    timer = loop.call_at(when, wake)
    try:
        if stop is None:
            await woken
            return
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait((woken, stopping), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
    finally:
        timer.cancel()
