"""The lifecycle under faults (GUIDE §5: 5, 11, 15, 17, 18, 19 and the lock order), driven from
outside the service: lost answers through proxies, racing callers on threads, replicas as
processes. After each, tests/invariants.py checks in SQL what must hold.

(Faults 6-8, 14 and 20 are in test_database_faults.py, 21 in test_migrations.py, 2-3 and the
poison task in test_worker_processes.py, 16 in test_spend.py, the watchdog in test_watchdog.py.)
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import grpc
import psycopg
import pytest
from psycopg.rows import dict_row

from generation.task.v1 import task_pb2, task_pb2_grpc
from service.api.rpcs import BINDINGS, HAND_BACK_SQL, STATEMENTS
from service.settings import Settings
from tests.conftest import Databases, ServiceProcess, url_for, wait_for
from tests.integration.test_semantics import Db, Stub, claim, confirm, queue, row
from tests.invariants import assert_invariants
from tests.tcp_proxy import AnswerDroppingProxy, TcpProxy
from workers_sdk.errors import Reason, from_rpc_error


def lapse(db: Db, task_id: str) -> None:
    db.execute(
        "UPDATE generation.tasks SET claim_expires_at = now() - interval '1 second' "
        "WHERE id = %s AND status = 'processing'",
        [task_id],
    )
    wait_for(lambda: row(db, task_id)["status"] != "processing", what="the rescuer")


# --- lost claim answers (fault 15) ------------------------------------------------------------


@pytest.fixture
def dropping(service: ServiceProcess) -> Iterator[Stub]:
    """A stub whose every answer is lost on the way back (the calls themselves are served)."""
    host, port = service.address.rsplit(":", 1)
    proxy = AnswerDroppingProxy((host, int(port)))
    proxy.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{proxy.port}")
    yield task_pb2_grpc.GenerationDataServiceStub(channel)
    channel.close()
    proxy.cut()


def test_lost_claim_answers_cost_no_run_then_end_with_their_own_error(
    stub: Stub, db: Db, tool_id: str, dropping: Stub
) -> None:
    """Seen: a task with max_retries 1 was dead after 2 lost answers. Now it survives any
    number below the bound (20), and then fails with its own error, not as a normal failure."""
    task = queue(stub, tool_id, max_retries=1)
    for lost in range(1, 11):
        with pytest.raises(grpc.RpcError) as caught:
            dropping.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id), timeout=0.5)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert row(db, task.id)["status"] == "processing", "the claim was served"
        lapse(db, task.id)
        stored = row(db, task.id)
        assert (stored["status"], stored["retry_count"]) == ("queued", 0)
        assert stored["unconfirmed_claims"] == lost

    db.execute("UPDATE generation.tasks SET unconfirmed_claims = 19 WHERE id = %s", [task.id])
    with pytest.raises(grpc.RpcError):
        dropping.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id), timeout=0.5)
    lapse(db, task.id)
    stored = row(db, task.id)
    assert stored["status"] == "failed"
    assert stored["error"].startswith("claim answers lost")
    assert stored["retry_count"] == 0
    outcomes = db.execute(
        "SELECT DISTINCT outcome::text FROM generation.attempts WHERE task_id = %s", [task.id]
    ).fetchall()
    assert outcomes == [{"outcome": "unconfirmed"}], "no claim that never arrived counts as a run"
    assert_invariants(db, tool_id, [task.id])


def test_hand_backs_of_passed_deadlines_never_wear_out_a_task(
    stub: Stub, db: Db, tool_id: str
) -> None:
    """A caller whose deadlines always pass gets the head-of-line task handed back each time:
    that costs the task nothing and counts toward no bound (only lost answers do)."""
    head = queue(stub, tool_id, max_retries=1)
    for _ in range(25):
        claimed = claim(stub, tool_id)
        assert claimed.task.id == head.id
        db.execute(HAND_BACK_SQL, {"task_id": head.id, "lease_token": claimed.lease_token})
    stored = row(db, head.id)
    assert (stored["status"], stored["retry_count"], stored["unconfirmed_claims"]) == (
        "queued",
        0,
        0,
    )
    assert_invariants(db, tool_id, [head.id])


def test_claims_whose_deadline_passes_are_handed_back_at_once(
    service: ServiceProcess, stub: Stub, db: Db, tool_id: str
) -> None:
    """Seen: with 5-50 ms deadlines, 110-170 of 800 claims were orphaned until their lease
    lapsed, and then charged a retry. Now the service hands back what the caller could not
    receive; whatever it could not tell (the answer lost after it left) costs no retry either."""
    tasks = [
        t.id
        for t in stub.QueueTasks(
            task_pb2.QueueTasksRequest(
                tool_id=tool_id,
                tasks=[task_pb2.QueueTaskRequest(max_retries=1) for _ in range(300)],
            )
        ).tasks
    ]
    received: list[str] = []

    def storm(seed: int) -> None:
        rng = random.Random(seed)
        with grpc.insecure_channel(service.address) as channel:
            own = task_pb2_grpc.GenerationDataServiceStub(channel)
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                try:
                    answer = own.ClaimNextTask(
                        task_pb2.ClaimNextTaskRequest(tool_id=tool_id),
                        timeout=rng.uniform(0.005, 0.05),
                    )
                except grpc.RpcError:
                    continue
                if answer.HasField("task"):
                    received.append(answer.task.id)
                    own.CompleteTask(
                        task_pb2.CompleteTaskRequest(
                            task_id=answer.task.id, lease_token=answer.lease_token
                        ),
                        timeout=10,
                    )

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(storm, range(8)))

    handed_back = db.execute(
        "SELECT count(*) AS n FROM generation.attempts WHERE tool_id = %s "
        "AND outcome = 'unconfirmed'",
        [tool_id],
    ).fetchone()
    orphans = [
        r["id"]
        for r in db.execute(
            "SELECT id FROM generation.tasks WHERE tool_id = %s AND status = 'processing'",
            [tool_id],
        )
    ]
    assert handed_back is not None and handed_back["n"] > 0, "no deadline passed: no test"
    assert len(orphans) <= handed_back["n"], "most of them were handed back at once"
    for task_id in orphans:  # answers lost after they left: their unconfirmed leases lapse
        lapse(db, str(task_id))
    while answer := stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id)):
        if not answer.HasField("task"):
            break
        stub.CompleteTask(
            task_pb2.CompleteTaskRequest(task_id=answer.task.id, lease_token=answer.lease_token)
        )
    done = db.execute(
        "SELECT status::text, max(retry_count) AS retries, count(*) AS n "
        "FROM generation.tasks WHERE tool_id = %s GROUP BY status",
        [tool_id],
    ).fetchall()
    assert done == [{"status": "completed", "retries": 0, "n": 300}], "no task lost a run"
    assert_invariants(db, tool_id, tasks)


# --- counting runs ----------------------------------------------------------------------------


def test_max_retries_bounds_runs_the_same_whatever_ends_them(
    stub: Stub, db: Db, tool_id: str
) -> None:
    """Seen: a task crashing its worker every time ran 4 times with max_retries 3; one failing
    cleanly ran 3 times. Now both run 3 times."""
    crashing = queue(stub, tool_id, max_retries=3)
    runs = 0
    while (claimed := claim(stub, tool_id)).HasField("task"):
        runs += 1
        confirm(stub, claimed)  # the worker got it, started, and died
        lapse(db, crashing.id)
    assert runs == 3 and row(db, crashing.id)["status"] == "failed"

    failing = queue(stub, tool_id, max_retries=3)
    runs = 0
    while (claimed := claim(stub, tool_id)).HasField("task"):
        runs += 1
        stub.FailTask(
            task_pb2.FailTaskRequest(
                task_id=claimed.task.id, lease_token=claimed.lease_token, increment_retry=True
            )
        )
    assert runs == 3 and row(db, failing.id)["status"] == "failed"
    assert_invariants(db, tool_id, [crashing.id, failing.id])


@pytest.mark.parametrize("stop", ["ReleaseTask", "account error"])
def test_a_deliberate_stop_on_the_last_retry_gives_it_back(
    stub: Stub, db: Db, tool_id: str, stop: str
) -> None:
    """Seen: a task reclaimed on its last retry, then released by the SIGTERM drain (or
    requeued by an account error), had no retries left and was reaped."""
    task = queue(stub, tool_id, max_retries=2)
    first = claim(stub, tool_id)
    confirm(stub, first)
    lapse(db, task.id)  # one run used by the crash
    last = claim(stub, tool_id)
    assert last.task.id == task.id and last.task.retry_count == 1
    if stop == "ReleaseTask":
        stub.ReleaseTask(task_pb2.ReleaseTaskRequest(task_id=task.id, lease_token=last.lease_token))
    else:
        stub.FailTask(
            task_pb2.FailTaskRequest(
                task_id=task.id, lease_token=last.lease_token, failure=task_pb2.FAILURE_KIND_ACCOUNT
            )
        )
        db.execute("DELETE FROM generation.holds")  # the hold is not what this test is about
    stored = row(db, task.id)
    assert (stored["status"], stored["retry_count"]) == ("queued", 1)
    again = claim(stub, tool_id)
    assert again.task.id == task.id, "its last run is still there"
    stub.CompleteTask(task_pb2.CompleteTaskRequest(task_id=task.id, lease_token=again.lease_token))
    assert_invariants(db, tool_id, [task.id])


# --- a RetryTask sent again after its answer was lost ------------------------------------------


def test_a_retry_sent_again_with_its_key_neither_fails_nor_runs_the_task_twice(
    stub: Stub, db: Db, tool_id: str
) -> None:
    """A failed, settled task is retried with a key and the answer is lost; the caller sends
    the same RetryTask again, once while the task waits and once after it ran, failed and was
    settled again. Each answers the task as it is, retried_now false, and changes nothing:
    without the key the second call failed FAILED_PRECONDITION and the third queued the task
    once more, refunding one reservation twice."""
    task = queue(stub, tool_id, reserved_token_amount=50, max_retries=1)
    claimed = claim(stub, tool_id)
    stub.FailTask(task_pb2.FailTaskRequest(task_id=task.id, lease_token=claimed.lease_token))
    stub.SettleTask(task_pb2.SettleTaskRequest(task_id=task.id))
    request = task_pb2.RetryTaskRequest(
        task_id=task.id, reserved_token_amount=50, retry_key="after-the-outage"
    )

    first = stub.RetryTask(request)  # its answer "lost"
    assert (first.retried_now, first.task.status) == (True, task_pb2.TASK_STATUS_QUEUED)
    again = stub.RetryTask(request)
    assert (again.retried_now, again.task.status) == (False, task_pb2.TASK_STATUS_QUEUED)
    assert row(db, task.id)["settlement_round"] == 2

    rerun = claim(stub, tool_id)
    stub.FailTask(task_pb2.FailTaskRequest(task_id=task.id, lease_token=rerun.lease_token))
    stub.SettleTask(task_pb2.SettleTaskRequest(task_id=task.id))
    late = stub.RetryTask(request)
    assert (late.retried_now, late.task.status) == (False, task_pb2.TASK_STATUS_FAILED)
    assert row(db, task.id)["settlement_round"] == 2, "no third round"
    rounds = db.execute(
        "SELECT count(*) AS n FROM generation.settlements WHERE task_id = %s", [task.id]
    ).fetchone()
    assert rounds == {"n": 2}

    fresh = stub.RetryTask(task_pb2.RetryTaskRequest(task_id=task.id, retry_key="once-more"))
    assert (fresh.retried_now, fresh.task.status) == (True, task_pb2.TASK_STATUS_QUEUED)
    assert_invariants(db, tool_id, [task.id])


# --- a QueueTask REQUEUE sent again after its answer was lost ----------------------------------


def requeue_request(tool_id: str, requeue_key: str) -> task_pb2.QueueTaskRequest:
    return task_pb2.QueueTaskRequest(
        tool_id=tool_id,
        idempotency_key=f"nightly-{tool_id}",
        reserved_token_amount=50,
        max_retries=1,
        on_conflict=task_pb2.ON_CONFLICT_REQUEUE,
        requeue_key=requeue_key,
    )


def run_and_settle(stub: Stub, tool_id: str, task_id: str) -> None:
    claimed = claim(stub, tool_id)
    assert claimed.task.id == task_id
    stub.FailTask(task_pb2.FailTaskRequest(task_id=task_id, lease_token=claimed.lease_token))
    stub.SettleTask(task_pb2.SettleTaskRequest(task_id=task_id))


def test_a_requeue_sent_again_with_its_key_does_not_run_the_task_twice(
    stub: Stub, db: Db, tool_id: str
) -> None:
    """QueueTask REQUEUE with a requeue_key, its answer lost, sent again after the task ran,
    failed and was settled: it answers the task as it is, requeued_now false, and changes
    nothing. So for the call that created the task (its key was recorded nowhere: found in
    review) and for one that queued it again; without the key each queued it once more, another
    paid run and another settlement round."""
    created = requeue_request(tool_id, "k1")
    made = stub.QueueTask(created)
    assert (made.created, made.requeued_now) == (True, False)
    run_and_settle(stub, tool_id, made.task.id)
    late = stub.QueueTask(created)  # the creating call's answer "lost"
    assert (late.requeued_now, late.task.status) == (False, task_pb2.TASK_STATUS_FAILED)

    again = requeue_request(tool_id, "k2")
    first = stub.QueueTask(again)  # its answer "lost"
    assert (first.created, first.requeued_now, first.task.status) == (
        False,
        True,
        task_pb2.TASK_STATUS_QUEUED,
    )
    run_and_settle(stub, tool_id, made.task.id)
    late = stub.QueueTask(again)
    assert (late.requeued_now, late.task.status) == (False, task_pb2.TASK_STATUS_FAILED)
    stored = row(db, made.task.id)
    assert (stored["settlement_round"], stored["attempt_count"]) == (2, 2), "no third run"
    assert stored["requeue_keys"] == ["k1", "k2"]
    keys = db.execute(
        "SELECT data ->> 'requeue_key' AS key FROM generation.event_stream "
        "WHERE task_id = %s AND kind = 'requeued'",
        [made.task.id],
    ).fetchall()
    assert keys == [{"key": "k2"}]
    assert_invariants(db, tool_id, [made.task.id])


def test_a_task_keeps_its_last_16_requeue_keys(stub: Stub, db: Db, tool_id: str) -> None:
    """A task requeued every night must not grow its row without end."""
    made = stub.QueueTask(requeue_request(tool_id, "k0"))
    for n in range(1, 18):
        run_and_settle(stub, tool_id, made.task.id)
        assert stub.QueueTask(requeue_request(tool_id, f"k{n}")).requeued_now
    assert row(db, made.task.id)["requeue_keys"] == [f"k{n}" for n in range(2, 18)]


def test_a_requeue_racing_its_own_resend_queues_the_task_once(
    stub: Stub, db: Db, database_url: str, tool_id: str
) -> None:
    """The first REQUEUE holds the row; the same request, sent again, waits for it with a
    snapshot taken before the first one commits, and meanwhile the task has finished again
    (here: cancelled in the first one's transaction). The resend must see the key on the row it
    then locks: reading it from the events in its snapshot would queue the task a second
    time."""
    request = requeue_request(tool_id, "k1")
    made = stub.QueueTask(
        task_pb2.QueueTaskRequest(
            tool_id=tool_id,
            idempotency_key=request.idempotency_key,
            reserved_token_amount=50,
            max_retries=1,
        )
    )
    run_and_settle(stub, tool_id, made.task.id)
    params = BINDINGS["QueueTask"].bind(request, Settings())
    with psycopg.connect(database_url) as first, ThreadPoolExecutor(1) as pool:
        first.execute(STATEMENTS["QueueTask"], params)
        first.execute(
            "UPDATE generation.tasks SET status = 'cancelled' WHERE id = %s", [made.task.id]
        )
        resent = pool.submit(stub.QueueTask, request)
        wait_for(partial(lock_waiters_reach, db, 1), what="the resend to wait")
        first.commit()
        answer = resent.result(timeout=20)
    assert (answer.requeued_now, answer.task.status) == (False, task_pb2.TASK_STATUS_CANCELLED)
    assert row(db, made.task.id)["requeue_keys"] == ["k1"]


@pytest.mark.parametrize("on_conflict", ["RETURN", "QueueTasks"])
def test_a_requeue_key_without_requeue_is_refused(
    stub: Stub, db: Db, tool_id: str, on_conflict: str
) -> None:
    item = task_pb2.QueueTaskRequest(tool_id=tool_id, idempotency_key="k", requeue_key="r")
    with pytest.raises(grpc.RpcError) as refused:
        if on_conflict == "RETURN":
            stub.QueueTask(item)
        else:
            stub.QueueTasks(task_pb2.QueueTasksRequest(tool_id=tool_id, tasks=[item]))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    queued = db.execute("SELECT count(*) AS n FROM generation.tasks WHERE tool_id = %s", [tool_id])
    assert queued.fetchone() == {"n": 0}


# --- settlement racing a requeue (fault 17) ---------------------------------------------------


@pytest.mark.parametrize("first", ["settle", "requeue"])
@pytest.mark.parametrize("requeue", ["RetryTask", "QueueTask REQUEUE"])
def test_a_settlement_racing_a_requeue_never_refunds_a_task_that_runs_again(
    stub: Stub, db: Db, database_url: str, tool_id: str, requeue: str, first: str
) -> None:
    """Both calls are in flight at once, queued behind a row lock the test holds, in a known
    order (Postgres grants a row lock first come, first served); then the lock goes."""
    key = f"race-{requeue}-{first}"
    task = queue(stub, tool_id, reserved_token_amount=100, idempotency_key=key, max_retries=1)
    claimed = claim(stub, tool_id)
    stub.FailTask(task_pb2.FailTaskRequest(task_id=task.id, lease_token=claimed.lease_token))

    def settle() -> bool:
        try:
            return bool(stub.SettleTask(task_pb2.SettleTaskRequest(task_id=task.id)).settled_now)
        except grpc.RpcError as error:  # the requeue came first: not terminal, nothing to settle
            assert from_rpc_error(error).reason is Reason.TASK_NOT_TERMINAL
            return False

    def again() -> bool:
        if requeue == "RetryTask":
            stub.RetryTask(task_pb2.RetryTaskRequest(task_id=task.id, reserved_token_amount=100))
        else:
            stub.QueueTask(
                task_pb2.QueueTaskRequest(
                    tool_id=tool_id,
                    idempotency_key=key,
                    reserved_token_amount=100,
                    max_retries=1,
                    on_conflict=task_pb2.ON_CONFLICT_REQUEUE,
                )
            )
        return True

    calls = {"settle": settle, "requeue": again}
    order = [first, "requeue" if first == "settle" else "settle"]
    with psycopg.connect(database_url) as blocker, ThreadPoolExecutor(2) as pool:
        blocker.execute("SELECT 1 FROM generation.tasks WHERE id = %s FOR UPDATE", [task.id])
        running = []
        for waiting, name in enumerate(order, start=1):
            running.append(pool.submit(calls[name]))
            wait_for(partial(lock_waiters_reach, db, waiting), what=f"{name} to wait")
        blocker.rollback()
        settled_now = dict(zip(order, [r.result(timeout=20) for r in running], strict=True))
    assert settled_now["settle"] is (first == "settle")
    stored = row(db, task.id)
    assert stored["status"] == "queued"
    assert stored["settled_at"] is None, "a task that runs again is not settled"
    # It runs again and ends: its round settles once, charging what the rerun delivered.
    rerun = claim(stub, tool_id)
    stub.CompleteTask(
        task_pb2.CompleteTaskRequest(
            task_id=task.id,
            lease_token=rerun.lease_token,
            reported_usage=task_pb2.ReportedUsage(token_amount=30),
        )
    )
    final = stub.SettleTask(task_pb2.SettleTaskRequest(task_id=task.id)).settlement
    assert final.charged_token_amount == 30
    assert final.settlement_round == stored["settlement_round"] == (2 if first == "settle" else 1)
    assert_invariants(db, tool_id, [task.id])


def lock_waiters_reach(db: Db, count: int) -> bool:
    return lock_waiters(db) >= count


def lock_waiters(db: Db) -> int:
    found = db.execute(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND datname = current_database()"
    ).fetchone()
    return int(found["n"]) if found else 0


def test_requeue_of_a_completed_task_waits_for_its_settlement(
    stub: Stub, db: Db, tool_id: str
) -> None:
    """The delivered run is charged before the task may run again: until its reservation is
    settled, REQUEUE answers the completed task as RETURN would."""
    request = task_pb2.QueueTaskRequest(
        tool_id=tool_id,
        idempotency_key="delivered",
        reserved_token_amount=1000,
        on_conflict=task_pb2.ON_CONFLICT_REQUEUE,
    )
    task = stub.QueueTask(request).task
    claimed = claim(stub, tool_id)
    stub.CompleteTask(
        task_pb2.CompleteTaskRequest(
            task_id=task.id,
            lease_token=claimed.lease_token,
            output={"url": "x"},
            reported_usage=task_pb2.ReportedUsage(token_amount=700),
        )
    )
    early = stub.QueueTask(request).task
    assert early.status == task_pb2.TASK_STATUS_COMPLETED, "not requeued before its settlement"
    settled = stub.SettleTask(task_pb2.SettleTaskRequest(task_id=task.id)).settlement
    assert settled.charged_token_amount == 700
    again = stub.QueueTask(request).task
    assert again.status == task_pb2.TASK_STATUS_QUEUED
    assert not again.HasField("output") and not again.HasField("reported_usage")
    assert_invariants(db, tool_id, [task.id])


# --- one lease, two completes (fault 18) ------------------------------------------------------


def test_concurrent_completes_under_one_lease_both_succeed(
    service: ServiceProcess, stub: Stub, db: Db, tool_id: str
) -> None:
    """Seen: 2-19 of 25 concurrent pairs answered ABORTED. Same lease, same answer, always."""
    for _ in range(25):
        task = queue(stub, tool_id)
        claimed = claim(stub, tool_id)
        request = task_pb2.CompleteTaskRequest(
            task_id=task.id,
            lease_token=claimed.lease_token,
            output={"n": 1},
            reported_usage=task_pb2.ReportedUsage(cost_nanos=5),
        )
        start = threading.Barrier(2)

        def complete(request: Any = request, start: threading.Barrier = start) -> task_pb2.Task:
            start.wait()
            return stub.CompleteTask(request, timeout=10).task

        with ThreadPoolExecutor(2) as pool:
            answers = [f.result() for f in [pool.submit(complete), pool.submit(complete)]]
        assert answers[0] == answers[1]
        assert answers[0].status == task_pb2.TASK_STATUS_COMPLETED
        ledger = db.execute(
            "SELECT outcome::text, cost_nanos FROM generation.attempts WHERE task_id = %s",
            [task.id],
        ).fetchall()
        assert ledger == [{"outcome": "completed", "cost_nanos": 5}], "counted once"
    assert_invariants(db, tool_id)


def test_a_retried_complete_while_the_first_still_commits_gets_the_same_answer(
    stub: Stub, db: Db, database_url: str, tool_id: str
) -> None:
    """The first CompleteTask holds the row (here: it waits behind a lock we hold, as a slow
    commit would); the worker's retry arrives meanwhile. Both answer success."""
    task = queue(stub, tool_id)
    claimed = claim(stub, tool_id)
    request = task_pb2.CompleteTaskRequest(task_id=task.id, lease_token=claimed.lease_token)
    with psycopg.connect(database_url) as blocker:
        blocker.execute("SELECT 1 FROM generation.tasks WHERE id = %s FOR UPDATE", [task.id])
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(stub.CompleteTask, request, timeout=20)
            wait_for(lambda: waiting_on_lock(db, "complete_task_v1") >= 1, what="the first")
            retry = pool.submit(stub.CompleteTask, request, timeout=20)
            wait_for(lambda: waiting_on_lock(db, "complete_task_v1") >= 2, what="the retry")
            blocker.rollback()
            assert first.result().task == retry.result().task
    assert row(db, task.id)["status"] == "completed"


def test_a_completion_that_waited_for_its_task_resets_a_failure_of_its_key_from_meanwhile(
    stub: Stub, db: Db, database_url: str, tool_id: str
) -> None:
    """A free completion waits for its task's lock (a heartbeat in flight, held here); another
    task of the same key fails meanwhile. The success comes after that failure, so it ends the
    key's run of failures: left at 1, one more failure would count as two and could cool the
    key."""
    first, second = queue(stub, tool_id), queue(stub, tool_id)
    claimed = {c.task.id: c for c in (claim(stub, tool_id), claim(stub, tool_id))}
    mine, other = claimed[first.id], claimed[second.id]

    def failures() -> int:
        found = db.execute(
            "SELECT c.consecutive_failures FROM generation.cooldowns AS c "
            "JOIN generation.tools AS t ON c.resource_key = t.name WHERE t.id = %s",
            [tool_id],
        ).fetchone()
        return int(found["consecutive_failures"]) if found else 0

    request = task_pb2.CompleteTaskRequest(task_id=first.id, lease_token=mine.lease_token)
    with psycopg.connect(database_url) as heartbeat:
        heartbeat.execute("SELECT 1 FROM generation.tasks WHERE id = %s FOR UPDATE", [first.id])
        with ThreadPoolExecutor(1) as pool:
            completing = pool.submit(stub.CompleteTask, request, timeout=20)
            wait_for(lambda: waiting_on_lock(db, "complete_task_v1") >= 1, what="the completion")
            stub.FailTask(
                task_pb2.FailTaskRequest(
                    task_id=second.id,
                    lease_token=other.lease_token,
                    failure=task_pb2.FAILURE_KIND_RETRYABLE,
                    error="boom",
                )
            )
            assert failures() == 1
            heartbeat.rollback()
            assert completing.result().task.status == task_pb2.TASK_STATUS_COMPLETED
    assert failures() == 0, "the key's run of failures ended with the success after it"
    assert_invariants(db, tool_id)


def test_a_completion_that_waited_behind_its_lease_refused_as_lost_leaves_that_close(
    stub: Stub, db: Db, database_url: str, tool_id: str
) -> None:
    """The same lease reports twice: a completion whose transaction began before the lease
    lapsed (standing for a statement held up between its start and the task's lock), and a
    report after the lapse, which closes the attempt `lease_lost` with its cost while the task
    stays processing. The completion waits for it, then ends the run as complete_task_v1's
    locked steps do: the attempt stays closed as the refusal closed it, not closed again. The
    service's rescuer is held off: it would hand the lapsed, unconfirmed lease back first."""
    task = queue(stub, tool_id)
    lease = claim(stub, tool_id).lease_token
    call = "SELECT x.task_found FROM generation.complete_task_v1(%s, %s, '{}', '{}', %s, NULL) AS x"
    with (
        rescuer_held_off(db),
        psycopg.connect(database_url) as early,
        psycopg.connect(database_url) as late,
    ):
        began = early.execute("SELECT now()").fetchone()  # its transaction's time
        assert began is not None
        db.execute(  # the lease lapses just after it: held at the completion's time, not later
            "UPDATE generation.tasks SET claim_expires_at = %s + interval '200 milliseconds' "
            "WHERE id = %s",
            [began[0], task.id],
        )
        lapsed = "SELECT claim_expires_at < now() AS lapsed FROM generation.tasks WHERE id = %s"
        wait_for(lambda: db.execute(lapsed, [task.id]).fetchone() == {"lapsed": True}, what="lapse")
        assert late.execute(call, [task.id, lease, 7]).fetchone() == (True,)
        refused = db.execute(
            "SELECT outcome::text, cost_nanos FROM generation.attempts WHERE task_id = %s",
            [task.id],
        ).fetchone()
        assert refused == {"outcome": "running", "cost_nanos": 0}, "not committed yet"
        with ThreadPoolExecutor(1) as pool:
            completing = pool.submit(lambda: early.execute(call, [task.id, lease, 0]).fetchone())
            wait_for(lambda: waiting_on_lock(db, "complete_task_v1") >= 1, what="the completion")
            late.commit()
            assert completing.result(timeout=20) == (True,)
        early.commit()
    ledger = db.execute(
        "SELECT outcome::text, cost_nanos FROM generation.attempts WHERE task_id = %s", [task.id]
    ).fetchall()
    assert ledger == [{"outcome": "lease_lost", "cost_nanos": 7}], "closed once, by the refusal"


@contextmanager
def rescuer_held_off(db: Db) -> Iterator[None]:
    """Another holder takes the maintenance lease for a minute: the service's sweeps run only
    under its own lease (LEADING, service/leader/lease.py), so none rescues meanwhile. At the
    end the row goes, and the service leads again at its next try."""
    db.execute(
        "INSERT INTO generation.leader (name, holder, expires_at) "
        "VALUES ('maintenance', gen_random_uuid(), now() + interval '1 minute') "
        "ON CONFLICT (name) DO UPDATE "
        "SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at"
    )
    try:
        yield
    finally:
        db.execute("DELETE FROM generation.leader WHERE name = 'maintenance'")


def waiting_on_lock(db: Db, function: str) -> int:
    found = db.execute(
        "SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND datname = current_database() AND query LIKE %s",
        [f"%{function}%"],
    ).fetchone()
    return int(found["n"]) if found else 0


# --- an answer lost at COMMIT (fault 5) -------------------------------------------------------


@pytest.fixture(scope="module")
def db_proxy_service(
    databases: Databases, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServiceProcess, TcpProxy, str]]:
    """The service reaching Postgres through a proxy that can lose one answer after commit."""
    url = url_for(databases.create("commit_cut"))
    target = urlsplit(url)
    proxy = TcpProxy((target.hostname or "127.0.0.1", target.port or 5432))
    proxy.start()
    proxied = target._replace(netloc=f"postgres@127.0.0.1:{proxy.port}").geturl()
    service = ServiceProcess(proxied, tmp_path_factory.mktemp("commit_cut") / "serve.log")
    yield service, proxy, url
    service.stop()
    proxy.cut()


