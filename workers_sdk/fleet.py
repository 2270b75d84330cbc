"""WorkerFleet: hosts tools, claims their tasks over gRPC, runs the handlers, reports the outcome.

    fleet = WorkerFleet("genq:50051")

    @fleet.tool("image-gen")   # 10 lanes (an async handler's default; `register` says why)
    async def generate(task, ctx):
        await ctx.progress(0.5, "half way")
        ctx.report_usage(token_amount=10, cost_nanos=2_000_000)
        return {"url": "..."}

    asyncio.run(fleet.run())   # until SIGTERM/SIGINT, then drains

The poll loop (one per tool, spec A "Fast pickup"; GUIDE A9). A remote worker has no Redis: the
service does the waiting. Each sweep is one ClaimTasks for as many tasks as the tool's lane has free
slots (`concurrency` minus the handlers running or about to run, at most 100, the service's limit)
with `wait` = jittered `poll_interval`: when tasks are ready it answers at once with up to that many
(so the loop drains fast while it keeps claiming), and when none is, it parks in the service, which
answers the moment a task for the tool is committed, or empty when the wait runs out (the polling
floor). A sweep for one slot is a ClaimNextTask (the same statement with a limit of 1). A slot is
taken from the claim until the task's handler returns (the report that follows no longer holds it,
so the next claim goes out while the last batch's reports are in flight). At concurrency capacity
the loop backs off 0.25 s (sooner if a slot frees). The fleet's own wake event says "a slot freed or
stop was requested"; it is cleared before each sweep, so one set during the sweep is not lost.

Batching. Each claimed task is worked on its own (below), but what the fleet sends about it is
coalesced: the heartbeats and CompleteTask/FailTask reports of every task in flight, of every tool,
go out as HeartbeatTasks, CompleteTasks and FailTasks carrying whatever is ready, and each item's
answer goes back to its own task (a `refused` LEASE_LOST or TASK_NOT_FOUND is that task's lost
lease, exactly as the single RPC's error would be). A batch leaves at the end of the event loop's
current turn, with every call made in that turn (the handlers of one claim that return together
report together), and waits for no company beyond it; `report_delay` (0 by default) makes it wait
that long for more. It leaves at once when it is full (1,000 items, or about 2 MiB of requests). A
batch that fails UNAVAILABLE fails each of its items, and each report is tried again on its own
policy, its pause ending at the same moment as those of the batch's other items (so the retries
batch again): that is safe, since the service answers a report repeated under
the same lease the same. A batch the service refuses as a whole (INVALID_ARGUMENT or
RESOURCE_EXHAUSTED: one item's output too large, say) is sent again item by item, so that each
report hears its own answer. A batch of one is the single RPC (HeartbeatTask, CompleteTask,
FailTask), which carries its task's trace context; a larger batch belongs to no one task's trace and
is sent outside any. ReleaseTask (drain) and PublishTaskEvent stay single.

Retries. Every call the fleet tries again follows a named policy (`workers_sdk.retry`): REGISTER
(UpsertTool at start), CLAIM (a failed sweep), CONFIRM, HEARTBEAT and REPORT (CompleteTask,
FailTask, ReleaseTask); each constant below says its pauses and when it gives up.

Leases. A claim answers the lease's length (`lease`: the tool's `lease_seconds`, else the
service's GENQ_LEASE_SECONDS; never under the service's GENQ_MIN_LEASE_SECONDS, 10 s by
default), and so does every heartbeat. The fleet's one beat schedule extends each running
task's lease every min(`heartbeat_interval`, lease / 3), reckoned from the lease the last answer
gave: two beats in a row may fail before the lease lapses, and a tool with
a short lease is beaten often enough without tuning the fleet. When the service says the lease
is gone (ABORTED, LEASE_LOST, from a heartbeat or an event publish), `ctx.lease_lost` is set:
the handler is told that its result will be dropped (another worker owns the task now; any write
from here would be refused). Billed is billed (spec B): by default the handler runs on to its
end, since a provider bills a call it has begun whether or not anyone waits for it, and a call
cut off midway is billed too; when it returns, the fleet reports the cost it reported
(`ctx.report_usage`), which the service keeps on the run's attempt. A handler may stop early (it
watches `ctx.lease_lost`), and a tool registered with `stop_on_lease_lost=True` has its async
handler cancelled at once instead (its cost so far still reported).

Confirmation. The service counts a claim as a run only once its worker confirms it (ConfirmClaim, or
a first heartbeat or event under the lease): a lease that lapses unconfirmed means the claim's
answer never reached a worker (a deadline, a dropped connection) and costs the task no retry, while
a confirmed run that ends without success (the worker crashed, the lease lapsed) costs one. So right
after a claim arrives, before any handler starts, the poll loop sends one ConfirmClaim for the
claim's whole batch (its tasks share one lease token). It answers the tasks the claim still holds,
now confirmed: those run, and those of them it says a cancel was asked for end cancelled unrun. A
task it leaves out is not this worker's any more (handed back, lapsed, gone): it does not run.
UNAVAILABLE or a deadline: tried again (CONFIRM) within the first two thirds of the lease (the call
is idempotent: a repeat answers the same); still nothing, and none of them runs: each is handed
back, which costs nothing even if a try committed unseen (should that fail too, the lease lapses).
One call per claim is the whole price (it extends no lease: the beats follow the claim's), and it is
what lets the service tell the two apart: a poison task that crashes its worker mid-handler was
confirmed each time, so `max_retries` bounds its runs, and a claim answer lost on the way is never
charged as a run.

Cancel. Cancelling a running task asks its worker to stop: the next heartbeat answers
`cancel_requested`. The fleet then sets `ctx.cancel_requested` and cancels an async handler (it runs
in its task's one asyncio task, which catches the cancel and goes on to report; a sync handler
cannot be interrupted: it checks `ctx.is_cancel_requested` and returns early, while the fleet keeps
the lease), and reports FailTask with FAILURE_KIND_CANCELLED and the cost the handler reported so
far (`ctx.report_usage`): billed is billed. What the handler returned or raised is dropped; the run
ends cancelled whatever is reported, and a report answered with a CANCELLED task (a cancel that
arrived after the last beat) is logged at INFO, not as an error.

Outcomes: see `workers_sdk.outcomes`. A handler's unexpected exception fails the task at once
(`retry_unknown_errors=False`) and stores only the exception's class name: spec B calls it a bug
in the handler, a bug usually repeats, and every retry of a paid generation costs money. A
handler that knows an error is transient raises `RetryableError` from it.

Drain (SIGTERM/SIGINT or `stop()`): stop claiming, let tasks in flight finish within
`drain_timeout` (30 s), then cancel the handlers still running and hand their tasks back with
ReleaseTask, which requeues a task at once without using an attempt (GUIDE B2: a deliberate stop
never consumes one). The alternatives are worse: FailTask(increment_retry=true) uses an attempt
and ends a task on its last attempt `failed`; letting the lease lapse also uses an attempt (the
run was confirmed) and keeps the task waiting a whole lease. That lapse is what happens when the
release itself fails (the service unreachable): the task is late and one attempt poorer, never
lost. Claims parked in the service when the drain starts are awaited, not cancelled: the service
may already have claimed a task for this worker, and a lost answer would strand that task until
its lease lapsed. A task such a claim brings is confirmed and handed back unrun once the drain's
deadline has passed, else worked like the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import random
import signal
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from contextvars import copy_context
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar, cast

import grpc
from google.protobuf import duration_pb2, json_format, struct_pb2
from google.protobuf.message import Message
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from generation.task.v1 import task_pb2
from workers_sdk import outcomes
from workers_sdk.client import DEFAULT_TARGET, Credentials, GenqClient
from workers_sdk.errors import GenqError, LeaseLost, Reason
from workers_sdk.retry import Policy, retry

log = logging.getLogger(__name__)

T = TypeVar("T")
Output: TypeAlias = Mapping[str, Any] | None
AsyncHandler: TypeAlias = Callable[[task_pb2.Task, "TaskContext"], Awaitable[Output]]
SyncHandler: TypeAlias = Callable[[task_pb2.Task, "TaskContext"], Output]
Handler: TypeAlias = AsyncHandler | SyncHandler

AT_CAPACITY_BACKOFF_SECONDS = 0.25
"""Spec A: how long the poll loop backs off when its tool's lane is full."""

