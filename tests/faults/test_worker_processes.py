"""Worker processes under faults (GUIDE §5 faults 2 and 3, A9 drain): real `genq serve`, real
worker processes (tests/fleet_worker.py, examples/worker.py), real signals.

The service here runs 2 s leases and rescues lapsed ones every 0.2 s, so a lease runs out in
seconds; workers heartbeat every 0.5 s. Every wait is a `wait_for` with a deadline.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from generation.task.v1 import task_pb2, task_pb2_grpc
from tests.conftest import ROOT, Databases, ServiceProcess, url_for, wait_for
from tests.invariants import assert_invariants

LEASE_SECONDS = 2
Db = psycopg.Connection[dict[str, Any]]
Stub = task_pb2_grpc.GenerationDataServiceStub


class Worker:
    """One worker process; its log (stdout and stderr) goes to a file the test can read."""

    def __init__(self, script: Path, log_path: Path, env: dict[str, str]) -> None:
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            [sys.executable, str(script)],
            env={**os.environ, **env},
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return self.log_path.read_text()

    def expect_in_log(self, text: str, timeout: float = 10.0) -> None:
        try:
            wait_for(lambda: text in self.output(), timeout=timeout, what=repr(text))
        except AssertionError as error:
            raise AssertionError(f"{error}; the worker's log:\n{self.output()}") from None

    def send(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"worker still running; its log:\n{self.output()}") from None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a stopped process cannot die otherwise
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture(scope="module")
def workers_database(databases: Databases) -> str:
    """These tests' own database, so their service sees no other test's tasks."""
    return url_for(databases.create("workers"))


@pytest.fixture(scope="module")
def short_leases(
    workers_database: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """A service with 2 s leases, rescued every 0.2 s."""
    service = ServiceProcess(
        workers_database,
        tmp_path_factory.mktemp("workers") / "serve.log",
        GENQ_LEASE_SECONDS=str(LEASE_SECONDS),
        GENQ_RESCUE_INTERVAL_SECONDS="0.2",
    )
    yield service
    service.stop()


@pytest.fixture
def sdb(workers_database: str) -> Iterator[Db]:
    with psycopg.connect(workers_database, autocommit=True, row_factory=dict_row) as connection:
        yield connection


@pytest.fixture
def tool(short_leases: ServiceProcess) -> tuple[str, str]:
    """(name, id) of a tool of this test's own."""
    name = f"tool-{uuid.uuid4().hex[:12]}"
    return name, short_leases.stub.UpsertTool(task_pb2.UpsertToolRequest(name=name)).tool.id


@pytest.fixture
def start_worker(
    short_leases: ServiceProcess, tool: tuple[str, str], tmp_path: Path
) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(
        worker_id: str, script: Path = ROOT / "tests" / "fleet_worker.py", **env: str
    ) -> Worker:
        settings = {
            "GENQ_ADDR": short_leases.address,
            "GENQ_TOOL": tool[0],
            "WORKER_ID": worker_id,
            "GENQ_CONCURRENCY": "1",
            "GENQ_POLL_INTERVAL": "0.5",
            "GENQ_HEARTBEAT_INTERVAL": "0.5",
            "GENQ_DRAIN_TIMEOUT": "30",
            **env,
        }
        worker = Worker(script, tmp_path / f"{worker_id}.log", settings)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()


def queue(stub: Stub, tool_id: str, **fields: Any) -> str:
    return stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id, **fields)).task.id


def row(db: Db, task_id: str) -> dict[str, Any]:
    found = db.execute("SELECT * FROM generation.tasks WHERE id = %s", [task_id]).fetchone()
    assert found is not None
    return found


def starts(db: Db, task_id: str) -> list[str]:
    """Which workers started the task, in order (from their first progress event)."""
    rows = db.execute(
        "SELECT data->>'message' AS message FROM generation.event_stream "
        "WHERE task_id = %s AND kind = 'progress' AND data->>'message' LIKE 'started by %%' "
        "ORDER BY sequence",
        [task_id],
    ).fetchall()
    return [r["message"].removeprefix("started by ") for r in rows]


def events(db: Db, task_id: str) -> list[dict[str, Any]]:
    return db.execute(
        "SELECT kind::text, data FROM generation.event_stream WHERE task_id = %s ORDER BY sequence",
        [task_id],
    ).fetchall()


