"""Rate limits per resource key (GUIDE X8): at most max_calls runs start, and at most max_units of
their tasks' rate_units are admitted, in any window, across tools, workers and replicas; a claim
beyond it answers rate_limited with when the next slot frees, and a parked claim wakes then.

The limits here are of a few seconds, not a minute: the window is the limit's own setting, and the
rule is the same for every length.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import grpc
import psycopg
import pytest
from google.protobuf import duration_pb2

from generation.task.v1 import task_pb2, task_pb2_grpc
from tests.conftest import ServiceProcess, wait_for
from tests.integration.test_fleet import new_fleet, running
from workers_sdk import TaskContext

Stub = task_pb2_grpc.GenerationDataServiceStub
Db = psycopg.Connection[dict[str, Any]]


def new_key() -> str:
    return f"rate-{uuid.uuid4().hex[:12]}"


def new_tool(stub: Stub, name: str | None = None) -> str:
    request = task_pb2.UpsertToolRequest(name=name or new_key())
    return str(stub.UpsertTool(request).tool.id)


def set_limit(
    stub: Stub, key: str, *, calls: int | None = None, units: int | None = None, window: int = 60
) -> task_pb2.SetRateLimitResponse:
    request = task_pb2.SetRateLimitRequest(
        resource_key=key, window=duration_pb2.Duration(seconds=window)
    )
    if calls is not None:
        request.max_calls = calls
    if units is not None:
        request.max_units = units
    response: task_pb2.SetRateLimitResponse = stub.SetRateLimit(request)
    return response


def queue(stub: Stub, tool_id: str, n: int, **fields: Any) -> list[str]:
    return [
        stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id, **fields)).task.id
        for _ in range(n)
    ]


def claim(stub: Stub, tool_id: str, limit: int, wait: float = 0) -> task_pb2.ClaimTasksResponse:
    request = task_pb2.ClaimTasksRequest(tool_id=tool_id, limit=limit)
    request.wait.FromTimedelta(timedelta(seconds=wait))
    response: task_pb2.ClaimTasksResponse = stub.ClaimTasks(request, timeout=wait + 10)
    return response


def db_now(db: Db) -> Any:
    row = db.execute("SELECT now() AS now").fetchone()
    assert row is not None
    return row["now"]


def test_set_rate_limit_is_shown_audited_and_removed(stub: Stub, db: Db) -> None:
    key = new_key()
    set_limit(stub, key, calls=30, units=1000, window=60)
    shown = stub.GetResourceKey(task_pb2.GetResourceKeyRequest(resource_key=key)).rate_limit
    assert (shown.resource_key, shown.max_calls, shown.max_units) == (key, 30, 1000)
    assert (shown.window.seconds, shown.calls, shown.units) == (60, 0, 0)
    assert not shown.HasField("limited_until")
    audited = db.execute(
        "SELECT detail FROM generation.audit WHERE action = 'SetRateLimit' "
        "AND detail ->> 'resource_key' = %s",
        [key],
    ).fetchall()
    assert len(audited) == 1
    status = stub.GetStatus(task_pb2.GetStatusRequest()).status
    assert key in [rate.resource_key for rate in status.rate_limits]

    removed = stub.SetRateLimit(task_pb2.SetRateLimitRequest(resource_key=key))
    assert not removed.HasField("rate_limit")
    found = stub.GetResourceKey(task_pb2.GetResourceKeyRequest(resource_key=key))
    assert not found.HasField("rate_limit")


@pytest.mark.parametrize(
    "fields",
    [
        {"max_calls": 0},
        {"max_units": 0},
        {"max_calls": 1_000_001},
        {"max_calls": 5, "window": duration_pb2.Duration(seconds=0)},
        {"max_calls": 5, "window": duration_pb2.Duration(seconds=1, nanos=500_000_000)},
        {"max_calls": 5, "window": duration_pb2.Duration(seconds=86_401)},
        {"max_calls": 5, "resource_key": ""},
    ],
    ids=["no-calls", "no-units", "too-many-calls", "no-window", "part-second", "over-a-day", "key"],
)
def test_a_bad_rate_limit_is_refused_and_changes_nothing(
    stub: Stub, db: Db, fields: dict[str, Any]
) -> None:
    key = new_key()
    request = task_pb2.SetRateLimitRequest(**{"resource_key": key, **fields})
    with pytest.raises(grpc.RpcError) as refused:
        stub.SetRateLimit(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    left = db.execute(
        "SELECT count(*) AS n FROM generation.rate_limits WHERE resource_key = %s", [key]
    ).fetchone()
    assert left == {"n": 0}


def test_a_claim_beyond_the_calls_answers_rate_limited_until_the_next_slot(
    stub: Stub, db: Db
) -> None:
    """Limit 2 per minute on the tool's key: a claim of 5 takes 2, the next takes none and says
    when their slot frees."""
    tool_id = new_tool(stub)
    key = db.execute("SELECT name FROM generation.tools WHERE id = %s", [tool_id]).fetchone()
    assert key is not None
    set_limit(stub, key["name"], calls=2, window=60)
    queue(stub, tool_id, 5)
    first = claim(stub, tool_id, 5)
    assert len(first.tasks) == 2
    started = db.execute(
        "SELECT min(started_at) AS at FROM generation.attempts WHERE tool_id = %s", [tool_id]
    ).fetchone()
    assert started is not None
    refused = claim(stub, tool_id, 5)
    assert not refused.tasks
    assert refused.idle_reason == task_pb2.IDLE_REASON_RATE_LIMITED
    # The window is counted in slices of a second: the slot frees when the slice that holds the
    # two starts has left the window, within a second after their own minute.
    frees = refused.idle_until.ToDatetime(tzinfo=started["at"].tzinfo)
    assert started["at"] + timedelta(seconds=60) < frees <= started["at"] + timedelta(seconds=61)
    single = stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id))
    assert single.idle_reason == task_pb2.IDLE_REASON_RATE_LIMITED
    assert single.idle_until == refused.idle_until
    window = stub.GetResourceKey(task_pb2.GetResourceKeyRequest(resource_key=key["name"]))
    assert (window.rate_limit.calls, window.rate_limit.limited_until) == (2, refused.idle_until)
    tools = stub.GetStatus(task_pb2.GetStatusRequest()).status.tools
    (shown,) = [t for t in tools if t.tool_id == tool_id]
    assert shown.rate_limited_until == refused.idle_until
    assert not shown.no_worker_seen


def test_units_are_admitted_in_claim_order_within_the_window(stub: Stub, db: Db) -> None:
    """100 units a minute on the tasks' own key, tasks of 40, 50, 30 and 5 units in claim order:
    the claim admits 40 and 50 (90), passes over 30 (120 would be over) and admits 5 (95); the
    next claim finds no room for the 30."""
    tool_id = new_tool(stub)
    key = new_key()
    set_limit(stub, key, units=100, window=60)
    ids = [
        stub.QueueTask(
            task_pb2.QueueTaskRequest(
                tool_id=tool_id, resource_key=key, rate_units=units, priority=10 - n
            )
        ).task.id
        for n, units in enumerate([40, 50, 30, 5])
    ]
    first = claim(stub, tool_id, 10)
    assert [item.task.id for item in first.tasks] == [ids[0], ids[1], ids[3]]
    assert [item.task.rate_units for item in first.tasks] == [40, 50, 5]
    second = claim(stub, tool_id, 10)
    assert second.idle_reason == task_pb2.IDLE_REASON_RATE_LIMITED
    window = stub.GetResourceKey(task_pb2.GetResourceKeyRequest(resource_key=key)).rate_limit
    assert (window.units, window.calls) == (95, 3)


def test_rate_units_out_of_range_are_refused(stub: Stub) -> None:
    tool_id = new_tool(stub)
    with pytest.raises(grpc.RpcError) as refused:
        stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id, rate_units=-1))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def slow_recheck(
    database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """A second replica of the session's database that re-checks a parked claim only every 30 s
    (and so wakes at a slot's time only because the claim said when)."""
    replica = ServiceProcess(
        database_url,
        tmp_path_factory.mktemp("rate-replica") / "serve.log",
        GENQ_RECHECK_SECONDS="30",
    )
    yield replica
    replica.stop()


def test_a_parked_claim_wakes_when_the_next_slot_frees(
    stub: Stub, slow_recheck: ServiceProcess, db: Db
) -> None:
    tool_id = new_tool(stub)
    name = db.execute("SELECT name FROM generation.tools WHERE id = %s", [tool_id]).fetchone()
    assert name is not None
    set_limit(stub, name["name"], calls=1, window=2)
    queue(stub, tool_id, 2)
    assert len(claim(slow_recheck.stub, tool_id, 1).tasks) == 1
    sent = time.monotonic()
    woken = claim(slow_recheck.stub, tool_id, 1, wait=20)
    assert len(woken.tasks) == 1, woken
    assert time.monotonic() - sent < 15, "woken by the slot, not by the wait running out"


@pytest.mark.parametrize("window", [3, 60], ids=["30-per-3s", "30-a-minute"])
def test_workers_on_two_replicas_never_start_more_than_the_limit_in_any_window(
    service: ServiceProcess, slow_recheck: ServiceProcess, db: Db, window: int
) -> None:
    """Four fleets, two on each replica, drain one key limited to 30 runs per window, until the
    key has started runs in a later window than its first: checked from the attempts ledger, no
    window holds more than 30 starts, and the limit was reached (the workers kept up with it).
    The minute's case waits the minute out."""
    name = new_key()
    tool_id = new_tool(service.stub, name)
    calls = 30
    set_limit(service.stub, name, calls=calls, window=window)
    service.stub.QueueTasks(
        task_pb2.QueueTasksRequest(
            tool_id=tool_id, tasks=[task_pb2.QueueTaskRequest() for _ in range(400)]
        )
    )
    fleets = []
    for replica in [service, slow_recheck] * 2:
        fleet = new_fleet(replica)

        async def handler(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
            return {}

        fleet.register(name, handler, concurrency=10)
        fleets.append(fleet)
    with running(fleets[0]), running(fleets[1]), running(fleets[2]), running(fleets[3]):

        def started() -> int:
            row = db.execute(
                "SELECT count(*) AS n FROM generation.attempts WHERE tool_id = %s", [tool_id]
            ).fetchone()
            return int(row["n"]) if row else 0

        wanted = 3 * calls if window < 10 else calls + 1
        wait_for(lambda: started() >= wanted, timeout=window * 3 + 30, what="a later window's runs")
    starts = [
        row["started_at"]
        for row in db.execute(
            "SELECT started_at FROM generation.attempts WHERE tool_id = %s ORDER BY started_at",
            [tool_id],
        )
    ]
    span = timedelta(seconds=window)
    most = max(
        sum(1 for later in starts[i:] if later < first + span) for i, first in enumerate(starts)
    )
    assert most == calls, f"{most} starts in one {window}-second window"