MAX_CLAIM_WAIT_SECONDS = 30.0
"""The longest `wait` the service accepts (GENQ_MAX_CLAIM_WAIT_SECONDS)."""

MAX_RESOURCE_KEY = 200
"""The longest resource key the service takes."""
MIN_LEASE_SECONDS = 10.0
"""The shortest lease the service grants; assumed when a claim's answer does not say."""

DRAIN_REPORT_SECONDS = 5.0
"""How long past the drain's deadline a report still being tried may go on: a stop ends within
`drain_timeout` plus this."""

RETRIED_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""A confirmation or report answered with one of these may not have reached the service: it is
sent again (a beat is idempotent, and a report repeated under its lease answers the same)."""

REGISTER = Policy("register", first=0.1, max_delay=5.0)
"""UpsertTool at start, answered UNAVAILABLE (the service may start after the fleet): tried
again 0.1 s later, the pause doubled up to 5 s, until it answers or stop is asked."""

CLAIM = Policy("claim", first=0.2)
"""A sweep that failed (the service may be restarting): tried again 0.2 s later, the pause
doubled up to `poll_interval`, until it answers or stop is asked; the poll loop outlives any
failure."""

CONFIRM_ATTEMPTS = 3
"""Tries of the ConfirmClaim that confirms a claim (policy "confirm"), when it answers
UNAVAILABLE or times out, all within two thirds of the claim's lease."""

CONFIRM_RETRY_SECONDS = 0.5
"""Pause before the second try of a confirmation; doubled before the third."""

HEARTBEAT = Policy("heartbeat", first=1.0, multiplier=1.0)
"""A heartbeat that failed but for a lost lease: tried again every second (every beat interval,
if shorter) until it answers or the run ends; the lease outlasts two beats."""

REPORT = Policy("report", first=0.2, max_delay=1.0)
"""A report (CompleteTask, FailTask, ReleaseTask) answered with one of RETRIED_CODES: tried again
0.2 s later, the pause doubled up to 1 s, until the lease it holds ends (as the last beat told),
and once the drain began no later than DRAIN_REPORT_SECONDS past its deadline. A fixed number
of tries would lose a finished task's result to a service restarting, and run the task again."""

DEFAULT_REPORT_DELAY = 0.0
"""The longest a heartbeat or report waits for others to share its batch (`report_delay`): by
default none, what is ready by the end of the event loop's turn leaves together."""

DEFAULT_ASYNC_CONCURRENCY = 10
"""Lanes of a tool with an async handler when `register` is given none (its docstring: why)."""

DEFAULT_SYNC_CONCURRENCY = 1
"""Lanes (threads) of a tool with a sync handler when `register` is given none."""

MAX_CLAIM_BATCH = 100
"""Most tasks one ClaimTasks takes (the service's limit)."""

MAX_REPORT_BATCH = 1_000
"""Most items in one HeartbeatTasks, CompleteTasks or FailTasks (the service's limit)."""

MAX_BATCH_BYTES = 2 * 1024 * 1024
"""Most bytes of requests in one batch: well under gRPC's 4 MiB default limit on a message the
service receives (the answers are small: a beat's lease, a report's task in brief)."""

SPLIT_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED})
"""A batch refused as a whole with one of these is sent again item by item: each item then
hears its own answer (the item at fault its own refusal)."""


