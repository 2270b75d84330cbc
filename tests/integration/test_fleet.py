"""WorkerFleet in this process against the real service (GUIDE A9, A11, A12 worker side, B7).

The fleet runs on an event loop in a thread of its own, as a worker would run it, while the test
thread enqueues over gRPC and checks rows in SQL. Handlers record what they saw.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import grpc
import psycopg
import pytest
from google.protobuf import duration_pb2
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from psycopg.rows import dict_row

from generation.task.v1 import task_pb2
from tests.conftest import Databases, ServiceProcess, url_for, wait_for
from tests.integration.test_semantics import Db, Stub, row
from workers_sdk import (
    AccountError,
    CancelledError,
    GenqClient,
    GenqError,
    LeaseLost,
    PermanentError,
    Reason,
    RetryableError,
    TaskContext,
    WorkerFleet,
)
from workers_sdk import fleet as fleet_module


@contextmanager
def running(fleet: WorkerFleet) -> Iterator[WorkerFleet]:
    """Runs the fleet on its own event loop in a thread; stops (drains) it on exit."""
    failures: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(fleet.run(handle_signals=False))
        except BaseException as error:
            failures.append(error)

    thread = threading.Thread(target=main, name="fleet", daemon=True)
    thread.start()
    wait_for(lambda: fleet.ready.is_set() or not thread.is_alive(), what="the fleet to start")
    try:
        yield fleet
    finally:
        fleet.stop()
        thread.join(30)
        assert not thread.is_alive(), "the fleet did not stop"
        if failures:
            raise failures[0]


def new_fleet(service: ServiceProcess, **settings: Any) -> WorkerFleet:
    return WorkerFleet(service.address, poll_interval=0.5, drain_timeout=5, **settings)


def no_backoff(service: ServiceProcess, tool_id: str) -> None:
    """Retries at once: these tests are about outcomes, not the backoff."""
    service.stub.ConfigureTool(
        task_pb2.ConfigureToolRequest(
            tool_id=tool_id, backoff_base_seconds=0, backoff_max_seconds=0
        )
    )


def tool_name() -> str:
    return f"fleet-{uuid.uuid4().hex[:12]}"


def queue(stub: Stub, tool_id: str, **fields: Any) -> str:
    return stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id, **fields)).task.id


def terminal(db: Db, *task_ids: str) -> bool:
    return all(row(db, t)["status"] in {"completed", "failed", "cancelled"} for t in task_ids)


def events(db: Db, task_id: str) -> list[dict[str, Any]]:
    return db.execute(
        "SELECT kind::text, data FROM generation.event_stream WHERE task_id = %s ORDER BY sequence",
        [task_id],
    ).fetchall()


def test_tasks_complete_with_output_and_usage(service: ServiceProcess, db: Db) -> None:
    name = tool_name()
    fleet = new_fleet(service)

    @fleet.tool(name, concurrency=2)
    async def echo(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        ctx.report_usage(token_amount=7, cost_nanos=1_234, model="m1")
        ctx.report_usage(token_amount=3, units=2)  # amounts add up
        return {"echo": ctx.input["prompt"], "tool": ctx.tool}

    with running(fleet):
        tasks = [
            queue(service.stub, fleet.tool_ids[name], input={"prompt": f"p{i}"}) for i in range(3)
        ]
        wait_for(lambda: terminal(db, *tasks), what="the tasks to finish")
    for i, task_id in enumerate(tasks):
        done = row(db, task_id)
        assert done["status"] == "completed"
        assert (done["retry_count"], done["error"]) == (0, None)
        assert done["output"] == {"echo": f"p{i}", "tool": name}
        assert done["reported_usage"] == {
            "token_amount": 10,
            "cost_nanos": 1_234,
            "details": {"model": "m1", "units": 2},
        }


def test_outcomes_and_stored_errors(service: ServiceProcess, db: Db) -> None:
    """B7: retryable requeues until attempts run out; permanent, cancelled and any other
    exception fail at once; an unexpected exception stores only its class name."""
    name = tool_name()
    fleet = new_fleet(service)
    runs: Counter[str] = Counter()

    @fleet.tool(name, concurrency=4)
    async def handler(task: task_pb2.Task, ctx: TaskContext) -> Any:
        runs[task.id] += 1
        match ctx.input["outcome"]:
            case "retryable":
                raise RetryableError("provider timed out")
            case "account":
                raise AccountError("quota exceeded")
            case "permanent":
                raise PermanentError("content blocked")
            case "permanent-silent":
                raise PermanentError()
            case "cancelled":
                raise CancelledError("the user left")
            case "bug":
                raise ValueError("secret prompt: a portrait of my neighbour")
            case "not-a-mapping":
                return ["secret", "list"]
        raise AssertionError("unknown outcome")

    expected = {
        # outcome: (max_retries, runs, retry_count, status, stored error)
        "retryable": (3, 3, 3, "failed", "provider timed out"),
        "permanent": (3, 1, 0, "failed", "content blocked"),
        "permanent-silent": (3, 1, 0, "failed", "PermanentError"),
        "cancelled": (3, 1, 0, "cancelled", "cancelled"),
        "bug": (3, 1, 0, "failed", "ValueError"),
        "not-a-mapping": (3, 1, 0, "failed", "TypeError"),
    }
    with running(fleet):
        tool_id = fleet.tool_ids[name]
        no_backoff(service, tool_id)
        tasks = {
            outcome: queue(
                service.stub, tool_id, max_retries=max_retries, input={"outcome": outcome}
            )
            for outcome, (max_retries, *_) in expected.items()
        }
        wait_for(lambda: terminal(db, *tasks.values()), what="every task to end")
        # Last, alone: an account error holds the tool's whole group.
        account = queue(service.stub, tool_id, input={"outcome": "account"})
        wait_for(lambda: runs[account] == 1 and row(db, account)["error"], what="the hold")
    for outcome, (_, run_count, retry_count, status, error) in expected.items():
        task_id = tasks[outcome]
        ended = row(db, task_id)
        assert (runs[task_id], ended["retry_count"], ended["status"], ended["error"]) == (
            run_count,
            retry_count,
            status,
            error,
        ), outcome
    held = row(db, account)
    assert (held["status"], held["retry_count"], held["error"]) == ("queued", 0, "quota exceeded")
    assert db.execute(
        "SELECT held_until > now() AS held FROM generation.holds WHERE account_group = %s", [name]
    ).fetchone() == {"held": True}
    for outcome in ("bug", "not-a-mapping"):
        stored = json.dumps([row(db, tasks[outcome]), events(db, tasks[outcome])], default=str)
        assert "secret" not in stored


def test_a_handler_falls_back_while_its_model_cools(service: ServiceProcess, db: Db) -> None:
    """B24: the handler asks whether its model is cooling (ctx.resource_cooling) and says which
    one it used (ctx.use_resource): the failures cool the model that failed, the fallback then
    serves, and the tool's own key never cools."""
    name, primary, fallback = (
        tool_name(),
        f"primary-{uuid.uuid4().hex}",
        f"fallback-{uuid.uuid4().hex}",
    )
    fleet = new_fleet(service)

    @fleet.tool(name, concurrency=1)
    async def generate(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        model = fallback if await ctx.resource_cooling(primary) else primary
        ctx.use_resource(model)
        if model == primary:
            raise RetryableError("the primary model is down")
        return {"model": model}

    settings = service.stub.GetSettings(task_pb2.GetSettingsRequest()).settings
    cooling = task_pb2.UpdateSettingsRequest(cooldown_threshold=2, cooldown_seconds=600)
    service.stub.UpdateSettings(cooling)  # this session's default never cools (conftest)
    try:
        with running(fleet):
            tool_id = fleet.tool_ids[name]
            no_backoff(service, tool_id)
            tasks = [queue(service.stub, tool_id, max_retries=10) for _ in range(3)]
            wait_for(lambda: terminal(db, *tasks), what="the tasks to finish")
    finally:
        service.stub.UpdateSettings(
            task_pb2.UpdateSettingsRequest(
                cooldown_threshold=settings.cooldown_threshold,
                cooldown_seconds=settings.cooldown_seconds,
            )
        )
    assert {row(db, t)["output"]["model"] for t in tasks} == {fallback}
    used = db.execute(
        "SELECT resource_key, outcome::text AS outcome, count(*) AS n FROM generation.attempts "
        "WHERE tool_id = %s GROUP BY 1, 2 ORDER BY 1, 2",
        [tool_id],
    ).fetchall()
    # Two failures cool the primary; a third run may have asked before the second's report
    # committed (a slot frees when its handler returns, before its report is sent).
    assert used[0] == {"resource_key": fallback, "outcome": "completed", "n": 3}
    assert (used[1]["resource_key"], used[1]["outcome"]) == (primary, "retry")
    assert 2 <= used[1]["n"] <= 3
    assert len(used) == 2
    state = service.stub.GetResourceKey(task_pb2.GetResourceKeyRequest(resource_key=primary))
    assert state.cooling
    own = service.stub.GetResourceKey(task_pb2.GetResourceKeyRequest(resource_key=name))
    assert not own.cooling


@pytest.mark.parametrize("size", [1_100_000, 5_000_000], ids=["over-output-limit", "over-4MiB"])
def test_output_the_service_refuses_fails_the_task(
    service: ServiceProcess, db: Db, size: int
) -> None:
    """An output over the service's size limit (INVALID_ARGUMENT), or over gRPC's message limit
    (RESOURCE_EXHAUSTED, else it is run again until its retries are used up), can
    never be stored: the task fails at once instead of being run (and paid for) again."""
    name = tool_name()
    fleet = new_fleet(service)
    runs: Counter[str] = Counter()

    @fleet.tool(name)
    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        runs[task.id] += 1
        return {"blob": "x" * size}

    with running(fleet):
        task_id = queue(service.stub, fleet.tool_ids[name])
        wait_for(lambda: terminal(db, task_id), what="the task to fail")
    failed = row(db, task_id)
    assert (failed["status"], failed["retry_count"], runs[task_id]) == ("failed", 0, 1)
    assert failed["error"].startswith("CompleteTask refused the result:")


def test_retry_unknown_errors_requeues_a_bug(service: ServiceProcess, db: Db) -> None:
    name = tool_name()
    fleet = new_fleet(service, retry_unknown_errors=True)
    runs: Counter[str] = Counter()

    @fleet.tool(name)
    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        runs[task.id] += 1
        raise KeyError("secret")

    with running(fleet):
        no_backoff(service, fleet.tool_ids[name])
        task_id = queue(service.stub, fleet.tool_ids[name], max_retries=2)
        wait_for(lambda: terminal(db, task_id), what="the task to fail")
    failed = row(db, task_id)
    assert (failed["status"], failed["error"], failed["retry_count"]) == ("failed", "KeyError", 2)
    assert runs[task_id] == 2


def test_concurrency_lanes_are_respected_per_tool(service: ServiceProcess, db: Db) -> None:
    """Each tool runs at most its lane's width at once, and fills it; a sync handler runs in a
    thread and reaches the task context through from_thread()."""
    lanes = {tool_name(): 2, tool_name(): 3}
    sync_tool, sync_lane = tool_name(), 2
    fleet = new_fleet(service)
    now: Counter[str] = Counter()
    peak: Counter[str] = Counter()
    lock = threading.Lock()

    def enter(name: str) -> None:
        with lock:
            now[name] += 1
            peak[name] = max(peak[name], now[name])

    def leave(name: str) -> None:
        with lock:
            now[name] -= 1

    def async_handler(name: str) -> Any:
        async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
            enter(name)
            await asyncio.sleep(0.1)
            leave(name)
            return {}

        return handler

    def sync_handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        assert threading.current_thread().name.startswith("genq-handler")
        enter(sync_tool)
        ctx.from_thread(ctx.progress(1.0, "from a thread"))
        time.sleep(0.1)
        leave(sync_tool)
        return {"thread": True}

    for name, width in lanes.items():
        fleet.register(name, async_handler(name), concurrency=width)
    fleet.register(sync_tool, sync_handler, concurrency=sync_lane)
    with running(fleet):
        tasks = [
            queue(service.stub, fleet.tool_ids[name])
            for name in [*lanes, sync_tool]
            for _ in range(8)
        ]
        wait_for(lambda: terminal(db, *tasks), timeout=20, what="every task to finish")
    assert all(row(db, t)["status"] == "completed" for t in tasks)
    assert dict(peak) == {**lanes, sync_tool: sync_lane}
    for task_id in tasks[-8:]:
        assert events(db, task_id)[:2] == [
            {"kind": "started", "data": {"attempt": 1}},
            {"kind": "progress", "data": {"progress": 1.0, "message": "from a thread"}},
        ]


def test_events_are_visible_through_watch(service: ServiceProcess, db: Db) -> None:
    name = tool_name()
    fleet = new_fleet(service)

    @fleet.tool(name)
    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        await ctx.progress(0.5, "half way")
        await ctx.streaming_url("https://preview.example.invalid/1")
        await ctx.partial_output({"frames": 12})
        await ctx.progress(1.0)
        return {"done": True}

    with running(fleet):
        task_id = queue(service.stub, fleet.tool_ids[name])
        watched = [
            response.event
            for response in service.stub.WatchTaskEvents(
                task_pb2.WatchTaskEventsRequest(task_id=task_id), timeout=20
            )
        ]
    assert [(event.kind, dict(event.data)) for event in watched] == [
        (task_pb2.TASK_EVENT_KIND_STARTED, {"attempt": 1.0}),
        (task_pb2.TASK_EVENT_KIND_PROGRESS, {"progress": 0.5, "message": "half way"}),
        (task_pb2.TASK_EVENT_KIND_STREAMING_URL, {"url": "https://preview.example.invalid/1"}),
        (task_pb2.TASK_EVENT_KIND_PARTIAL_OUTPUT, {"frames": 12}),
        (task_pb2.TASK_EVENT_KIND_PROGRESS, {"progress": 1.0}),
        (task_pb2.TASK_EVENT_KIND_COMPLETED, {}),
    ]


@pytest.mark.parametrize("noticed_by", ["heartbeat", "publish"])
def test_a_handler_whose_lease_is_lost_runs_on_and_its_cost_is_kept(
    service: ServiceProcess, db: Db, noticed_by: str
) -> None:
    """Billed is billed. Another claimer takes the task (its token replaces ours): the next
    heartbeat or event publish hears LEASE_LOST and the handler sees ctx.lease_lost, but is
    not cancelled: it finishes its provider call, reports what it cost, and returns. Its result
    is dropped (the task is untouched) and its cost lands on the run's attempt."""
    name = tool_name()
    heartbeat_interval = 0.2 if noticed_by == "heartbeat" else 60.0
    fleet = new_fleet(service, heartbeat_interval=heartbeat_interval)
    started = threading.Event()
    stolen = threading.Event()
    finished: list[bool] = []

    @fleet.tool(name)
    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        started.set()
        assert await asyncio.to_thread(stolen.wait, 10)
        if noticed_by == "publish":
            await ctx.progress(0.9, "after the steal")
        await asyncio.wait_for(ctx.lease_lost.wait(), 10)
        await asyncio.sleep(0.3)  # the provider's call goes on, and is billed at its end
        ctx.report_usage(cost_nanos=7_000)
        finished.append(ctx.is_lease_lost)
        return {"dropped": "this"}

    with running(fleet):
        task_id = queue(service.stub, fleet.tool_ids[name])
        wait_for(started.is_set, what="the handler to start")
        db.execute(
            "UPDATE generation.tasks SET lease_token = gen_random_uuid() WHERE id = %s", [task_id]
        )
        stolen.set()
        wait_for(lambda: finished, what="the handler to run to its end")
        wait_for(lambda: fleet.in_flight[name] == 0, what="the fleet to let the task go")
        held = row(db, task_id)
        attempt = db.execute(
            "SELECT outcome::text, cost_nanos FROM generation.attempts WHERE task_id = %s",
            [task_id],
        ).fetchone()
    assert finished == [True]
    assert (held["status"], held["output"], held["error"]) == ("processing", None, None)
    assert events(db, task_id) == [{"kind": "started", "data": {"attempt": 1}}]
    assert attempt == {"outcome": "lease_lost", "cost_nanos": 7_000}


def test_stop_on_lease_lost_cancels_the_handler(service: ServiceProcess, db: Db) -> None:
    """A tool registered with stop_on_lease_lost: its async handler is cancelled once its lease
    is lost (a provider that bills nothing for a call cut off), and the cost it reported before
    is still kept."""
    name = tool_name()
    fleet = new_fleet(service, heartbeat_interval=0.2)
    started = threading.Event()
    seen: list[bool] = []

    @fleet.tool(name, stop_on_lease_lost=True)
    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        ctx.report_usage(cost_nanos=3_000)
        started.set()
        try:
            await asyncio.sleep(30)  # cancelled by the fleet, well before this ends
        except asyncio.CancelledError:
            seen.append(ctx.is_lease_lost)
            raise
        return {"dropped": "this"}

    with running(fleet):
        task_id = queue(service.stub, fleet.tool_ids[name])
        wait_for(started.is_set, what="the handler to start")
        db.execute(
            "UPDATE generation.tasks SET lease_token = gen_random_uuid() WHERE id = %s", [task_id]
        )
        wait_for(lambda: seen, what="the handler to be cancelled")
        wait_for(lambda: fleet.in_flight[name] == 0, what="the fleet to let the task go")
        attempt = db.execute(
            "SELECT outcome::text, cost_nanos FROM generation.attempts WHERE task_id = %s",
            [task_id],
        ).fetchone()
    assert seen == [True]
    assert attempt == {"outcome": "lease_lost", "cost_nanos": 3_000}


def test_process_span_continues_the_enqueued_trace(service: ServiceProcess, db: Db) -> None:
    """A12, worker side: "process <tool>" is a child of the traceparent stored at enqueue, and
    the completion is reported inside it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    name = tool_name()
    fleet = new_fleet(service, tracer_provider=provider)
    seen_in_handler: list[trace.SpanContext] = []

    @fleet.tool(name)
    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        seen_in_handler.append(trace.get_current_span().get_span_context())
        return {}

    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    with running(fleet):
        task_id = queue(
            service.stub, fleet.tool_ids[name], w3c_traceparent=f"00-{trace_id}-{parent_id}-01"
        )
        wait_for(lambda: terminal(db, task_id), what="the task to complete")

    def only(span_name: str) -> ReadableSpan:
        found = [s for s in exporter.get_finished_spans() if s.name == span_name]
        assert len(found) == 1, [s.name for s in exporter.get_finished_spans()]
        return found[0]

    process = only(f"process {name}")
    complete = only(f"complete {name}")
    assert process.context is not None and process.parent is not None
    assert format(process.context.trace_id, "032x") == trace_id
    assert format(process.parent.span_id, "016x") == parent_id
    assert process.attributes is not None and process.attributes["genq.task_id"] == task_id
    assert complete.parent is not None and complete.parent.span_id == process.context.span_id
    assert seen_in_handler[0].span_id == process.context.span_id
    claims = [s for s in exporter.get_finished_spans() if s.name == f"claim {name}"]
    assert [link.context for link in process.links] == [
        c.context for c in claims if c.attributes and c.attributes.get("genq.claimed")
    ]


def test_without_tracing_the_handler_still_runs_in_the_enqueued_trace(
    service: ServiceProcess, db: Db
) -> None:
    """Nothing traces (a no-op provider): the fleet skips its spans, yet a handler that passes
    its context on (propagate.inject) still hands on the enqueuer's trace, as OpenTelemetry's
    no-op spans did; a task enqueued without one hands on none."""
    name = tool_name()
    fleet = new_fleet(service, tracer_provider=trace.NoOpTracerProvider())
    carried: dict[str, dict[str, str]] = {}

    @fleet.tool(name)
    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        carried[task.id] = carrier
        return {}

    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with running(fleet):
        traced = queue(service.stub, fleet.tool_ids[name], w3c_traceparent=traceparent)
        untraced = queue(service.stub, fleet.tool_ids[name])
        wait_for(lambda: terminal(db, traced, untraced), what="both tasks to complete")
    assert carried[traced].get("traceparent") == traceparent
    assert "traceparent" not in carried[untraced]


# -- leases, confirmation and cancel against the real service -----------------------------------


def attempts(db: Db, task_id: str) -> list[dict[str, Any]]:
    return db.execute(
        "SELECT attempt, outcome::text, cost_nanos FROM generation.attempts "
        "WHERE task_id = %s ORDER BY attempt",
        [task_id],
    ).fetchall()


SHORT_LEASE = 3
"""A tool's lease (s) below the default floor, which `short_leases` lets tools have."""
SLOW_HANDLER = 8
"""A handler's run (s): well past the short lease, so only heartbeats keep it."""


@pytest.fixture(scope="module")
def short_lease_url(databases: Databases) -> str:
    return url_for(databases.create("short_leases"))


@pytest.fixture(scope="module")
def short_leases(
    short_lease_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """A service whose lease floor (GENQ_MIN_LEASE_SECONDS) takes SHORT_LEASE, on a database of
    its own."""
    log = tmp_path_factory.mktemp("short_leases") / "serve.log"
    process = ServiceProcess(short_lease_url, log, GENQ_MIN_LEASE_SECONDS=str(SHORT_LEASE))
    yield process
    process.stop()


@pytest.fixture
def short_lease_db(short_lease_url: str) -> Iterator[Db]:
    with psycopg.connect(short_lease_url, autocommit=True, row_factory=dict_row) as connection:
        yield connection


def test_heartbeats_follow_a_short_lease(short_leases: ServiceProcess, short_lease_db: Db) -> None:
    """A tool with 3 s leases and a handler running 8 s: the fleet (heartbeat_interval left at
    60 s) beats every third of the lease, so the run completes on its first attempt."""
    service, db = short_leases, short_lease_db
    name = tool_name()
    fleet = new_fleet(service)
    lost: list[bool] = []

    @fleet.tool(name)
    async def slow(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        await asyncio.sleep(SLOW_HANDLER)
        lost.append(ctx.is_lease_lost)
        return {"slept": SLOW_HANDLER}

    with running(fleet):
        tool_id = fleet.tool_ids[name]
        lease = task_pb2.ConfigureToolRequest(tool_id=tool_id, lease_seconds=SHORT_LEASE)
        service.stub.ConfigureTool(lease)
        task_id = queue(service.stub, tool_id)
        wait_for(lambda: terminal(db, task_id), timeout=30, what="the slow task to complete")
    done = row(db, task_id)
    assert (done["status"], done["output"], lost) == ("completed", {"slept": SLOW_HANDLER}, [False])
    assert (done["attempt_count"], done["retry_count"]) == (1, 0)
    assert [a["outcome"] for a in attempts(db, task_id)] == ["completed"]


def test_a_claim_is_confirmed_before_the_handler_runs(service: ServiceProcess, db: Db) -> None:
    """By the time the handler runs, the claim is confirmed (one ConfirmClaim: its token in
    claim_confirmations; the task row untouched, its lease still the claim's)."""
    name = tool_name()
    fleet = new_fleet(service)
    seen: list[dict[str, Any]] = []

    def confirmed(task_id: str) -> dict[str, Any]:
        found = db.execute(
            "SELECT t.lease_confirmed, t.unconfirmed_claims, t.started_at, t.claim_expires_at, "
            "  generation.claim_confirmed_v1(t) AS confirmed "
            "FROM generation.tasks AS t WHERE t.id = %s",
            [task_id],
        ).fetchone()
        assert found is not None
        return dict(found)

    @fleet.tool(name)
    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        seen.append(await asyncio.to_thread(confirmed, task.id))
        return {}

    with running(fleet):
        tool_id = fleet.tool_ids[name]
        service.stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, lease_seconds=10))
        task_id = queue(service.stub, tool_id)
        wait_for(lambda: terminal(db, task_id), what="the task to complete")
    [held] = seen
    assert (held["confirmed"], held["unconfirmed_claims"]) == (True, 0)
    lease = (held["claim_expires_at"] - held["started_at"]).total_seconds()
    assert lease == pytest.approx(10, abs=0.5), "ConfirmClaim extends no lease"
    assert row(db, task_id)["status"] == "completed"


@pytest.mark.parametrize("handler_kind", ["async", "sync"])
def test_a_cancelled_running_task_stops_and_its_cost_is_recorded(
    service: ServiceProcess, db: Db, caplog: pytest.LogCaptureFixture, handler_kind: str
) -> None:
    """CancelTask of a running task is a request: the next heartbeat brings it to the handler
    (ctx.cancel_requested; an async handler is cancelled), the fleet reports the cancel with the
    cost reported so far, and the task ends cancelled with that cost on its attempt."""
    name = tool_name()
    fleet = new_fleet(service, heartbeat_interval=0.3)
    started = threading.Event()
    seen: list[str] = []

    async def async_handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        ctx.report_usage(cost_nanos=5_000)
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append(f"cancelled, requested={ctx.is_cancel_requested}")
            raise
        return {"not": "reached"}

    def sync_handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        ctx.report_usage(cost_nanos=5_000)
        started.set()
        deadline = time.monotonic() + 60
        while not ctx.is_cancel_requested and time.monotonic() < deadline:
            time.sleep(0.02)
        seen.append(f"returned, requested={ctx.is_cancel_requested}")
        return {"dropped": True}

    fleet.register(name, async_handler if handler_kind == "async" else sync_handler)
    caplog.set_level(logging.INFO, logger="workers_sdk.fleet")
    with running(fleet):
        task_id = queue(service.stub, fleet.tool_ids[name])
        wait_for(started.is_set, what="the handler to start")
        asked = service.stub.CancelTask(task_pb2.CancelTaskRequest(task_id=task_id)).task
        assert asked.status == task_pb2.TASK_STATUS_PROCESSING
        assert asked.HasField("cancel_requested_at")
        wait_for(lambda: terminal(db, task_id), what="the task to end cancelled")
        wait_for(lambda: fleet.in_flight[name] == 0, what="the fleet to let the task go")
    ended = row(db, task_id)
    assert (ended["status"], ended["output"]) == ("cancelled", None)
    assert seen == [
        "cancelled, requested=True" if handler_kind == "async" else "returned, requested=True"
    ]
    assert [(a["outcome"], a["cost_nanos"]) for a in attempts(db, task_id)] == [
        ("cancelled", 5_000)
    ]
    kinds = [e["kind"] for e in events(db, task_id)]
    assert kinds == ["started", "cancel_requested", "cancelled"]
    messages = [r.getMessage() for r in caplog.records if r.name == "workers_sdk.fleet"]
    assert f"task {task_id}: cancelled while running; cost recorded" in messages
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# -- the same against a scripted client (no service): what the fleet sends, in what order ----


Beat = Callable[[int], task_pb2.HeartbeatTaskResponse]
"""The scripted answer to the n-th HeartbeatTask (from 1); raises to answer an error."""

Confirm = Callable[[int, task_pb2.ConfirmClaimRequest], task_pb2.ConfirmClaimResponse]
"""The scripted answer to the n-th ConfirmClaim (from 1); raises to answer an error."""


def confirm_all(cancel: bool = False) -> Confirm:
    """Confirms every task asked for (and asks each to cancel, with `cancel`)."""

    def answer(n: int, request: task_pb2.ConfirmClaimRequest) -> task_pb2.ConfirmClaimResponse:
        ids = list(request.task_ids)
        return task_pb2.ConfirmClaimResponse(
            task_ids=ids, cancel_requested_task_ids=ids if cancel else []
        )

    return answer


def lease(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(int(seconds * 1e9))
    return duration


class ScriptedClient:
    """Stands in for GenqClient: one claimable task, heartbeats answered by `beat`, and a log
    of every call (and of the handler's start) in order."""

    def __init__(
        self, beat: Beat, *, claim_lease: float | None = 30.0, confirm: Confirm | None = None
    ) -> None:
        self.target = "scripted"
        self.timeout = 10.0
        self.beat = beat
        self.confirm = confirm or confirm_all()
        self.confirms = 0
        self.claim_lease = claim_lease
        self.log: list[str] = []
        self.requests: list[Any] = []
        self.beats = 0
        self.claimed = False

    async def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        self.log.append(method)
        self.requests.append(request)
        if method == "UpsertTool":
            return task_pb2.UpsertToolResponse(tool=task_pb2.Tool(id="tool-1", name=request.name))
        if method == "ClaimNextTask":
            if self.claimed:
                await asyncio.sleep(0.02)
                return task_pb2.ClaimNextTaskResponse(idle_reason=task_pb2.IDLE_REASON_EMPTY)
            self.claimed = True
            response = task_pb2.ClaimNextTaskResponse(
                task=task_pb2.Task(id="task-1", tool_id="tool-1"), lease_token="token-1"
            )
            if self.claim_lease is not None:
                response.lease.CopyFrom(lease(self.claim_lease))
            return response
        if method == "HeartbeatTask":
            self.beats += 1
            return self.beat(self.beats)
        if method == "ConfirmClaim":
            self.confirms += 1
            return self.confirm(self.confirms, request)
        if method in {"CompleteTask", "FailTask", "ReleaseTask"}:
            answer = getattr(task_pb2, f"{method}Response")
            return answer(task=task_pb2.Task(id="task-1", status=task_pb2.TASK_STATUS_COMPLETED))
        raise AssertionError(f"unexpected call {method}")

    async def close(self) -> None:
        pass


def run_scripted(
    client: ScriptedClient, until: Callable[[], bool], handler: Any = None, **settings: Any
) -> list[str]:
    """Runs a fleet over the scripted client until `until()`, then drains it; returns the log
    without the claims."""
    fleet = WorkerFleet(cast(GenqClient, client), poll_interval=0.05, drain_timeout=1, **settings)

    async def default(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        client.log.append("handler")
        return {}

    fleet.register("scripted", handler or default, concurrency=1)  # ClaimNextTask

    async def main() -> None:
        work = asyncio.create_task(fleet.run(handle_signals=False))
        deadline = time.monotonic() + 10
        while not until():
            assert time.monotonic() < deadline, client.log
            assert not work.done(), work
            await asyncio.sleep(0.01)
        fleet.stop()
        await asyncio.wait_for(work, 10)

    asyncio.run(main())
    return [entry for entry in client.log if entry != "ClaimNextTask"]


def ok(lease_seconds: float = 30.0, cancel: bool = False) -> Beat:
    return lambda n: task_pb2.HeartbeatTaskResponse(
        lease=lease(lease_seconds), cancel_requested=cancel
    )


def unavailable() -> GenqError:
    return GenqError(grpc.StatusCode.UNAVAILABLE, "connection refused", None)


def test_scripted_the_claim_is_confirmed_before_the_handler() -> None:
    client = ScriptedClient(ok())
    log = run_scripted(client, lambda: "CompleteTask" in client.log)
    assert log == ["UpsertTool", "ConfirmClaim", "handler", "CompleteTask"]
    [confirm] = [r for r in client.requests if isinstance(r, task_pb2.ConfirmClaimRequest)]
    assert (confirm.tool_id, confirm.lease_token, list(confirm.task_ids)) == (
        "tool-1",
        "token-1",
        ["task-1"],
    )


def test_scripted_a_task_the_confirmation_leaves_out_does_not_run() -> None:
    """ConfirmClaim answers an empty list (the claim lost its task: handed back, lapsed,
    stolen): the handler does not run and nothing is reported."""

    def confirm(n: int, request: task_pb2.ConfirmClaimRequest) -> task_pb2.ConfirmClaimResponse:
        return task_pb2.ConfirmClaimResponse()

    client = ScriptedClient(ok(), confirm=confirm)
    # Several claims after the unconfirmed one: the run is over by then.
    log = run_scripted(
        client, lambda: client.confirms >= 1 and client.log.count("ClaimNextTask") > 3
    )
    assert log == ["UpsertTool", "ConfirmClaim"], "not run, nothing reported"


def test_scripted_a_refused_confirmation_does_not_run_the_handler() -> None:
    """ConfirmClaim refused (no retry helps): not run, not handed back either."""

    def confirm(n: int, request: task_pb2.ConfirmClaimRequest) -> task_pb2.ConfirmClaimResponse:
        raise GenqError(grpc.StatusCode.INVALID_ARGUMENT, "bad claim", None)

    client = ScriptedClient(ok(), confirm=confirm)
    log = run_scripted(
        client, lambda: client.confirms >= 1 and client.log.count("ClaimNextTask") > 3
    )
    assert log == ["UpsertTool", "ConfirmClaim"], "not run, nothing reported"


def test_scripted_an_unavailable_confirmation_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_module, "CONFIRM_RETRY_SECONDS", 0.05)

    def confirm(n: int, request: task_pb2.ConfirmClaimRequest) -> task_pb2.ConfirmClaimResponse:
        if n <= 2:
            raise unavailable()
        return confirm_all()(n, request)

    client = ScriptedClient(ok(), confirm=confirm)
    log = run_scripted(client, lambda: "CompleteTask" in client.log)
    assert log == ["UpsertTool", *["ConfirmClaim"] * 3, "handler", "CompleteTask"]


def test_scripted_a_claim_that_cannot_be_confirmed_is_not_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fleet_module, "CONFIRM_RETRY_SECONDS", 0.05)
    attempts_allowed = fleet_module.CONFIRM_ATTEMPTS

    def confirm(n: int, request: task_pb2.ConfirmClaimRequest) -> task_pb2.ConfirmClaimResponse:
        raise unavailable()

    client = ScriptedClient(ok(), confirm=confirm)
    log = run_scripted(
        client,
        lambda: client.confirms >= attempts_allowed and client.log.count("ClaimNextTask") > 10,
    )
    # Not run, and handed back: one of the tries may have committed (its answer lost), and a
    # confirmed lease's lapse would cost a retry for a run that never happened.
    assert log == ["UpsertTool", *["ConfirmClaim"] * attempts_allowed, "ReleaseTask"]


def test_scripted_heartbeats_follow_the_lease() -> None:
    """The claim says 0.6 s, every beat 0.3 s: though heartbeat_interval is 60 s, the fleet
    beats 0.2 s after the claim, then every 0.1 s once a beat answered."""
    client = ScriptedClient(ok(0.3), claim_lease=0.6)
    beats_at: list[float] = []

    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        started, count = time.monotonic(), client.beats
        while time.monotonic() - started < 1.0:
            if client.beats != count:
                count = client.beats
                beats_at.append(time.monotonic() - started)
            await asyncio.sleep(0.005)
        return {}

    run_scripted(client, lambda: "CompleteTask" in client.log, handler, heartbeat_interval=60)
    assert 7 <= len(beats_at) <= 11, beats_at
    gaps = [b - a for a, b in itertools.pairwise(beats_at)]
    assert all(0.05 < gap < 0.2 for gap in gaps), gaps


def test_scripted_without_a_lease_the_beat_is_heartbeat_interval() -> None:
    """An answer that gives no lease leaves the beat at heartbeat_interval."""
    client = ScriptedClient(lambda n: task_pb2.HeartbeatTaskResponse(), claim_lease=None)

    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        await asyncio.sleep(0.5)
        return {}

    log = run_scripted(
        client, lambda: "CompleteTask" in client.log, handler, heartbeat_interval=0.2
    )
    assert log.count("HeartbeatTask") == 2  # at 0.2 s and 0.4 s (ConfirmClaim is no beat)


def test_scripted_a_cancel_request_cancels_the_handler_and_reports_its_cost() -> None:
    client = ScriptedClient(lambda n: ok(0.6, cancel=n >= 2)(n), claim_lease=0.6)
    seen: list[bool] = []

    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        ctx.report_usage(cost_nanos=777, token_amount=3)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append(ctx.is_cancel_requested)
            raise
        return {}

    log = run_scripted(client, lambda: "FailTask" in client.log, handler)
    assert seen == [True]
    assert log == ["UpsertTool", "ConfirmClaim", "HeartbeatTask", "HeartbeatTask", "FailTask"]
    [report] = [r for r in client.requests if isinstance(r, task_pb2.FailTaskRequest)]
    assert report.failure == task_pb2.FAILURE_KIND_CANCELLED
    assert (report.error, report.lease_token) == ("cancelled", "token-1")
    assert (report.reported_usage.cost_nanos, report.reported_usage.token_amount) == (777, 3)


def test_scripted_a_cancel_before_the_start_runs_nothing() -> None:
    client = ScriptedClient(ok(), confirm=confirm_all(cancel=True))
    log = run_scripted(client, lambda: "FailTask" in client.log)
    assert log == ["UpsertTool", "ConfirmClaim", "FailTask"]
    [report] = [r for r in client.requests if isinstance(r, task_pb2.FailTaskRequest)]
    assert (report.failure, report.reported_usage.cost_nanos) == (
        task_pb2.FAILURE_KIND_CANCELLED,
        0,
    )


# -- batching: claims, confirmations, heartbeats and reports share calls ------------------------


class CountingClient(GenqClient):
    """GenqClient that records every call: (method, items), items being a batch's length (1 for
    a single RPC), and for a claim how many tasks it brought."""

    calls: list[tuple[str, int]]
    sent: list[float]
    claimed: list[int]

    def __init__(self, target: str, *, timeout: float = 10.0) -> None:
        super().__init__(target, timeout=timeout)
        self.calls = []
        self.sent = []
        self.claimed = []
        COUNTING.append(self)

    async def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        fields = request.DESCRIPTOR.fields_by_name
        items = (
            len(request.tasks)
            if "tasks" in fields
            else len(request.task_ids)
            if "task_ids" in fields
            else 1
        )
        self.calls.append((method, items))
        self.sent.append(time.monotonic())
        response = await super().call(method, request, timeout=timeout)
        if method == "ClaimTasks":
            self.claimed.append(len(response.tasks))
        elif method == "ClaimNextTask":
            self.claimed.append(int(response.HasField("task")))
        return response

    def count(self, *methods: str) -> int:
        return sum(1 for method, _ in self.calls if method in methods)

    def items(self, *methods: str) -> int:
        return sum(items for method, items in self.calls if method in methods)


COUNTING: list[CountingClient] = []


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[CountingClient]]:
    """The clients fleets make in this test (one per fleet), counting their calls."""
    COUNTING.clear()
    monkeypatch.setattr(fleet_module, "GenqClient", CountingClient)
    yield COUNTING
    COUNTING.clear()


