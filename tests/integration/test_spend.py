"""Spend control (GUIDE B1-B6, B8, B11), enforced in the claim's own statement.

These tests run against a database and a service of their own, since they change the global
settings; every test starts from the defaults (no cap) and a tool of its own.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from google.protobuf import duration_pb2, timestamp_pb2
from psycopg.rows import dict_row

from generation.task.v1 import task_pb2, task_pb2_grpc
from service.leader.waits import waits
from tests.conftest import UNLIMITED, Databases, ServiceProcess, url_for, wait_for
from tests.integration.test_server import genq
from tests.invariants import assert_invariants
from workers_sdk.errors import Reason, from_rpc_error

Stub = task_pb2_grpc.GenerationDataServiceStub
Db = psycopg.Connection[dict[str, Any]]
UNIT = 1_000_000_000  # nanos in one currency unit


@pytest.fixture(scope="module")
def spend_url(databases: Databases) -> str:
    return url_for(databases.create("spend"))


@pytest.fixture(scope="module")
def spend_service(
    spend_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    process = ServiceProcess(
        spend_url,
        tmp_path_factory.mktemp("spend") / "serve.log",
        GENQ_RESCUE_INTERVAL_SECONDS="0.2",
    )
    yield process
    process.stop()


@pytest.fixture
def sdb(spend_url: str) -> Iterator[Db]:
    with psycopg.connect(spend_url, autocommit=True, row_factory=dict_row) as connection:
        connection.execute(
            "UPDATE generation.settings SET enabled = true, daily_cap_nanos = NULL, "
            "granted_day = NULL, granted_nanos = 0, cooldown_threshold = 2, "
            "cooldown_seconds = 600, account_hold_seconds = 3600"
        )
        connection.execute(
            "UPDATE generation.tools SET spent_day = NULL, spent_nanos = 0, reserved_nanos = 0, "
            "granted_nanos = 0"
        )
        connection.execute("DELETE FROM generation.cooldowns")
        connection.execute("DELETE FROM generation.holds")
        yield connection


@pytest.fixture
def stub(spend_service: ServiceProcess, sdb: Db) -> Stub:
    return spend_service.stub


def new_tool(stub: Stub, **settings: Any) -> str:
    tool_id = str(stub.UpsertTool(task_pb2.UpsertToolRequest(name=uuid.uuid4().hex)).tool.id)
    stub.ConfigureTool(
        task_pb2.ConfigureToolRequest(
            tool_id=tool_id, backoff_base_seconds=0, backoff_max_seconds=0, **settings
        )
    )
    return tool_id


def set_cap(stub: Stub, nanos: int) -> task_pb2.Settings:
    return stub.UpdateSettings(task_pb2.UpdateSettingsRequest(daily_cap_nanos=nanos)).settings


def queue(stub: Stub, tool_id: str, **fields: Any) -> task_pb2.Task:
    return stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id, **fields)).task


def claim(stub: Stub, tool_id: str) -> task_pb2.ClaimNextTaskResponse:
    return stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id))


def complete(stub: Stub, claimed: Any, cost: int = 0) -> task_pb2.Task:
    return stub.CompleteTask(
        task_pb2.CompleteTaskRequest(
            task_id=claimed.task.id,
            lease_token=claimed.lease_token,
            reported_usage=task_pb2.ReportedUsage(cost_nanos=cost),
        )
    ).task


def fail(stub: Stub, claimed: Any, failure: int, cost: int = 0) -> task_pb2.Task:
    return stub.FailTask(
        task_pb2.FailTaskRequest(
            task_id=claimed.task.id,
            lease_token=claimed.lease_token,
            failure=failure,
            error="boom",
            reported_usage=task_pb2.ReportedUsage(cost_nanos=cost),
        )
    ).task


def idle(stub: Stub, tool_id: str) -> str:
    answer = claim(stub, tool_id)
    assert not answer.HasField("task"), "a task was claimed"
    return task_pb2.IdleReason.Name(answer.idle_reason).removeprefix("IDLE_REASON_").lower()


def counters(db: Db) -> dict[str, int]:
    found = db.execute(
        "SELECT spent_nanos AS spent, reserved_nanos AS reserved FROM generation.spend_today"
    ).fetchone()
    assert found is not None
    return found


def task_row(db: Db, task_id: str) -> dict[str, Any]:
    found = db.execute("SELECT * FROM generation.tasks WHERE id = %s", [task_id]).fetchone()
    assert found is not None
    return found


# --- B1: the daily cap


def test_no_cap_or_a_zero_cap_runs_nothing_and_uses_no_attempt(stub: Stub, sdb: Db) -> None:
    tool_id = new_tool(stub)
    task = queue(stub, tool_id)
    assert idle(stub, tool_id) == "capped"
    set_cap(stub, 0)
    assert idle(stub, tool_id) == "capped"
    stored = task_row(sdb, task.id)
    assert (stored["status"], stored["retry_count"], stored["attempt_count"]) == ("queued", 0, 0)
    set_cap(stub, UNIT)
    assert claim(stub, tool_id).task.id == task.id


def race_claims(
    service: ServiceProcess, url: str, tools: list[str], cap: int
) -> tuple[list[Any], list[dict[str, int]]]:
    """16 claimers claim 10 times each, each starting at another of `tools`, while a watcher
    reads the spend counters: what was claimed, and every moment spend passed the cap."""
    claimed: list[Any] = []
    over_cap: list[dict[str, int]] = []
    racing = threading.Event()
    start = threading.Barrier(16)

    def watch() -> None:
        with psycopg.connect(url, autocommit=True, row_factory=dict_row) as watcher:
            while racing.is_set():
                seen = counters(watcher)
                if seen["spent"] + seen["reserved"] > cap:
                    over_cap.append(seen)

    def claimer(number: int) -> None:
        with grpc.insecure_channel(service.address) as channel:
            own = task_pb2_grpc.GenerationDataServiceStub(channel)
            start.wait()
            for attempt in range(10):
                answer = claim(own, tools[(number + attempt) % len(tools)])
                if answer.HasField("task"):
                    claimed.append(answer)

    racing.set()
    watcher = threading.Thread(target=watch)
    watcher.start()
    claimers = [threading.Thread(target=claimer, args=(n,)) for n in range(16)]
    for thread in claimers:
        thread.start()
    for thread in claimers:
        thread.join(60)
    racing.clear()
    watcher.join(10)
    return claimed, over_cap


def test_cap_admits_exactly_k_under_16_concurrent_claimers(
    spend_service: ServiceProcess, stub: Stub, sdb: Db, spend_url: str
) -> None:
    """B1 and B11: 16 claimers race for 40 tasks under a cap that admits exactly 5 estimates;
    exactly 5 are claimed, and spent + reserved never exceeds the cap at any moment."""
    estimate, admitted = 100 * UNIT // 1000, 5
    cap = estimate * admitted
    set_cap(stub, cap)
    tool_id = new_tool(stub, cost_estimate_nanos=estimate)
    for _ in range(40):
        queue(stub, tool_id)
    claimed, over_cap = race_claims(spend_service, spend_url, [tool_id], cap)

    assert len(claimed) == admitted
    assert over_cap == []
    assert counters(sdb) == {"spent": 0, "reserved": cap}
    assert idle(stub, tool_id) == "capped"

    # Reported costs replace the estimates; room opens as spend stays under the cap.
    for answer in claimed:
        complete(stub, answer, cost=estimate // 2)
    assert counters(sdb) == {"spent": cap // 2, "reserved": 0}
    ledger = sdb.execute(
        "SELECT outcome::text, count(*) AS n, sum(cost_nanos) AS cost FROM generation.attempts "
        "WHERE tool_id = %s GROUP BY outcome",
        [tool_id],
    ).fetchall()
    assert ledger == [{"outcome": "completed", "n": admitted, "cost": cap // 2}]
    assert claim(stub, tool_id).HasField("task")


def test_the_cap_admits_exactly_k_across_8_tools_holding_shares(
    spend_service: ServiceProcess, stub: Stub, sdb: Db, spend_url: str
) -> None:
    """Item 5 of the throughput issue: 8 tools share the global cap in shares of their own; 16
    claimers racing over them never pass it, and once the race is over the unused shares are
    taken back so that exactly k estimates are admitted in all."""
    estimate, admitted = UNIT, 20
    cap = estimate * admitted
    set_cap(stub, cap)
    tools = [new_tool(stub, cost_estimate_nanos=estimate) for _ in range(8)]
    for tool_id in tools:
        for _ in range(6):
            queue(stub, tool_id)
    claimed, over_cap = race_claims(spend_service, spend_url, tools, cap)
    for tool_id in tools:  # what the race left in other tools' shares is taken back now
        while (answer := claim(stub, tool_id)).HasField("task"):
            claimed.append(answer)

    assert over_cap == []
    assert len(claimed) == admitted
    assert counters(sdb) == {"spent": 0, "reserved": cap}
    assert {idle(stub, tool_id) for tool_id in tools} == {"capped"}
    for tool_id in tools:
        assert_invariants(sdb, tool_id)


def run_without_waiting(stub: Stub, tool_id: str, cost: int) -> None:
    """Claims a task of the tool and completes it with a cost, each call within 10 s: neither
    waits for a row another transaction holds."""
    answer = stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id), timeout=10)
    assert answer.HasField("task")
    done = stub.CompleteTask(
        task_pb2.CompleteTaskRequest(
            task_id=answer.task.id,
            lease_token=answer.lease_token,
            reported_usage=task_pb2.ReportedUsage(cost_nanos=cost),
        ),
        timeout=10,
    )
    assert done.task.status == task_pb2.TASK_STATUS_COMPLETED


def test_a_paid_claim_within_its_share_waits_for_neither_settings_nor_other_tools(
    stub: Stub, sdb: Db, spend_url: str
) -> None:
    """Paid claims and costed completions of different tools do not serialize on one row: with
    the settings row and another tool's row locked, a tool whose share has room claims and
    completes."""
    set_cap(stub, 1_000 * UNIT)
    busy, free = (new_tool(stub, cost_estimate_nanos=UNIT) for _ in range(2))
    for tool_id in (busy, busy, free, free):
        queue(stub, tool_id)
    complete(stub, claim(stub, free), cost=UNIT)  # takes the tool's first share
    with psycopg.connect(spend_url) as blocker:
        blocker.execute("SELECT 1 FROM generation.settings FOR UPDATE")
        blocker.execute("SELECT 1 FROM generation.tools WHERE id = %s FOR UPDATE", [busy])
        run_without_waiting(stub, free, cost=UNIT)
        blocker.rollback()
    assert counters(sdb) == {"spent": 2 * UNIT, "reserved": 0}
    assert_invariants(sdb, free)


def test_costed_runs_of_a_free_tool_wait_for_neither_settings_nor_other_tools(
    stub: Stub, sdb: Db, spend_url: str
) -> None:
    """A task estimated at 0 reserves nothing, but its run may report a cost. Once the tool's
    runs have spent today and its share is used up, its claim takes a slice of the cap
    (claim_tasks_v1, v3's steps), so the costs that follow fit in the tool's own row: with the
    settings row locked, such a tool claims and completes with a cost. (Before, each such close
    grew the grants and waited for settings.) A tool that has spent nothing today takes no
    slice."""
    set_cap(stub, 1_000 * UNIT)
    free = new_tool(stub)
    for _ in range(4):
        queue(stub, free)
    complete(stub, claim(stub, free), cost=UNIT)  # nothing spent yet: no slice; the cost grows it
    shares = sdb.execute("SELECT granted_nanos FROM generation.tools WHERE id = %s", [free])
    assert shares.fetchone() == {"granted_nanos": UNIT}
    complete(stub, claim(stub, free), cost=UNIT)  # spent and used up: this claim takes a slice
    with psycopg.connect(spend_url) as blocker:
        blocker.execute("SELECT 1 FROM generation.settings FOR UPDATE")
        for _ in range(2):
            run_without_waiting(stub, free, cost=UNIT)
        blocker.rollback()
    assert counters(sdb) == {"spent": 4 * UNIT, "reserved": 0}
    assert_invariants(sdb, free)


def test_a_lowered_cap_takes_back_the_shares_granted_under_the_old_one(stub: Stub, sdb: Db) -> None:
    set_cap(stub, 100 * UNIT)
    first, second = (new_tool(stub, cost_estimate_nanos=UNIT) for _ in range(2))
    for tool_id in (first, first, first, second):
        queue(stub, tool_id)
    assert claim(stub, first).HasField("task")  # granted a share well above one estimate
    set_cap(stub, 2 * UNIT)
    assert claim(stub, first).HasField("task"), "two estimates fit under the new cap"
    assert idle(stub, first) == "capped"
    assert idle(stub, second) == "capped"
    assert counters(sdb) == {"spent": 0, "reserved": 2 * UNIT}
    total = sdb.execute("SELECT granted_nanos FROM generation.settings").fetchone()
    assert total == {"granted_nanos": 2 * UNIT}


def test_a_cost_above_its_estimate_grows_the_share_and_counts_against_the_cap(
    stub: Stub, sdb: Db
) -> None:
    set_cap(stub, 10 * UNIT)
    tool_id = new_tool(stub, cost_estimate_nanos=UNIT)
    for _ in range(12):
        queue(stub, tool_id)
    complete(stub, claim(stub, tool_id), cost=6 * UNIT)
    assert_invariants(sdb, tool_id)
    running = [claim(stub, tool_id) for _ in range(4)]
    assert all(answer.HasField("task") for answer in running), "6 spent + 4 reserved fit"
    assert idle(stub, tool_id) == "capped"
    assert counters(sdb) == {"spent": 6 * UNIT, "reserved": 4 * UNIT}
    assert_invariants(sdb, tool_id)


# --- B20: busy, the concurrency limits


def test_a_tool_at_max_in_flight_is_busy_until_a_run_ends(
    spend_service: ServiceProcess, stub: Stub, sdb: Db, spend_url: str
) -> None:
    """16 claimers race for a tool whose max_in_flight is 3: exactly 3 run; a batch claim asks
    for 10 and gets none; when one run ends, one more is claimed."""
    set_cap(stub, UNLIMITED)
    tool_id = new_tool(stub, max_in_flight=3)
    for _ in range(20):
        queue(stub, tool_id)
    claimed, _ = race_claims(spend_service, spend_url, [tool_id], UNLIMITED)
    assert len(claimed) == 3
    assert idle(stub, tool_id) == "busy"
    batch = stub.ClaimTasks(task_pb2.ClaimTasksRequest(tool_id=tool_id, limit=10))
    assert (len(batch.tasks), batch.idle_reason) == (0, task_pb2.IDLE_REASON_BUSY)
    complete(stub, claimed[0])
    more = stub.ClaimTasks(task_pb2.ClaimTasksRequest(tool_id=tool_id, limit=10))
    assert len(more.tasks) == 1
    assert stub.GetTool(task_pb2.GetToolRequest(tool_id=tool_id)).tool.max_in_flight == 3
    stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, clear=["max_in_flight"]))
    assert claim(stub, tool_id).HasField("task"), "no limit once cleared"
    assert_invariants(sdb, tool_id)


def test_a_busy_resource_key_holds_its_tasks_in_every_tool_and_not_others(
    stub: Stub, sdb: Db
) -> None:
    set_cap(stub, UNLIMITED)
    key = f"model-{uuid.uuid4().hex}"
    limit = stub.SetResourceLimit(
        task_pb2.SetResourceLimitRequest(resource_key=key, max_in_flight=1)
    )
    assert (limit.resource_key, limit.max_in_flight) == (key, 1)
    first, second = new_tool(stub, resource_key=key), new_tool(stub)
    queue(stub, first)
    queue(stub, first)
    running = claim(stub, first)
    assert running.HasField("task")
    assert idle(stub, first) == "busy", "the tool's own key is busy, as a cooling key would hold it"
    held = queue(stub, second, resource_key=key)
    assert idle(stub, second) == "busy"
    other = queue(stub, second)
    assert claim(stub, second).task.id == other.id, "a busy key's task is passed over"
    complete(stub, running)
    assert claim(stub, second).task.id == held.id
    removed = stub.SetResourceLimit(task_pb2.SetResourceLimitRequest(resource_key=key))
    assert not removed.HasField("max_in_flight")
    assert sdb.execute(
        "SELECT count(*) AS n FROM generation.resource_limits WHERE resource_key = %s", [key]
    ).fetchone() == {"n": 0}


@pytest.mark.parametrize("limit", [0, -1, 100_001])
def test_a_concurrency_limit_out_of_range_is_invalid(stub: Stub, limit: int) -> None:
    tool_id = new_tool(stub)
    calls: list[tuple[Any, Any]] = [
        (stub.ConfigureTool, task_pb2.ConfigureToolRequest(tool_id=tool_id, max_in_flight=limit)),
        (
            stub.SetResourceLimit,
            task_pb2.SetResourceLimitRequest(resource_key="k", max_in_flight=limit),
        ),
    ]
    for method, request in calls:
        with pytest.raises(grpc.RpcError) as caught:
            method(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not stub.GetTool(task_pb2.GetToolRequest(tool_id=tool_id)).tool.HasField("max_in_flight")


def test_a_key_limit_holds_across_tools_under_16_racing_claimers(
    spend_service: ServiceProcess, stub: Stub, sdb: Db, spend_url: str
) -> None:
    """A claim counts the key's runs after it holds the key's limit, so one that waited for
    another claim of the key sees what that one started: never more than the limit run."""
    set_cap(stub, UNLIMITED)
    key = f"model-{uuid.uuid4().hex}"
    stub.SetResourceLimit(task_pb2.SetResourceLimitRequest(resource_key=key, max_in_flight=3))
    tools = [new_tool(stub, resource_key=key) for _ in range(4)]
    for tool_id in tools:
        for _ in range(10):
            queue(stub, tool_id)
    claimed, _ = race_claims(spend_service, spend_url, tools, UNLIMITED)
    assert len(claimed) == 3
    running = sdb.execute(
        "SELECT count(*) AS n FROM generation.attempts WHERE resource_key = %s "
        "AND outcome = 'running'",
        [key],
    ).fetchone()
    assert running == {"n": 3}


def test_a_free_claim_runs_when_a_lowered_cap_leaves_the_grants_above_it(
    stub: Stub, sdb: Db
) -> None:
    set_cap(stub, 100 * UNIT)
    paid, free = new_tool(stub, cost_estimate_nanos=UNIT), new_tool(stub)
    queue(stub, paid)
    queue(stub, free)
    complete(stub, claim(stub, paid), cost=0)  # its share stays granted, nothing spent
    set_cap(stub, 2 * UNIT)
    assert claim(stub, free).HasField("task"), "nothing is spent: a free task fits"


def test_a_time_zone_change_to_a_date_with_runs_counts_it_from_the_ledger(
    stub: Stub, sdb: Db
) -> None:
    """The new zone's date may be one that already has runs (one started before its midnight):
    its counters are counted from the ledger, so every run's reservation is there to release."""
    set_cap(stub, UNLIMITED)
    tool_id = new_tool(stub, cost_estimate_nanos=100)
    queue(stub, tool_id)
    queue(stub, tool_id)
    stub.UpdateSettings(task_pb2.UpdateSettingsRequest(timezone="Etc/GMT-12"))  # UTC+12
    try:
        moves_back(stub, sdb, tool_id)
    finally:
        stub.UpdateSettings(task_pb2.UpdateSettingsRequest(timezone="UTC"))


def moves_back(stub: Stub, sdb: Db, tool_id: str) -> None:
    before_midnight = claim(stub, tool_id)
    # As a run started yesterday looks today: its day's counters were dropped at midnight.
    sdb.execute(
        "UPDATE generation.attempts SET local_day = local_day - 1 WHERE lease_token = %s",
        [before_midnight.lease_token],
    )
    sdb.execute(
        "UPDATE generation.tools SET reserved_nanos = 0, granted_nanos = 0 WHERE id = %s",
        [tool_id],
    )
    sdb.execute("UPDATE generation.settings SET granted_nanos = 0")
    after_midnight = claim(stub, tool_id)
    # UTC-12 is 24 hours behind: today becomes yesterday's date.
    stub.UpdateSettings(task_pb2.UpdateSettingsRequest(timezone="Etc/GMT+12"))
    assert tool_counters(stub, tool_id) == (0, 200)
    complete(stub, before_midnight, cost=100)
    complete(stub, after_midnight, cost=100)
    assert tool_counters(stub, tool_id) == (200, 0)
    assert_invariants(sdb, tool_id)


def tool_counters(stub: Stub, tool_id: str) -> tuple[int, int]:
    tool = stub.GetTool(task_pb2.GetToolRequest(tool_id=tool_id)).tool
    return tool.spent_today_nanos, tool.reserved_nanos


def test_estimate_zero_needs_the_total_strictly_below_the_cap(stub: Stub, sdb: Db) -> None:
    set_cap(stub, 1_000)
    tool_id = new_tool(stub)
    queue(stub, tool_id)
    queue(stub, tool_id)
    complete(stub, claim(stub, tool_id), cost=999)
    running = claim(stub, tool_id)
    assert running.HasField("task"), "999 of 1000 spent: an estimate of 0 still fits"
    complete(stub, running, cost=1)
    queue(stub, tool_id)
    assert idle(stub, tool_id) == "capped"


def test_the_stricter_cap_wins(stub: Stub, sdb: Db) -> None:
    set_cap(stub, 10 * UNIT)
    tool_id = new_tool(stub, cost_estimate_nanos=UNIT, daily_cap_nanos=UNIT + UNIT // 2)
    for _ in range(3):
        queue(stub, tool_id)
    assert claim(stub, tool_id).HasField("task")
    assert idle(stub, tool_id) == "capped"
    tool = stub.GetTool(task_pb2.GetToolRequest(tool_id=tool_id)).tool
    assert (tool.reserved_nanos, tool.daily_cap_nanos) == (UNIT, UNIT + UNIT // 2)


def test_a_batch_of_a_free_tool_stops_at_a_task_the_cap_has_no_room_for(
    stub: Stub, sdb: Db
) -> None:
    """Claim order holds across the one-statement claim (claim_tasks_v1) and the rules it hands
    over to: a task estimated above today's room, queued between two free ones, stops the batch
    there, and the free task behind it is not taken instead (it would take the room the day
    frees first)."""
    set_cap(stub, 100)
    tool_id = new_tool(stub)
    queue(stub, tool_id)
    complete(stub, claim(stub, tool_id), cost=50)
    first = queue(stub, tool_id)
    queue(stub, tool_id, cost_estimate_nanos=60)
    queue(stub, tool_id)
    batch = stub.ClaimTasks(task_pb2.ClaimTasksRequest(tool_id=tool_id, limit=3))
    assert [claimed.task.id for claimed in batch.tasks] == [first.id]
    assert idle(stub, tool_id) == "capped", "the estimated task heads the queue"
    assert counters(sdb)["reserved"] == 0


@pytest.mark.parametrize("cap", ["global", "tool"])
def test_a_task_estimated_above_the_cap_in_force_is_passed_over_until_it_is_raised(
    stub: Stub, sdb: Db, cap: str
) -> None:
    """No day's room could take it: it does not hold back its tool or the tasks behind it, the
    status names it, and it runs in its place once the cap is raised: it must not stop every
    claim of its tool for good with nothing saying why."""
    set_cap(stub, 100 if cap == "global" else UNLIMITED)
    tool_id = new_tool(stub, **({"daily_cap_nanos": 100} if cap == "tool" else {}))
    big = queue(stub, tool_id, cost_estimate_nanos=150, priority=10)
    cheap = [queue(stub, tool_id, cost_estimate_nanos=10) for _ in range(2)]
    assert claim(stub, tool_id).task.id == cheap[0].id
    batch = stub.ClaimTasks(task_pb2.ClaimTasksRequest(tool_id=tool_id, limit=5))
    assert [claimed.task.id for claimed in batch.tasks] == [cheap[1].id]
    assert idle(stub, tool_id) == "capped", "only the task no day's room takes is left"
    status = stub.GetStatus(task_pb2.GetStatusRequest()).status
    (row,) = [t for t in status.tools if t.tool_id == tool_id]
    assert (row.queued, row.largest_queued_estimate_nanos) == (1, 150)
    assert "over_cap" in {wait.reason for wait in waits(status)}
    assert task_row(sdb, big.id)["status"] == "queued"

    if cap == "global":
        set_cap(stub, 1_000)
    else:
        stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, daily_cap_nanos=1_000))
    assert claim(stub, tool_id).task.id == big.id


def test_a_per_task_estimate_overrides_the_tools(stub: Stub, sdb: Db) -> None:
    set_cap(stub, 100)
    tool_id = new_tool(stub, cost_estimate_nanos=1_000)
    cheap = queue(stub, tool_id, cost_estimate_nanos=60)
    assert claim(stub, tool_id).task.id == cheap.id
    assert counters(sdb)["reserved"] == 60


def test_fresh_reads_a_cap_changed_in_the_database_binds_at_once(stub: Stub, sdb: Db) -> None:
    set_cap(stub, UNIT)
    tool_id = new_tool(stub)
    queue(stub, tool_id)
    sdb.execute("UPDATE generation.settings SET daily_cap_nanos = 0")
    assert idle(stub, tool_id) == "capped"


def test_spend_counts_on_the_local_day(stub: Stub, sdb: Db) -> None:
    set_cap(stub, 1_000)
    tool_id = new_tool(stub, cost_estimate_nanos=1_000)
    sdb.execute(
        "UPDATE generation.tools SET spent_nanos = 600, reserved_nanos = 400, "
        "granted_nanos = 1000, "
        "spent_day = (now() AT TIME ZONE 'UTC')::date - 1 WHERE id = %s",
        [tool_id],
    )
    sdb.execute(
        "UPDATE generation.settings SET granted_nanos = 1000, "
        "granted_day = (now() AT TIME ZONE 'UTC')::date - 1"
    )
    queue(stub, tool_id)
    assert claim(stub, tool_id).HasField("task"), "yesterday's spend and reservations do not count"
    assert counters(sdb) == {"spent": 0, "reserved": 1_000}


# --- B2: kill switch and pauses


def test_kill_switch_and_pause_keep_attempts(stub: Stub, sdb: Db) -> None:
    set_cap(stub, UNIT)
    tool_id = new_tool(stub)
    task = queue(stub, tool_id)
    stub.UpdateSettings(task_pb2.UpdateSettingsRequest(enabled=False))
    assert idle(stub, tool_id) == "disabled"
    stub.UpdateSettings(task_pb2.UpdateSettingsRequest(enabled=True))
    stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, paused=True))
    assert idle(stub, tool_id) == "paused"
    stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, paused=False))
    assert task_row(sdb, task.id)["attempt_count"] == 0
    assert claim(stub, tool_id).task.id == task.id