def test_a_complete_whose_commit_answer_is_lost_is_retried_to_the_same_answer(
    db_proxy_service: tuple[ServiceProcess, TcpProxy, str],
) -> None:
    service, proxy, url = db_proxy_service
    stub = service.stub
    tool_id = str(stub.UpsertTool(task_pb2.UpsertToolRequest(name="commit-cut")).tool.id)
    task = queue(stub, tool_id, reserved_token_amount=50)
    claimed = claim(stub, tool_id)
    request = task_pb2.CompleteTaskRequest(
        task_id=task.id,
        lease_token=claimed.lease_token,
        reported_usage=task_pb2.ReportedUsage(token_amount=20, cost_nanos=9),
    )
    proxy.cut_after_request(b"complete_task_v1", b"SELECT 1\x00")
    with pytest.raises(grpc.RpcError) as caught:
        stub.CompleteTask(request, timeout=20)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, "retryable, as clients do"
    assert proxy.cuts == 1
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as db:
        assert row(db, task.id)["status"] == "completed", "it committed before the cut"
        again = wait_for(lambda: retried(stub, request), what="the retry to get through")
        assert again.task.status == task_pb2.TASK_STATUS_COMPLETED
        settlements = [
            stub.SettleTask(task_pb2.SettleTaskRequest(task_id=task.id)) for _ in range(2)
        ]
        assert [s.settled_now for s in settlements] == [True, False]
        ledger = db.execute(
            "SELECT count(*) AS n, sum(cost_nanos)::bigint AS cost FROM generation.attempts "
            "WHERE task_id = %s",
            [task.id],
        ).fetchone()
        assert ledger == {"n": 1, "cost": 9}
        assert_invariants(db, tool_id, [task.id])


