"""Fenced leases (GUIDE X1): only the lease holder writes; the reaper fails only stale tasks."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from generation.task.v1 import task_pb2
from service.api.rpcs import STATEMENTS
from tests.integration.test_semantics import Db, Stub, add_row, ago, claim, lapse_lease, queue, row
from workers_sdk.errors import Reason, from_rpc_error

WRONG_TOKEN = "00000000-0000-0000-0000-00000000dead"


def refused(call: Any, request: Any) -> Any:
    with pytest.raises(grpc.RpcError) as caught:
        call(request)
    return from_rpc_error(caught.value)


def writes(task_id: str, token: str) -> list[tuple[str, Any]]:
    """Every worker write a lease holder can make, with the given token."""
    return [
        ("HeartbeatTask", task_pb2.HeartbeatTaskRequest(task_id=task_id, lease_token=token)),
        (
            "PublishTaskEvent",
            task_pb2.PublishTaskEventRequest(
                task_id=task_id, lease_token=token, kind=task_pb2.TASK_EVENT_KIND_PROGRESS
            ),
        ),
        ("ReleaseTask", task_pb2.ReleaseTaskRequest(task_id=task_id, lease_token=token)),
        (
            "CompleteTask",
            task_pb2.CompleteTaskRequest(task_id=task_id, lease_token=token, output={"x": 1}),
        ),
        (
            "FailTask",
            task_pb2.FailTaskRequest(task_id=task_id, lease_token=token, increment_retry=True),
        ),
        (
            "FailTask",
            task_pb2.FailTaskRequest(task_id=task_id, lease_token=token, increment_retry=False),
        ),
    ]


def assert_lease_lost(
    stub: Stub, db: Db, task_id: str, token: str, but: tuple[str, ...] = ()
) -> None:
    before = row(db, task_id)
    for method, request in writes(task_id, token):
        if method in but:
            continue
        error = refused(getattr(stub, method), request)
        assert error.code == grpc.StatusCode.ABORTED, method
        assert error.reason == Reason.LEASE_LOST, method
        assert row(db, task_id) == before, f"{method} changed the row"


def test_heartbeat_extends_the_lease(stub: Stub, db: Db, tool_id: str) -> None:
    task = queue(stub, tool_id)
    claimed = claim(stub, tool_id)
    db.execute(
        "UPDATE generation.tasks SET claim_expires_at = now() + interval '5 s' WHERE id = %s",
        [task.id],
    )
    stub.HeartbeatTask(
        task_pb2.HeartbeatTaskRequest(task_id=task.id, lease_token=claimed.lease_token)
    )
    left = db.execute(
        "SELECT claim_expires_at - now() AS left FROM generation.tasks WHERE id = %s", [task.id]
    ).fetchone()
    assert left is not None and left["left"].total_seconds() > 100


def test_wrong_token_changes_nothing(stub: Stub, db: Db, tool_id: str) -> None:
    task = queue(stub, tool_id)
    claim(stub, tool_id)
    assert_lease_lost(stub, db, task.id, WRONG_TOKEN)


def test_lapsed_lease_changes_nothing_even_before_the_rescue(
    stub: Stub, db: Db, tool_id: str
) -> None:
    """Only the lease's time decides: the writes run in the transaction that lapsed the lease,
    which the rescuer cannot see, so it cannot hand the task back first."""
    task = queue(stub, tool_id)
    claimed = claim(stub, tool_id)
    params = {"task_id": task.id, "lease_token": claimed.lease_token, "cost_nanos": 0}
    with db.transaction(force_rollback=True):
        db.execute(
            "UPDATE generation.tasks SET claim_expires_at = now() - interval '1 ms' WHERE id = %s",
            [task.id],
        )
        before = row(db, task.id)
        extras: dict[str, dict[str, Any]] = {
            "HeartbeatTask": {"lease_seconds": 120},
            "CompleteTask": {"output": None, "reported_usage": None, "resource_key": None},
            "FailTask": {"failure": "retryable", "error": None, "resource_key": None},
            "ReleaseTask": {},
            "PublishTaskEvent": {"kind": "progress", "data": None},
        }
        for method, extra in extras.items():
            answer = db.execute(STATEMENTS[method], {**params, **extra}).fetchone()
            assert answer is not None and answer["task_found"], method
            changed = "claim_expires_at" if method == "HeartbeatTask" else "id"
            assert answer[changed] is None, f"{method} took a lapsed lease"
            assert row(db, task.id) == before, f"{method} changed the row"


def test_old_holder_loses_to_the_reclaimer(stub: Stub, db: Db, tool_id: str) -> None:
    task = queue(stub, tool_id)
    old = claim(stub, tool_id)
    lapse_lease(db, task.id)
    new = claim(stub, tool_id)
    assert new.task.id == task.id

    assert_lease_lost(stub, db, task.id, old.lease_token)

    done = stub.CompleteTask(
        task_pb2.CompleteTaskRequest(task_id=task.id, lease_token=new.lease_token, output={"w": 2})
    ).task
    assert done.status == task_pb2.TASK_STATUS_COMPLETED
    assert dict(done.output) == {"w": 2}


def test_writes_after_terminal_change_nothing(stub: Stub, db: Db, tool_id: str) -> None:
    task = queue(stub, tool_id)
    claimed = claim(stub, tool_id)
    stub.CompleteTask(
        task_pb2.CompleteTaskRequest(task_id=task.id, lease_token=claimed.lease_token)
    )
    # Its own CompleteTask again is a retry and answers the same (see the test below).
    assert_lease_lost(stub, db, task.id, claimed.lease_token, but=("CompleteTask",))


def test_writes_after_requeue_change_nothing(stub: Stub, db: Db, tool_id: str) -> None:
    task = queue(stub, tool_id)
    claimed = claim(stub, tool_id)
    request = task_pb2.FailTaskRequest(
        task_id=task.id, lease_token=claimed.lease_token, increment_retry=True
    )
    requeued = stub.FailTask(request).task
    # Its own FailTask again is a retry after a lost answer: the task as it is, nothing changed.
    before = row(db, task.id)
    assert stub.FailTask(request).task == requeued
    assert row(db, task.id) == before
    assert_lease_lost(stub, db, task.id, claimed.lease_token, but=("FailTask",))


def forced_fail(stub: Stub, task_id: str) -> task_pb2.Task:
    request = task_pb2.FailTaskRequest(task_id=task_id, increment_retry=False, error="stale")
    return stub.FailTask(request).task


def test_forced_fail_refuses_a_live_task(stub: Stub, db: Db, tool_id: str) -> None:
    queued = queue(stub, tool_id)
    running = queue(stub, tool_id)
    claim(stub, tool_id)  # takes `queued` (FIFO)
    for task_id in (queued.id, running.id):
        before = row(db, task_id)
        error = refused(
            stub.FailTask, task_pb2.FailTaskRequest(task_id=task_id, increment_retry=False)
        )
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION
        assert error.reason == Reason.TASK_NOT_STALE
        assert row(db, task_id) == before


def test_forced_fail_refuses_an_exhausted_task_whose_lease_still_runs(
    stub: Stub, db: Db, tool_id: str
) -> None:
    task = queue(stub, tool_id, max_retries=1)
    claim(stub, tool_id)
    db.execute("UPDATE generation.tasks SET retry_count = 1 WHERE id = %s", [task.id])
    error = refused(stub.FailTask, task_pb2.FailTaskRequest(task_id=task.id, increment_retry=False))
    assert error.reason == Reason.TASK_NOT_STALE
    assert row(db, task.id)["status"] == "processing"


def test_forced_fail_takes_each_stale_population(stub: Stub, db: Db, tool_id: str) -> None:
    """(A dead zombie needs the rescuer stopped: tests/integration/test_watchdog.py.)"""
    unclaimable = queue(stub, tool_id, max_retries=0).id
    abandoned = add_row(
        db,
        tool_id,
        status="dispatched",
        created_at=ago(db, 3600),
        queued_at=ago(db, 3600),
        run_at=ago(db, 3600),
    )
    for task_id in (unclaimable, abandoned):
        failed = forced_fail(stub, task_id)
        assert failed.status == task_pb2.TASK_STATUS_FAILED
        assert failed.error == "stale"
        assert row(db, task_id)["lease_token"] is None


def test_a_retried_complete_of_the_same_lease_answers_the_same(
    stub: Stub, db: Db, tool_id: str
) -> None:
    """Fault 5: the answer to a committed CompleteTask is lost and the worker retries it: the
    retry succeeds with the same task and nothing changes or counts twice."""
    task = queue(stub, tool_id)
    claimed = claim(stub, tool_id)
    request = task_pb2.CompleteTaskRequest(
        task_id=task.id,
        lease_token=claimed.lease_token,
        output={"url": "x"},
        reported_usage=task_pb2.ReportedUsage(cost_nanos=7),
    )
    first = stub.CompleteTask(request).task
    before = row(db, task.id)
    again = stub.CompleteTask(request).task
    assert again == first
    assert row(db, task.id) == before
    ledger = db.execute(
        "SELECT outcome::text, cost_nanos FROM generation.attempts WHERE task_id = %s", [task.id]
    ).fetchall()
    assert ledger == [{"outcome": "completed", "cost_nanos": 7}]