def status_is(db: Db, task_id: str, status: str) -> Callable[[], bool]:
    return lambda: row(db, task_id)["status"] == status


def test_killed_worker_task_is_reclaimed_and_counted_once(
    short_leases: ServiceProcess, sdb: Db, tool: tuple[str, str], start_worker: Any
) -> None:
    """Fault 2: kill -9 mid-task; another worker reclaims it after the lease; one retry used."""
    a = start_worker("A")
    task_id = queue(short_leases.stub, tool[1], input={"hang_on": "A", "seconds": 0.1})
    wait_for(lambda: starts(sdb, task_id) == ["A"], timeout=20, what="worker A to start")

    # A's heartbeats carry the lease past the 2 s the claim gave it.
    def extended() -> bool:
        held = row(sdb, task_id)
        lease = held["claim_expires_at"]  # None if the lease lapsed under a loaded machine
        return lease is not None and (lease - held["started_at"]).total_seconds() > (
            LEASE_SECONDS + 0.3
        )

    wait_for(extended, what="a heartbeat to extend the lease")
    a.send(signal.SIGKILL)
    assert a.wait(10) == -signal.SIGKILL
    start_worker("B")
    wait_for(status_is(sdb, task_id, "completed"), timeout=20, what="B to complete the task")
    done = row(sdb, task_id)
    assert done["output"] == {"worker": "B"}
    assert done["retry_count"] == 1
    assert starts(sdb, task_id) == ["A", "B"]


def test_stopped_worker_completion_is_refused_after_another_completed(
    short_leases: ServiceProcess, sdb: Db, tool: tuple[str, str], start_worker: Any
) -> None:
    """Fault 3: SIGSTOP past the lease, another worker completes, SIGCONT: the stopped worker's
    CompleteTask is refused with LEASE_LOST and the other worker's result stands."""
    # A's task takes 0.8 s; A is stopped right after its first event, so its lease lapses only
    # because A is stopped. Resumed, its handler's sleep and its next beat (due every third of
    # the 2 s lease) are both overdue: the handler returns at once and the fleet stops the beat
    # before an answer can come back, so A goes straight to CompleteTask with its old token. (A
    # beat that hears LEASE_LOST first makes the fleet drop the result without trying:
    # tests/integration/test_fleet.py covers that path.)
    a = start_worker("A", GENQ_HEARTBEAT_INTERVAL="30")
    task_id = queue(short_leases.stub, tool[1], input={"seconds": 0.8})
    wait_for(lambda: starts(sdb, task_id) == ["A"], timeout=20, what="worker A to start")
    # Stopped only once its handler sleeps: stopped while the publish's answer is on its way,
    # the handler would start its 0.8 s only after SIGCONT, and the overdue beat hear first.
    a.expect_in_log(f"task {task_id}: sleeping")
    a.send(signal.SIGSTOP)
    start_worker("B")
    wait_for(status_is(sdb, task_id, "completed"), timeout=20, what="B to complete the task")
    by_b = row(sdb, task_id)
    assert by_b["output"] == {"worker": "B"}
    assert by_b["retry_count"] == 1

    a.send(signal.SIGCONT)
    a.expect_in_log(f"task {task_id}: CompleteTask refused (LEASE_LOST); result dropped")
    assert row(sdb, task_id) == by_b
    completed_events = sdb.execute(
        "SELECT count(*) AS n FROM generation.event_stream "
        "WHERE task_id = %s AND kind = 'completed'",
        [task_id],
    ).fetchone()
    assert completed_events == {"n": 1}
    # A lives on after the refusal and still drains cleanly.
    a.send(signal.SIGTERM)
    assert a.wait(15) == 0