def retried(stub: Stub, request: Any) -> Any:
    try:
        return stub.CompleteTask(request, timeout=5)
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.UNAVAILABLE:
            return None
        raise


# --- events racing the end (fault 19) ---------------------------------------------------------


def test_events_racing_the_terminal_transition_never_follow_it(
    service: ServiceProcess, stub: Stub, db: Db, tool_id: str
) -> None:
    for _ in range(10):
        task = queue(stub, tool_id)
        claimed = claim(stub, tool_id)
        lease = {"task_id": task.id, "lease_token": claimed.lease_token}
        stop = threading.Event()

        def publish(lease: dict[str, str] = lease, stop: threading.Event = stop) -> int:
            sent = 0
            with grpc.insecure_channel(service.address) as channel:
                own = task_pb2_grpc.GenerationDataServiceStub(channel)
                while not stop.is_set():
                    try:
                        own.PublishTaskEvent(
                            task_pb2.PublishTaskEventRequest(
                                **lease, kind=task_pb2.TASK_EVENT_KIND_PROGRESS
                            )
                        )
                        sent += 1
                    except grpc.RpcError as error:
                        assert from_rpc_error(error).reason is Reason.LEASE_LOST
                        return sent
            return sent

        with ThreadPoolExecutor(3) as pool:
            publishers = [pool.submit(publish) for _ in range(3)]
            wait_for(partial(published, db, task.id), what="a progress event")
            stub.CompleteTask(task_pb2.CompleteTaskRequest(**lease))
            stop.set()
            assert sum(p.result() for p in publishers) > 0
        stream = events(db, task.id)
        assert [seq for seq, _ in stream] == list(range(1, len(stream) + 1)), "no gaps"
        assert stream[-1][1] == "completed", "nothing after the terminal event"
        watched = [
            (e.event.sequence, e.event.kind)
            for e in stub.WatchTaskEvents(task_pb2.WatchTaskEventsRequest(task_id=task.id))
        ]
        assert len(watched) == len(stream), "a follower sees every event"