def test_the_environment_switch_cannot_be_undone_by_the_database(
    spend_url: str, stub: Stub, sdb: Db, tmp_path: Path
) -> None:
    set_cap(stub, UNIT)
    off = ServiceProcess(spend_url, tmp_path / "off.log", GENQ_DISABLED="true")
    try:
        tool_id = new_tool(off.stub)
        queue(off.stub, tool_id)
        settings = off.stub.UpdateSettings(task_pb2.UpdateSettingsRequest(enabled=True)).settings
        assert settings.enabled and settings.disabled_by_environment
        assert idle(off.stub, tool_id) == "disabled"
    finally:
        off.stop()


# --- B3: backoff


def test_retryable_failure_backs_off_with_full_jitter(stub: Stub, sdb: Db) -> None:
    set_cap(stub, UNIT)
    stub.UpdateSettings(task_pb2.UpdateSettingsRequest(cooldown_threshold=100))
    tool_id = new_tool(stub)
    stub.ConfigureTool(
        task_pb2.ConfigureToolRequest(
            tool_id=tool_id, backoff_base_seconds=100, backoff_max_seconds=150
        )
    )
    task = queue(stub, tool_id, max_retries=5)
    for attempt, ceiling in ((1, 100), (2, 150), (3, 150)):
        requeued = fail(stub, claim(stub, tool_id), task_pb2.FAILURE_KIND_RETRYABLE)
        assert requeued.status == task_pb2.TASK_STATUS_QUEUED
        delay = sdb.execute(
            "SELECT extract(epoch FROM run_at - now()) AS s FROM generation.tasks WHERE id = %s",
            [task.id],
        ).fetchone()
        assert delay is not None and -1 <= delay["s"] <= ceiling, (attempt, delay)
        sdb.execute(
            "UPDATE generation.tasks SET run_at = now() + interval '1 hour' WHERE id = %s",
            [task.id],
        )
        assert idle(stub, tool_id) == "waiting", "never claimed before its time"
        sdb.execute("UPDATE generation.tasks SET run_at = now() WHERE id = %s", [task.id])


