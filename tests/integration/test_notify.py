"""Wakes across processes and replicas without Redis: Postgres NOTIFY after the commit, coalesced
per tool, LISTENed by every process, which reconnects when its connection drops."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
import pytest
from google.protobuf import duration_pb2

from generation.task.v1 import task_pb2
from service.api.signals import WAKE_CHANNEL, Signals
from service.settings import Settings
from tests.conftest import Databases, ServiceProcess, url_for, wait_for

NO_RECHECK = {"GENQ_RECHECK_SECONDS": "30"}  # a parked claim woken in time was woken by NOTIFY


@pytest.fixture(scope="module")
def notify_url(databases: Databases) -> str:
    return url_for(databases.create("notify"))


@pytest.fixture(scope="module")
def pair(
    notify_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServiceProcess]]:
    """Two `genq serve`, one process each, without Redis, on one database."""
    logs = tmp_path_factory.mktemp("notify")
    started = [
        ServiceProcess(
            notify_url, logs / f"{name}.log", GENQ_PROCESSES="1", REDIS_ADDR="", **NO_RECHECK
        )
        for name in ("a", "b")
    ]
    try:
        for replica in started:
            wait_for(partial(listening, replica), what="the replica to LISTEN")
        yield started
    finally:
        for replica in started:
            replica.stop()


@pytest.fixture
def own_url(databases: Databases) -> str:
    """A database with no service on it: the only LISTEN session is the test's."""
    return url_for(databases.create(f"notify_{uuid.uuid4().hex[:6]}"))


def listening(replica: ServiceProcess) -> bool:
    return f"channel {WAKE_CHANNEL}" in replica.log_path.read_text()


def polled(url: str, tool_id: str) -> bool:
    """The tool's first claim statement has committed (it notes the poll): its caller is parked."""
    with psycopg.connect(url, autocommit=True) as db:
        found = db.execute("SELECT 1 FROM generation.tool_polls WHERE tool_id = %s", [tool_id])
        return found.fetchone() is not None


def test_a_claim_parked_in_one_replica_is_woken_by_an_enqueue_through_another(
    pair: list[ServiceProcess], notify_url: str
) -> None:
    a, b = pair
    latencies = []
    for _ in range(8):
        name = f"notify-{uuid.uuid4().hex[:8]}"
        tool = b.stub.UpsertTool(task_pb2.UpsertToolRequest(name=name)).tool.id
        answers: list[Any] = []
        request = task_pb2.ClaimNextTaskRequest(
            tool_id=tool, wait=duration_pb2.Duration(seconds=20)
        )

        def park(
            request: task_pb2.ClaimNextTaskRequest = request, answers: list[Any] = answers
        ) -> None:
            answers.append(a.stub.ClaimNextTask(request, timeout=30))
            answers.append(time.monotonic())

        parked = threading.Thread(target=park)
        parked.start()
        wait_for(partial(polled, notify_url, tool), what="the claim to park on A")
        sent = time.monotonic()
        task = b.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool)).task
        parked.join(30)
        claimed, answered = answers
        assert claimed.task.id == task.id
        latencies.append(answered - sent)
    ms = sorted(1000 * x for x in latencies)
    print(
        f"\nwoken across replicas by NOTIFY: p50 {statistics.median(ms):.1f} ms, max {ms[-1]:.1f}"
    )
    assert ms[-1] < 2000, "a wake took longer than NOTIFY should (the re-check is 30 s)"


