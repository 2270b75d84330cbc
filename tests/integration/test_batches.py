"""Batch RPCs (GUIDE X3): ClaimTasks, HeartbeatTasks, CompleteTasks, FailTasks — one statement
each, every item fenced by its own lease, a result per item in request order."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import psycopg
import pytest
from google.protobuf import duration_pb2, json_format, timestamp_pb2

from generation.task.v1 import task_pb2
from tests.conftest import ServiceProcess, wait_for
from tests.integration.test_semantics import Db, Stub, queue, row
from tests.invariants import assert_invariants
from workers_sdk.errors import Reason, from_rpc_error


def claim_many(
    stub: Stub, tool_id: str, limit: int, **fields: object
) -> task_pb2.ClaimTasksResponse:
    return stub.ClaimTasks(task_pb2.ClaimTasksRequest(tool_id=tool_id, limit=limit, **fields))


def refused(call: object, request: object) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call(request)  # type: ignore[operator]
    error = from_rpc_error(caught.value)
    return error.code, str(error.reason), str(error)


def test_claim_tasks_takes_up_to_limit_in_claim_order(stub: Stub, db: Db, tool_id: str) -> None:
    low = queue(stub, tool_id, priority=-1)
    fifo = [queue(stub, tool_id) for _ in range(4)]
    high = queue(stub, tool_id, priority=9)

    first = claim_many(stub, tool_id, 4)
    assert [c.task.id for c in first.tasks] == [high.id, *[t.id for t in fifo[:3]]]
    assert len({c.lease_token for c in first.tasks}) == 1, "one token per claim"
    assert first.lease.seconds == 120 and first.idle_reason == task_pb2.IDLE_REASON_UNSPECIFIED
    for claimed in first.tasks:
        stored = row(db, claimed.task.id)
        assert (stored["status"], str(stored["lease_token"])) == ("processing", claimed.lease_token)

    rest = claim_many(stub, tool_id, 100)
    assert [c.task.id for c in rest.tasks] == [fifo[3].id, low.id]
    assert {c.lease_token for c in rest.tasks} != {c.lease_token for c in first.tasks}
    empty = claim_many(stub, tool_id, 100)
    assert not empty.tasks and empty.idle_reason == task_pb2.IDLE_REASON_EMPTY
    attempts = db.execute(
        "SELECT count(*) AS n FROM generation.attempts WHERE tool_id = %s", [tool_id]
    ).fetchone()
    assert attempts == {"n": 6}


def test_claim_tasks_admits_spend_task_by_task_and_stops_at_the_cap(
    stub: Stub, db: Db, tool_id: str
) -> None:
    stub.ConfigureTool(
        task_pb2.ConfigureToolRequest(tool_id=tool_id, cost_estimate_nanos=10, daily_cap_nanos=25)
    )
    tasks = [queue(stub, tool_id) for _ in range(5)]
    claimed = claim_many(stub, tool_id, 5)
    assert [c.task.id for c in claimed.tasks] == [t.id for t in tasks[:2]], "20 fits, 30 not"
    tool = stub.GetTool(task_pb2.GetToolRequest(tool_id=tool_id)).tool
    assert tool.reserved_nanos == 20
    capped = claim_many(stub, tool_id, 5)
    assert not capped.tasks and capped.idle_reason == task_pb2.IDLE_REASON_CAPPED
    assert_invariants(db, tool_id, [t.id for t in tasks])


def test_claim_tasks_waits_like_a_claim(service: ServiceProcess, stub: Stub, tool_id: str) -> None:
    with ThreadPoolExecutor(1) as pool:
        parked = pool.submit(claim_many, stub, tool_id, 10, wait=duration_pb2.Duration(seconds=10))
        task = queue(stub, tool_id)
        answer = parked.result(timeout=10)
    assert [c.task.id for c in answer.tasks] == [task.id]


def test_batch_reports_answer_each_item_in_request_order(stub: Stub, db: Db, tool_id: str) -> None:
    for _ in range(3):
        queue(stub, tool_id, max_retries=2)
    a, b, c = claim_many(stub, tool_id, 3).tasks
    unknown = str(uuid.uuid4())
    beats = stub.HeartbeatTasks(
        task_pb2.HeartbeatTasksRequest(
            tasks=[
                task_pb2.HeartbeatTaskRequest(task_id=c.task.id, lease_token=c.lease_token),
                task_pb2.HeartbeatTaskRequest(task_id=a.task.id, lease_token=unknown),
                task_pb2.HeartbeatTaskRequest(task_id=unknown, lease_token=a.lease_token),
            ]
        )
    ).results
    assert [(r.task_id, r.refused) for r in beats] == [
        (c.task.id, ""),
        (a.task.id, "LEASE_LOST"),
        (unknown, "TASK_NOT_FOUND"),
    ]
    assert beats[0].heartbeat.lease.seconds == 120 and not beats[0].heartbeat.cancel_requested

    completes = task_pb2.CompleteTasksRequest(
        tasks=[
            task_pb2.CompleteTaskRequest(
                task_id=b.task.id,
                lease_token=b.lease_token,
                output={"n": 2},
                reported_usage=task_pb2.ReportedUsage(cost_nanos=4),
            ),
            task_pb2.CompleteTaskRequest(task_id=a.task.id, lease_token=unknown),
            task_pb2.CompleteTaskRequest(
                task_id=a.task.id, lease_token=a.lease_token, output={"n": 1}
            ),
        ]
    )
    done = stub.CompleteTasks(completes).results
    assert [(r.task_id, r.refused, r.task.status) for r in done] == [
        (b.task.id, "", task_pb2.TASK_STATUS_COMPLETED),
        (a.task.id, "LEASE_LOST", task_pb2.TASK_STATUS_UNSPECIFIED),
        (a.task.id, "", task_pb2.TASK_STATUS_COMPLETED),
    ]
    # The task in brief: its state after the report, not its input nor the output just sent.
    assert not done[0].task.HasField("input") and not done[0].task.HasField("output")
    assert done[0].task.tool_id == tool_id and done[0].task.HasField("completed_at")
    stored = stub.GetTask(task_pb2.GetTaskRequest(task_id=b.task.id)).task
    assert dict(stored.output) == {"n": 2}
    again = stub.CompleteTasks(completes).results
    assert [r.task for r in again] == [r.task for r in done], "a retried batch answers the same"

    failed = stub.FailTasks(
        task_pb2.FailTasksRequest(
            tasks=[
                task_pb2.FailTaskRequest(
                    task_id=c.task.id,
                    lease_token=c.lease_token,
                    error="rate limited",
                    increment_retry=True,
                )
            ]
        )
    ).results
    assert failed[0].task.status == task_pb2.TASK_STATUS_QUEUED
    assert failed[0].task.retry_count == 1
    # In brief, as stored: the error, and when the backoff lets it run again.
    requeued = stub.GetTask(task_pb2.GetTaskRequest(task_id=c.task.id)).task
    assert (failed[0].task.error, failed[0].task.run_at) == (requeued.error, requeued.run_at)
    assert requeued.error and requeued.run_at.ToDatetime() > c.task.run_at.ToDatetime()
    ledger = db.execute(
        "SELECT outcome::text, count(*) AS n, sum(cost_nanos)::bigint AS cost "
        "FROM generation.attempts WHERE tool_id = %s GROUP BY 1 ORDER BY 1",
        [tool_id],
    ).fetchall()
    assert ledger == [
        {"outcome": "completed", "n": 2, "cost": 4},
        {"outcome": "retry", "n": 1, "cost": 0},
    ]
    assert_invariants(db, tool_id)


def test_batch_limits_and_item_errors_name_the_item(stub: Stub, tool_id: str) -> None:
    code, reason, _ = refused(
        stub.ClaimTasks, task_pb2.ClaimTasksRequest(tool_id=tool_id, limit=101)
    )
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    code, _, message = refused(stub.CompleteTasks, task_pb2.CompleteTasksRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "1 to 1000" in message
    many = [task_pb2.HeartbeatTaskRequest(task_id=str(uuid.uuid4()), lease_token=str(uuid.uuid4()))]
    code, _, _ = refused(stub.HeartbeatTasks, task_pb2.HeartbeatTasksRequest(tasks=many * 1001))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    task = queue(stub, tool_id)
    code, _, message = refused(
        stub.FailTasks,
        task_pb2.FailTasksRequest(
            tasks=[
                task_pb2.FailTaskRequest(task_id=task.id, lease_token=str(uuid.uuid4())),
                task_pb2.FailTaskRequest(task_id=task.id),
            ]
        ),
    )
    assert (
        code == grpc.StatusCode.INVALID_ARGUMENT
        and "tasks[1]" in message
        and "lease_token" in message
    )


def test_batches_in_opposite_orders_never_deadlock(
    service: ServiceProcess, stub: Stub, db: Db, tool_id: str
) -> None:
    for _ in range(20):
        for _ in range(2):
            queue(stub, tool_id)
        a, b = claim_many(stub, tool_id, 2).tasks
        assert complete_at_once(stub, (a, b), (b, a)) == [["", ""], ["", ""]]
    assert_invariants(db, tool_id)


def complete_at_once(
    stub: Stub, *batches: tuple[task_pb2.ClaimedTask, ...], cost: int = 0
) -> list[list[str]]:
    """Sends each batch as one CompleteTasks, all let go at once; each item's refusal."""
    start = threading.Barrier(len(batches))

    def report(pair: tuple[task_pb2.ClaimedTask, ...]) -> list[str]:
        start.wait()
        answer = stub.CompleteTasks(
            task_pb2.CompleteTasksRequest(
                tasks=[
                    task_pb2.CompleteTaskRequest(
                        task_id=c.task.id,
                        lease_token=c.lease_token,
                        reported_usage=task_pb2.ReportedUsage(cost_nanos=cost),
                    )
                    for c in pair
                ]
            ),
            timeout=10,
        )
        return [r.refused for r in answer.results]

    with ThreadPoolExecutor(len(batches)) as pool:
        return [f.result() for f in [pool.submit(report, batch) for batch in batches]]