# --- B4: cooldowns and holds


def test_two_retryable_failures_cool_the_key_without_using_more_attempts(
    stub: Stub, sdb: Db
) -> None:
    set_cap(stub, UNIT)
    tool_id = new_tool(stub, resource_key="provider/model-x")
    first = queue(stub, tool_id, max_retries=10)
    second = queue(stub, tool_id, max_retries=10)
    fail(stub, claim(stub, tool_id), task_pb2.FAILURE_KIND_RETRYABLE)
    fail(stub, claim(stub, tool_id), task_pb2.FAILURE_KIND_RETRYABLE)
    assert idle(stub, tool_id) == "cooling"
    attempts = {t: task_row(sdb, t)["retry_count"] for t in (first.id, second.id)}
    assert sorted(attempts.values()) == [0, 2] or sorted(attempts.values()) == [1, 1]
    released = stub.ReleaseCooldown(
        task_pb2.ReleaseCooldownRequest(resource_key="provider/model-x")
    )
    assert released.released
    assert claim(stub, tool_id).HasField("task")


def test_a_run_that_fell_back_to_another_key_cools_the_key_it_used(stub: Stub, sdb: Db) -> None:
    """B24: the handler tried model-y instead of the task's model-x (ctx.use_resource): the
    failures count toward model-y, which cools; model-x stays free, and GetResourceKey says so."""
    set_cap(stub, UNIT)
    used = f"model-y-{uuid.uuid4().hex}"
    tool_id = new_tool(stub, resource_key=f"model-x-{uuid.uuid4().hex}")
    for _ in range(3):
        queue(stub, tool_id, max_retries=10)
    for _ in range(2):
        claimed = claim(stub, tool_id)
        stub.FailTask(
            task_pb2.FailTaskRequest(
                task_id=claimed.task.id,
                lease_token=claimed.lease_token,
                failure=task_pb2.FAILURE_KIND_RETRYABLE,
                resource_key=used,
            )
        )
    state = stub.GetResourceKey(task_pb2.GetResourceKeyRequest(resource_key=used))
    assert state.cooling and state.cooling_until.seconds > 0
    tool = stub.GetTool(task_pb2.GetToolRequest(tool_id=tool_id)).tool
    own = stub.GetResourceKey(task_pb2.GetResourceKeyRequest(resource_key=tool.resource_key))
    assert (own.cooling, own.consecutive_failures) == (False, 0)
    claimed = claim(stub, tool_id)
    assert claimed.HasField("task"), "the task's own key is not cooling"
    stub.CompleteTask(
        task_pb2.CompleteTaskRequest(
            task_id=claimed.task.id, lease_token=claimed.lease_token, resource_key=used
        )
    )
    ledger = sdb.execute(
        "SELECT resource_key, outcome::text FROM generation.attempts WHERE tool_id = %s "
        "ORDER BY started_at",
        [tool_id],
    ).fetchall()
    assert [(a["resource_key"], a["outcome"]) for a in ledger] == [
        (used, "retry"),
        (used, "retry"),
        (used, "completed"),
    ]