def test_wakes_are_coalesced_per_tool_and_carry_the_count(own_url: str) -> None:
    notify_url = own_url

    async def scenario() -> list[psycopg.Notify]:
        listener = await psycopg.AsyncConnection.connect(notify_url, autocommit=True)
        await listener.execute(f"LISTEN {WAKE_CHANNEL}")
        signals = Signals(Settings(), notify_url)
        try:
            for _ in range(100):  # one turn of the loop: one send starts, the rest collect
                signals.task_queued("tool-a")
            for _ in range(5):
                signals.task_queued("tool-b", 10)
            assert signals._sender is not None
            await asyncio.wait_for(signals._sender, 10)
            received = []
            async for notify in listener.notifies(timeout=5, stop_after=1):
                received.append(notify)
            async for notify in listener.notifies(timeout=0.2):
                received.append(notify)  # what else the same sends carried
            return received
        finally:
            await signals.close()
            await listener.close()

    received = asyncio.run(scenario())
    counts: dict[str, int] = {}
    for notify in received:
        tool, _, count = notify.payload.partition(":")
        counts[tool] = counts.get(tool, 0) + int(count)
    assert counts == {"tool-a": 100, "tool-b": 50}
    assert len(received) <= 3, f"{len(received)} notifications for two tools: not coalesced"


def test_a_process_skips_its_own_wakes_and_reconnects_a_lost_listener(own_url: str) -> None:
    notify_url = own_url

    async def listening_backend(db: psycopg.AsyncConnection[Any], other_than: int | None) -> int:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            cursor = await db.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND query = %s AND pid <> %s",
                [f"LISTEN {WAKE_CHANNEL}", other_than or 0],
            )
            if row := await cursor.fetchone():
                return int(row[0])
            await asyncio.sleep(0.02)
        raise AssertionError("no LISTEN session")

    async def scenario() -> None:
        db = await psycopg.AsyncConnection.connect(notify_url, autocommit=True)
        signals = Signals(Settings(), notify_url)
        listen = asyncio.create_task(signals.listen())
        try:
            first = await listening_backend(db, None)
            # Its own wake: one parked claim woken in-process, and none again by the NOTIFY.
            mine = [signals.tools.register("tool-x") for _ in range(2)]
            signals.task_queued("tool-x")
            assert signals._sender is not None
            await asyncio.wait_for(signals._sender, 10)
            assert [w.done() for w in mine] == [True, False]
            marker = signals.tools.register("tool-y")
            # A stranger's payload the listener cannot read wakes at most one, ends nothing.
            await db.execute("SELECT pg_notify(%s, 'tool-w:²')", [WAKE_CHANNEL])
            await db.execute("SELECT pg_notify(%s, 'tool-w:' || repeat('9', 4301))", [WAKE_CHANNEL])
            await db.execute("SELECT pg_notify(%s, 'tool-y:1')", [WAKE_CHANNEL])
            await asyncio.wait_for(marker, 5)  # delivered after our own: that one was skipped
            assert not mine[1].done()

            # The listener's connection is cut: it reconnects, and wakes every parked claim once
            # (what was sent meanwhile is lost), then takes wakes again.
            await db.execute("SELECT pg_terminate_backend(%s)", [first])
            await asyncio.wait_for(mine[1], 10)
            await listening_backend(db, first)
            again = signals.tools.register("tool-z")
            await db.execute("SELECT pg_notify(%s, 'tool-z:1')", [WAKE_CHANNEL])
            await asyncio.wait_for(again, 5)
        finally:
            listen.cancel()
            await asyncio.gather(listen, return_exceptions=True)
            await signals.close()
            await db.close()

    asyncio.run(scenario())


def test_enqueues_never_fail_when_the_notifier_cannot_connect(tmp_path: Path) -> None:
    """A notifier that cannot reach Postgres drops its wakes (logged) and fails nothing."""

    async def scenario() -> None:
        signals = Signals(Settings(connect_timeout_seconds=2), "postgresql://nobody@127.0.0.1:1/x")
        waiter = signals.tools.register("tool-q")
        signals.task_queued("tool-q")  # the in-process wake still works
        assert waiter.done()
        assert signals._sender is not None
        await asyncio.wait_for(signals._sender, 10)
        signals.task_queued("tool-q")  # within the retry pause: dropped at once
        await asyncio.wait_for(signals._sender, 1)
        await signals.close()

    asyncio.run(scenario())
