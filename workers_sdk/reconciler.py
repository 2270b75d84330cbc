"""The gateway's background reconciler: the watchdog reaper, then the settlement sweep.

Each sweep does two things, over gRPC only (no database credentials):

1. Reap. `ListStaleTasks` returns the tasks that can never finish on their own (dead zombies,
   unclaimable rows, abandoned never-claimed rows). Each is forced terminal `failed` with a
   `FailTask` that carries no lease token; the service re-checks in that same statement, by the
   same settings as the list (`processing_grace_seconds`, `queued_max_age_seconds`), that the
   task is still stale, so a task that came alive in between (claimed, heartbeating) answers
   TASK_NOT_STALE and is skipped, never killed. `on_failed(task)` then lets the gateway project
   the failure onto its own record (a chat message stuck at "planning...", say).
2. Settle. `ListUnsettledTasks` returns terminal tasks holding a reservation nobody settled yet;
   `SettleTask` settles each exactly once (completed: charge the reported usage, at most the
   reservation, refund the rest; failed: refund it all). The task just reaped above is settled in
   the same sweep. `on_settled(settlement)` runs only for the call that made the settlement
   (`settled_now`), so several reconcilers can sweep at once without double-counting.

Hooks may be plain functions or coroutines. A hook that raises is logged and the sweep goes on:
the failure or settlement is already recorded in the service regardless, and no later sweep will
offer that task again (it is no longer stale, or no longer unsettled). A hook is therefore called
at most once per task across all reconcilers, and can be missed: when it raises, or when the answer
to the call that made the change is lost (a deadline, a dropped connection). So give the gateway
a catch-up path of its own for records still pending (`GetTask` shows the terminal state;
`SettleTask` on a settled task returns the existing settlement, `settled_now` false, without
settling again), and write the hooks idempotent by task id, since that path and the hook may
both apply the same change.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from generation.task.v1 import task_pb2
from workers_sdk.client import GenqClient
from workers_sdk.errors import GenqError, Reason

log = logging.getLogger(__name__)

T = TypeVar("T")
Hook = Callable[[T], object]
"""A callback of one value: a plain function, or a coroutine function (its result is awaited)."""

# Answers to a forced fail that mean "nothing to do": the task came alive (claimed again, or
# finished) between the list and the fail, or it was deleted (e.g. by a retention purge).
REAP_SKIPPED_REASONS = frozenset({Reason.TASK_NOT_STALE, Reason.TASK_NOT_FOUND})

# Answers to a settle of a task the list called terminal and unsettled that mean "not mine to
# settle now": it was deleted since (a retention purge), or it is not terminal as far as this call
# could see: requeued since (it is settled once terminal again). A concurrent settle of the same
# task is not among these: the loser gets the winner's settlement with settled_now = false.
SETTLE_SKIPPED_REASONS = frozenset({Reason.TASK_NOT_FOUND, Reason.TASK_NOT_TERMINAL})

MAX_PAGE_SIZE = 10_000
"""The most tasks the service returns from one list call."""

STALE_REASON_NAMES = {
    task_pb2.STALE_REASON_DEAD_ZOMBIE: "dead_zombie",
    task_pb2.STALE_REASON_UNCLAIMABLE: "unclaimable",
    task_pb2.STALE_REASON_ABANDONED: "abandoned",
}


@dataclass
class SweepSummary:
    """What one sweep did."""

    failed: int = 0
    """Stale tasks this sweep forced to `failed`."""

    settled: int = 0
    """Settlements this sweep made (`settled_now`); ones another reconciler made don't count."""

    skipped: int = 0
    """Stale tasks left alone: alive again by the time of the forced fail, or gone."""

    errors: int = 0
    """Calls for one task that failed (e.g. UNAVAILABLE); the task is retried next sweep."""

    hook_errors: int = 0
    """Hooks that raised (logged); the change they were told about stands."""