def completed_once(db: Db, task_ids: list[str]) -> None:
    """Each task completed, on its first attempt, with one completed event and one attempt."""
    rows = db.execute(
        "SELECT t.id::text AS id, t.status::text AS status, t.retry_count, "
        "  (SELECT count(*) FROM generation.attempts AS a WHERE a.task_id = t.id) AS attempts, "
        "  (SELECT count(*) FROM generation.attempts AS a "
        "   WHERE a.task_id = t.id AND a.outcome = 'completed') AS completed_attempts, "
        "  (SELECT count(*) FROM generation.event_stream AS e "
        "   WHERE e.task_id = t.id AND e.kind = 'completed') AS completed_events "
        "FROM generation.tasks AS t WHERE t.id = ANY(%s::uuid[])",
        [task_ids],
    ).fetchall()
    assert len(rows) == len(task_ids)
    for found in rows:
        assert (
            found["status"],
            found["retry_count"],
            found["attempts"],
            found["completed_attempts"],
            found["completed_events"],
        ) == ("completed", 0, 1, 1, 1), found


def test_eight_lanes_drain_fifty_tasks_in_few_calls(
    service: ServiceProcess, db: Db, counting: list[CountingClient]
) -> None:
    """8 lanes, 50 quick tasks: the claims ask for the free lanes, each claim is confirmed by
    one ConfirmClaim, and the completions share CompleteTasks. Far fewer calls than
    tasks, each task completed once, one attempt each in the ledger."""
    name = tool_name()
    tool_id = service.stub.UpsertTool(task_pb2.UpsertToolRequest(name=name)).tool.id
    tasks = [queue(service.stub, tool_id, input={"n": n}) for n in range(50)]
    fleet = new_fleet(service)
    runs: Counter[str] = Counter()

    @fleet.tool(name, concurrency=8)
    async def quick(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        runs[task.id] += 1
        return {"n": ctx.input["n"]}

    with running(fleet):
        wait_for(lambda: terminal(db, *tasks), what="the 50 tasks to complete")
    [client] = counting
    completed_once(db, tasks)
    assert runs == dict.fromkeys(tasks, 1)
    assert [row(db, t)["output"] for t in tasks] == [{"n": n} for n in range(50)]
    claims = [n for n in client.claimed if n]
    assert sum(claims) == 50
    assert len(claims) <= 50 / 4, client.claimed  # 8 at a time, save the last few
    assert client.count("ClaimTasks") >= 1
    reports = client.count("CompleteTask", "CompleteTasks")
    assert client.items("CompleteTask", "CompleteTasks") == 50
    assert reports <= 50 / 4, client.calls
    assert client.count("ConfirmClaim") == len(claims), client.calls  # one per claim
    assert client.items("ConfirmClaim") == 50  # every claimed task confirmed
    assert client.count("HeartbeatTask", "HeartbeatTasks") == 0  # quick: no beat due
    assert client.count("FailTask", "FailTasks", "ReleaseTask") == 0


@pytest.mark.parametrize("delay", [fleet_module.DEFAULT_REPORT_DELAY, 0.3], ids=["default", "0.3s"])
def test_a_lone_report_leaves_within_report_delay(
    service: ServiceProcess, db: Db, counting: list[CountingClient], delay: float
) -> None:
    """A task alone waits for company no longer than `report_delay`: its CompleteTask leaves
    between `report_delay` and a little more after the handler returns (the loop's own latency,
    on a loaded machine), and with the defaults a parked worker completes it at once."""
    name = tool_name()
    fleet = new_fleet(service, report_delay=delay)
    returned: list[float] = []

    @fleet.tool(name, concurrency=4)
    async def quick(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        returned.append(time.monotonic())
        return {}

    with running(fleet):
        [client] = counting
        wait_for(lambda: client.count("ClaimTasks"), what="the claim to park")
        sent = time.monotonic()
        task_id = queue(service.stub, fleet.tool_ids[name])
        wait_for(lambda: terminal(db, task_id), timeout=5, what="the lone task")
        done = time.monotonic()
    completed_once(db, [task_id])
    [handler_returned] = returned
    [reported] = [
        at
        for (method, _), at in zip(client.calls, client.sent, strict=True)
        if method == "CompleteTask"
    ]
    assert delay <= reported - handler_returned < delay + 0.5  # slack for a loaded machine
    if delay == fleet_module.DEFAULT_REPORT_DELAY:
        # Wake, claim, confirm, handler, complete: a few round trips, nowhere near a second.
        assert done - sent < 1.0


def test_a_lease_lost_in_a_batch_reaches_only_its_task(
    service: ServiceProcess, db: Db, counting: list[CountingClient]
) -> None:
    """Three tasks beaten and completed in shared batches; another claimer takes the middle
    one. Its heartbeat is refused LEASE_LOST inside a HeartbeatTasks that the other two pass:
    only its ctx.lease_lost is set, its result is dropped, and the other two complete."""
    name = tool_name()
    fleet = new_fleet(service, heartbeat_interval=0.3, report_delay=0.1)
    started: dict[int, TaskContext] = {}
    release = threading.Event()
    lost: dict[int, bool] = {}

    @fleet.tool(name, concurrency=3)
    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        n = int(ctx.input["n"])
        started[n] = ctx
        assert await asyncio.to_thread(release.wait, 20)
        lost[n] = ctx.is_lease_lost
        return {"n": n}

    tool_id = service.stub.UpsertTool(task_pb2.UpsertToolRequest(name=name)).tool.id
    tasks = [queue(service.stub, tool_id, input={"n": n}) for n in range(3)]
    with running(fleet):
        [client] = counting
        wait_for(lambda: len(started) == 3, what="the three handlers to start")
        before = len(client.calls)
        db.execute(
            "UPDATE generation.tasks SET lease_token = gen_random_uuid() WHERE id = %s", [tasks[1]]
        )
        wait_for(lambda: started[1].is_lease_lost, what="the stolen task to see its lease lost")
        assert ("HeartbeatTasks", 3) in client.calls[before:], "the refusal came in a batch"
        wait_for(
            lambda: ("HeartbeatTasks", 2) in client.calls[before:],
            what="a beat of the other two, in a batch without the stolen one",
        )
        assert [started[n].is_lease_lost for n in range(3)] == [False, True, False]
        release.set()
        wait_for(lambda: terminal(db, tasks[0], tasks[2]), what="the other two to complete")
        wait_for(lambda: fleet.in_flight[name] == 0, what="the fleet to let the tasks go")
    assert lost == {0: False, 1: True, 2: False}
    completed_once(db, [tasks[0], tasks[2]])
    stolen = row(db, tasks[1])
    assert (stolen["status"], stolen["output"]) == ("processing", None)
    assert ("HeartbeatTasks", 3) in client.calls, client.calls
    assert ("CompleteTasks", 2) in client.calls, client.calls


def test_a_lease_lost_in_a_completion_batch_drops_only_that_result(
    service: ServiceProcess,
    db: Db,
    counting: list[CountingClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The steal goes unnoticed until the three completions leave together in one
    CompleteTasks: the stolen task's item is refused LEASE_LOST (its result dropped, logged as a
    refused CompleteTask would be), the other two complete."""
    name = tool_name()
    fleet = new_fleet(service, report_delay=0.2)
    started: set[int] = set()
    release = threading.Event()

    @fleet.tool(name, concurrency=3)
    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        started.add(int(ctx.input["n"]))
        assert await asyncio.to_thread(release.wait, 20)
        return {"n": ctx.input["n"]}

    tool_id = service.stub.UpsertTool(task_pb2.UpsertToolRequest(name=name)).tool.id
    tasks = [queue(service.stub, tool_id, input={"n": n}) for n in range(3)]
    caplog.set_level(logging.INFO, logger="workers_sdk.fleet")
    with running(fleet):
        wait_for(lambda: len(started) == 3, what="the three handlers to start")
        db.execute(
            "UPDATE generation.tasks SET lease_token = gen_random_uuid() WHERE id = %s", [tasks[1]]
        )
        release.set()
        wait_for(lambda: terminal(db, tasks[0], tasks[2]), what="the other two to complete")
        wait_for(lambda: fleet.in_flight[name] == 0, what="the fleet to let the tasks go")
    [client] = counting
    assert ("CompleteTasks", 3) in client.calls, client.calls
    completed_once(db, [tasks[0], tasks[2]])
    assert row(db, tasks[1])["status"] == "processing"
    messages = [r.getMessage() for r in caplog.records if r.name == "workers_sdk.fleet"]
    refused = [m for m in messages if "refused (LEASE_LOST)" in m]
    assert refused == [f"task {tasks[1]}: CompleteTask refused (LEASE_LOST); result dropped"]


def test_an_output_refused_in_a_batch_fails_only_its_task(
    service: ServiceProcess, db: Db, counting: list[CountingClient]
) -> None:
    """A batch the service refuses as a whole (one output over its size limit) is sent again
    item by item: the oversized one fails, the other completes."""
    name = tool_name()
    fleet = new_fleet(service, report_delay=0.2)
    both = threading.Barrier(2)

    @fleet.tool(name, concurrency=2)
    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        n = int(ctx.input["n"])
        await asyncio.to_thread(both.wait, 20)
        return {"blob": "x" * 1_100_000} if n == 0 else {"n": n}

    tool_id = service.stub.UpsertTool(task_pb2.UpsertToolRequest(name=name)).tool.id
    big, small = (queue(service.stub, tool_id, input={"n": n}) for n in range(2))
    with running(fleet):
        wait_for(lambda: terminal(db, big, small), what="both tasks to end")
    [client] = counting
    assert ("CompleteTasks", 2) in client.calls, client.calls
    assert client.count("CompleteTask") == 2  # then one by one
    completed_once(db, [small])
    failed = row(db, big)
    assert (failed["status"], failed["retry_count"]) == ("failed", 0)
    assert failed["error"].startswith("CompleteTask refused the result:")


class FakeFleet:
    """What a _Batcher reads of its fleet."""

    def __init__(self, client: Any, report_delay: float) -> None:
        self.client = client
        self.report_delay = report_delay
        self._traced = False


class BatchClient:
    """Answers HeartbeatTasks (refusing the ids in `refuse`) and records each call's time."""

    def __init__(self, refuse: frozenset[str] = frozenset()) -> None:
        self.timeout = 10.0
        self.refuse = refuse
        self.calls: list[tuple[str, int, float]] = []

    async def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        items = list(request.tasks) if method.endswith("Tasks") else [request]
        self.calls.append((method, len(items), time.monotonic()))
        beats = [
            task_pb2.HeartbeatResult(task_id=item.task_id, refused="LEASE_LOST")
            if item.task_id in self.refuse
            else task_pb2.HeartbeatResult(
                task_id=item.task_id, heartbeat=task_pb2.HeartbeatTaskResponse(lease=lease(30))
            )
            for item in items
        ]
        if method == "HeartbeatTask":
            if beats[0].refused:
                raise LeaseLost(grpc.StatusCode.ABORTED, "lease lost", Reason.LEASE_LOST)
            return beats[0].heartbeat
        return task_pb2.HeartbeatTasksResponse(results=beats)


def beat_request(n: int) -> task_pb2.HeartbeatTaskRequest:
    return task_pb2.HeartbeatTaskRequest(task_id=f"task-{n}", lease_token=f"token-{n}")


def test_a_full_batch_leaves_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a report_delay of 10 s, a batch that fills (5 items here) leaves at once; the rest
    waits for the delay, or for more. Each item gets its own answer."""
    monkeypatch.setattr(fleet_module, "MAX_REPORT_BATCH", 5)
    client = BatchClient(refuse=frozenset({"task-3"}))
    batcher = fleet_module._Batcher(
        cast(Any, FakeFleet(client, 10.0)), "HeartbeatTask", lambda r: r.heartbeat
    )

    async def main() -> list[Any]:
        started = time.monotonic()
        calls = [asyncio.ensure_future(batcher.call(beat_request(n))) for n in range(7)]
        first = await asyncio.wait_for(asyncio.gather(*calls[:5], return_exceptions=True), 2)
        assert time.monotonic() - started < 1.0
        assert [(method, items) for method, items, _ in client.calls] == [("HeartbeatTasks", 5)]
        assert not calls[5].done()
        batcher.flush()
        rest = await asyncio.wait_for(asyncio.gather(*calls[5:]), 2)
        return [*first, *rest]

    answers = asyncio.run(main())
    assert [(method, items) for method, items, _ in client.calls] == [
        ("HeartbeatTasks", 5),
        ("HeartbeatTasks", 2),
    ]
    assert isinstance(answers[3], LeaseLost)
    assert all(
        isinstance(a, task_pb2.HeartbeatTaskResponse) and a.lease.seconds == 30
        for n, a in enumerate(answers)
        if n != 3
    )


def test_a_batch_is_held_at_most_report_delay() -> None:
    """Calls made over a few milliseconds share one batch, sent report_delay after the first;
    a lone call is sent alone (the single RPC) after the same bound."""
    client = BatchClient()
    delay = 0.05
    batcher = fleet_module._Batcher(
        cast(Any, FakeFleet(client, delay)), "HeartbeatTask", lambda r: r.heartbeat
    )

    async def main() -> tuple[float, float]:
        first = time.monotonic()
        calls = []
        for n in range(3):
            calls.append(asyncio.ensure_future(batcher.call(beat_request(n))))
            await asyncio.sleep(0.01)
        await asyncio.wait_for(asyncio.gather(*calls), 2)
        alone = time.monotonic()
        await asyncio.wait_for(batcher.call(beat_request(9)), 2)
        return first, alone

    first, alone = asyncio.run(main())
    (batch, items, sent), (single, one, sent_alone) = client.calls
    assert (batch, items, single, one) == ("HeartbeatTasks", 3, "HeartbeatTask", 1)
    assert delay <= sent - first < delay + 0.5  # slack for a loaded machine
    assert delay <= sent_alone - alone < delay + 0.5


class BatchScriptedClient(ScriptedClient):
    """A service with the batch RPCs: one ClaimTasks brings `tasks` tasks, every beat passes,
    and `complete` answers the n-th CompleteTasks (from 1); `batches` logs (method, items)."""

    def __init__(self, tasks: int, complete: Callable[[int, Any], Any]) -> None:
        super().__init__(ok())
        self.queued = [f"task-{n}" for n in range(tasks)]
        self.complete = complete
        self.batches: list[tuple[str, int]] = []

    async def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        if method == "ClaimTasks":
            self.log.append(method)
            self.requests.append(request)
            if not self.queued:
                await asyncio.sleep(0.02)
                return task_pb2.ClaimTasksResponse(idle_reason=task_pb2.IDLE_REASON_EMPTY)
            claimed, self.queued = self.queued[: request.limit], self.queued[request.limit :]
            return task_pb2.ClaimTasksResponse(
                tasks=[
                    # The tasks of one claim share its token.
                    task_pb2.ClaimedTask(
                        task=task_pb2.Task(id=t), lease_token=f"token-{claimed[0]}"
                    )
                    for t in claimed
                ],
                lease=lease(30),
            )
        if method in {"HeartbeatTasks", "CompleteTasks"}:
            self.log.append(method)
            self.batches.append((method, len(request.tasks)))
            if method == "HeartbeatTasks":
                return task_pb2.HeartbeatTasksResponse(
                    results=[
                        task_pb2.HeartbeatResult(task_id=item.task_id, heartbeat=ok()(0))
                        for item in request.tasks
                    ]
                )
            return self.complete(self.batches.count(("CompleteTasks", len(request.tasks))), request)
        return await super().call(method, request, timeout=timeout)


def test_scripted_a_batch_that_fails_unavailable_is_retried_together() -> None:
    """The first CompleteTasks of three answers UNAVAILABLE: each report is retried after its
    pause, and the three retries leave together again."""

    def complete(n: int, request: Any) -> Any:
        if n == 1:
            raise unavailable()
        return task_pb2.CompleteTasksResponse(
            results=[
                task_pb2.ReportResult(
                    task_id=item.task_id,
                    task=task_pb2.Task(id=item.task_id, status=task_pb2.TASK_STATUS_COMPLETED),
                )
                for item in request.tasks
            ]
        )

    client = BatchScriptedClient(3, complete)
    fleet = WorkerFleet(cast(GenqClient, client), poll_interval=0.05, drain_timeout=1)

    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        return {"id": task.id}

    fleet.register("batched", handler, concurrency=3)

    async def main() -> None:
        work = asyncio.create_task(fleet.run(handle_signals=False))
        deadline = time.monotonic() + 5
        while client.batches.count(("CompleteTasks", 3)) < 2:
            assert time.monotonic() < deadline, client.batches
            await asyncio.sleep(0.01)
        fleet.stop()
        await asyncio.wait_for(work, 10)

    asyncio.run(main())
    assert client.batches == [("CompleteTasks", 3), ("CompleteTasks", 3)]
    assert [entry for entry in client.log if entry != "ClaimTasks"] == [
        "UpsertTool",
        "ConfirmClaim",
        "CompleteTasks",
        "CompleteTasks",
    ]


def test_scripted_a_claim_that_comes_in_after_the_drain_deadline_is_handed_back_unrun() -> None:
    """A claim parked when the fleet stops brings a task after the drain's deadline: it is
    confirmed (the beat may have committed) and released at once, its handler never started
    (not run, then released midway for another worker to run again)."""
    client = ScriptedClient(ok())
    parked, stopping = asyncio.Event(), asyncio.Event()
    answer = client.call

    async def late(method: str, request: Any, *, timeout: float | None = None) -> Any:
        if method == "ClaimNextTask" and not client.claimed:
            parked.set()
            await stopping.wait()
            await asyncio.sleep(0.3)  # past the drain's deadline (0.1 s)
        return await answer(method, request, timeout=timeout)

    client.call = late  # type: ignore[method-assign]
    fleet = WorkerFleet(cast(GenqClient, client), poll_interval=0.05, drain_timeout=0.1)

    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        client.log.append("handler")
        return {}

    fleet.register("scripted", handler, concurrency=1)

    async def main() -> None:
        work = asyncio.create_task(fleet.run(handle_signals=False))
        await asyncio.wait_for(parked.wait(), 10)
        fleet.stop()
        stopping.set()
        await asyncio.wait_for(work, 10)

    asyncio.run(main())
    assert [entry for entry in client.log if entry != "ClaimNextTask"] == [
        "UpsertTool",
        "ConfirmClaim",
        "ReleaseTask",
    ]


def test_scripted_a_report_is_tried_until_its_lease_ends() -> None:
    """CompleteTasks answers UNAVAILABLE five times (a service restarting, ~3 s): the reports
    keep trying within their lease (30 s), batched again, and land: giving up sooner loses the
    task's result and runs the task again."""

    def complete(n: int, request: Any) -> Any:
        if n <= 5:
            raise unavailable()
        return task_pb2.CompleteTasksResponse(
            results=[
                task_pb2.ReportResult(
                    task_id=item.task_id,
                    task=task_pb2.Task(id=item.task_id, status=task_pb2.TASK_STATUS_COMPLETED),
                )
                for item in request.tasks
            ]
        )

    client = BatchScriptedClient(2, complete)
    fleet = WorkerFleet(cast(GenqClient, client), poll_interval=0.05, drain_timeout=1)

    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        return {"id": task.id}

    fleet.register("batched", handler, concurrency=2)

    async def main() -> None:
        work = asyncio.create_task(fleet.run(handle_signals=False))
        deadline = time.monotonic() + 15
        while client.batches.count(("CompleteTasks", 2)) < 6:
            assert time.monotonic() < deadline, client.batches
            assert not work.done(), work
            await asyncio.sleep(0.01)
        fleet.stop()
        await asyncio.wait_for(work, 10)

    asyncio.run(main())
    assert client.batches.count(("CompleteTasks", 2)) == 6, "tried until they landed, not after"


def test_scripted_a_stop_with_the_service_down_ends_soon_after_the_drain_deadline() -> None:
    """Reports that cannot get through are tried until their lease ends (30 s here), but a
    stop ends DRAIN_REPORT_SECONDS after the drain's deadline, not the whole lease later (120 s
    with the service's default)."""

    def complete(n: int, request: Any) -> Any:
        raise unavailable()

    client = BatchScriptedClient(2, complete)
    fleet = WorkerFleet(cast(GenqClient, client), poll_interval=0.05, drain_timeout=0.2)

    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        return {"id": task.id}

    fleet.register("batched", handler, concurrency=2)

    async def main() -> float:
        work = asyncio.create_task(fleet.run(handle_signals=False))
        deadline = time.monotonic() + 10
        while ("CompleteTasks", 2) not in client.batches:
            assert time.monotonic() < deadline, client.batches
            await asyncio.sleep(0.01)
        stopped = time.monotonic()
        fleet.stop()
        await asyncio.wait_for(work, 30)
        return time.monotonic() - stopped

    took = asyncio.run(main())
    assert took < 0.2 + fleet_module.DRAIN_REPORT_SECONDS + 2, f"the stop took {took:.1f} s"


def test_a_claim_of_large_inputs_is_taken_whole(
    service: ServiceProcess, db: Db, counting: list[CountingClient]
) -> None:
    """Eight tasks of 700 KB each: their ClaimTasks answer (5.6 MB) is over gRPC's default 4 MiB
    receive limit, which the SDK's channel lifts."""
    name = tool_name()
    tool_id = service.stub.UpsertTool(task_pb2.UpsertToolRequest(name=name)).tool.id
    blob = "x" * 700_000
    tasks = [queue(service.stub, tool_id, input={"blob": blob, "n": n}) for n in range(8)]
    fleet = new_fleet(service)

    @fleet.tool(name, concurrency=8)
    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        return {"n": ctx.input["n"], "size": len(ctx.input["blob"])}

    with running(fleet):
        wait_for(lambda: terminal(db, *tasks), what="the large tasks to complete")
    [client] = counting
    completed_once(db, tasks)
    assert client.claimed[0] == 8, client.calls
    assert row(db, tasks[7])["output"] == {"n": 7, "size": 700_000}
    # A report's answer holds its task in brief: the reports' batches are bound by their own
    # bytes, not by the 700 KB inputs.
    reports = [items for method, items in client.calls if method.startswith("CompleteTask")]
    assert sum(reports) == 8, reports


# -- the pipelined worker: lanes by default, one asyncio task per run, nothing traced -----------


def run_batch_scripted(
    client: BatchScriptedClient, handler: Any, until: Callable[[], bool], **register: Any
) -> None:
    """Runs a fleet hosting "batched" over `client` until `until()`, then drains it."""
    fleet = WorkerFleet(
        cast(GenqClient, client),
        poll_interval=0.05,
        drain_timeout=1,
        tracer_provider=trace.NoOpTracerProvider(),
    )
    fleet.register("batched", handler, **register)

    async def main() -> None:
        work = asyncio.create_task(fleet.run(handle_signals=False))
        deadline = time.monotonic() + 10
        while not until():
            assert time.monotonic() < deadline, client.log
            assert not work.done(), work
            await asyncio.sleep(0.01)
        fleet.stop()
        await asyncio.wait_for(work, 10)

    asyncio.run(main())


def completions(client: BatchScriptedClient) -> int:
    batched = sum(items for method, items in client.batches if method == "CompleteTasks")
    return batched + client.log.count("CompleteTask")


def completed_batch(request: Any) -> Any:
    return task_pb2.CompleteTasksResponse(
        results=[
            task_pb2.ReportResult(
                task_id=item.task_id,
                task=task_pb2.Task(id=item.task_id, status=task_pb2.TASK_STATUS_COMPLETED),
            )
            for item in request.tasks
        ]
    )


def test_scripted_an_async_handler_gets_ten_lanes_by_default_and_runs_in_its_runs_task() -> None:
    """Registered without `concurrency`, an async handler's tool claims 10 at a time; each
    handler runs in its run's own asyncio task (none of its own), and the 12 tasks complete."""
    client = BatchScriptedClient(12, lambda n, request: completed_batch(request))
    ran_in: dict[str, str] = {}

    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        current = asyncio.current_task()
        assert current is not None
        ran_in[task.id] = current.get_name()
        return {}

    run_batch_scripted(client, handler, lambda: completions(client) == 12)
    assert fleet_module.DEFAULT_ASYNC_CONCURRENCY == 10
    claims = [r.limit for r in client.requests if isinstance(r, task_pb2.ClaimTasksRequest)]
    assert claims[0] == 10, claims
    assert ran_in == {f"task-{n}": f"genq batched task-{n}" for n in range(12)}


def test_scripted_a_sync_handler_gets_one_lane_by_default() -> None:
    client = BatchScriptedClient(0, lambda n, request: completed_batch(request))

    def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        return {}

    run_batch_scripted(client, handler, lambda: "ClaimNextTask" in client.log)
    assert "ClaimTasks" not in client.log, client.log  # one lane: ClaimNextTask


def test_scripted_with_nothing_traced_a_task_costs_no_context_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No tracer provider: working tasks enqueued without a trace attaches no OpenTelemetry
    context at all (no span, no context per task or per batch)."""
    attached: list[Any] = []
    attach = otel_context.attach

    def counting_attach(context: Any) -> Any:
        attached.append(context)
        return attach(context)

    monkeypatch.setattr(otel_context, "attach", counting_attach)
    client = BatchScriptedClient(30, lambda n, request: completed_batch(request))

    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        return {}

    run_batch_scripted(client, handler, lambda: completions(client) == 30, concurrency=4)
    assert attached == []


def test_scripted_one_confirmation_per_claim_runs_only_what_it_confirms() -> None:
    """A claim of three: one ConfirmClaim with the claim's token and its three ids answers
    task-0 confirmed, task-1 left out (lost), task-2 confirmed with a cancel asked for: task-0
    runs and completes, task-1 neither runs nor reports, task-2 ends cancelled unrun."""
    client = BatchScriptedClient(3, lambda n, request: completed_batch(request))

    def confirm(n: int, request: task_pb2.ConfirmClaimRequest) -> task_pb2.ConfirmClaimResponse:
        return task_pb2.ConfirmClaimResponse(
            task_ids=["task-0", "task-2"], cancel_requested_task_ids=["task-2"]
        )

    client.confirm = confirm
    ran: list[str] = []

    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        ran.append(task.id)
        return {}

    run_batch_scripted(
        client, handler, lambda: "CompleteTask" in client.log and "FailTask" in client.log
    )
    [request] = [r for r in client.requests if isinstance(r, task_pb2.ConfirmClaimRequest)]
    assert (request.lease_token, list(request.task_ids)) == (
        "token-task-0",
        ["task-0", "task-1", "task-2"],
    )
    assert ran == ["task-0"]
    reports = [
        (type(r).__name__, r.task_id)
        for r in client.requests
        if isinstance(r, (task_pb2.CompleteTaskRequest, task_pb2.FailTaskRequest))
    ]
    assert sorted(reports) == [("CompleteTaskRequest", "task-0"), ("FailTaskRequest", "task-2")]
    [cancel] = [r for r in client.requests if isinstance(r, task_pb2.FailTaskRequest)]
    assert cancel.failure == task_pb2.FAILURE_KIND_CANCELLED