class TaskContext:
    """What a handler gets beside its task: the lease, event publishing, and usage reporting.

    Publishing is best effort: an event that cannot be published is logged, not raised, so a
    progress report never fails paid work. A sync handler (running in a thread) calls the
    coroutines through `ctx.from_thread(ctx.progress(0.5))`.
    """

    def __init__(
        self,
        client: GenqClient,
        tool: str,
        task: task_pb2.Task,
        lease_token: str,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.tool = tool
        self.task = task
        self.lease_token = lease_token
        self.lease_lost = asyncio.Event()
        """Set when the service says this worker no longer holds the task: another worker may
        run it now, and this run's result will be dropped. The handler runs on to its end
        unless it stops itself (or its tool was registered with `stop_on_lease_lost`): either
        way the cost it reported is kept on the run's attempt (billed is billed)."""
        self.cancel_requested = asyncio.Event()
        """Set when a cancel of the task was asked for: stop; the run ends cancelled, and what
        it cost so far (`report_usage`) is recorded. An async handler is cancelled right after."""
        self._client = client
        self._loop = loop
        self._token_amount = 0
        self._cost_nanos = 0
        self._details = struct_pb2.Struct()
        self._resource_key = ""
        self._stop_handler: Callable[[], object] | None = None
        """Cancels an async handler when its lease is lost (set while one runs, when its tool
        was registered with `stop_on_lease_lost`)."""

    @property
    def is_lease_lost(self) -> bool:
        return self.lease_lost.is_set()

    @property
    def is_cancel_requested(self) -> bool:
        return self.cancel_requested.is_set()

    @functools.cached_property
    def input(self) -> dict[str, Any]:
        """The task's input as a plain dict (JSON numbers are floats, as in a Struct)."""
        return json_format.MessageToDict(self.task.input)

    async def progress(self, fraction: float, message: str | None = None) -> None:
        """Publishes a progress event, `fraction` from 0.0 to 1.0."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"progress must be between 0.0 and 1.0, not {fraction}")
        data: dict[str, Any] = {"progress": fraction}
        if message is not None:
            data["message"] = message
        await self._publish(task_pb2.TASK_EVENT_KIND_PROGRESS, data)

    async def streaming_url(self, url: str) -> None:
        """Publishes where the output can be followed while it is generated."""
        await self._publish(task_pb2.TASK_EVENT_KIND_STREAMING_URL, {"url": url})

    async def partial_output(self, output: Mapping[str, Any]) -> None:
        """Publishes part of the output ahead of completion."""
        await self._publish(task_pb2.TASK_EVENT_KIND_PARTIAL_OUTPUT, output)

    def report_usage(self, *, token_amount: int = 0, cost_nanos: int = 0, **details: Any) -> None:
        """Adds to the usage sent with CompleteTask: user tokens to charge against the task's
        reservation, the provider's cost in nanos, and anything else worth keeping (`details`,
        later keys win). Amounts add up, so a handler calling a provider twice reports twice.
        """
        for name, amount in (("token_amount", token_amount), ("cost_nanos", cost_nanos)):
            if isinstance(amount, bool) or not isinstance(amount, int) or amount < 0:
                raise ValueError(f"{name} must be a non-negative int, not {amount!r}")
        self._details.update(details)  # raises now, not at completion, for what JSON cannot hold
        self._token_amount += token_amount
        self._cost_nanos += cost_nanos

    async def resource_cooling(self, resource_key: str) -> bool:
        """Whether `resource_key` (a model, say) is cooling down right now after repeated
        retryable failures, by the database's clock: ask before picking a model, to fall back to
        another one (and say so with `use_resource`)."""
        request = task_pb2.GetResourceKeyRequest(resource_key=resource_key)
        response = await self._client.call("GetResourceKey", request)
        return bool(response.cooling)

    def use_resource(self, resource_key: str) -> None:
        """Says this run uses `resource_key` instead of the task's own: its success, or its
        retryable failure, counts toward that key's cooldown (the last call wins)."""
        if not resource_key or len(resource_key) > MAX_RESOURCE_KEY:
            raise ValueError(f"resource_key must be 1 to {MAX_RESOURCE_KEY} characters")
        self._resource_key = resource_key

    def from_thread(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Runs one of this context's coroutines from a sync handler's thread and waits for it."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            coroutine.close()
            raise RuntimeError("from_thread() is for sync handlers; an async handler awaits")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    @property
    def used_resource(self) -> str:
        """The resource key given to `use_resource`, or "" (the task's own)."""
        return self._resource_key

    def reported_usage(self) -> task_pb2.ReportedUsage:
        return task_pb2.ReportedUsage(
            token_amount=self._token_amount, cost_nanos=self._cost_nanos, details=self._details
        )

    def _request_cancel(self) -> bool:
        """Sets `cancel_requested`; says whether this call set it."""
        if self.cancel_requested.is_set():
            return False
        log.info("task %s: cancel requested; stopping the handler", self.task.id)
        self.cancel_requested.set()
        return True

    def _lose_lease(self, why: str) -> None:
        if not self.lease_lost.is_set():
            self.lease_lost.set()
            if self._stop_handler is not None:
                log.warning("task %s: lease lost (%s); stopping the handler", self.task.id, why)
                self._stop_handler()
            else:
                log.warning(
                    "task %s: lease lost (%s); its result will be dropped, its cost kept",
                    self.task.id,
                    why,
                )

    async def _publish(
        self, kind: task_pb2.TaskEventKind.ValueType, data: Mapping[str, Any]
    ) -> None:
        if self.is_lease_lost:
            return
        struct = struct_pb2.Struct()
        struct.update(data)
        request = task_pb2.PublishTaskEventRequest(
            task_id=self.task.id, lease_token=self.lease_token, kind=kind, data=struct
        )
        try:
            await self._client.call("PublishTaskEvent", request)
        except GenqError as error:
            if _lease_gone(error):
                self._lose_lease(f"PublishTaskEvent: {error.reason}")
            else:
                log.warning("task %s: event not published: %s", self.task.id, error)


@dataclass(eq=False)
class _Lane:
    """One hosted tool: its handler and how many of its tasks may run at once."""

    name: str
    call: AsyncHandler
    concurrency: int
    runs_in_thread: bool
    stop_on_lease_lost: bool
    """Cancel an async handler once its lease is lost, rather than let it run to its end."""
    tool_id: str = ""
    runs: set[_Run] = field(default_factory=set)
    """Its claimed and confirmed tasks not yet let go (running or reporting)."""
    running: set[_Run] = field(default_factory=set)
    """Those that hold a slot: claimed, their handler not returned yet."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a slot frees or stop is requested; the poll loop clears it before each sweep."""

    @property
    def free(self) -> int:
        """Slots the next claim may fill."""
        return self.concurrency - len(self.running)


@dataclass(eq=False)
class _Run:
    """One claimed task being worked, by one asyncio task (`WorkerFleet._execute`), which also
    runs an async handler (no task of its own: stopping the handler cancels the run's task,
    which catches that and goes on to report)."""

    lane: _Lane
    ctx: TaskContext
    claim_span: trace.SpanContext
    lease: float
    """The lease's length in seconds, as the claim (then each heartbeat) gave it."""
    lease_until: float
    """Loop time at which the lease ends, by the last answer (claim or beat): how long a report
    is worth trying (the service decides, on its clock; past this it can only refuse)."""
    task: asyncio.Task[None] | None = None
    """The asyncio task working it (`WorkerFleet._execute`)."""
    handling: bool = False
    """Its handler is running: a lost lease, a cancel request or the drain stops it."""
    interrupted: bool = False
    """The fleet cancelled `task` to stop the handler (once at most)."""
    abandoned: bool = False
    """The drain's deadline passed before the handler returned: the task is handed back."""
    beat_due: float = math.inf
    """Loop time of its next heartbeat, while it waits in the fleet's beat schedule."""
    heartbeat: asyncio.Task[None] | None = None
    """The beat in flight (`WorkerFleet._heartbeat`), from the second beat on."""


@dataclass(eq=False)
class _Item:
    """One call waiting in a `_Batcher`."""

    request: Message
    future: asyncio.Future[Any]
    deadline: float
    """Loop time by which its answer is due (the call's timeout, from when it was made)."""
    context: otel_context.Context | None
    """The caller's trace context, carried when the item is sent on its own (None when the
    fleet traces nothing)."""


class _Batcher:
    """Coalesces the calls of one per-task RPC (HeartbeatTask, CompleteTask or FailTask) into its
    batch RPC (HeartbeatTasks, ...); see "Batching" in the module docstring.

    `call` is a drop-in for `client.call(single, request)`: it answers with the single RPC's
    fields (a HeartbeatTaskResponse; for a report, a message whose `task` is the task after it,
    in brief when batched: ReportResult) or raises the GenqError the single RPC would have
    (LeaseLost for an item refused LEASE_LOST).
    """

    def __init__(self, fleet: WorkerFleet, single: str, answer: Callable[[Any], Message]) -> None:
        self._fleet = fleet
        self.single = single
        self.batch = f"{single}s"
        self._batch_request: Callable[..., Message] = getattr(task_pb2, f"{self.batch}Request")
        self._answer = answer
        self._pending: list[_Item] = []
        self._bytes = 0
        self._timer: asyncio.Handle | None = None
        self._sending: set[asyncio.Task[None]] = set()

    async def call(self, request: Message, *, timeout: float | None = None) -> Any:
        """Sends `request` in the next batch and returns its own answer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout or self._fleet.client.timeout)
        context = otel_context.get_current() if self._fleet._traced else None
        item = _Item(request, loop.create_future(), deadline, context)
        size = request.ByteSize()
        if self._pending and self._bytes + size > MAX_BATCH_BYTES:
            self.flush()
        self._pending.append(item)
        self._bytes += size
        if len(self._pending) >= MAX_REPORT_BATCH or self._bytes >= MAX_BATCH_BYTES:
            self.flush()
        elif self._timer is None:
            delay = self._fleet.report_delay
            # No delay: what is ready by the end of this loop turn leaves together, at once.
            self._timer = (
                loop.call_soon(self.flush) if delay <= 0 else loop.call_later(delay, self.flush)
            )
        return await item.future

    def flush(self) -> None:
        """Sends what is waiting now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        items, self._pending, self._bytes = self._pending, [], 0
        if items:
            sending = asyncio.get_running_loop().create_task(self._send(items))
            self._sending.add(sending)
            sending.add_done_callback(self._sending.discard)

    def close(self) -> None:
        """Stops the timer and any send in flight (the fleet is gone: nobody awaits them)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for sending in self._sending:
            sending.cancel()

    async def _send(self, items: list[_Item]) -> None:
        items = [item for item in items if not item.future.done()]  # a beat given up meanwhile
        if len(items) > 1:
            try:
                await self._send_batch(items)
                return
            except Exception as error:
                if not (isinstance(error, GenqError) and error.code in SPLIT_CODES):
                    for item in items:
                        _resolve(item.future, error=error)
                    return
                log.info("%s refused (%s); sending its items one by one", self.batch, error)
        await asyncio.gather(*(self._send_one(item) for item in items))

    async def _send_batch(self, items: list[_Item]) -> None:
        loop = asyncio.get_running_loop()
        request = self._batch_request(tasks=[item.request for item in items])
        timeout = max(0.001, min(item.deadline for item in items) - loop.time())
        if self._fleet._traced:
            # A batch belongs to no one task's trace: sent outside any (the flush runs in the
            # context of whichever call started the batch).
            token = otel_context.attach(otel_context.Context())
            try:
                response = await self._fleet.client.call(self.batch, request, timeout=timeout)
            finally:
                otel_context.detach(token)
        else:
            response = await self._fleet.client.call(self.batch, request, timeout=timeout)
        results = response.results
        if len(results) != len(items):
            raise GenqError(
                grpc.StatusCode.INTERNAL,
                f"{self.batch} answered {len(results)} results for {len(items)} items",
                None,
            )
        for item, result in zip(items, results, strict=True):
            if result.refused:
                _resolve(item.future, error=_refusal(self.single, result.refused))
            else:
                _resolve(item.future, value=self._answer(result))

    async def _send_one(self, item: _Item) -> None:
        if item.future.done():
            return
        remaining = max(0.001, item.deadline - asyncio.get_running_loop().time())
        token = None if item.context is None else otel_context.attach(item.context)
        try:
            response = await self._fleet.client.call(self.single, item.request, timeout=remaining)
        except Exception as error:
            _resolve(item.future, error=error)
        else:
            _resolve(item.future, value=response)
        finally:
            if token is not None:
                otel_context.detach(token)


class WorkerFleet:
    """Hosts tools and works their tasks; see the module docstring for the loop, leases and drain.

    Settings (each with its default):
    - `credentials` (None: `Credentials.from_env()`, GENQ_TOKEN and GENQ_TLS_*): the token and
      TLS of the client the fleet makes from a target (a client given brings its own).
    - `poll_interval` (2.0 s): how long an idle tool's claim parks in the service, jittered
      by ±25 % so a fleet's claims do not line up; at most 30 s (the service's limit).
    - `heartbeat_interval` (60 s): the longest time between two extensions of a running task's
      lease. The beat follows the lease the service grants: every min(`heartbeat_interval`,
      lease / 3), from the lease the claim and then each heartbeat answered (the service's
      GENQ_LEASE_SECONDS, 120, or the tool's `lease_seconds`; never under the service's
      GENQ_MIN_LEASE_SECONDS, 10 by default).
    - `drain_timeout` (30 s): on stop, how long tasks in flight get to finish.
    - `report_delay` (0): how long a heartbeat or a report (CompleteTask, FailTask) waits for
      others to share its batch RPC; a full batch leaves at once. 0 sends, at the end of the
      event loop's turn, what is ready by then (module docstring, "Batching").
    - `retry_unknown_errors` (False): whether a handler's unexpected exception requeues the task
      (uses an attempt) instead of failing it at once. Either way only the class name is stored.
    - `tracer_provider`: where the claim/process/complete spans go; None means OpenTelemetry's
      global provider (a no-op until the application installs an SDK; install it before `run`,
      which looks once: with none, the fleet makes no spans at all).

    One ClaimTasks claims as many tasks as a lane has free slots, and what the fleet sends about
    its tasks is batched (module docstring, "Batching"). Before a claimed task's handler starts,
    one ConfirmClaim confirms the claim's batch (a run counts only once confirmed); a task it
    does not confirm is not run. A heartbeat answering `cancel_requested` sets
    `ctx.cancel_requested`, cancels the handler and reports the cancel with the run's cost. See
    the module docstring for why.
    """

    def __init__(
        self,
        client: GenqClient | str = DEFAULT_TARGET,
        *,
        poll_interval: float = 2.0,
        heartbeat_interval: float = 60.0,
        drain_timeout: float = 30.0,
        report_delay: float = DEFAULT_REPORT_DELAY,
        retry_unknown_errors: bool = False,
        tracer_provider: trace.TracerProvider | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        if poll_interval <= 0:
            raise ValueError("poll_interval must be positive")
        if heartbeat_interval <= 0:
            raise ValueError("heartbeat_interval must be positive")
        if drain_timeout < 0:
            raise ValueError("drain_timeout must not be negative")
        if not 0 <= report_delay <= 1:
            raise ValueError("report_delay must be between 0 and 1 s")
        # Given a target, the fleet makes its own client inside run(): a grpc.aio channel
        # belongs to the event loop it is created in.
        self._target = client if isinstance(client, str) else client.target
        self._client = None if isinstance(client, str) else client
        self._owns_client = isinstance(client, str)
        self._credentials = credentials  # for the client made from a target (None: from env)
        self.poll_interval = poll_interval
        self.heartbeat_interval = heartbeat_interval
        self.drain_timeout = drain_timeout
        self.report_delay = report_delay
        self.retry_unknown_errors = retry_unknown_errors
        self._beats = _Batcher(self, "HeartbeatTask", lambda result: result.heartbeat)
        # A ReportResult has the single answer's one field, `task`.
        self._reports = {
            method: _Batcher(self, method, lambda result: result)
            for method in ("CompleteTask", "FailTask")
        }
        self._tracer_provider = tracer_provider
        self._tracer = trace.get_tracer(__name__, tracer_provider=tracer_provider)
        self._traced = True
        """Whether a tracer provider is set up (`run` looks once): else `_span` stands in."""
        self._lanes: dict[str, _Lane] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested = False
        self._stopping = asyncio.Event()
        self._drain_deadline: float | None = None
        """Loop time by which the drain releases what is unfinished; set once it begins."""
        self._due: set[_Run] = set()
        """Runs whose handler runs and whose next beat is not sent yet (`_beat_schedule`)."""
        self._beat_at = math.inf
        """Loop time at which the beat schedule next looks at `_due`."""
        self._beat_wake = asyncio.Event()
        """Set when a run's beat falls due before `_beat_at`."""
        self.ready = asyncio.Event()
        """Set once every tool is registered and its poll loop runs."""

    @property
    def client(self) -> GenqClient:
        if self._client is None:
            raise RuntimeError("the fleet makes its client when it runs")
        return self._client

    # -- registration -------------------------------------------------------------------------

    def register(
        self,
        name: str,
        handler: Handler,
        *,
        concurrency: int | None = None,
        stop_on_lease_lost: bool = False,
    ) -> None:
        """Hosts the tool `name`; its tasks run at most `concurrency` at a time.

        An `async def` handler runs on the fleet's event loop and must not block it (heartbeats
        run there too). A plain function runs in a thread of its own; it cannot be interrupted,
        so a drain that gives up on it hands its task back and drops its result, but the
        process exits only once the thread returns. Either returns the task's output (a
        mapping, or None) or raises an outcome (`workers_sdk.outcomes`).

        `concurrency` left out: DEFAULT_ASYNC_CONCURRENCY (10) lanes for an async handler,
        DEFAULT_SYNC_CONCURRENCY (1) for a sync one. An async handler mostly waits on a
        provider: one lane would leave the worker idle through every claim, confirm and report
        round trip (on the bench's 2-core machine a worker drained under 200 no-op tasks/s
        with 1 lane, 1,300 to 1,600 with 10, and 4,800 to 5,300 with 100, bench/drain.py),
        while 10 keep a worker's calls to its provider, and the tasks its crash would strand
        (each then charged a retry), few: raise it for a provider that takes more at once. A sync
        handler runs in a thread of its own per lane: code not written for threads stays safe,
        and Python code that computes gains nothing from more threads (the GIL); raise it for
        a handler that blocks on I/O and is thread-safe.

        `stop_on_lease_lost` (False): cancel an async handler as soon as its lease is lost. Left
        False, it runs to its end and the cost it reports is kept (module docstring, "Leases"):
        set it for a provider that does not bill a call cut off midway.
        """
        if self._loop is not None:
            raise RuntimeError("register tools before run()")
        if name in self._lanes:
            raise ValueError(f"tool {name!r} is already registered")
        runs_in_thread = not _is_async(handler)
        if concurrency is None:
            concurrency = DEFAULT_SYNC_CONCURRENCY if runs_in_thread else DEFAULT_ASYNC_CONCURRENCY
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        call: AsyncHandler
        if runs_in_thread:
            sync = cast(SyncHandler, handler)
            call = functools.partial(self._in_thread, sync)
        else:
            call = cast(AsyncHandler, handler)
        self._lanes[name] = _Lane(name, call, concurrency, runs_in_thread, stop_on_lease_lost)

    def tool(
        self, name: str, *, concurrency: int | None = None, stop_on_lease_lost: bool = False
    ) -> Callable[[Handler], Handler]:
        """Decorator form of `register`."""

        def decorate(handler: Handler) -> Handler:
            self.register(
                name, handler, concurrency=concurrency, stop_on_lease_lost=stop_on_lease_lost
            )
            return handler

        return decorate

    @property
    def tool_ids(self) -> dict[str, str]:
        """Tool name → id, once `ready`."""
        return {lane.name: lane.tool_id for lane in self._lanes.values()}

    @property
    def in_flight(self) -> dict[str, int]:
        """Tool name → tasks being worked right now (claimed, and not yet reported)."""
        return {lane.name: len(lane.runs) for lane in self._lanes.values()}

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self, *, handle_signals: bool = True) -> None:
        """Works tasks until SIGTERM/SIGINT (with `handle_signals`) or `stop()`, then drains."""
        if not self._lanes:
            raise RuntimeError("no tools registered")
        if self._loop is not None:
            raise RuntimeError("a fleet runs once")
        loop = self._loop = asyncio.get_running_loop()
        if self._client is None:
            self._client = (
                GenqClient(self._target)  # its own credentials, from the environment
                if self._credentials is None
                else GenqClient(self._target, credentials=self._credentials)
            )
        if self._stop_requested:
            self._begin_stop()
        threads = sum(lane.concurrency for lane in self._lanes.values() if lane.runs_in_thread)
        if threads:
            self._executor = ThreadPoolExecutor(threads, thread_name_prefix="genq-handler")
        signals = self._install_signal_handlers(loop) if handle_signals else []
        provider = self._tracer_provider or trace.get_tracer_provider()
        self._traced = not isinstance(
            provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
        )
        polls: list[asyncio.Task[None]] = []
        beats = asyncio.create_task(self._beat_schedule(), name="genq heartbeats")
        try:
            await self._register_tools()
            if not self._stopping.is_set():
                polls = [
                    asyncio.create_task(self._poll(lane), name=f"genq poll {lane.name}")
                    for lane in self._lanes.values()
                ]
                self.ready.set()
                log.info("working %s at %s", ", ".join(self._lanes), self._target)
                await self._stopping.wait()
            await self._drain(polls)
        finally:
            # Only finds work left when run() itself was cancelled: there is no drain then, and
            # the leases lapse (use stop() or a signal to drain).
            for task in [*polls, *self._working(), beats]:
                task.cancel()
            for batcher in (self._beats, *self._reports.values()):
                batcher.close()
            for sig in signals:
                loop.remove_signal_handler(sig)
            if self._executor is not None:
                # A sync handler cannot be interrupted; its thread ends on its own.
                self._executor.shutdown(wait=False, cancel_futures=True)
            if self._owns_client:
                await self.client.close()

    def stop(self) -> None:
        """Starts the drain. Safe from any thread, and before `run()`. Repeating it (or the
        signal) changes nothing; only SIGKILL cuts a drain short."""
        if self._loop is None:
            self._stop_requested = True
            return
        with contextlib.suppress(RuntimeError):  # the loop is already closed: nothing to stop
            self._loop.call_soon_threadsafe(self._begin_stop)

    def _begin_stop(self) -> None:
        if self._stopping.is_set():
            return
        log.info("stopping: no new claims; draining for up to %g s", self.drain_timeout)
        self._stopping.set()
        for lane in self._lanes.values():
            lane.wake.set()

    def _install_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> list[signal.Signals]:
        installed = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._begin_stop)
            except (NotImplementedError, RuntimeError, ValueError):
                continue  # not the main thread, or not a Unix loop: stop() still works
            installed.append(sig)
        return installed

    async def _register_tools(self) -> None:
        """UpsertTool for each tool; waits out an unavailable service (REGISTER)."""

        def unavailable(error: Exception, tries: int, pause: float) -> None:
            log.warning("service unavailable at %s; retrying", self.client.target)

        for lane in self._lanes.values():
            request = task_pb2.UpsertToolRequest(name=lane.name)
            try:
                response = await retry(
                    REGISTER,
                    functools.partial(self.client.call, "UpsertTool", request),
                    retry_on=_unavailable,
                    stop=self._stopping,
                    on_retry=unavailable,
                )
            except GenqError as error:
                if _unavailable(error) and self._stopping.is_set():
                    return
                raise
            lane.tool_id = response.tool.id

    def _report_deadline(self) -> float:
        """How long a failing report may go on being tried, beyond its lease: once the drain
        began, DRAIN_REPORT_SECONDS past its deadline, so that a stop with the service down
        does not wait a whole lease."""
        if self._drain_deadline is None:
            return float("inf")
        return self._drain_deadline + DRAIN_REPORT_SECONDS

    def _past_drain_deadline(self) -> bool:
        deadline = self._drain_deadline
        return deadline is not None and asyncio.get_running_loop().time() >= deadline

    async def _drain(self, polls: list[asyncio.Task[None]]) -> None:
        loop = asyncio.get_running_loop()
        deadline = self._drain_deadline = loop.time() + self.drain_timeout
        # Each poll loop ends once its current claim answers (within its park time); a task it
        # brings back joins the ones in flight.
        await asyncio.gather(*polls)
        working = self._working()
        if working:
            await asyncio.wait(working, timeout=max(0.0, deadline - loop.time()))
        if running := sum(len(lane.running) for lane in self._lanes.values()):  # not reporting
            log.warning("drain timeout: releasing %d unfinished tasks", running)
        for lane in self._lanes.values():
            for run in lane.runs:
                if run.handling:
                    run.abandoned = True
                    self._interrupt(run)
        if working := self._working():
            # Each run reports within DRAIN_REPORT_SECONDS; a handler that ignores its
            # cancellation is not waited for (run() cancels it again).
            await asyncio.wait(working, timeout=DRAIN_REPORT_SECONDS + 1.0)

    def _working(self) -> set[asyncio.Task[None]]:
        return {run.task for lane in self._lanes.values() for run in lane.runs if run.task}

    # -- the poll loop --------------------------------------------------------------------------

    async def _poll(self, lane: _Lane) -> None:
        policy = CLAIM.capped(self.poll_interval)

        def failed(error: Exception, tries: int, pause: float) -> None:
            log.warning("claim for %s failed (%s); retrying in %.1f s", lane.name, error, pause)

        while not self._stopping.is_set():
            lane.wake.clear()  # before the sweep, so a slot freed during it is not missed
            if lane.free <= 0:
                await _wait(lane.wake, AT_CAPACITY_BACKOFF_SECONDS)
                continue
            # CLAIM tries a failed sweep until it answers: it gives up only once stop is asked.
            with contextlib.suppress(Exception):
                await retry(
                    policy,
                    functools.partial(self._sweep, lane),
                    retry_on=lambda error: True,
                    stop=self._stopping,
                    on_retry=failed,
                )

    async def _sweep(self, lane: _Lane) -> None:
        """Claims tasks for the lane's free slots, confirms the claim, and starts working the
        tasks it holds."""
        limit = min(lane.free, MAX_CLAIM_BATCH)
        claimed, lease, claim_span = await self._claim(lane, limit, self._park_seconds())
        if claimed:
            await self._confirm_claim(lane, claimed, lease, claim_span)

    async def _confirm_claim(
        self,
        lane: _Lane,
        claimed: list[task_pb2.ClaimedTask],
        lease: float,
        claim_span: trace.SpanContext,
    ) -> None:
        """One ConfirmClaim for a claim's tasks (they share its lease token) before any handler
        runs (module docstring, "Confirmation"); starts the tasks it confirms, cancelled before
        they start when a cancel was asked for. Never raises: a failed sweep is claimed again."""
        loop = asyncio.get_running_loop()
        claimed_at = loop.time()
        # Give up well inside the claim's lease: past it the confirmation could only be refused.
        deadline = claimed_at + lease * 2 / 3
        request = task_pb2.ConfirmClaimRequest(
            tool_id=lane.tool_id,
            lease_token=claimed[0].lease_token,
            task_ids=[item.task.id for item in claimed],
        )

        async def confirm() -> Any:
            timeout = min(self.client.timeout, max(0.001, deadline - loop.time()))
            return await self.client.call("ConfirmClaim", request, timeout=timeout)

        def failed(error: Exception, tries: int, pause: float) -> None:
            log.warning("%s: confirming a claim of %d failed: %s", lane.name, len(claimed), error)

        # Policy "confirm", made here from its two settings (read when used: a test shortens them).
        policy = Policy("confirm", first=CONFIRM_RETRY_SECONDS, attempts=CONFIRM_ATTEMPTS)
        try:
            answer = await retry(
                policy, confirm, retry_on=_transient, deadline=deadline, on_retry=failed
            )
        except Exception as error:
            if not _transient(error):
                log.error(
                    "%s: claim of %d not confirmed: %s; not running it",
                    lane.name,
                    len(claimed),
                    error,
                )
                return
            log.warning(
                "%s: could not confirm a claim of %d (%s); not running it, handing it back",
                lane.name,
                len(claimed),
                error,
            )
            # One of the tries may have committed after all (its answer lost): the leases would
            # then count as confirmed and their lapse cost a retry for runs that never happened.
            # A release costs nothing either way; if it cannot get through either, they lapse.
            await asyncio.gather(*(self._hand_back(item) for item in claimed))
            return
        held = set(answer.task_ids)
        cancel = set(answer.cancel_requested_task_ids)
        lease_until = claimed_at + lease
        for item in claimed:
            task = item.task
            if task.id not in held:
                log.warning(
                    "task %s: claim not confirmed (lease lost or task gone); not running it",
                    task.id,
                )
                continue
            ctx = TaskContext(self.client, lane.name, task, item.lease_token, loop)
            if task.id in cancel:
                ctx._request_cancel()
            run = _Run(lane, ctx, claim_span, lease, lease_until)
            lane.running.add(run)
            lane.runs.add(run)
            run.task = asyncio.create_task(self._execute(run), name=f"genq {lane.name} {task.id}")
            run.task.add_done_callback(functools.partial(self._finished, run))

    async def _hand_back(self, item: task_pb2.ClaimedTask) -> None:
        """ReleaseTask for a claimed task that could not be confirmed (never raises)."""
        request = task_pb2.ReleaseTaskRequest(task_id=item.task.id, lease_token=item.lease_token)
        try:
            await self.client.call("ReleaseTask", request, timeout=self.client.timeout)
        except GenqError as error:
            log.info("task %s: hand-back not delivered either (%s)", item.task.id, error.code)

    def _span(self, name: str) -> AbstractContextManager[trace.Span]:
        """`name` as the current span. With no tracer provider set up when the fleet started
        (OpenTelemetry's no-op default), nothing at all: no span, no context attached (the
        API's no-op spans and context switches cost about a seventh of the fleet's CPU per
        task)."""
        if self._traced:
            return self._tracer.start_as_current_span(name)
        return _UNTRACED

    def _park_seconds(self) -> float:
        return min(self.poll_interval * random.uniform(0.75, 1.25), MAX_CLAIM_WAIT_SECONDS)

    async def _claim(
        self, lane: _Lane, limit: int, wait: float
    ) -> tuple[list[task_pb2.ClaimedTask], float, trace.SpanContext]:
        """One ClaimTasks for up to `limit` tasks (ClaimNextTask for one) that parks in the
        service for up to `wait` seconds; returns the tasks, the lease's length and the span."""
        park = duration_pb2.Duration()
        park.FromNanoseconds(int(wait * 1e9))
        timeout = wait + self.client.timeout
        with self._span(f"claim {lane.name}") as span:
            if limit > 1:
                request = task_pb2.ClaimTasksRequest(tool_id=lane.tool_id, limit=limit, wait=park)
                many = await self.client.call("ClaimTasks", request, timeout=timeout)
                claimed, lease = list(many.tasks), _lease_seconds(many, MIN_LEASE_SECONDS)
            else:
                single = task_pb2.ClaimNextTaskRequest(tool_id=lane.tool_id, wait=park)
                one = await self.client.call("ClaimNextTask", single, timeout=timeout)
                claimed, lease = [], _lease_seconds(one, MIN_LEASE_SECONDS)
                if one.HasField("task"):
                    claimed.append(task_pb2.ClaimedTask(task=one.task, lease_token=one.lease_token))
            span.set_attribute("genq.claimed", bool(claimed))
            span.set_attribute("genq.claimed_count", len(claimed))
            if len(claimed) == 1:
                span.set_attribute("genq.task_id", claimed[0].task.id)
            return claimed, lease, span.get_span_context()

    def _finished(self, run: _Run, _: asyncio.Task[None]) -> None:
        run.lane.runs.discard(run)
        self._free_slot(run)

    def _free_slot(self, run: _Run) -> None:
        """The run's handler is done (or never ran): its lane may claim another task."""
        run.lane.running.discard(run)
        run.lane.wake.set()

    # -- one task -------------------------------------------------------------------------------

    async def _execute(self, run: _Run) -> None:
        """Works one claimed task: confirm, heartbeat, handler, then complete, fail, drop or
        release. With nothing traced, no span: a task enqueued in a trace has the enqueuer's
        span made current (in this asyncio task's own context, which ends with it: nothing to
        detach), so that a handler passing its context on hands that trace on, as
        OpenTelemetry's no-op spans would; a task without one costs no OpenTelemetry call."""
        task = run.ctx.task
        if not self._traced:
            if task.w3c_traceparent:
                otel_context.attach(_parent_context(task.w3c_traceparent))
            await self._work(run, trace.INVALID_SPAN)
            return
        links = [trace.Link(run.claim_span)] if run.claim_span.is_valid else []
        with self._tracer.start_as_current_span(
            f"process {run.lane.name}",
            context=_parent_context(task.w3c_traceparent),
            kind=trace.SpanKind.CONSUMER,
            links=links,
            attributes={"genq.task_id": task.id, "genq.retry_count": task.retry_count},
            record_exception=False,  # an exception's message may quote the user's prompt
        ) as span:
            await self._work(run, span)

    async def _work(self, run: _Run, span: trace.Span) -> None:
        ctx = run.ctx
        if self._past_drain_deadline():
            # The drain's deadline passed while the claim came in (a claim parked at the
            # stop) or was confirmed: hand it back unrun rather than run it and release it
            # midway, for another worker to run again.
            await self._release(run)
            return
        if ctx.is_cancel_requested:
            # Cancelled before it started: nothing ran, nothing to bill.
            span.set_attribute("genq.cancelled", True)
            await self._report(run, "cancel", _cancel_request(ctx))
            return
        # The first beat is due a beat interval after the claim answered (ConfirmClaim extends
        # no lease), in the fleet's one beat schedule: a run shorter than that sends none.
        claimed_at = run.lease_until - run.lease
        due = claimed_at + self._beat_interval(run) - asyncio.get_running_loop().time()
        self._schedule_beat(run, max(0.0, due))
        run.handling = True
        if run.lane.stop_on_lease_lost and not run.lane.runs_in_thread:
            ctx._stop_handler = functools.partial(self._interrupt, run)  # a thread sees the flag
        output: Output = None
        error: BaseException | None = None
        try:
            output = await run.lane.call(ctx.task, ctx)
        except asyncio.CancelledError as cancelled:
            current = asyncio.current_task()
            if current is None or current.cancelling() > int(run.interrupted):
                raise  # cancelled from outside (run() itself): no report
            error = cancelled
        except Exception as raised:
            error = raised
        finally:
            # The heartbeat stops before the report: a beat racing a completion could only
            # misreport a lost lease. The lease has at least a beat's worth left.
            run.handling = False
            ctx._stop_handler = None
            self._due.discard(run)
            if run.heartbeat is not None:
                run.heartbeat.cancel()
            if run.interrupted:
                # The fleet's own cancel is spent (caught above, or swallowed by the handler):
                # the report that follows must not be cancelled by it.
                current = asyncio.current_task()
                if current is not None:
                    current.uncancel()
            self._free_slot(run)  # the report is no handler's work: the lane may claim
        try:
            if run.abandoned:
                await self._release(run)
            else:
                await self._settle(run, output, error, span)
        except Exception:
            log.exception("task %s: reporting the outcome failed", ctx.task.id)

    def _interrupt(self, run: _Run) -> None:
        """Stops the run's handler (lost lease, cancel request, drain): cancels the run's
        task, which catches it where the handler is awaited. Once at most, and only while the
        handler runs (a sync handler's thread goes on; its result is dropped)."""
        if run.handling and not run.interrupted and run.task is not None:
            run.interrupted = True
            run.task.cancel()

    async def _in_thread(
        self, handler: SyncHandler, task: task_pb2.Task, ctx: TaskContext
    ) -> Output:
        loop = asyncio.get_running_loop()
        context = copy_context()  # the thread sees the process span as current
        return await loop.run_in_executor(self._executor, context.run, handler, task, ctx)

    def _schedule_beat(self, run: _Run, after: float) -> None:
        """Puts the run's next beat `after` seconds from now in the fleet's beat schedule."""
        run.beat_due = asyncio.get_running_loop().time() + after
        self._due.add(run)
        if run.beat_due < self._beat_at:
            self._beat_wake.set()

    async def _beat_schedule(self) -> None:
        """The fleet's one heartbeat timer: sends each running task's beat when it falls due
        (`_heartbeat`, a task for the beat in flight only), so that a run shorter than a beat
        costs no timer and no task of its own."""
        loop = asyncio.get_running_loop()
        while True:
            self._beat_wake.clear()
            now = loop.time()
            due: list[_Run] = []
            later = math.inf
            for run in self._due:
                if run.beat_due <= now:
                    due.append(run)
                elif run.beat_due < later:
                    later = run.beat_due
            for run in due:
                self._due.discard(run)
                run.heartbeat = asyncio.create_task(self._heartbeat(run))
            self._beat_at = later
            if later == math.inf:
                await self._beat_wake.wait()
            else:
                await _wait(self._beat_wake, later - now)

    async def _heartbeat(self, run: _Run) -> None:
        """One beat (tried again as HEARTBEAT says until it answers or the lease is gone), then
        the next one put in the schedule."""
        ctx = run.ctx
        request = task_pb2.HeartbeatTaskRequest(task_id=ctx.task.id, lease_token=ctx.lease_token)

        def failed(error: Exception, tries: int, pause: float) -> None:
            log.warning("task %s: heartbeat failed: %s", ctx.task.id, error)

        interval = self._beat_interval(run)
        # A beat that hangs must not outlive the next one.
        timeout = min(self.client.timeout, max(interval, 1.0))
        try:
            response = await retry(
                HEARTBEAT.capped(interval),
                functools.partial(self._beats.call, request, timeout=timeout),
                retry_on=_lease_held,
                on_retry=failed,
            )
        except GenqError as error:  # the lease is gone: every other answer is tried again
            ctx._lose_lease(f"HeartbeatTask: {error.reason}")
            return
        finally:
            run.heartbeat = None
        self._beaten(run, response)
        if run.handling:
            self._schedule_beat(run, self._beat_interval(run))

    def _beat_interval(self, run: _Run) -> float:
        """min(heartbeat_interval, lease / 3): two beats may fail before the lease lapses."""
        return min(self.heartbeat_interval, run.lease / 3)

    def _beaten(self, run: _Run, response: task_pb2.HeartbeatTaskResponse) -> None:
        """Takes in a heartbeat's answer: the lease's length, and a cancel request."""
        run.lease = _lease_seconds(response, run.lease)
        run.lease_until = asyncio.get_running_loop().time() + run.lease
        if not response.cancel_requested or not run.ctx._request_cancel():
            return
        # A thread cannot be interrupted: a sync handler sees ctx.cancel_requested and returns,
        # and the lease is kept until it does.
        if not run.lane.runs_in_thread:
            self._interrupt(run)

    async def _settle(
        self, run: _Run, output: Output, error: BaseException | None, span: trace.Span
    ) -> None:
        ctx = run.ctx
        if ctx.is_lease_lost:
            log.warning("task %s: lease lost while running; result dropped", ctx.task.id)
            await self._report_cost(run)
            return
        if ctx.is_cancel_requested:
            # Whatever the handler made of the cancel (returned, raised, or was cancelled), the
            # run ends cancelled; what it cost so far is recorded.
            span.set_attribute("genq.cancelled", True)
            await self._report(run, "cancel", _cancel_request(ctx))
            return
        if error is None:
            await self._complete(run, output, span)
        elif isinstance(error, outcomes.TaskOutcome):
            span.set_status(trace.StatusCode.ERROR, type(error).__name__)
            request = _fail_request(ctx, error.stored_error(), error.failure)
            await self._report(run, "fail", request)
        else:
            # Only the class name leaves this process; the traceback stays in the worker's log.
            name = type(error).__name__
            log.error("task %s: handler raised %s", ctx.task.id, name, exc_info=error)
            span.set_status(trace.StatusCode.ERROR, name)
            await self._report(run, "fail", _fail_request(ctx, name, self._bug_failure))

    @property
    def _bug_failure(self) -> task_pb2.FailureKind.ValueType:
        """What an exception that is no TaskOutcome (a bug in the handler) makes of the task."""
        if self.retry_unknown_errors:
            return task_pb2.FAILURE_KIND_RETRYABLE
        return task_pb2.FAILURE_KIND_PERMANENT

    async def _complete(self, run: _Run, output: Output, span: trace.Span) -> None:
        ctx = run.ctx
        try:
            struct = _struct(output)
        except (TypeError, ValueError) as error:
            # The handler returned something that is not a JSON object: a bug in the handler.
            log.error("task %s: handler returned an unusable output: %s", ctx.task.id, error)
            span.set_status(trace.StatusCode.ERROR, type(error).__name__)
            name = type(error).__name__
            await self._report(run, "fail", _fail_request(ctx, name, self._bug_failure))
            return
        request = task_pb2.CompleteTaskRequest(
            task_id=ctx.task.id,
            lease_token=ctx.lease_token,
            output=struct,
            reported_usage=ctx.reported_usage(),
            resource_key=ctx.used_resource,
        )
        refused = await self._report(run, "complete", request)
        if refused is not None and refused.code in SPLIT_CODES:
            # The service refuses this output (over its limit: INVALID_ARGUMENT; over gRPC's
            # message limit: RESOURCE_EXHAUSTED): running again would pay for the same refusal,
            # so the task fails now.
            error_text = f"CompleteTask refused the result: {refused}"
            failure = _fail_request(ctx, error_text, task_pb2.FAILURE_KIND_PERMANENT)
            await self._report(run, "fail", failure)

    async def _release(self, run: _Run) -> None:
        """Returns a task the drain could not finish to the queue, its attempt unused. Should
        the release fail, the heartbeat is stopped already: the lease lapses and the service's
        rescuer requeues the task (the lapse of this confirmed run then uses a retry)."""
        ctx = run.ctx
        if ctx.is_lease_lost:
            await self._report_cost(run)  # another worker holds it already
            return
        log.warning("task %s: unfinished at the drain deadline; releasing it", ctx.task.id)
        request = task_pb2.ReleaseTaskRequest(
            task_id=ctx.task.id,
            lease_token=ctx.lease_token,
            cost_nanos=ctx.reported_usage().cost_nanos,
        )
        await self._report(run, "release", request)

    async def _report_cost(self, run: _Run) -> None:
        """Billed is billed: a run whose lease was lost still tells the service what it cost.
        The ReleaseTask is refused (LEASE_LOST) but the cost lands on the run's attempt. The
        lease ended long ago when the handler ran on to its end: the report is tried for a
        lease's length from now (the service takes a late cost whenever it comes)."""
        ctx = run.ctx
        cost = ctx.reported_usage().cost_nanos
        if cost > 0:
            request = task_pb2.ReleaseTaskRequest(
                task_id=ctx.task.id, lease_token=ctx.lease_token, cost_nanos=cost
            )
            until = asyncio.get_running_loop().time() + run.lease
            await self._report(run, "report cost", request, until=until)

    async def _report(
        self, run: _Run, what: str, request: Message, *, until: float | None = None
    ) -> GenqError | None:
        """Sends the write that ends this worker's hold on the task (CompleteTask, FailTask or
        ReleaseTask) in a span named `what`; returns the error that refused it, if any.
        CompleteTask and FailTask go in a batch; a failure is tried again as REPORT says (in
        the next batch) until the lease ends (or `until`, loop time), or the drain's deadline."""
        method = type(request).__name__.removesuffix("Request")
        ctx = run.ctx
        batcher = self._reports.get(method)
        send: Callable[[], Awaitable[Any]] = (
            functools.partial(self.client.call, method, request)
            if batcher is None
            else functools.partial(batcher.call, request)
        )

        def failed(error: Exception, tries: int, pause: float) -> None:
            if tries == 1:
                log.warning(
                    "task %s: %s failed: %s; trying again until its lease ends",
                    ctx.task.id,
                    method,
                    error,
                )

        with self._span(f"{what} {run.lane.name}"):
            try:
                response = await retry(
                    REPORT,
                    send,
                    retry_on=_transient,
                    deadline=lambda: min(
                        run.lease_until if until is None else until, self._report_deadline()
                    ),
                    on_retry=failed,
                )
            except GenqError as error:
                if _lease_gone(error):
                    ctx.lease_lost.set()
                    log.warning(
                        "task %s: %s refused (%s); result dropped",
                        ctx.task.id,
                        method,
                        error.reason,
                    )
                else:
                    log.error(
                        "task %s: %s failed: %s (if it did not commit, the lease lapses and the "
                        "task runs again)",
                        ctx.task.id,
                        method,
                        error,
                    )
                return error
            if response.task.status == task_pb2.TASK_STATUS_CANCELLED:
                # A cancel was asked for while the task ran: whatever was reported, the run
                # ended cancelled, with its cost.
                log.info("task %s: cancelled while running; cost recorded", ctx.task.id)
            return None