class Reconciler:
    """Reaps stale tasks and settles reservations, once per `sweep()` or periodically (`run`).

    All durations are in seconds; every default is the spec's. What "stale" means is the
    service's to say, one rule for every caller: the settings `processing_grace_seconds` (120)
    and `queued_max_age_seconds` (900), changed with UpdateSettings (`genq settings`).
    """

    def __init__(
        self,
        client: GenqClient,
        *,
        on_failed: Hook[task_pb2.Task] | None = None,
        on_settled: Hook[task_pb2.Settlement] | None = None,
        reconcile_interval_seconds: float = 60,
        page_size: int = 500,
    ) -> None:
        if not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be 1 to {MAX_PAGE_SIZE}, not {page_size}")
        if reconcile_interval_seconds <= 0:
            raise ValueError("reconcile_interval_seconds must be above 0")
        self.client = client
        self.on_failed = on_failed
        """Called with each task this reconciler forced to `failed` (status FAILED, its error)."""
        self.on_settled = on_settled
        """Called with each settlement this reconciler made."""
        self.reconcile_interval_seconds = reconcile_interval_seconds
        """Pause between the start of one sweep and the next in `run` (60)."""
        self.page_size = page_size
        """Tasks asked for per list call (500); a sweep keeps listing until it has seen all."""

    async def sweep(self) -> SweepSummary:
        """One pass: reap, then settle. Per-task failures are counted and logged; a failure to
        list (the service unreachable, say) raises GenqError."""
        summary = SweepSummary()
        await self._reap(summary)
        await self._settle(summary)
        return summary

    async def run(self, stop: asyncio.Event) -> None:
        """Sweeps every `reconcile_interval_seconds` until `stop` is set. A sweep that fails is
        logged and tried again at the next interval."""
        loop = asyncio.get_running_loop()
        interval = self.reconcile_interval_seconds
        while not stop.is_set():
            started = loop.time()
            try:
                summary = await self.sweep()
                log.info("reconcile sweep: %s", describe(summary))
            except GenqError as error:
                log.warning("reconcile sweep failed (%s); next try in %.0f s", error, interval)
            except Exception:
                # A bug must not silently end the gateway's only reaper: log it, keep sweeping.
                log.exception("reconcile sweep crashed; next try in %.0f s", interval)
            remaining = interval - (loop.time() - started)
            with contextlib.suppress(TimeoutError):  # the interval is up: sweep again
                await asyncio.wait_for(stop.wait(), timeout=max(remaining, 0))

    async def _reap(self, summary: SweepSummary) -> None:
        # A failed task drops out of the list, so the next page is simply the next call. The
        # `seen` check stops the loop when a full page brings nothing new (every task on it was
        # skipped or errored and is still listed), instead of spinning on it.
        seen: set[str] = set()
        while True:
            response = await self.client.call(
                "ListStaleTasks",
                task_pb2.ListStaleTasksRequest(limit=self.page_size),
            )
            fresh = [stale for stale in response.tasks if stale.task.id not in seen]
            for stale in fresh:
                seen.add(stale.task.id)
                await self._reap_one(stale, summary)
            if len(response.tasks) < self.page_size or not fresh:
                return

    async def _reap_one(self, stale: task_pb2.StaleTask, summary: SweepSummary) -> None:
        reason = STALE_REASON_NAMES.get(stale.reason, "stale")
        request = task_pb2.FailTaskRequest(
            task_id=stale.task.id,
            error=f"reaped: {reason}",
            increment_retry=False,
        )
        try:
            response = await self.client.call("FailTask", request)
        except GenqError as error:
            if error.reason in REAP_SKIPPED_REASONS:
                log.info("task %s not reaped: %s", stale.task.id, error.reason)
                summary.skipped += 1
            else:
                log.warning("task %s: forced fail failed: %s", stale.task.id, error)
                summary.errors += 1
            return
        if response.task.status != task_pb2.TASK_STATUS_FAILED:
            # A dead zombie whose run the service ended as its lease rescuer would have: handed
            # back (unconfirmed, or retries left). It runs again; nothing to project.
            log.info("task %s handed back to the queue, not failed", stale.task.id)
            summary.skipped += 1
            return
        summary.failed += 1
        log.info("reaped task %s (%s)", stale.task.id, reason)
        if not await _call_hook(self.on_failed, response.task, "on_failed", stale.task.id):
            summary.hook_errors += 1

    async def _settle(self, summary: SweepSummary) -> None:
        seen: set[str] = set()  # as in _reap: a settled task drops out of the list
        while True:
            response = await self.client.call(
                "ListUnsettledTasks", task_pb2.ListUnsettledTasksRequest(limit=self.page_size)
            )
            fresh = [task for task in response.tasks if task.id not in seen]
            for task in fresh:
                seen.add(task.id)
                await self._settle_one(task.id, summary)
            if len(response.tasks) < self.page_size or not fresh:
                return

    async def _settle_one(self, task_id: str, summary: SweepSummary) -> None:
        try:
            response = await self.client.call(
                "SettleTask", task_pb2.SettleTaskRequest(task_id=task_id)
            )
        except GenqError as error:
            if error.reason in SETTLE_SKIPPED_REASONS:
                log.info("task %s not settled here: %s", task_id, error.reason)
                return
            log.warning("task %s: settlement failed: %s", task_id, error)
            summary.errors += 1
            return
        if not response.settled_now:  # settled before, or by a concurrent caller: not ours
            return
        summary.settled += 1
        if not await _call_hook(self.on_settled, response.settlement, "on_settled", task_id):
            summary.hook_errors += 1


async def _call_hook(hook: Hook[T] | None, value: T, name: str, task_id: str) -> bool:
    """Runs a hook; False when it raised (logged with its traceback)."""
    if hook is None:
        return True
    try:
        result = hook(value)
        if inspect.isawaitable(result):
            await result
    except Exception:
        log.exception("%s hook raised for task %s; the change stands in the service", name, task_id)
        return False
    return True


def describe(summary: SweepSummary) -> str:
    """One log line: "failed 2, settled 5, skipped 0, errors 0, hook errors 0"."""
    return (
        f"failed {summary.failed}, settled {summary.settled}, skipped {summary.skipped}, "
        f"errors {summary.errors}, hook errors {summary.hook_errors}"
    )
