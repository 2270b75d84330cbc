"""ConfirmClaim: one call confirms a claim's tasks, one row per claim, fenced by (task, token)."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import psycopg
import pytest
from psycopg.rows import dict_row

from generation.task.v1 import task_pb2
from service.api.rpcs import HAND_BACK_SQL, STATEMENTS
from tests.conftest import wait_for
from tests.integration.test_semantics import Db, Stub, lapse_lease, queue, row
from workers_sdk.errors import from_rpc_error

WRONG_TOKEN = "00000000-0000-0000-0000-00000000dead"
CONFIRM_SQL = (
    "SELECT c.task_id, c.cancel_requested "
    "FROM generation.confirm_claim_v1(%(tool_id)s, %(lease_token)s, %(task_ids)s::uuid[]) AS c"
)


def claim_batch(stub: Stub, tool_id: str, limit: int) -> task_pb2.ClaimTasksResponse:
    return stub.ClaimTasks(task_pb2.ClaimTasksRequest(tool_id=tool_id, limit=limit))


def confirm(
    stub: Stub, tool_id: str, token: str, task_ids: list[str]
) -> task_pb2.ConfirmClaimResponse:
    return stub.ConfirmClaim(
        task_pb2.ConfirmClaimRequest(tool_id=tool_id, lease_token=token, task_ids=task_ids)
    )


def confirmations(db: Db, token: str) -> int:
    found = db.execute(
        "SELECT count(*) AS n FROM generation.claim_confirmations WHERE lease_token = %s", [token]
    ).fetchone()
    assert found is not None
    return int(found["n"])


def tuple_versions(db: Db, ids: list[str]) -> list[tuple[str, str]]:
    """Where each task's row version lives and who wrote it: a write moves both."""
    found = db.execute(
        "SELECT ctid::text AS place, xmin::text AS writer FROM generation.tasks "
        "WHERE id = ANY (%s::uuid[]) ORDER BY id",
        [ids],
    ).fetchall()
    return [(f["place"], f["writer"]) for f in found]


def test_one_call_confirms_a_whole_claim_under_its_one_token(
    stub: Stub, db: Db, tool_id: str
) -> None:
    for _ in range(3):
        queue(stub, tool_id)
    claimed = claim_batch(stub, tool_id, 3)
    tokens = {c.lease_token for c in claimed.tasks}
    assert len(claimed.tasks) == 3 and len(tokens) == 1, "a claim's tasks share one token"
    (token,) = tokens
    ids = [c.task.id for c in claimed.tasks]
    before = [row(db, task_id) for task_id in ids]
    versions = tuple_versions(db, ids)

    answer = confirm(stub, tool_id, token, ids[::-1])

    assert list(answer.task_ids) == ids[::-1], "held, in request order"
    assert list(answer.cancel_requested_task_ids) == []
    assert confirmations(db, token) == 1
    assert [row(db, task_id) for task_id in ids] == before
    assert tuple_versions(db, ids) == versions, "no task row gets a new version"


def test_a_lapse_after_confirm_claim_costs_a_retry_an_unconfirmed_one_none(
    stub: Stub, db: Db, tool_id: str
) -> None:
    first, second = queue(stub, tool_id, priority=1), queue(stub, tool_id)
    confirmed = claim_batch(stub, tool_id, 1).tasks[0]
    assert confirmed.task.id == first.id
    unconfirmed = claim_batch(stub, tool_id, 1).tasks[0]
    assert unconfirmed.task.id == second.id
    confirm(stub, tool_id, confirmed.lease_token, [first.id])

    lapse_lease(db, first.id)
    lapse_lease(db, second.id)

    ran = row(db, first.id)
    assert (ran["status"], ran["retry_count"], ran["unconfirmed_claims"]) == ("queued", 1, 0)
    lost = row(db, second.id)
    assert (lost["status"], lost["retry_count"], lost["unconfirmed_claims"]) == ("queued", 0, 1)