def _fail_request(
    ctx: TaskContext, error: str, failure: task_pb2.FailureKind.ValueType
) -> task_pb2.FailTaskRequest:
    return task_pb2.FailTaskRequest(
        task_id=ctx.task.id,
        lease_token=ctx.lease_token,
        error=error,
        failure=failure,
        increment_retry=failure == task_pb2.FAILURE_KIND_RETRYABLE,
        reported_usage=ctx.reported_usage(),
        resource_key=ctx.used_resource,
    )


def _cancel_request(ctx: TaskContext) -> task_pb2.FailTaskRequest:
    """The report of a run stopped by a cancel request, with what it cost so far."""
    cancelled = outcomes.CancelledError()
    return _fail_request(ctx, cancelled.stored_error(), cancelled.failure)


def _lease_seconds(
    response: task_pb2.ClaimNextTaskResponse
    | task_pb2.ClaimTasksResponse
    | task_pb2.HeartbeatTaskResponse,
    unsaid: float,
) -> float:
    """The lease's length an answer gives, in seconds; `unsaid` when it gives none."""
    seconds = response.lease.ToNanoseconds() / 1e9
    return seconds if seconds > 0 else unsaid


def _refusal(method: str, reason: str) -> GenqError:
    """A batch item's `refused` as the error the single RPC would have raised."""
    if reason == Reason.LEASE_LOST:
        return LeaseLost(grpc.StatusCode.ABORTED, f"{method}: the lease is lost", Reason.LEASE_LOST)
    if reason == Reason.TASK_NOT_FOUND:
        return GenqError(
            grpc.StatusCode.NOT_FOUND, f"{method}: no such task", Reason.TASK_NOT_FOUND
        )
    known = Reason(reason) if reason in Reason.__members__ else None
    return GenqError(grpc.StatusCode.FAILED_PRECONDITION, f"{method} refused: {reason}", known)


