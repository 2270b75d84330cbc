"""The spec's queue semantics (GUIDE A3-A7), against the running service and a real Postgres.

Time moves by writing timestamps in SQL, never by sleeping through a lease.
"""

from __future__ import annotations

import uuid
from typing import Any

import grpc
import psycopg
import pytest
from google.protobuf import duration_pb2, timestamp_pb2

from generation.task.v1 import task_pb2, task_pb2_grpc
from service.api.rpcs import STATEMENTS
from tests.conftest import forget_waits, wait_for
from workers_sdk.errors import Reason, from_rpc_error

Stub = task_pb2_grpc.GenerationDataServiceStub
Db = psycopg.Connection[dict[str, Any]]


def queue(stub: Stub, tool_id: str, **fields: Any) -> task_pb2.Task:
    return stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id, **fields)).task


def claim(stub: Stub, tool_id: str) -> task_pb2.ClaimNextTaskResponse:
    return stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id))


def confirm(stub: Stub, claimed: task_pb2.ClaimNextTaskResponse) -> None:
    """The worker's first heartbeat: the claim's answer arrived, so the run counts."""
    stub.HeartbeatTask(
        task_pb2.HeartbeatTaskRequest(task_id=claimed.task.id, lease_token=claimed.lease_token)
    )


def row(db: Db, task_id: str) -> dict[str, Any]:
    found = db.execute("SELECT * FROM generation.tasks WHERE id = %s", [task_id]).fetchone()
    assert found is not None
    return found


def lapse_lease(db: Db, task_id: str) -> None:
    """Moves the task's lease into the past, then waits for the service's rescuer to requeue it."""
    db.execute(
        "UPDATE generation.tasks SET claim_expires_at = now() - interval '1 second' WHERE id = %s",
        [task_id],
    )
    wait_for(lambda: row(db, task_id)["reclaimed"], what="the rescuer to requeue the task")


def test_queue_task_stores_every_field(stub: Stub, db: Db, tool_id: str) -> None:
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    task = queue(
        stub,
        tool_id,
        priority=7,
        max_retries=5,
        reserved_token_amount=1_500,
        billing_idempotency_key="bill-1",
        w3c_traceparent=traceparent,
        input={"prompt": "a cat", "n": 2},
    )
    stored = row(db, task.id)
    assert stored["status"] == "queued"
    assert (stored["priority"], stored["max_retries"], stored["retry_count"]) == (7, 5, 0)
    assert stored["reserved_token_amount"] == 1_500
    assert stored["billing_idempotency_key"] == "bill-1"
    assert stored["w3c_traceparent"] == traceparent
    assert stored["input"] == {"prompt": "a cat", "n": 2}
    assert task.status == task_pb2.TASK_STATUS_QUEUED


def test_expires_at_and_source_are_kept_by_both_enqueues(stub: Stub, db: Db, tool_id: str) -> None:
    """B19: an absolute expiry beside ttl, and who enqueued, through QueueTask and QueueTasks."""
    expiry = timestamp_pb2.Timestamp(seconds=4_102_444_800)  # 2100-01-01
    one = queue(stub, tool_id, expires_at=expiry, source="nightly-backfill")
    many = stub.QueueTasks(
        task_pb2.QueueTasksRequest(
            tool_id=tool_id,
            tasks=[task_pb2.QueueTaskRequest(expires_at=expiry, source="api-gateway")],
        )
    ).tasks
    assert (one.source, one.expires_at) == ("nightly-backfill", expiry)
    # QueueTasks answers what the service set, the expiry among it; the source is the item's own.
    assert (many[0].source, many[0].expires_at) == ("", expiry)
    for task, source in ((one, "nightly-backfill"), (many[0], "api-gateway")):
        stored = row(db, task.id)
        assert (stored["source"], int(stored["expires_at"].timestamp())) == (source, expiry.seconds)
        assert stub.GetTask(task_pb2.GetTaskRequest(task_id=task.id)).task.source == source


