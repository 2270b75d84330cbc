"""WorkerFleet in this process against the real service (GUIDE A9, A11, A12 worker side, B7).

The fleet runs on an event loop in a thread of its own, as a worker would run it, while the test
thread enqueues over gRPC and checks rows in SQL. Handlers record what they saw.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from generation.task.v1 import task_pb2
from tests.conftest import ServiceProcess, wait_for
from tests.test_semantics import Db, Stub, row
from workers_sdk import (
    AccountError,
    CancelledError,
    PermanentError,
    RetryableError,
    TaskContext,
    WorkerFleet,
)


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
        "SELECT kind::text, data FROM generation.task_events WHERE task_id = %s ORDER BY sequence",
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


def test_output_the_service_refuses_fails_the_task(service: ServiceProcess, db: Db) -> None:
    """An output over the service's size limit can never be stored: the task fails at once
    instead of being run (and paid for) again."""
    name = tool_name()
    fleet = new_fleet(service)
    runs: Counter[str] = Counter()

    @fleet.tool(name)
    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        runs[task.id] += 1
        return {"blob": "x" * 1_100_000}

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
        assert events(db, task_id)[0] == {
            "kind": "progress",
            "data": {"progress": 1.0, "message": "from a thread"},
        }


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
        (task_pb2.TASK_EVENT_KIND_PROGRESS, {"progress": 0.5, "message": "half way"}),
        (task_pb2.TASK_EVENT_KIND_STREAMING_URL, {"url": "https://preview.example.invalid/1"}),
        (task_pb2.TASK_EVENT_KIND_PARTIAL_OUTPUT, {"frames": 12}),
        (task_pb2.TASK_EVENT_KIND_PROGRESS, {"progress": 1.0}),
        (task_pb2.TASK_EVENT_KIND_COMPLETED, {}),
    ]


@pytest.mark.parametrize("noticed_by", ["heartbeat", "publish"])
def test_lost_lease_is_signalled_and_the_result_dropped(
    service: ServiceProcess, db: Db, noticed_by: str
) -> None:
    """Another claimer takes the task (its token replaces ours): the next heartbeat or event
    publish hears LEASE_LOST, the handler sees ctx.lease_lost, and its result is dropped."""
    name = tool_name()
    heartbeat_interval = 0.2 if noticed_by == "heartbeat" else 60.0
    fleet = new_fleet(service, heartbeat_interval=heartbeat_interval)
    started = threading.Event()
    stolen = threading.Event()
    seen: list[bool] = []

    @fleet.tool(name)
    async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
        started.set()
        assert await asyncio.to_thread(stolen.wait, 10)
        if noticed_by == "publish":
            await ctx.progress(0.9, "after the steal")
        await asyncio.wait_for(ctx.lease_lost.wait(), 10)
        seen.append(ctx.is_lease_lost)
        return {"dropped": "this"}

    with running(fleet):
        task_id = queue(service.stub, fleet.tool_ids[name])
        wait_for(started.is_set, what="the handler to start")
        db.execute(
            "UPDATE generation.tasks SET lease_token = gen_random_uuid() WHERE id = %s", [task_id]
        )
        stolen.set()
        wait_for(lambda: seen, what="the handler to see its lease lost")
        wait_for(lambda: fleet.in_flight[name] == 0, what="the fleet to let the task go")
        held = row(db, task_id)
    assert seen == [True]
    assert (held["status"], held["output"], held["error"]) == ("processing", None, None)
    assert events(db, task_id) == []


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