def test_a_token_task_mismatch_or_a_stolen_lease_answers_the_task_lost(
    stub: Stub, db: Db, tool_id: str
) -> None:
    task, other = queue(stub, tool_id, priority=1), queue(stub, tool_id)
    mine = claim_batch(stub, tool_id, 1).tasks[0]
    theirs = claim_batch(stub, tool_id, 1).tasks[0]
    assert (mine.task.id, theirs.task.id) == (task.id, other.id)
    assert mine.lease_token != theirs.lease_token

    # Another claim's task under this claim's token, a wrong token, an unknown task, a wrong tool.
    assert list(confirm(stub, tool_id, mine.lease_token, [other.id]).task_ids) == []
    assert list(confirm(stub, tool_id, WRONG_TOKEN, [task.id]).task_ids) == []
    assert list(confirm(stub, tool_id, mine.lease_token, [WRONG_TOKEN]).task_ids) == []
    stranger = stub.UpsertTool(task_pb2.UpsertToolRequest(name=f"other-{task.id}")).tool.id
    assert list(confirm(stub, stranger, mine.lease_token, [task.id]).task_ids) == []
    assert confirmations(db, mine.lease_token) == 0
    assert confirmations(db, WRONG_TOKEN) == 0

    # Stolen: the lease lapsed unconfirmed and the task went to a new claim.
    lapse_lease(db, task.id)
    again = claim_batch(stub, tool_id, 1).tasks[0]
    assert again.task.id == task.id and again.lease_token != mine.lease_token
    assert list(confirm(stub, tool_id, mine.lease_token, [task.id]).task_ids) == []
    assert confirmations(db, mine.lease_token) == 0
    assert list(confirm(stub, tool_id, again.lease_token, [task.id]).task_ids) == [task.id]


def test_a_repeated_confirm_claim_answers_the_same(stub: Stub, db: Db, tool_id: str) -> None:
    for _ in range(2):
        queue(stub, tool_id)
    claimed = claim_batch(stub, tool_id, 2)
    token, ids = claimed.tasks[0].lease_token, [c.task.id for c in claimed.tasks]
    stub.CancelTask(task_pb2.CancelTaskRequest(task_id=ids[1]))

    first = confirm(stub, tool_id, token, ids)
    second = confirm(stub, tool_id, token, ids)

    assert first == second
    assert list(first.task_ids) == ids
    assert list(first.cancel_requested_task_ids) == [ids[1]]
    assert confirmations(db, token) == 1


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_id": "nope", "lease_token": "TOKEN", "task_ids": ["TASK"]},
        {"lease_token": "", "task_ids": ["TASK"]},
        {"lease_token": "not-a-uuid", "task_ids": ["TASK"]},
        {"lease_token": "TOKEN", "task_ids": []},
        {"lease_token": "TOKEN", "task_ids": ["TASK", "x"]},
        {"lease_token": "TOKEN", "task_ids": ["TASK", "TASK"]},
        {"lease_token": "TOKEN", "task_ids": ["TASK"] + [WRONG_TOKEN] * 1000},
    ],
)
def test_bad_input_is_invalid_and_changes_nothing(
    stub: Stub, db: Db, tool_id: str, fields: dict[str, Any]
) -> None:
    task = queue(stub, tool_id)
    claimed = claim_batch(stub, tool_id, 1).tasks[0]
    given = {"tool_id": tool_id, **fields}
    if given["lease_token"] == "TOKEN":
        given["lease_token"] = claimed.lease_token
    given["task_ids"] = [task.id if x == "TASK" else x for x in given["task_ids"]]
    request = task_pb2.ConfirmClaimRequest(**given)
    before = row(db, task.id)
    with pytest.raises(grpc.RpcError) as caught:
        stub.ConfirmClaim(request)
    assert from_rpc_error(caught.value).code == grpc.StatusCode.INVALID_ARGUMENT
    assert row(db, task.id) == before
    assert confirmations(db, claimed.lease_token) == 0


def waiting_on_a_lock(db: Db, fragment: str) -> bool:
    found = db.execute(
        "SELECT count(*) AS n FROM pg_stat_activity "
        "WHERE wait_event_type = 'Lock' AND query LIKE %s",
        [f"%{fragment}%"],
    ).fetchone()
    return found is not None and found["n"] > 0