@pytest.mark.parametrize(
    "fields",
    [
        {
            "expires_at": timestamp_pb2.Timestamp(seconds=4_102_444_800),
            "ttl": duration_pb2.Duration(seconds=60),
        },
        {
            "expires_at": timestamp_pb2.Timestamp(seconds=4_102_444_800),
            "run_after": timestamp_pb2.Timestamp(seconds=4_102_444_800),
        },
        {"source": "x" * 201},
    ],
    ids=["expiry-and-ttl", "expiry-not-after-run-after", "source-too-long"],
)
def test_enqueue_options_out_of_bounds_are_invalid(
    stub: Stub, db: Db, tool_id: str, fields: dict[str, Any]
) -> None:
    before = db.execute("SELECT count(*) AS n FROM generation.tasks").fetchone()
    with pytest.raises(grpc.RpcError) as caught:
        queue(stub, tool_id, **fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert db.execute("SELECT count(*) AS n FROM generation.tasks").fetchone() == before


def test_queue_task_defaults(stub: Stub, tool_id: str) -> None:
    task = queue(stub, tool_id)
    assert (task.priority, task.max_retries, task.retry_count) == (0, 3, 0)


def test_claim_takes_zombies_first_then_priority_then_fifo(
    stub: Stub, db: Db, tool_id: str
) -> None:
    zombie = queue(stub, tool_id, priority=-50)
    assert claim(stub, tool_id).task.id == zombie.id
    low = queue(stub, tool_id, priority=-1)
    first_high = queue(stub, tool_id, priority=5)
    second_high = queue(stub, tool_id, priority=5)
    normal = queue(stub, tool_id)
    lapse_lease(db, zombie.id)

    order = [claim(stub, tool_id).task.id for _ in range(5)]

    assert order == [zombie.id, first_high.id, second_high.id, normal.id, low.id]
    assert not claim(stub, tool_id).HasField("task")


def test_claim_stamps_a_lease_on_the_database_clock(stub: Stub, db: Db, tool_id: str) -> None:
    task = queue(stub, tool_id)
    claimed = claim(stub, tool_id)
    stored = row(db, task.id)
    assert stored["status"] == "processing"
    assert str(stored["lease_token"]) == claimed.lease_token
    lease = db.execute(
        "SELECT claim_expires_at - started_at AS lease FROM generation.tasks WHERE id = %s",
        [task.id],
    ).fetchone()
    assert lease is not None and lease["lease"].total_seconds() == 120


def test_a_lapsed_confirmed_run_costs_one_retry_and_the_reclaim_none(
    stub: Stub, db: Db, tool_id: str
) -> None:
    task = queue(stub, tool_id)
    first = claim(stub, tool_id)
    confirm(stub, first)
    assert first.task.retry_count == 0
    started_at = row(db, task.id)["started_at"]
    lapse_lease(db, task.id)
    assert row(db, task.id)["retry_count"] == 1, "the run that lapsed is the one charged"

    second = claim(stub, tool_id)

    assert second.task.id == task.id
    assert second.task.retry_count == 1, "claiming again costs nothing"
    assert second.lease_token != first.lease_token
    assert row(db, task.id)["started_at"] == started_at
    assert not row(db, task.id)["reclaimed"]


def test_a_lapsed_unconfirmed_claim_costs_nothing(stub: Stub, db: Db, tool_id: str) -> None:
    """The claim's answer never reached a worker: nothing ran, so no retry is used."""
    task = queue(stub, tool_id, max_retries=1)
    claim(stub, tool_id)
    lapse_lease(db, task.id)
    stored = row(db, task.id)
    assert (stored["status"], stored["retry_count"], stored["unconfirmed_claims"]) == (
        "queued",
        0,
        1,
    )
    outcome = db.execute(
        "SELECT outcome::text FROM generation.attempts WHERE task_id = %s", [task.id]
    ).fetchone()
    assert outcome == {"outcome": "unconfirmed"}
    assert claim(stub, tool_id).task.id == task.id, "its one retry is still there"


def test_fresh_claim_and_requeue_do_not_count_as_reclaim(stub: Stub, tool_id: str) -> None:
    queue(stub, tool_id, max_retries=3)
    claimed = claim(stub, tool_id)
    stub.FailTask(
        task_pb2.FailTaskRequest(
            task_id=claimed.task.id, lease_token=claimed.lease_token, increment_retry=True
        )
    )
    again = claim(stub, tool_id)
    assert again.task.retry_count == 1, "one for the failure, none for the claim"


def test_max_retries_zero_is_never_claimed_and_is_stale(stub: Stub, tool_id: str) -> None:
    task = queue(stub, tool_id, max_retries=0)
    assert not claim(stub, tool_id).HasField("task")
    stale = stub.ListStaleTasks(task_pb2.ListStaleTasksRequest(limit=10_000)).tasks
    reasons = {s.task.id: s.reason for s in stale}
    assert reasons[task.id] == task_pb2.STALE_REASON_UNCLAIMABLE


def test_a_lapse_on_the_last_retry_fails_the_task_at_once(stub: Stub, db: Db, tool_id: str) -> None:
    """Nobody waits for the reaper: the rescue that charges the last retry ends the task."""
    task = queue(stub, tool_id, max_retries=1)
    confirm(stub, claim(stub, tool_id))
    db.execute(
        "UPDATE generation.tasks SET claim_expires_at = now() - interval '1 s' WHERE id = %s",
        [task.id],
    )
    wait_for(lambda: row(db, task.id)["status"] == "failed", what="the rescuer to end the task")
    stored = row(db, task.id)
    assert stored["retry_count"] == 1 and stored["error"] == "lease lapsed on its last run"
    assert not claim(stub, tool_id).HasField("task")


def test_fail_requeues_while_retries_remain_then_fails(stub: Stub, db: Db, tool_id: str) -> None:
    task = queue(stub, tool_id, max_retries=2)

    first = claim(stub, tool_id)
    requeued = stub.FailTask(
        task_pb2.FailTaskRequest(
            task_id=task.id, lease_token=first.lease_token, increment_retry=True, error="E1"
        )
    ).task
    assert requeued.status == task_pb2.TASK_STATUS_QUEUED
    assert requeued.retry_count == 1
    assert not requeued.HasField("completed_at")
    assert row(db, task.id)["lease_token"] is None

    second = claim(stub, tool_id)
    failed = stub.FailTask(
        task_pb2.FailTaskRequest(
            task_id=task.id, lease_token=second.lease_token, increment_retry=True, error="E2"
        )
    ).task
    assert failed.status == task_pb2.TASK_STATUS_FAILED
    assert failed.retry_count == 2
    assert failed.error == "E2"
    assert failed.HasField("completed_at")
    assert not claim(stub, tool_id).HasField("task")


def test_fail_without_increment_is_terminal(stub: Stub, tool_id: str) -> None:
    task = queue(stub, tool_id, max_retries=5)
    claimed = claim(stub, tool_id)
    failed = stub.FailTask(
        task_pb2.FailTaskRequest(
            task_id=task.id, lease_token=claimed.lease_token, increment_retry=False, error="bad"
        )
    ).task
    assert failed.status == task_pb2.TASK_STATUS_FAILED
    assert failed.retry_count == 0


def test_complete_stores_output_and_usage(stub: Stub, db: Db, tool_id: str) -> None:
    task = queue(stub, tool_id, reserved_token_amount=100)
    claimed = claim(stub, tool_id)
    done = stub.CompleteTask(
        task_pb2.CompleteTaskRequest(
            task_id=task.id,
            lease_token=claimed.lease_token,
            output={"url": "https://example.invalid/1.png"},
            reported_usage=task_pb2.ReportedUsage(
                token_amount=80, cost_nanos=12_345_678_901, details={"model": "m1"}
            ),
        )
    ).task
    assert done.status == task_pb2.TASK_STATUS_COMPLETED
    stored = row(db, task.id)
    assert stored["output"] == {"url": "https://example.invalid/1.png"}
    assert stored["reported_usage"] == {
        "token_amount": 80,
        "cost_nanos": 12_345_678_901,
        "details": {"model": "m1"},
    }
    assert stored["lease_token"] is None and stored["claim_expires_at"] is None
    assert done.reported_usage.cost_nanos == 12_345_678_901


def test_get_task(stub: Stub, tool_id: str) -> None:
    task = queue(stub, tool_id, input={"prompt": "x"})
    got = stub.GetTask(task_pb2.GetTaskRequest(task_id=task.id)).task
    assert got == task


# --- ListStaleTasks: the three populations, exactly at their boundaries -------------------------


def stale_reasons(stub: Stub, tool_id: str) -> dict[str, int]:
    response = stub.ListStaleTasks(task_pb2.ListStaleTasksRequest(limit=10_000))
    return {s.task.id: s.reason for s in response.tasks if s.task.tool_id == tool_id}


def add_row(db: Db, tool_id: str, **columns: Any) -> str:
    """Writes a task row directly, e.g. in `dispatched`, which no RPC sets."""
    names = ["tool_id", *columns]
    values = [tool_id, *columns.values()]
    created = db.execute(
        f"INSERT INTO generation.tasks ({', '.join(names)}) "
        f"VALUES ({', '.join(['%s'] * len(values))}) RETURNING id",
        values,
    ).fetchone()
    assert created is not None
    return str(created["id"])


@pytest.mark.parametrize("status", ["queued", "dispatched"])
def test_stale_abandoned_boundary(stub: Stub, db: Db, tool_id: str, status: str) -> None:
    """Abandoned counts from when the task entered the queue, also after it ran before."""
    forget_waits(db, tool_id)

    def waiting(since: int, **columns: Any) -> str:
        return add_row(
            db, tool_id, status=status, run_at=ago(db, 5000), queued_at=ago(db, since), **columns
        )

    old = waiting(901, created_at=ago(db, 901))
    young = waiting(890, created_at=ago(db, 890))
    ran_and_requeued = waiting(1000, created_at=ago(db, 5000), started_at=ago(db, 4000))
    requeued_lately = waiting(100, created_at=ago(db, 5000), started_at=ago(db, 4000))
    reasons = stale_reasons(stub, tool_id)
    assert reasons == {
        old: task_pb2.STALE_REASON_ABANDONED,
        ran_and_requeued: task_pb2.STALE_REASON_ABANDONED,
    }
    assert young not in reasons and requeued_lately not in reasons


@pytest.mark.parametrize("status", ["queued", "dispatched"])
def test_stale_unclaimable_boundary(stub: Stub, db: Db, tool_id: str, status: str) -> None:
    exhausted = add_row(db, tool_id, status=status, retry_count=3, max_retries=3)
    last_try_left = add_row(db, tool_id, status=status, retry_count=2, max_retries=3)
    reasons = stale_reasons(stub, tool_id)
    assert reasons == {exhausted: task_pb2.STALE_REASON_UNCLAIMABLE}
    assert last_try_left not in reasons


def test_stale_dead_zombie_boundary(stub: Stub, db: Db, tool_id: str) -> None:
    """A lapsed lease the rescuer never handed back (it is not running), past the grace."""

    def zombie(lapsed_seconds_ago: int) -> str:
        return add_row(
            db,
            tool_id,
            status="processing",
            max_retries=2,
            lease_token=str(uuid.uuid4()),
            started_at=ago(db, 3600),
            claim_expires_at=ago(db, lapsed_seconds_ago),
        )

    with db.transaction():
        # Written and listed in one transaction the rescuer cannot see into: it would hand them
        # back at once otherwise.
        dead = zombie(121)
        in_grace = zombie(110)
        reasons = {
            str(r["id"]): r["stale_reason"]
            for r in db.execute(STATEMENTS["ListStaleTasks"], {"limit": 10_000})
            if str(r["tool_id"]) == tool_id
        }
        db.execute("DELETE FROM generation.tasks WHERE id IN (%s, %s)", [dead, in_grace])
    assert reasons == {dead: "dead_zombie"}, "in grace at 110 s, dead at 121 s"


def test_stale_never_lists_live_or_finished_work(stub: Stub, db: Db, tool_id: str) -> None:
    queue(stub, tool_id)
    queue(stub, tool_id)
    claim(stub, tool_id)
    for status in ("completed", "failed"):
        add_row(db, tool_id, status=status, created_at=ago(db, 10_000), max_retries=0)
    assert stale_reasons(stub, tool_id) == {}


def ago(db: Db, seconds: int) -> Any:
    found = db.execute("SELECT now() - make_interval(secs => %s) AS t", [seconds]).fetchone()
    assert found is not None
    return found["t"]


def test_unknown_task_is_not_found(stub: Stub) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.GetTask(task_pb2.GetTaskRequest(task_id="00000000-0000-0000-0000-0000000000ff"))
    error = from_rpc_error(caught.value)
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert error.reason == Reason.TASK_NOT_FOUND


def test_complete_after_a_failed_attempt_clears_the_error(stub: Stub, tool_id: str) -> None:
    task = queue(stub, tool_id)
    first = claim(stub, tool_id)
    stub.FailTask(
        task_pb2.FailTaskRequest(
            task_id=task.id, lease_token=first.lease_token, increment_retry=True, error="503"
        )
    )
    second = claim(stub, tool_id)
    done = stub.CompleteTask(
        task_pb2.CompleteTaskRequest(task_id=task.id, lease_token=second.lease_token)
    ).task
    assert done.error == ""


def test_list_tasks_pages_through_a_batch_sharing_one_instant(stub: Stub, tool_id: str) -> None:
    items = [task_pb2.QueueTaskRequest(input={"i": i}) for i in range(5)]
    stub.QueueTasks(task_pb2.QueueTasksRequest(tool_id=tool_id, tasks=items))
    seen: list[str] = []
    request = task_pb2.ListTasksRequest(tool_id=tool_id, limit=2)
    while page := stub.ListTasks(request).tasks:
        seen += [task.id for task in page]
        request.before.CopyFrom(page[-1].created_at)
        request.before_id = page[-1].id
    assert len(seen) == len(set(seen)) == 5