def test_a_success_resets_the_failure_count(stub: Stub, sdb: Db) -> None:
    set_cap(stub, UNIT)
    tool_id = new_tool(stub)
    for _ in range(3):
        queue(stub, tool_id, max_retries=10)
    fail(stub, claim(stub, tool_id), task_pb2.FAILURE_KIND_RETRYABLE)
    complete(stub, claim(stub, tool_id))
    fail(stub, claim(stub, tool_id), task_pb2.FAILURE_KIND_RETRYABLE)
    assert claim(stub, tool_id).HasField("task"), "one failure since the success: not cooling"


def test_account_error_holds_the_group_and_keeps_the_attempt(stub: Stub, sdb: Db) -> None:
    set_cap(stub, UNIT)
    group = f"account-{uuid.uuid4().hex[:6]}"
    tool_a = new_tool(stub, account_group=group)
    tool_b = new_tool(stub, account_group=group)
    task = queue(stub, tool_a)
    queue(stub, tool_b)
    requeued = fail(stub, claim(stub, tool_a), task_pb2.FAILURE_KIND_ACCOUNT)
    assert (requeued.status, requeued.retry_count) == (task_pb2.TASK_STATUS_QUEUED, 0)
    assert idle(stub, tool_a) == "held"
    assert idle(stub, tool_b) == "held"
    assert stub.ReleaseHold(task_pb2.ReleaseHoldRequest(account_group=group)).released
    assert claim(stub, tool_a).task.id == task.id