def test_batches_over_two_paid_tools_in_opposite_orders_never_deadlock(
    stub: Stub, db: Db, tool_id: str
) -> None:
    """Money moves on each item's tool row: a batch locks its tools in id order before its
    items run, so two batches whose task order puts the tools the other way round do not wait
    on each other in a cycle."""
    other = stub.UpsertTool(task_pb2.UpsertToolRequest(name=f"other-{tool_id}")).tool.id
    for tool in (tool_id, other):
        stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool, cost_estimate_nanos=1))
    crossed = 0
    while crossed < 10:
        for tool in (tool_id, other):
            for _ in range(2):
                queue(stub, tool)
        mine = sorted(claim_many(stub, tool_id, 2).tasks, key=lambda c: c.task.id)
        theirs = sorted(claim_many(stub, other, 2).tasks, key=lambda c: c.task.id)
        # One batch whose first task is this tool's, one whose first is the other's.
        first = (mine[0], theirs[1]) if mine[0].task.id < theirs[1].task.id else None
        second = (theirs[0], mine[1]) if theirs[0].task.id < mine[1].task.id else None
        if first is None or second is None:
            for claimed in (*mine, *theirs):
                stub.CompleteTask(
                    task_pb2.CompleteTaskRequest(
                        task_id=claimed.task.id, lease_token=claimed.lease_token
                    )
                )
            continue
        crossed += 1
        assert complete_at_once(stub, first, second, cost=1) == [["", ""], ["", ""]]
    for tool in (tool_id, other):
        assert_invariants(db, tool)