def published(db: Db, task_id: str) -> bool:
    return events(db, task_id)[-1][1] == "progress"


def events(db: Db, task_id: str) -> list[tuple[int, str]]:
    return [
        (int(r["sequence"]), str(r["kind"]))
        for r in db.execute(
            "SELECT sequence, kind::text FROM generation.event_stream WHERE task_id = %s "
            "ORDER BY sequence",
            [task_id],
        )
    ] or [(0, "")]


def test_every_transition_is_in_the_tasks_stream(stub: Stub, db: Db, tool_id: str) -> None:
    """Seen: CancelTasks, RetryTask, REQUEUE, the rescuer and reclaims wrote no event."""
    task = queue(stub, tool_id, idempotency_key="stream", max_retries=3)
    confirm(stub, claim(stub, tool_id))
    lapse(db, task.id)  # the rescuer
    claim(stub, tool_id)  # a reclaim
    stub.CancelTasks(task_pb2.CancelTasksRequest(tool_id=tool_id, include_processing=True))
    reclaimed = row(db, task.id)
    stub.ReleaseTask(
        task_pb2.ReleaseTaskRequest(task_id=task.id, lease_token=str(reclaimed["lease_token"]))
    )
    stub.RetryTask(task_pb2.RetryTaskRequest(task_id=task.id))
    stub.CancelTasks(task_pb2.CancelTasksRequest(tool_id=tool_id))
    stub.QueueTask(
        task_pb2.QueueTaskRequest(
            tool_id=tool_id,
            idempotency_key="stream",
            max_retries=3,
            on_conflict=task_pb2.ON_CONFLICT_REQUEUE,
        )
    )
    assert [kind for _, kind in events(db, task.id)] == [
        "started",
        "requeued",  # the lease lapsed
        "started",
        "cancel_requested",
        "cancelled",  # its worker stopped
        "requeued",  # RetryTask
        "cancelled",  # CancelTasks
        "requeued",  # QueueTask REQUEUE
    ]