# --- B5: the attempts ledger


def test_reclaimed_zombie_closes_abandoned_and_a_late_report_keeps_its_cost(
    stub: Stub, sdb: Db
) -> None:
    set_cap(stub, UNIT)
    tool_id = new_tool(stub, cost_estimate_nanos=100)
    task = queue(stub, tool_id)
    old = claim(stub, tool_id)
    sdb.execute(
        "UPDATE generation.tasks SET claim_expires_at = now() - interval '1 s' WHERE id = %s",
        [task.id],
    )
    wait_for(lambda: task_row(sdb, task.id)["reclaimed"], what="the rescue")
    assert counters(sdb)["reserved"] == 0, "the abandoned attempt's reservation is released"
    new = claim(stub, tool_id)
    with pytest.raises(grpc.RpcError) as caught:
        complete(stub, old, cost=70)
    assert from_rpc_error(caught.value).reason == Reason.LEASE_LOST
    complete(stub, new, cost=30)
    ledger = sdb.execute(
        "SELECT attempt, outcome::text, cost_nanos, local_day = (now() AT TIME ZONE 'UTC')::date "
        "AS today FROM generation.attempts WHERE task_id = %s ORDER BY attempt",
        [task.id],
    ).fetchall()
    assert ledger == [
        {"attempt": 1, "outcome": "lease_lost", "cost_nanos": 70, "today": True},
        {"attempt": 2, "outcome": "completed", "cost_nanos": 30, "today": True},
    ]
    assert counters(sdb) == {"spent": 100, "reserved": 0}
    assert task_row(sdb, task.id)["status"] == "completed"