def test_a_batch_ends_its_held_runs_as_single_completes_would(
    stub: Stub, db: Db, tool_id: str
) -> None:
    """CompleteTasks ends every held run in one statement (complete_tasks_v1): each ends as
    CompleteTask would end it — `cancelled` when a cancel was asked for, its attempt closed with
    its cost, the tool's reservation released and its spend added (a cost above the estimate
    grows the share), the key's run of failures reset, one terminal event each — and an item
    repeated in the batch is answered as a repeated CompleteTask is."""
    stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, cost_estimate_nanos=10))
    key = stub.GetTool(task_pb2.GetToolRequest(tool_id=tool_id)).tool.name
    db.execute(
        "INSERT INTO generation.cooldowns (resource_key, consecutive_failures) VALUES (%s, 1)",
        [key],
    )
    for _ in range(3):
        queue(stub, tool_id)
    a, b, c = claim_many(stub, tool_id, 3).tasks
    stub.CancelTask(task_pb2.CancelTaskRequest(task_id=c.task.id))

    def report(claimed: task_pb2.ClaimedTask, cost: int) -> task_pb2.CompleteTaskRequest:
        return task_pb2.CompleteTaskRequest(
            task_id=claimed.task.id,
            lease_token=claimed.lease_token,
            output={"id": claimed.task.id},
            reported_usage=task_pb2.ReportedUsage(cost_nanos=cost),
        )

    done = stub.CompleteTasks(
        task_pb2.CompleteTasksRequest(
            tasks=[report(a, 4), report(b, 25), report(c, 3), report(a, 4)]
        )
    ).results
    assert [(r.refused, r.task.status) for r in done] == [
        ("", task_pb2.TASK_STATUS_COMPLETED),
        ("", task_pb2.TASK_STATUS_COMPLETED),
        ("", task_pb2.TASK_STATUS_CANCELLED),
        ("", task_pb2.TASK_STATUS_COMPLETED),
    ]
    outputs = [
        stub.GetTask(task_pb2.GetTaskRequest(task_id=task_id)).task
        for task_id in (b.task.id, c.task.id)
    ]
    assert dict(outputs[0].output) == {"id": b.task.id} and not outputs[1].HasField("output")
    ledger = db.execute(
        "SELECT task_id::text, outcome::text, cost_nanos, ended_at IS NOT NULL AS ended "
        "FROM generation.attempts WHERE tool_id = %s ORDER BY cost_nanos",
        [tool_id],
    ).fetchall()
    assert ledger == [
        {"task_id": c.task.id, "outcome": "cancelled", "cost_nanos": 3, "ended": True},
        {"task_id": a.task.id, "outcome": "completed", "cost_nanos": 4, "ended": True},
        {"task_id": b.task.id, "outcome": "completed", "cost_nanos": 25, "ended": True},
    ], "the repeated item added no second cost"
    events = db.execute(
        "SELECT task_id::text, array_agg(kind::text ORDER BY sequence) AS kinds "
        "FROM generation.event_stream WHERE task_id = ANY(%s::uuid[]) GROUP BY 1",
        [[a.task.id, b.task.id, c.task.id]],
    ).fetchall()
    assert {e["task_id"]: e["kinds"] for e in events} == {
        a.task.id: ["started", "completed"],
        b.task.id: ["started", "completed"],
        c.task.id: ["started", "cancel_requested", "cancelled"],
    }
    tool = stub.GetTool(task_pb2.GetToolRequest(tool_id=tool_id)).tool
    assert (tool.spent_today_nanos, tool.reserved_nanos) == (32, 0)
    failures = db.execute(
        "SELECT consecutive_failures FROM generation.cooldowns WHERE resource_key = %s", [key]
    ).fetchone()
    assert failures == {"consecutive_failures": 0}
    assert_invariants(db, tool_id)


