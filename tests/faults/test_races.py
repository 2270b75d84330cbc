"""Races: many claimers at once never share a task and never deadlock (GUIDE §5.1)."""

from __future__ import annotations

import threading
from collections import Counter

import grpc

from generation.task.v1 import task_pb2, task_pb2_grpc
from tests.conftest import ServiceProcess
from tests.integration.test_semantics import Db, Stub, queue

CLAIMERS = 32
TASKS = 1_000


def test_32_claimers_over_1000_tasks_claim_each_exactly_once(
    service: ServiceProcess, stub: Stub, db: Db, tool_id: str
) -> None:
    db.execute(
        "INSERT INTO generation.tasks (tool_id) SELECT %s FROM generate_series(1, %s)",
        [tool_id, TASKS],
    )
    claimed: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(CLAIMERS)

    def claimer() -> None:
        with grpc.insecure_channel(service.address) as channel:
            own = task_pb2_grpc.GenerationDataServiceStub(channel)
            start.wait()
            try:
                while True:
                    answer = own.ClaimNextTask(
                        task_pb2.ClaimNextTaskRequest(tool_id=tool_id), timeout=30
                    )
                    if not answer.HasField("task"):
                        return
                    claimed.append(answer.task.id)
            except BaseException as error:  # reported below; a thread cannot fail the test
                errors.append(error)

    threads = [threading.Thread(target=claimer) for _ in range(CLAIMERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "claimers hung: deadlock?"
    assert errors == []

    assert len(claimed) == TASKS
    assert Counter(claimed).most_common(1)[0][1] == 1, "a task was claimed twice"
    states = db.execute(
        "SELECT status, count(DISTINCT lease_token) AS leases, count(*) AS n "
        "FROM generation.tasks WHERE tool_id = %s GROUP BY status",
        [tool_id],
    ).fetchall()
    assert states == [{"status": "processing", "leases": TASKS, "n": TASKS}]


def test_64_claimers_racing_on_one_task_one_wins(
    service: ServiceProcess, stub: Stub, tool_id: str
) -> None:
    task = queue(stub, tool_id)
    winners: list[str] = []
    start = threading.Barrier(64)

    def claimer() -> None:
        with grpc.insecure_channel(service.address) as channel:
            own = task_pb2_grpc.GenerationDataServiceStub(channel)
            start.wait()
            answer = own.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id), timeout=30)
            if answer.HasField("task"):
                winners.append(answer.task.id)

    threads = [threading.Thread(target=claimer) for _ in range(64)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert winners == [task.id]