# --- lock order -------------------------------------------------------------------------------


def test_a_paid_claim_never_waits_for_an_open_enqueue(
    stub: Stub, db: Db, database_url: str, tool_id: str
) -> None:
    """Seen: a paid claim took FOR UPDATE on its tool row, which waited for the KEY SHARE that
    every open enqueue of that tool held through the tasks' foreign key: one 1,000-item
    QueueTasks stalled every paid claim. Without that key an open enqueue holds
    no lock a claim could wait for, and claims take FOR NO KEY UPDATE anyway; this fails should
    a lock between the two come back."""
    stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, cost_estimate_nanos=10))
    task = queue(stub, tool_id)
    with psycopg.connect(database_url) as enqueue:  # an enqueue that has not committed yet
        enqueue.execute("INSERT INTO generation.tasks (tool_id) VALUES (%s)", [tool_id])
        claimed = stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id), timeout=5)
        assert claimed.task.id == task.id
        stub.CompleteTask(
            task_pb2.CompleteTaskRequest(
                task_id=task.id,
                lease_token=claimed.lease_token,
                reported_usage=task_pb2.ReportedUsage(cost_nanos=3),
            ),
            timeout=5,
        )
        enqueue.rollback()
    assert_invariants(db, tool_id, [task.id])


# --- overrides bind every replica -------------------------------------------------------------


