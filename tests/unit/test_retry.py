"""workers_sdk.retry: calls that one failure ended try again in the same loop turn, so that the
items of a failed batch leave in one batch again (the WorkerFleet's batcher sends what is ready
by the end of a loop turn)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable

from workers_sdk.retry import Policy, retry

QUICK = Policy("quick", first=0.05)


class Unavailable(Exception):
    pass


def test_calls_one_failure_ended_try_again_in_the_same_loop_turn() -> None:
    """Two calls fail with the same error (one batch's answer). The second one reaches its pause
    3 ms after the first, as a loaded loop would make it; still both try again before anything
    the first's second try schedules for the next loop turn runs."""
    shared = Unavailable("the batch answered UNAVAILABLE")
    events: list[str] = []

    def call(name: str) -> Callable[[], Awaitable[str]]:
        tries = 0

        async def attempt() -> str:
            nonlocal tries
            tries += 1
            if tries == 1:
                raise shared
            events.append(f"{name} tries again")
            # What the batcher does with a report: send it at the end of this loop turn.
            asyncio.get_running_loop().call_soon(events.append, f"next turn after {name}")
            return name

        return attempt

    def busy(error: Exception, tries: int, pause: float) -> None:
        time.sleep(0.003)

    async def main() -> None:
        await asyncio.gather(
            retry(QUICK, call("first"), retry_on=lambda error: True),
            retry(QUICK, call("second"), retry_on=lambda error: True, on_retry=busy),
        )
        await asyncio.sleep(0)

    asyncio.run(main())
    # Either may go first (their timers are due at the same moment), but both before the turn.
    assert sorted(events[:2]) == ["first tries again", "second tries again"], events


def test_a_set_stop_cuts_the_pause_short_and_raises_the_failure() -> None:
    async def main() -> float:
        stop = asyncio.Event()

        async def failing() -> None:
            raise Unavailable("down")

        asyncio.get_running_loop().call_later(0.05, stop.set)
        started = time.monotonic()
        try:
            await retry(Policy("long", first=30), failing, retry_on=lambda error: True, stop=stop)
        except Unavailable:
            return time.monotonic() - started
        raise AssertionError("retry returned")

    assert asyncio.run(main()) < 5


def test_an_error_raised_again_after_its_pause_still_pauses() -> None:
    """A call that raises one and the same exception object each time pauses every time."""
    again = Unavailable("the same object")
    tries: list[float] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def failing() -> None:
            tries.append(loop.time())
            if len(tries) < 4:
                raise again

        await retry(Policy("steady", first=0.02, multiplier=1), failing, retry_on=lambda e: True)

    asyncio.run(main())
    gaps = [later - earlier for earlier, later in itertools.pairwise(tries)]
    assert len(gaps) == 3 and min(gaps) >= 0.015, gaps
