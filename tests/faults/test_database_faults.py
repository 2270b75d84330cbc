"""A database that freezes, restarts, runs out of connections, or a service killed mid-enqueue:
the service never hangs a call past its deadline, health says NOT_SERVING within 5 s of the
database stopping, and it recovers on its own when the database is back.

Every fault is done to a private Postgres (tests/private_postgres.py), never the shared one.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from generation.task.v1 import task_pb2, task_pb2_grpc
from service.api.errors import DatabaseUnavailable
from service.database import STOP_STATEMENT_SECONDS, Database, connection_kwargs
from service.settings import Settings
from tests.conftest import ServiceProcess, wait_for
from tests.private_postgres import PrivatePostgres, private_postgres

TEMPLATE = "genq_template"
HEALTH_BOUND = 5.0  # seconds from the database stopping to NOT_SERVING
SLACK = 0.5  # seconds a call may overrun its deadline (thread scheduling, the client's own timer)
FAILED_FAST = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE}
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def cluster() -> Iterator[PrivatePostgres]:
    with private_postgres(TEMPLATE) as pg:
        yield pg


class Faults:
    """A fresh database on the private cluster, and the services a test starts on it."""

    def __init__(self, cluster: PrivatePostgres, tmp_path: Path) -> None:
        self.cluster = cluster
        self.tmp_path = tmp_path
        self.name = f"faults_{uuid.uuid4().hex[:8]}"
        self.url = cluster.create(self.name, template=TEMPLATE)
        self.services: list[ServiceProcess] = []

    def serve(self, **env: str) -> ServiceProcess:
        log = self.tmp_path / f"serve{len(self.services)}.log"
        service = ServiceProcess(self.url, log, GENQ_SHUTDOWN_GRACE_SECONDS="1", **env)
        self.services.append(service)
        return service

    def existing(self, task_ids: list[str]) -> set[str]:
        with self.cluster.connect(self.name) as connection:
            rows = connection.execute(
                "SELECT id::text FROM generation.tasks WHERE id::text = ANY(%s)", [task_ids]
            ).fetchall()
        return {row[0] for row in rows}

    def close(self) -> None:
        self.cluster.thaw()
        if self.cluster.pid() is None:
            self.cluster.start()
        for service in self.services:
            service.stop()


@pytest.fixture
def faults(cluster: PrivatePostgres, tmp_path: Path) -> Iterator[Faults]:
    harness = Faults(cluster, tmp_path)
    try:
        yield harness
    finally:
        harness.close()


def new_tool(service: ServiceProcess) -> str:
    name = f"tool-{uuid.uuid4().hex[:12]}"
    return str(service.stub.UpsertTool(task_pb2.UpsertToolRequest(name=name), timeout=5).tool.id)


def not_serving(service: ServiceProcess) -> bool:
    try:
        response = service.health.Check(health_pb2.HealthCheckRequest(), timeout=1)
    except grpc.RpcError:
        return False
    return bool(response.status == NOT_SERVING)


def seconds_until(condition: Callable[[], object], timeout: float, what: str) -> float:
    started = time.monotonic()
    wait_for(condition, timeout=timeout, what=what)
    return time.monotonic() - started


def timed_call(call: Callable[[], object]) -> tuple[grpc.StatusCode, float]:
    started = time.monotonic()
    try:
        call()
    except grpc.RpcError as error:
        return error.code(), time.monotonic() - started
    return grpc.StatusCode.OK, time.monotonic() - started


@dataclass
class Call:
    started: float
    ended: float
    code: grpc.StatusCode
    task_id: str | None


class Load:
    """A few threads enqueueing, each call with `deadline`; every outcome recorded."""

    def __init__(
        self,
        stub: task_pb2_grpc.GenerationDataServiceStub,
        tool_id: str,
        threads: int = 4,
        deadline: float = 1.0,
    ) -> None:
        self.stub = stub
        self.tool_id = tool_id
        self.deadline = deadline
        self.calls: list[Call] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> list[Call]:
        self.stopping.set()
        for thread in self.threads:
            thread.join(self.deadline + 10)
            assert not thread.is_alive(), "a call never returned"
        return self.calls

    def _run(self) -> None:
        n = 0
        while not self.stopping.is_set():
            n += 1
            request = task_pb2.QueueTaskRequest(tool_id=self.tool_id, input={"n": n})
            started = time.monotonic()
            try:
                task = self.stub.QueueTask(request, timeout=self.deadline).task
                code, task_id = grpc.StatusCode.OK, str(task.id)
            except grpc.RpcError as error:
                code, task_id = error.code(), None
            with self.lock:
                self.calls.append(Call(started, time.monotonic(), code, task_id))
            if code != grpc.StatusCode.OK:
                self.stopping.wait(0.05)  # refused at once while down: do not spin

    def count(self, code: grpc.StatusCode | None = None, after: float = 0.0) -> int:
        """Calls that ended with `code` (None: with any error) and started after `after`."""
        with self.lock:
            calls = list(self.calls)
        return sum(
            1
            for call in calls
            if call.started >= after
            and (call.code == code if code else call.code != grpc.StatusCode.OK)
        )

    def acknowledged(self) -> list[str]:
        return [call.task_id for call in self.calls if call.task_id is not None]

    def overruns(self) -> list[Call]:
        return [c for c in self.calls if c.ended - c.started > self.deadline + SLACK]


# GUIDE fault 20: Postgres SIGSTOPped while the service is idle.
def test_frozen_database_while_idle(faults: Faults) -> None:
    service = faults.serve()
    tool_id = new_tool(service)
    task = service.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id), timeout=5).task

    faults.cluster.freeze()
    took = seconds_until(lambda: not_serving(service), HEALTH_BOUND, "health NOT_SERVING")
    print(f"\nidle freeze: NOT_SERVING after {took:.2f} s")

    code, elapsed = timed_call(
        lambda: service.stub.GetTask(task_pb2.GetTaskRequest(task_id=task.id), timeout=2)
    )
    print(f"idle freeze: a call with a 2 s deadline ended {code.name} after {elapsed:.2f} s")
    assert code in FAILED_FAST
    assert elapsed <= 2 + SLACK

    faults.cluster.thaw()
    took = seconds_until(service.serving, 15, "health SERVING after SIGCONT")
    print(f"idle freeze: SERVING {took:.2f} s after SIGCONT")
    got = service.stub.GetTask(task_pb2.GetTaskRequest(task_id=task.id), timeout=5).task
    assert got.id == task.id
    assert service.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id), timeout=5).task.id


def test_a_stop_with_the_database_frozen_ends_within_its_bounds(faults: Faults) -> None:
    """What a stop writes (the leader's lease given up, this replica's overrides withdrawn)
    waits STOP_STATEMENT_SECONDS at most on a frozen database: each lapses on its own. It
    waited the pool's whole bound (17 s) each, past docker compose's 15 s stop (found in
    review)."""
    service = faults.serve(GENQ_DAILY_CAP_NANOS="1000")
    new_tool(service)
    wait_for(
        lambda: "now runs the maintenance sweeps" in service.log_path.read_text(), 15, "a leader"
    )
    faults.cluster.freeze()
    stopped = time.monotonic()
    service.process.send_signal(signal.SIGTERM)
    service.process.wait(timeout=60)
    took = time.monotonic() - stopped
    print(f"\nstop with the database frozen: exited after {took:.1f} s")
    bound = 1 + 3 * STOP_STATEMENT_SECONDS + HEALTH_BOUND  # grace 1 s, each write, slack
    assert took < bound, f"the stop took {took:.1f} s (bound {bound:.1f} s)"


# Fault 7: SIGSTOP under load, longer than a call's deadline.
def test_frozen_database_under_load(faults: Faults) -> None:
    service = faults.serve()
    tool_id = new_tool(service)
    with Load(service.stub, tool_id, threads=4, deadline=1.0) as load:
        wait_for(lambda: load.count(grpc.StatusCode.OK) >= 20, 10, "enqueues before the freeze")

        frozen_at = time.monotonic()
        faults.cluster.freeze()
        took = seconds_until(lambda: not_serving(service), HEALTH_BOUND, "health NOT_SERVING")
        print(f"\nfreeze under load: NOT_SERVING after {took:.2f} s")
        # Frozen for three deadlines, with calls failing all along.
        wait_for(
            lambda: (
                time.monotonic() - frozen_at >= 3 * load.deadline
                and load.count(after=frozen_at) >= 8
            ),
            10,
            "calls to fail during the freeze",
        )
        faults.cluster.thaw()
        thawed_at = time.monotonic()
        took = seconds_until(service.serving, 15, "health SERVING after SIGCONT")
        print(f"freeze under load: SERVING {took:.2f} s after SIGCONT")
        wait_for(
            lambda: load.count(grpc.StatusCode.OK, after=thawed_at + took) >= 20,
            10,
            "enqueues to succeed again",
        )
    calls = load.stop()

    assert not load.overruns(), f"calls past their deadline: {load.overruns()}"
    assert {call.code for call in calls} <= {grpc.StatusCode.OK} | FAILED_FAST
    slowest = max(c.ended - c.started for c in calls)
    print(f"freeze under load: {len(calls)} calls, slowest {slowest:.2f} s (deadline 1 s)")
    acknowledged = load.acknowledged()
    assert faults.existing(acknowledged) == set(acknowledged)


# Fault 6: Postgres restarted under load.
def test_restarted_database_under_load(faults: Faults) -> None:
    # A pool wait shorter than the deadline: a call waiting for a connection answers UNAVAILABLE.
    service = faults.serve(GENQ_POOL_TIMEOUT_SECONDS="1")
    tool_id = new_tool(service)
    with Load(service.stub, tool_id, threads=4, deadline=3.0) as load:
        wait_for(lambda: load.count(grpc.StatusCode.OK) >= 20, 10, "enqueues before the restart")

        stopped_at = time.monotonic()
        faults.cluster.stop("immediate")  # a crash: no goodbye to the clients
        took = seconds_until(lambda: not_serving(service), HEALTH_BOUND, "health NOT_SERVING")
        print(f"\nrestart: NOT_SERVING {took:.2f} s after the stop")
        wait_for(lambda: load.count(after=stopped_at) >= 4, 10, "calls to fail while down")
        faults.cluster.start()
        started_at = time.monotonic()
        took = seconds_until(service.serving, 15, "health SERVING after the restart")
        print(f"restart: SERVING {took:.2f} s after the start")
        wait_for(
            lambda: load.count(grpc.StatusCode.OK, after=started_at + took) >= 20,
            10,
            "enqueues to succeed again",
        )
    calls = load.stop()

    codes = {call.code for call in calls}
    assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
    assert grpc.StatusCode.UNAVAILABLE in codes
    assert not load.overruns(), f"calls past their deadline: {load.overruns()}"
    acknowledged = load.acknowledged()
    assert faults.existing(acknowledged) == set(acknowledged), "an acknowledged enqueue was lost"
    print(
        f"restart: {len(calls)} calls, {load.count(grpc.StatusCode.UNAVAILABLE)} UNAVAILABLE,"
        f" {len(acknowledged)} acknowledged, all in the table"
    )


# Fault 8: the pool exhausted by a statement that blocks.
def test_exhausted_pool_answers_unavailable_within_the_deadline(faults: Faults) -> None:
    service = faults.serve(
        GENQ_POOL_MIN_SIZE="1", GENQ_POOL_MAX_SIZE="1", GENQ_POOL_TIMEOUT_SECONDS="1.5"
    )
    tool_id = new_tool(service)
    task = service.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id), timeout=5).task
    get = task_pb2.GetTaskRequest(task_id=task.id)

    with (
        faults.cluster.connect(faults.name) as blocker,
        faults.cluster.connect("postgres") as admin,
    ):
        blocker.execute("BEGIN")
        blocker.execute("LOCK TABLE generation.tasks IN ACCESS EXCLUSIVE MODE")
        blocked: list[grpc.StatusCode] = []
        enqueue = threading.Thread(
            target=lambda: blocked.append(
                timed_call(
                    lambda: service.stub.QueueTask(
                        task_pb2.QueueTaskRequest(tool_id=tool_id), timeout=8
                    )
                )[0]
            )
        )
        enqueue.start()

        def waiting_on_the_lock() -> bool:
            row = admin.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = %s AND wait_event_type = 'Lock'",
                [faults.name],
            ).fetchone()
            return bool(row and row[0] >= 1)

        wait_for(waiting_on_the_lock, 10, "the service's one connection to wait on the lock")

        code, elapsed = timed_call(lambda: service.stub.GetTask(get, timeout=3))
        print(
            f"\nexhausted pool: a call with a 3 s deadline ended {code.name} after {elapsed:.2f} s"
        )
        assert code == grpc.StatusCode.UNAVAILABLE  # the pool wait (1.5 s) ran out first
        assert elapsed <= 3

        code, elapsed = timed_call(lambda: service.stub.GetTask(get, timeout=1))
        print(f"exhausted pool: a call with a 1 s deadline ended {code.name} after {elapsed:.2f} s")
        assert code in FAILED_FAST
        assert elapsed <= 1 + SLACK

        blocker.execute("ROLLBACK")
    enqueue.join(10)
    assert not enqueue.is_alive()
    assert blocked[0] in {grpc.StatusCode.OK} | FAILED_FAST

    wait_for(service.serving, 10, "health SERVING once the lock is gone")
    assert service.stub.GetTask(get, timeout=5).task.id == task.id


# Fault 14: the service killed with kill -9 mid-enqueue, restarted on the same database.
def test_killed_service_loses_no_acknowledged_enqueue(faults: Faults) -> None:
    service = faults.serve()
    tool_id = new_tool(service)
    with Load(service.stub, tool_id, threads=4, deadline=3.0) as load:
        wait_for(lambda: load.count(grpc.StatusCode.OK) >= 30, 10, "enqueues before the kill")
        killed_at = time.monotonic()
        service.process.kill()
        service.process.wait(10)
        wait_for(lambda: load.count(after=killed_at) >= 4, 10, "calls to fail after the kill")
    calls = load.stop()
    assert not load.overruns()

    restarted = faults.serve()
    acknowledged = load.acknowledged()
    assert faults.existing(acknowledged) == set(acknowledged), "an acknowledged enqueue was lost"
    got = restarted.stub.GetTask(task_pb2.GetTaskRequest(task_id=acknowledged[-1]), timeout=5)
    assert got.task.id == acknowledged[-1]
    assert restarted.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id), timeout=5).task.id
    print(f"\nkill -9: {len(calls)} calls, {len(acknowledged)} acknowledged, all in the table")


# The reported defect's second half: the service's own backends stopped, the server otherwise up.
def test_stopped_backends_turn_health_not_serving_and_get_replaced(faults: Faults) -> None:
    service = faults.serve()
    tool_id = new_tool(service)
    task = service.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id), timeout=5).task

    pids = faults.cluster.freeze_backends(faults.name)
    assert pids, "the service holds no connection"
    took = seconds_until(lambda: not_serving(service), HEALTH_BOUND, "health NOT_SERVING")
    print(f"\nbackends stopped: NOT_SERVING after {took:.2f} s")
    # Without SIGCONT: the wedged connections are dropped and replaced by fresh ones.
    took = seconds_until(service.serving, 30, "health SERVING on new connections")
    print(f"backends stopped: SERVING again {took:.2f} s later, the old backends still stopped")
    wait_for(
        lambda: (
            timed_call(
                lambda: service.stub.GetTask(task_pb2.GetTaskRequest(task_id=task.id), timeout=2)
            )[0]
            == grpc.StatusCode.OK
        ),
        30,
        "calls to work on new connections",
    )


# `Database.fetch` itself: the caller's timeout bounds the wait for a connection and the statement.
def test_fetch_never_waits_past_its_timeout(faults: Faults) -> None:
    settings = Settings(pool_min_size=1, pool_max_size=1, pool_timeout_seconds=5)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        database = Database(faults.url, settings)
        await database.open()
        try:
            await database.pool.wait(timeout=10)

            async with database.pool.connection():  # the one connection, held
                started = loop.time()
                with pytest.raises(DatabaseUnavailable):
                    await database.fetch("SELECT 1", {}, timeout=0.5)
                waited = loop.time() - started
            print(f"\nfetch: gave up waiting for a connection after {waited:.2f} s (timeout 0.5)")
            assert 0.4 <= waited <= 0.5 + SLACK

            faults.cluster.freeze()
            try:
                started = loop.time()
                with pytest.raises(DatabaseUnavailable):
                    await database.fetch("SELECT 1", {}, timeout=1.0)
                took = loop.time() - started
                print(f"fetch: a statement on a frozen server gave up after {took:.2f} s")
                assert took <= 1.0 + SLACK

                started = loop.time()
                assert not await database.ping()
                took = loop.time() - started
                print(f"fetch: ping on a frozen server answered False after {took:.2f} s")
                assert took <= settings.ping_timeout_seconds + SLACK
            finally:
                faults.cluster.thaw()

            deadline = loop.time() + 15
            while not await database.ping():
                assert loop.time() < deadline, "the pool did not recover after SIGCONT"
                await asyncio.sleep(0.1)
            assert await database.fetch("SELECT 1 AS one", {}, timeout=5) == [{"one": 1}]
        finally:
            await database.close()

    asyncio.run(scenario())


def test_connections_are_set_to_notice_a_dead_server(faults: Faults) -> None:
    settings = Settings(pool_min_size=1, pool_max_size=1)
    # The URL's own values win.
    given = connection_kwargs("postgresql://h/db?connect_timeout=7&keepalives_idle=30", settings)
    assert "connect_timeout" not in given and "keepalives_idle" not in given
    assert given["keepalives"] == 1 and given["tcp_user_timeout"] == 10_000

    async def scenario() -> dict[str, bytes | None]:
        database = Database(faults.url, settings)
        await database.open()
        try:
            async with database.pool.connection(timeout=10) as connection:
                return {o.keyword.decode(): o.val for o in connection.pgconn.info}
        finally:
            await database.close()

    options = asyncio.run(scenario())
    assert options["connect_timeout"] == b"3"
    assert options["keepalives"] == b"1"
    assert options["keepalives_idle"] == b"10"
    assert options["keepalives_interval"] == b"3"
    assert options["keepalives_count"] == b"3"
    assert options["tcp_user_timeout"] == b"10000"