def test_sigterm_drain_loses_nothing(
    short_leases: ServiceProcess, sdb: Db, tool: tuple[str, str], start_worker: Any
) -> None:
    """SIGTERM: A stops claiming, finishes what it can within its drain timeout and releases
    the rest, its attempts unused (even on a task's last attempt, where FailTask would have
    failed it); B then completes everything. No task lost, no attempt used."""
    stub = short_leases.stub
    # Priorities decide what A (3 at a time) claims: the three below, not the backlog.
    long = queue(stub, tool[1], priority=10, input={"hang_on": "A"})
    last = queue(stub, tool[1], priority=9, max_retries=1, input={"hang_on": "A"})
    short = queue(stub, tool[1], priority=8, input={"seconds": 1.2})
    backlog = [queue(stub, tool[1], input={"seconds": 0.05}) for _ in range(3)]
    a = start_worker("A", GENQ_CONCURRENCY="3", GENQ_DRAIN_TIMEOUT="3")
    wait_for(
        lambda: all(starts(sdb, t) == ["A"] for t in (long, last, short)),
        timeout=20,
        what="A to start its three tasks",
    )
    a.send(signal.SIGTERM)
    assert a.wait(15) == 0, a.output()

    # What A left behind: its short task completed, the two it could not finish back in the
    # queue at once (no lease left to lapse), the backlog untouched.
    assert row(sdb, short)["status"] == "completed"
    assert row(sdb, short)["output"] == {"worker": "A"}
    for task_id in (long, last):
        released = row(sdb, task_id)
        assert (released["status"], released["retry_count"]) == ("queued", 0)
        assert (released["lease_token"], released["claim_expires_at"]) == (None, None)
        assert events(sdb, task_id)[-1] == {
            "kind": "requeued",
            "data": {"released": True, "retry_count": 0},
        }
    for task_id in backlog:
        assert row(sdb, task_id)["status"] == "queued"
        assert starts(sdb, task_id) == []

    start_worker("B", GENQ_CONCURRENCY="4")
    everything = [long, last, short, *backlog]
    wait_for(
        lambda: all(row(sdb, t)["status"] == "completed" for t in everything),
        timeout=20,
        what="B to complete everything",
    )
    assert {t: row(sdb, t)["retry_count"] for t in everything} == dict.fromkeys(everything, 0)
    assert {t: row(sdb, t)["output"]["worker"] for t in everything} == {
        **dict.fromkeys(everything, "B"),
        short: "A",
    }


def test_example_worker_renders_and_drains(
    short_leases: ServiceProcess, sdb: Db, tool: tuple[str, str], start_worker: Any
) -> None:
    """examples/worker.py as shipped: progress, usage and output; SIGTERM exits cleanly."""
    worker = start_worker("example", ROOT / "examples" / "worker.py")
    task_id = queue(
        short_leases.stub,
        tool[1],
        input={"prompt": "a cat", "seconds": 0.2},
        reserved_token_amount=100,
    )
    wait_for(status_is(sdb, task_id, "completed"), timeout=20, what="the example to render")
    done = row(sdb, task_id)
    assert done["output"]["image_url"].endswith(f"/{task_id}.png")
    assert done["reported_usage"] == {
        "token_amount": 10,
        "cost_nanos": 400_000,
        "details": {"model": "stand-in-diffusion"},
    }
    kinds = [event["kind"] for event in events(sdb, task_id)]
    assert kinds == ["started", "streaming_url"] + ["progress"] * 5 + ["completed"]
    worker.send(signal.SIGTERM)
    assert worker.wait(15) == 0, worker.output()


def test_a_poison_task_that_kills_every_worker_runs_max_retries_times_then_fails(
    short_leases: ServiceProcess, sdb: Db, tool: tuple[str, str], start_worker: Any
) -> None:
    """Fault 11: each run kills its worker's process. Every run was confirmed (the fleet sends
    its claim's ConfirmClaim before the handler starts), so each lapse costs one retry: 3 runs,
    then failed at once, the reservation released with every run's, and one settlement."""
    stub = short_leases.stub
    stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool[1], cost_estimate_nanos=100))
    task_id = queue(stub, tool[1], input={"poison": True}, max_retries=3, reserved_token_amount=10)
    crashes = 0
    while row(sdb, task_id)["status"] != "failed":
        assert crashes < 3, "a fourth run"
        worker = start_worker(f"P{crashes}")
        assert worker.process.wait(timeout=60) == 137, worker.output()
        crashes += 1
        wait_for(
            lambda: row(sdb, task_id)["status"] != "processing",
            timeout=30,
            what="the lapsed run to be ended",
        )
    assert crashes == 3
    failed = row(sdb, task_id)
    assert (failed["retry_count"], failed["error"]) == (3, "lease lapsed on its last run")
    settlement = stub.SettleTask(task_pb2.SettleTaskRequest(task_id=task_id))
    again = stub.SettleTask(task_pb2.SettleTaskRequest(task_id=task_id))
    assert (settlement.settled_now, again.settled_now) == (True, False)
    assert settlement.settlement.refunded_token_amount == 10
    assert_invariants(sdb, tool[1], [task_id])