def test_confirm_claim_waits_for_a_hand_back_in_flight_and_answers_the_task_lost(
    stub: Stub, db: Db, database_url: str, tool_id: str
) -> None:
    task = queue(stub, tool_id)
    claimed = claim_batch(stub, tool_id, 1).tasks[0]
    answers: list[task_pb2.ConfirmClaimResponse] = []
    with psycopg.connect(database_url, row_factory=dict_row) as hand_back:
        hand_back.execute(
            HAND_BACK_SQL, {"task_id": task.id, "lease_token": claimed.lease_token}
        )  # not committed yet: holds the task's row
        confirming = threading.Thread(
            target=lambda: answers.append(confirm(stub, tool_id, claimed.lease_token, [task.id]))
        )
        confirming.start()
        wait_for(lambda: waiting_on_a_lock(db, "confirm_claim_v1"), what="ConfirmClaim to wait")
        hand_back.commit()
    confirming.join(timeout=30)
    assert [list(a.task_ids) for a in answers] == [[]], "handed back: lost to the worker"
    assert row(db, task.id)["status"] == "queued"
    assert confirmations(db, claimed.lease_token) == 0


def test_a_hand_back_waits_for_a_confirm_in_flight_and_leaves_the_task_held(
    stub: Stub, db: Db, database_url: str, tool_id: str
) -> None:
    task = queue(stub, tool_id)
    claimed = claim_batch(stub, tool_id, 1).tasks[0]
    handed: list[list[dict[str, Any]]] = []

    def hand_back() -> None:
        with psycopg.connect(database_url, autocommit=True, row_factory=dict_row) as connection:
            handed.append(
                connection.execute(
                    HAND_BACK_SQL, {"task_id": task.id, "lease_token": claimed.lease_token}
                ).fetchall()
            )

    with psycopg.connect(database_url, row_factory=dict_row) as confirming:
        answer = confirming.execute(
            CONFIRM_SQL,
            {"tool_id": tool_id, "lease_token": claimed.lease_token, "task_ids": [task.id]},
        ).fetchall()
        assert [str(a["task_id"]) for a in answer] == [task.id]
        thread = threading.Thread(target=hand_back)
        thread.start()
        wait_for(lambda: waiting_on_a_lock(db, "release_task_v1"), what="the hand-back to wait")
        confirming.commit()
    thread.join(timeout=30)
    assert len(handed) == 1 and handed[0][0]["event"] is None, "the hand-back left it alone"
    held = row(db, task.id)
    assert (held["status"], str(held["lease_token"])) == ("processing", claimed.lease_token)


def race_once(stub: Stub, db: Db, database_url: str, tool_id: str) -> bool:
    """ConfirmClaim and the hand-back of one claim, started together; True when confirm won."""
    task = queue(stub, tool_id)
    claimed = claim_batch(stub, tool_id, 1).tasks[0]
    answers: list[task_pb2.ConfirmClaimResponse] = []
    start = threading.Barrier(2)

    def confirming() -> None:
        start.wait()
        answers.append(confirm(stub, tool_id, claimed.lease_token, [task.id]))

    def hand_back() -> None:
        with psycopg.connect(database_url, autocommit=True) as connection:
            start.wait()
            connection.execute(
                HAND_BACK_SQL, {"task_id": task.id, "lease_token": claimed.lease_token}
            )

    threads = [threading.Thread(target=confirming), threading.Thread(target=hand_back)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    stored = row(db, task.id)
    won = list(answers[0].task_ids) == [task.id]
    if won:
        assert (stored["status"], str(stored["lease_token"])) == (
            "processing",
            claimed.lease_token,
        )
    else:
        assert list(answers[0].task_ids) == [] and stored["status"] == "queued"
    stub.CancelTask(task_pb2.CancelTaskRequest(task_id=task.id))
    return won


def test_confirm_claim_racing_the_hand_back_exactly_one_wins(
    stub: Stub, db: Db, database_url: str, tool_id: str
) -> None:
    for _ in range(20):
        race_once(stub, db, database_url, tool_id)


def test_purge_deletes_the_confirmations_no_running_task_holds(
    stub: Stub, db: Db, tool_id: str
) -> None:
    done, running = queue(stub, tool_id, priority=1), queue(stub, tool_id)
    first = claim_batch(stub, tool_id, 1).tasks[0]
    second = claim_batch(stub, tool_id, 1).tasks[0]
    assert (first.task.id, second.task.id) == (done.id, running.id)
    confirm(stub, tool_id, first.lease_token, [done.id])
    confirm(stub, tool_id, second.lease_token, [running.id])
    stub.CompleteTask(task_pb2.CompleteTaskRequest(task_id=done.id, lease_token=first.lease_token))

    db.execute(
        STATEMENTS["PurgeTasks"], {"older_than_days": None, "batch_size": 1, "dry_run": False}
    )

    assert confirmations(db, first.lease_token) == 0
    assert confirmations(db, second.lease_token) == 1