def test_a_batch_locks_two_leases_of_one_task_in_attempt_order(
    stub: Stub, db: Db, tool_id: str, database_url: str
) -> None:
    """A batch naming a task's current lease before a stale one locks their attempts in
    (task, attempt) order, as every transition does: a transaction that holds the first attempt
    and then wants the second (a time-zone change locks today's attempts so) must not deadlock
    with it, as it would were they locked in item order."""
    task = queue(stub, tool_id)
    first = claim_many(stub, tool_id, 1).tasks[0]
    stub.ReleaseTask(task_pb2.ReleaseTaskRequest(task_id=task.id, lease_token=first.lease_token))
    second = claim_many(stub, tool_id, 1).tasks[0]
    assert second.task.id == task.id and second.task.attempt_count == 2
    items = [
        task_pb2.CompleteTaskRequest(task_id=task.id, lease_token=lease)
        for lease in (second.lease_token, first.lease_token)  # current first, stale second
    ]
    attempt = "SELECT 1 FROM generation.attempts WHERE task_id = %s AND attempt = %s FOR UPDATE"
    with psycopg.connect(database_url) as holder:
        holder.execute(attempt, [task.id, 1])
        with ThreadPoolExecutor(1) as pool:
            batch = pool.submit(stub.CompleteTasks, task_pb2.CompleteTasksRequest(tasks=items))
            waiting = (
                "SELECT count(*) AS n FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND query LIKE '%%complete_tasks%%'"
            )
            wait_for(
                lambda: db.execute(waiting).fetchone() == {"n": 1},
                what="the batch waiting for the first attempt",
            )
            # The batch must not hold the second attempt while it waits for the first.
            holder.execute("SET LOCAL lock_timeout = '5s'")
            holder.execute(attempt, [task.id, 2])
            holder.commit()
            results = batch.result(timeout=30).results
    assert [r.refused for r in results] == ["", Reason.LEASE_LOST.value]
    assert row(db, task.id)["status"] == "completed"