def test_a_repeated_complete_does_not_count_twice(stub: Stub, sdb: Db) -> None:
    set_cap(stub, UNIT)
    tool_id = new_tool(stub)
    queue(stub, tool_id)
    claimed = claim(stub, tool_id)
    complete(stub, claimed, cost=40)
    complete(stub, claimed, cost=40)  # a retry after a lost answer: the same success
    assert counters(sdb)["spent"] == 40


# --- B6: enqueue features


def test_idempotency_key_return_conflict_and_requeue(stub: Stub, sdb: Db) -> None:
    set_cap(stub, UNIT)
    tool_id = new_tool(stub)
    first = queue(stub, tool_id, idempotency_key="job-1", input={"n": 1})
    again = queue(stub, tool_id, idempotency_key="job-1", input={"n": 1})
    assert again.id == first.id
    with pytest.raises(grpc.RpcError) as caught:
        queue(stub, tool_id, idempotency_key="job-1", input={"n": 2})
    error = from_rpc_error(caught.value)
    assert (error.code, error.reason) == (
        grpc.StatusCode.ALREADY_EXISTS,
        Reason.IDEMPOTENCY_KEY_REUSED,
    )
    fail(stub, claim(stub, tool_id), task_pb2.FAILURE_KIND_PERMANENT)
    kept = queue(stub, tool_id, idempotency_key="job-1", input={"n": 1})
    assert kept.status == task_pb2.TASK_STATUS_FAILED
    requeued = queue(
        stub,
        tool_id,
        idempotency_key="job-1",
        input={"n": 1},
        on_conflict=task_pb2.ON_CONFLICT_REQUEUE,
    )
    assert (requeued.id, requeued.status, requeued.retry_count) == (
        first.id,
        task_pb2.TASK_STATUS_QUEUED,
        0,
    )