def test_an_override_in_one_replicas_environment_binds_every_replica(
    databases: Databases, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Seen: GENQ_DISABLED on one of five replicas stopped a fifth of the claims."""
    url = url_for(databases.create("overrides"))
    logs = tmp_path_factory.mktemp("overrides")
    plain = ServiceProcess(url, logs / "plain.log")
    try:
        tool_id = str(plain.stub.UpsertTool(task_pb2.UpsertToolRequest(name="t")).tool.id)
        queue(plain.stub, tool_id)

        def idle() -> int:
            return int(
                plain.stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id)).idle_reason
            )

        off = ServiceProcess(url, logs / "off.log", GENQ_DISABLED="true")
        try:
            assert idle() == task_pb2.IDLE_REASON_DISABLED, "the other replica obeys it"
            settings = plain.stub.GetSettings(task_pb2.GetSettingsRequest()).settings
            assert settings.disabled_by_environment
        finally:
            off.stop()
        capped = ServiceProcess(url, logs / "capped.log", GENQ_DAILY_CAP_NANOS="0")
        try:
            assert idle() == task_pb2.IDLE_REASON_CAPPED
        finally:
            capped.stop()
        claimed = plain.stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id))
        assert claimed.HasField("task"), "a replica's override goes with it"
    finally:
        plain.stop()


# --- spend never drops by a settings change ---------------------------------------------------


def test_a_time_zone_change_never_drops_todays_spend(
    databases: Databases, tmp_path_factory: pytest.TempPathFactory
) -> None:
    url = url_for(databases.create("timezone"))
    service = ServiceProcess(url, tmp_path_factory.mktemp("timezone") / "serve.log")
    try:
        stub = service.stub
        tool_id = str(stub.UpsertTool(task_pb2.UpsertToolRequest(name="t")).tool.id)
        task = queue(stub, tool_id)
        claimed = claim(stub, tool_id)
        stub.CompleteTask(
            task_pb2.CompleteTaskRequest(
                task_id=task.id,
                lease_token=claimed.lease_token,
                reported_usage=task_pb2.ReportedUsage(cost_nanos=42),
            )
        )
        before = stub.GetSettings(task_pb2.GetSettingsRequest()).settings
        # Two zones 24 hours apart: one of them puts "today" on another date than the first.
        for zone in ("Etc/GMT+12", "Etc/GMT-12", "Etc/GMT+12"):
            after = stub.UpdateSettings(task_pb2.UpdateSettingsRequest(timezone=zone)).settings
            assert after.spent_today_nanos == before.spent_today_nanos == 42, zone
            tool = stub.GetTool(task_pb2.GetToolRequest(tool_id=tool_id)).tool
            assert tool.spent_today_nanos == 42, zone
        with psycopg.connect(url, autocommit=True, row_factory=dict_row) as db:
            assert_invariants(db, tool_id, [task.id])
    finally:
        service.stop()


def test_time_zone_changes_racing_paid_claims_keep_spend_equal_to_the_ledger(
    databases: Databases, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Seen in review: a claim that read the zone before a change committed reset today's spend.
    A change that moves the local day now waits for claims in flight (the day lock)."""
    url = url_for(databases.create("timezone_race"))
    service = ServiceProcess(url, tmp_path_factory.mktemp("timezone_race") / "serve.log")
    try:
        stub = service.stub
        tool_id = str(stub.UpsertTool(task_pb2.UpsertToolRequest(name="paid")).tool.id)
        stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, cost_estimate_nanos=3))
        stub.QueueTasks(
            task_pb2.QueueTasksRequest(
                tool_id=tool_id, tasks=[task_pb2.QueueTaskRequest() for _ in range(150)]
            )
        )
        stop = threading.Event()

        def work() -> int:
            done = 0
            with grpc.insecure_channel(service.address) as channel:
                own = task_pb2_grpc.GenerationDataServiceStub(channel)
                while not stop.is_set():
                    answer = own.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id))
                    if not answer.HasField("task"):
                        return done
                    own.CompleteTask(
                        task_pb2.CompleteTaskRequest(
                            task_id=answer.task.id,
                            lease_token=answer.lease_token,
                            reported_usage=task_pb2.ReportedUsage(cost_nanos=2),
                        )
                    )
                    done += 1
            return done

        with ThreadPoolExecutor(5) as pool:
            workers = [pool.submit(work) for _ in range(4)]
            for zone in ["Pacific/Kiritimati", "Pacific/Pago_Pago"] * 6:
                stub.UpdateSettings(task_pb2.UpdateSettingsRequest(timezone=zone), timeout=10)
            stop.set()
            done = sum(w.result() for w in workers)
        assert done > 0
        spent = stub.GetSettings(task_pb2.GetSettingsRequest()).settings.spent_today_nanos
        with psycopg.connect(url, autocommit=True, row_factory=dict_row) as db:
            assert_invariants(db, tool_id)
            ledger = db.execute(
                "SELECT COALESCE(sum(cost_nanos), 0)::bigint AS cost FROM generation.attempts "
                "WHERE local_day = (SELECT (now() AT TIME ZONE timezone)::date "
                "                   FROM generation.settings)"
            ).fetchone()
        assert ledger == {"cost": spent} and spent == 2 * done
    finally:
        service.stop()