def test_failure_batches_creating_two_new_keys_in_opposite_orders_both_succeed(
    stub: Stub, db: Db, tool_id: str, database_url: str
) -> None:
    """The first retryable failure of a key inserts its cooldown row. Two FailTasks batches that
    create the same two new keys, each in its own task order, must not each wait for the
    other's insert (Postgres would break that cycle by failing one). Here the first batch is
    held between its two items (its first task's next event is taken, uncommitted) while the
    second starts."""
    for _ in range(4):
        queue(stub, tool_id)
    t1, t2, t3, t4 = sorted(claim_many(stub, tool_id, 4).tasks, key=lambda c: c.task.id)
    first_key, second_key = f"k1-{tool_id}", f"k2-{tool_id}"

    def failures(*items: tuple[task_pb2.ClaimedTask, str]) -> task_pb2.FailTasksRequest:
        return task_pb2.FailTasksRequest(
            tasks=[
                task_pb2.FailTaskRequest(
                    task_id=c.task.id,
                    lease_token=c.lease_token,
                    failure=task_pb2.FAILURE_KIND_RETRYABLE,
                    error="boom",
                    resource_key=key,
                )
                for c, key in items
            ]
        )

    def waiting() -> int:
        found = db.execute(
            "SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database() AND query LIKE '%fail_tasks%'"
        ).fetchone()
        return int(found["n"]) if found else 0

    with psycopg.connect(database_url) as holder:
        holder.execute(
            "INSERT INTO generation.task_events (task_id, sequence, kind) "
            "SELECT id, last_event_seq + 1, 'progress' FROM generation.tasks WHERE id = %s",
            [t1.task.id],
        )
        with ThreadPoolExecutor(2) as pool:
            one = pool.submit(
                stub.FailTasks, failures((t1, first_key), (t2, second_key)), timeout=30
            )
            wait_for(lambda: waiting() >= 1, what="the first batch")
            other = pool.submit(
                stub.FailTasks, failures((t3, second_key), (t4, first_key)), timeout=30
            )
            wait_for(lambda: waiting() >= 2, what="the second batch")
            holder.rollback()
            answers = [one.result(), other.result()]
    assert [[r.refused for r in a.results] for a in answers] == [["", ""], ["", ""]]
    counted = db.execute(
        "SELECT resource_key, consecutive_failures FROM generation.cooldowns "
        "WHERE resource_key IN (%s, %s) ORDER BY resource_key",
        [first_key, second_key],
    ).fetchall()
    assert [c["consecutive_failures"] for c in counted] == [2, 2]
    assert_invariants(db, tool_id)