def _resolve(
    future: asyncio.Future[Any], *, value: Any = None, error: BaseException | None = None
) -> None:
    """Answers a batched call, unless its caller gave up on it meanwhile."""
    if future.done():
        return
    if error is None:
        future.set_result(value)
    elif isinstance(error, GenqError):
        future.set_exception(error)
    else:  # callers branch on GenqError: a bug in a batch must not end a heartbeat silently
        future.set_exception(GenqError(grpc.StatusCode.INTERNAL, repr(error), None))


def _lease_gone(error: GenqError) -> bool:
    """The service says this worker can no longer write the task (or the task is gone)."""
    return isinstance(error, LeaseLost) or error.reason is Reason.TASK_NOT_FOUND


def _lease_held(error: Exception) -> bool:
    """A call failed, but not because the lease is gone (what HEARTBEAT tries again)."""
    return isinstance(error, GenqError) and not _lease_gone(error)


def _transient(error: Exception) -> bool:
    """The call may not have reached the service (RETRIED_CODES)."""
    return isinstance(error, GenqError) and error.code in RETRIED_CODES


def _unavailable(error: Exception) -> bool:
    return isinstance(error, GenqError) and error.code == grpc.StatusCode.UNAVAILABLE


_UNTRACED = contextlib.nullcontext(trace.INVALID_SPAN)
"""What `WorkerFleet._span` stands in with when nothing traces."""


def _parent_context(traceparent: str) -> otel_context.Context:
    """The enqueuer's span as parent. A fresh Context either way: without a stored traceparent
    the task starts its own trace instead of nesting under whatever span started the fleet."""
    if not traceparent:
        return otel_context.Context()
    return propagate.extract({"traceparent": traceparent}, context=otel_context.Context())


def _struct(output: Output) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    if output is None:
        return struct
    if not isinstance(output, Mapping):
        raise TypeError(f"a handler returns a mapping or None, not {type(output).__name__}")
    struct.update(output)
    return struct


def _is_async(handler: Handler) -> bool:
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 - an object with `async def __call__`
    )


async def _wait(event: asyncio.Event, seconds: float) -> None:
    """Waits for `event`, at most `seconds`."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