# --- the lease floor --------------------------------------------------------------------------


def test_a_lease_shorter_than_the_floor_is_refused(stub: Stub, tool_id: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, lease_seconds=1))
    error = from_rpc_error(caught.value)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "lease_seconds" in str(error)
    stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, lease_seconds=10))
    answer = stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id))
    claimed = stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id))
    assert claimed.task.id == answer.task.id and claimed.lease.seconds == 10


# --- a migration under a running replica ------------------------------------------------------


def test_a_column_added_under_a_running_replica_does_not_break_its_statements(
    databases: Databases, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A rolling deploy migrates while old replicas serve: their statements, prepared on each
    pooled connection, meet a table whose rows changed shape ("cached plan must not change
    result type"). The service re-prepares them on a fresh connection instead of failing."""
    url = url_for(databases.create("reprepare"))
    service = ServiceProcess(
        url, tmp_path_factory.mktemp("reprepare") / "serve.log", GENQ_POOL_MAX_SIZE="2"
    )
    try:
        stub = service.stub
        tool_id = str(stub.UpsertTool(task_pb2.UpsertToolRequest(name="t")).tool.id)
        task = queue(stub, tool_id)
        for _ in range(4):  # prepared on every pooled connection
            stub.GetTask(task_pb2.GetTaskRequest(task_id=task.id))
        with psycopg.connect(url, autocommit=True) as db:
            db.execute("ALTER TABLE generation.tasks ADD COLUMN added_by_a_later_release integer")
        for _ in range(4):
            assert stub.GetTask(task_pb2.GetTaskRequest(task_id=task.id)).task.id == task.id
    finally:
        service.stop()