def test_concurrent_duplicates_make_one_row(
    spend_service: ServiceProcess, stub: Stub, sdb: Db
) -> None:
    tool_id = new_tool(stub)
    answers: list[str] = []
    start = threading.Barrier(16)

    def enqueue() -> None:
        with grpc.insecure_channel(spend_service.address) as channel:
            own = task_pb2_grpc.GenerationDataServiceStub(channel)
            start.wait()
            answers.append(queue(own, tool_id, idempotency_key="dup", input={"x": 1}).id)

    threads = [threading.Thread(target=enqueue) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(answers) == 16 and len(set(answers)) == 1
    count = sdb.execute(
        "SELECT count(*) AS n FROM generation.tasks WHERE tool_id = %s", [tool_id]
    ).fetchone()
    assert count == {"n": 1}


def test_not_before_and_expiry(stub: Stub, sdb: Db) -> None:
    set_cap(stub, UNIT)
    tool_id = new_tool(stub)
    now = sdb.execute("SELECT extract(epoch FROM now())::bigint AS t").fetchone()
    assert now is not None
    later = timestamp_pb2.Timestamp(seconds=now["t"] + 3600)  # by the database's clock
    queue(stub, tool_id, run_after=later)
    assert idle(stub, tool_id) == "waiting"
    short = queue(stub, tool_id, ttl=duration_pb2.Duration(nanos=1_000_000))
    wait_for(lambda: task_row(sdb, short.id)["status"] == "expired", what="the expiry sweep")
    kinds = sdb.execute(
        "SELECT kind::text FROM generation.event_stream WHERE task_id = %s", [short.id]
    ).fetchall()
    assert kinds == [{"kind": "expired"}]
    forever = queue(stub, tool_id, ttl=duration_pb2.Duration())
    assert task_row(sdb, forever.id)["expires_at"] is None
    default = queue(stub, tool_id)
    lifetime = sdb.execute(
        "SELECT expires_at - run_at AS ttl FROM generation.tasks WHERE id = %s", [default.id]
    ).fetchone()
    assert lifetime is not None and lifetime["ttl"].days == 7


def test_expiry_is_suspended_while_the_switch_is_off(stub: Stub, sdb: Db) -> None:
    tool_id = new_tool(stub)
    stub.UpdateSettings(task_pb2.UpdateSettingsRequest(enabled=False))
    task = queue(stub, tool_id, ttl=duration_pb2.Duration(nanos=1_000_000))
    expired = sdb.execute("SELECT * FROM generation.expire_tasks_v1(1000, false)").fetchall()
    assert expired == []
    assert task_row(sdb, task.id)["status"] == "queued", "a pause keeps its backlog"
    stub.UpdateSettings(task_pb2.UpdateSettingsRequest(enabled=True))
    wait_for(lambda: task_row(sdb, task.id)["status"] == "expired", what="the expiry sweep")


def test_cancel_one_by_filter_and_retry(stub: Stub, sdb: Db) -> None:
    set_cap(stub, UNIT)
    tool_id = new_tool(stub, cost_estimate_nanos=10)
    queued = queue(stub, tool_id)
    cancelled = stub.CancelTask(task_pb2.CancelTaskRequest(task_id=queued.id)).task
    assert cancelled.status == task_pb2.TASK_STATUS_CANCELLED
    again = stub.CancelTask(task_pb2.CancelTaskRequest(task_id=queued.id)).task
    assert again == cancelled, "a retried cancel answers the same"
    done = queue(stub, tool_id)
    held = claim(stub, tool_id)
    assert held.task.id == done.id
    stub.CompleteTask(task_pb2.CompleteTaskRequest(task_id=done.id, lease_token=held.lease_token))
    with pytest.raises(grpc.RpcError) as finished:
        stub.CancelTask(task_pb2.CancelTaskRequest(task_id=done.id))
    assert from_rpc_error(finished.value).reason == Reason.TASK_FINISHED

    batch = [queue(stub, tool_id, idempotency_key=f"bulk-{i}") for i in range(3)]
    other = queue(stub, tool_id, idempotency_key="keep")
    gone = stub.CancelTasks(
        task_pb2.CancelTasksRequest(tool_id=tool_id, idempotency_key_prefix="bulk-")
    )
    assert gone.cancelled == 3
    assert {task_row(sdb, t.id)["status"] for t in batch} == {"cancelled"}
    assert task_row(sdb, other.id)["status"] == "queued"

    retried = stub.RetryTask(task_pb2.RetryTaskRequest(task_id=queued.id)).task
    assert (retried.status, retried.retry_count) == (task_pb2.TASK_STATUS_QUEUED, 0)
    with pytest.raises(grpc.RpcError) as not_failed:
        stub.RetryTask(task_pb2.RetryTaskRequest(task_id=other.id))
    assert from_rpc_error(not_failed.value).reason == Reason.TASK_NOT_RETRYABLE


@pytest.mark.parametrize("report", ["CompleteTask", "FailTask", "ReleaseTask", "lease lapse"])
def test_cancelling_a_running_task_asks_its_worker_and_keeps_the_cost(
    stub: Stub, sdb: Db, report: str
) -> None:
    """Fault 16: cancel of a running task is a request. The worker hears it on its next
    heartbeat, reports what the run cost, and the run ends cancelled; the reservation is
    released when the run really ends, and the spend equals the ledger."""
    set_cap(stub, UNIT)
    tool_id = new_tool(stub, cost_estimate_nanos=10)
    task = queue(stub, tool_id)
    running = claim(stub, tool_id)
    lease = {"task_id": task.id, "lease_token": running.lease_token}
    asked = stub.CancelTask(task_pb2.CancelTaskRequest(task_id=task.id)).task
    assert asked.status == task_pb2.TASK_STATUS_PROCESSING and asked.HasField("cancel_requested_at")
    assert counters(sdb) == {"spent": 0, "reserved": 10}, "still running: still reserved"
    beat = stub.HeartbeatTask(task_pb2.HeartbeatTaskRequest(**lease))
    assert beat.cancel_requested

    usage = task_pb2.ReportedUsage(cost_nanos=7)
    if report == "CompleteTask":
        ended = stub.CompleteTask(task_pb2.CompleteTaskRequest(**lease, reported_usage=usage)).task
    elif report == "FailTask":
        ended = stub.FailTask(
            task_pb2.FailTaskRequest(
                **lease, failure=task_pb2.FAILURE_KIND_CANCELLED, reported_usage=usage
            )
        ).task
    elif report == "ReleaseTask":
        ended = stub.ReleaseTask(task_pb2.ReleaseTaskRequest(**lease, cost_nanos=7)).task
    else:
        sdb.execute(
            "UPDATE generation.tasks SET claim_expires_at = now() - interval '1 s' WHERE id = %s",
            [task.id],
        )
        wait_for(lambda: task_row(sdb, task.id)["status"] == "cancelled", what="the rescue")
        # The worker's report comes after the lapse: refused, but billed is billed.
        with pytest.raises(grpc.RpcError) as late:
            stub.CompleteTask(task_pb2.CompleteTaskRequest(**lease, reported_usage=usage))
        assert from_rpc_error(late.value).reason == Reason.LEASE_LOST
        ended = stub.GetTask(task_pb2.GetTaskRequest(task_id=task.id)).task

    assert ended.status == task_pb2.TASK_STATUS_CANCELLED
    assert counters(sdb) == {"spent": 7, "reserved": 0}
    ledger = sdb.execute(
        "SELECT sum(cost_nanos)::bigint AS cost FROM generation.attempts WHERE task_id = %s",
        [task.id],
    ).fetchone()
    assert ledger == {"cost": 7}
    kinds = [
        r["kind"]
        for r in sdb.execute(
            "SELECT kind::text FROM generation.event_stream WHERE task_id = %s ORDER BY sequence",
            [task.id],
        )
    ]
    assert kinds == ["started", "cancel_requested", "cancelled"]


def test_queue_tasks_enqueues_many_in_one_call(stub: Stub, sdb: Db) -> None:
    tool_id = new_tool(stub)
    queue(stub, tool_id, idempotency_key="taken")
    items = [task_pb2.QueueTaskRequest(input={"i": i}, priority=i % 3) for i in range(200)]
    items.append(task_pb2.QueueTaskRequest(idempotency_key="taken"))
    answer = stub.QueueTasks(task_pb2.QueueTasksRequest(tool_id=tool_id, tasks=items))
    assert (len(answer.tasks), answer.skipped) == (200, 1)
    # In item order, each with what the service set (not the input the item sent).
    assert [t.priority for t in answer.tasks] == [i % 3 for i in range(200)]
    assert {t.status for t in answer.tasks} == {task_pb2.TASK_STATUS_QUEUED}
    assert not any(t.HasField("input") for t in answer.tasks)
    stored = {
        str(r["id"]): r["input"]["i"]
        for r in sdb.execute(
            "SELECT id, input FROM generation.tasks WHERE tool_id = %s AND input ? 'i'",
            [tool_id],
        ).fetchall()
    }
    assert [stored[t.id] for t in answer.tasks] == list(range(200))
    count = sdb.execute(
        "SELECT count(*) AS n FROM generation.tasks WHERE tool_id = %s", [tool_id]
    ).fetchone()
    assert count == {"n": 201}


def test_genq_cap_sets_the_cap_in_nanos(spend_service: ServiceProcess, stub: Stub) -> None:
    result = genq("cap", "2.50", "--currency", "EUR", "--target", spend_service.address)
    assert result.returncode == 0, result.stderr
    assert "2.5" in result.stdout
    stored = stub.GetSettings(task_pb2.GetSettingsRequest()).settings
    assert (stored.daily_cap_nanos, stored.currency) == (2_500_000_000, "EUR")
    for bad in ("-1", "abc", "0.0000000001"):
        refused = genq("cap", bad, "--target", spend_service.address)
        assert refused.returncode == 2, bad


def test_a_report_with_another_tasks_token_leaves_that_task_alone(stub: Stub, sdb: Db) -> None:
    set_cap(stub, UNIT)
    tool_id = new_tool(stub, cost_estimate_nanos=100)
    queue(stub, tool_id)
    queue(stub, tool_id)
    x, y = claim(stub, tool_id), claim(stub, tool_id)
    with pytest.raises(grpc.RpcError) as caught:
        stub.CompleteTask(
            task_pb2.CompleteTaskRequest(
                task_id=x.task.id,
                lease_token=y.lease_token,
                reported_usage=task_pb2.ReportedUsage(cost_nanos=7),
            )
        )
    assert from_rpc_error(caught.value).reason == Reason.LEASE_LOST
    outcome = sdb.execute(
        "SELECT outcome::text, cost_nanos FROM generation.attempts WHERE lease_token = %s",
        [y.lease_token],
    ).fetchone()
    assert outcome == {"outcome": "running", "cost_nanos": 0}
    assert counters(sdb) == {"spent": 0, "reserved": 200}


def test_watching_a_cancelled_task_ends(stub: Stub, sdb: Db) -> None:
    tool_id = new_tool(stub)
    task = queue(stub, tool_id)
    stub.CancelTask(task_pb2.CancelTaskRequest(task_id=task.id))
    request = task_pb2.WatchTaskEventsRequest(task_id=task.id)
    kinds = [answer.event.kind for answer in stub.WatchTaskEvents(request, timeout=10)]
    assert kinds == [task_pb2.TASK_EVENT_KIND_CANCELLED]


def test_requeue_keeps_an_unsettled_reservation_and_claims_as_fresh(stub: Stub, sdb: Db) -> None:
    set_cap(stub, UNIT)
    tool_id = new_tool(stub)
    first = queue(stub, tool_id, idempotency_key="k", reserved_token_amount=50)
    stub.CancelTask(task_pb2.CancelTaskRequest(task_id=first.id))
    sdb.execute("UPDATE generation.tasks SET reclaimed = true WHERE id = %s", [first.id])
    again = queue(
        stub,
        tool_id,
        idempotency_key="k",
        reserved_token_amount=80,
        on_conflict=task_pb2.ON_CONFLICT_REQUEUE,
    )
    stored = task_row(sdb, again.id)
    assert (stored["status"], stored["reclaimed"]) == ("queued", False)
    assert (stored["reserved_token_amount"], stored["settlement_round"]) == (50, 1)


@pytest.mark.parametrize(
    "fields",
    [
        {"run_after": timestamp_pb2.Timestamp(seconds=10**12)},
        {"ttl": duration_pb2.Duration(seconds=10**15)},
    ],
    ids=["run_after", "ttl"],
)
def test_times_out_of_range_are_invalid(stub: Stub, sdb: Db, fields: dict[str, Any]) -> None:
    tool_id = new_tool(stub)
    with pytest.raises(grpc.RpcError) as caught:
        queue(stub, tool_id, **fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_cost_beyond_reason_is_invalid(stub: Stub, sdb: Db) -> None:
    set_cap(stub, UNIT)
    tool_id = new_tool(stub)
    queue(stub, tool_id)
    claimed = claim(stub, tool_id)
    with pytest.raises(grpc.RpcError) as caught:
        complete(stub, claimed, cost=2**62)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_queue_tasks_with_a_ttl(stub: Stub, sdb: Db) -> None:
    tool_id = new_tool(stub)
    items = [task_pb2.QueueTaskRequest(ttl=duration_pb2.Duration(seconds=3600))]
    created = stub.QueueTasks(task_pb2.QueueTasksRequest(tool_id=tool_id, tasks=items)).tasks
    lifetime = sdb.execute(
        "SELECT expires_at - run_at AS ttl FROM generation.tasks WHERE id = %s", [created[0].id]
    ).fetchone()
    assert lifetime is not None and lifetime["ttl"].total_seconds() == 3600