def test_queue_tasks_answers_each_item_as_stored(stub: Stub, tool_id: str) -> None:
    """Items of different shapes in one QueueTasks (a delay, a TTL, an idempotency key, plain):
    each answered task is the one stored for its item, field for field."""
    later = timestamp_pb2.Timestamp()
    later.FromSeconds(int(time.time()) + 3_600)
    key = f"shape-{uuid.uuid4()}"
    items = [
        task_pb2.QueueTaskRequest(input={"n": 0}),
        task_pb2.QueueTaskRequest(input={"n": 1}, run_after=later, priority=7),
        task_pb2.QueueTaskRequest(input={"n": 2}, ttl=duration_pb2.Duration(seconds=60)),
        task_pb2.QueueTaskRequest(input={"n": 3}, idempotency_key=key, max_retries=0),
        task_pb2.QueueTaskRequest(input={"n": 4}),
        # What an item leaves out when it is the statement's default: these are not defaults.
        task_pb2.QueueTaskRequest(ttl=duration_pb2.Duration(seconds=0), priority=-5),
        task_pb2.QueueTaskRequest(input={}, reserved_token_amount=12),
    ]
    answer = stub.QueueTasks(task_pb2.QueueTasksRequest(tool_id=tool_id, tasks=items)).tasks
    assert len({task.id for task in answer}) == len(items)
    fields = ("id", "tool_id", "status", "priority", "max_retries", "idempotency_key")
    moments = ("created_at", "run_at", "expires_at")
    stored = [stub.GetTask(task_pb2.GetTaskRequest(task_id=task.id)).task for task in answer]
    for task, kept in zip(answer, stored, strict=True):
        assert [getattr(task, name) for name in fields + moments] == [
            getattr(kept, name) for name in fields + moments
        ], task.id
    assert [json_format.MessageToDict(kept.input) for kept in stored] == [
        {"n": 0},
        {"n": 1},
        {"n": 2},
        {"n": 3},
        {"n": 4},
        {},
        {},
    ]
    assert not answer[5].HasField("expires_at"), "a TTL of 0 never expires"
    assert answer[5].priority == -5
    assert stored[6].reserved_token_amount == 12 and stored[0].reserved_token_amount == 0
    assert answer[1].run_at == later and answer[1].priority == 7
    assert answer[2].expires_at.seconds - answer[2].run_at.seconds == 60
    assert (answer[3].idempotency_key, answer[3].max_retries) == (key, 0)
    assert answer[0].run_at == answer[4].run_at, "one statement, one moment"
    assert answer[0].expires_at.seconds - answer[0].run_at.seconds == 7 * 86_400  # the default


def test_queue_tasks_in_opposite_key_orders_both_succeed(
    stub: Stub, db: Db, tool_id: str, database_url: str
) -> None:
    """Two QueueTasks whose new idempotency keys come in opposite orders wait on each other's
    keys: Postgres breaks the cycle by rolling one back, and the service runs that one again
    (it used to answer UNAVAILABLE). Ordered here by a key a third transaction holds: the first
    call takes `a`, waits on `x`; the second takes `b`, waits on `a`; `x` let go, the first
    reaches `b`, a cycle. Both succeed, and each key makes one task."""
    run = uuid.uuid4().hex
    a, b, x = (f"{name}-{run}" for name in "abx")

    def enqueue(keys: list[str]) -> task_pb2.QueueTasksResponse:
        items = [task_pb2.QueueTaskRequest(idempotency_key=key) for key in keys]
        return stub.QueueTasks(task_pb2.QueueTasksRequest(tool_id=tool_id, tasks=items))

    def waiting_on_a_key(n: int) -> bool:
        waits = db.execute(
            "SELECT count(*) AS n FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock' "
            "AND query LIKE '%%jsonb_to_recordset%%'"
        ).fetchone()
        return waits == {"n": n}

    with psycopg.connect(database_url) as holder, ThreadPoolExecutor(2) as pool:
        holder.execute(
            "INSERT INTO generation.tasks (tool_id, idempotency_key) VALUES (%s, %s)",
            [tool_id, x],
        )
        first = pool.submit(enqueue, [a, x, b])
        wait_for(lambda: waiting_on_a_key(1), what="the first call waiting on x")
        second = pool.submit(enqueue, [b, a])
        wait_for(lambda: waiting_on_a_key(2), what="the second call waiting on a")
        holder.rollback()
        answers = [first.result(timeout=30), second.result(timeout=30)]
    created = sorted(task.idempotency_key for answer in answers for task in answer.tasks)
    assert created == sorted([a, b, x])
    assert sum(answer.skipped for answer in answers) == 2
    stored = db.execute(
        "SELECT count(*) AS n FROM generation.tasks WHERE idempotency_key = ANY (%s)", [[a, b, x]]
    ).fetchone()
    assert stored == {"n": 3}
