"""The reconciler (workers_sdk.reconciler, `genq reconcile`) against the running service (GUIDE A8,
§5 fault 11): stale tasks are forced to failed and projected through a hook, reservations are
settled exactly once, also with several reconcilers at once.

Stale rows are written directly in SQL with past timestamps, never waited for. The stale and
unsettled lists are global (other tests leave tasks behind), so every check filters on this
test's own tool or task ids.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest

from generation.task.v1 import task_pb2
from tests.conftest import (
    ROOT,
    Databases,
    ServiceProcess,
    forget_waits,
    free_port,
    url_for,
    wait_for,
)
from tests.integration.test_semantics import add_row, ago
from workers_sdk.client import GenqClient
from workers_sdk.reconciler import Reconciler, SweepSummary

Db = psycopg.Connection[dict[str, Any]]
DEAD_LEASE = "00000000-0000-0000-0000-000000000001"


@pytest.fixture(scope="module")
def database_url(databases: Databases) -> str:
    """This module's own database (the shared service's rescuer would see its zombies)."""
    return url_for(databases.create("reconciler"))


@pytest.fixture(scope="module")
def service(
    database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """The service with its rescuer idle (one sweep at start, then hourly). A running rescuer
    ends every lapsed run at once (requeued, failed, or handed back unconfirmed), so the dead
    zombies the reaper is for exist only where no rescuer runs: these tests write them."""
    process = ServiceProcess(
        database_url,
        tmp_path_factory.mktemp("reconciler") / "serve.log",
        GENQ_RESCUE_INTERVAL_SECONDS="3600",
    )
    yield process
    process.stop()


def run(service: ServiceProcess, scenario: Callable[[GenqClient], Awaitable[Any]]) -> Any:
    """Runs an async scenario with a fresh client (grpc.aio channels belong to one event loop)."""

    async def main() -> Any:
        async with GenqClient(service.address) as client:
            return await scenario(client)

    return asyncio.run(main())


def row(db: Db, task_id: str) -> dict[str, Any]:
    found = db.execute("SELECT * FROM generation.tasks WHERE id = %s", [task_id]).fetchone()
    assert found is not None
    return found


def settlement_counts(db: Db, task_ids: list[str]) -> dict[str, int]:
    rows = db.execute(
        "SELECT task_id::text AS id, count(*) AS n FROM generation.settlements "
        "WHERE task_id = ANY(%s::uuid[]) GROUP BY task_id",
        [task_ids],
    ).fetchall()
    return {r["id"]: r["n"] for r in rows}


def waited(db: Db, seconds: int) -> dict[str, Any]:
    """The columns of a task queued (and due) `seconds` ago."""
    then = ago(db, seconds)
    return {"created_at": then, "queued_at": then, "run_at": then}


def stale_population(db: Db, tool_id: str, **columns: Any) -> dict[str, str]:
    """One task of each stale kind, by the error the reaper will give it (with the tool's
    watchdog clock moved back, so the abandoned one is)."""
    forget_waits(db, tool_id)
    return {
        # A confirmed run on its last retry, whose lease nobody handed back: the reaper ends it
        # as the rescuer would have (docs/ARCHITECTURE.md, "What stale means").
        "lease lapsed on its last run": add_row(
            db,
            tool_id,
            status="processing",
            retry_count=2,
            max_retries=3,
            lease_confirmed=True,
            lease_token=DEAD_LEASE,
            started_at=ago(db, 3600),
            claim_expires_at=ago(db, 600),
            **columns,
        ),
        "reaped: unclaimable": add_row(db, tool_id, status="queued", max_retries=0, **columns),
        "reaped: abandoned": add_row(db, tool_id, status="queued", **waited(db, 1000), **columns),
    }


class Recorder:
    """Hooks that record each call, for one reconciler or shared by several."""

    def __init__(self, tool_id: str | None = None, task_ids: set[str] | None = None) -> None:
        self.tool_id = tool_id
        self.task_ids = task_ids
        self.failed: list[task_pb2.Task] = []
        self.settled: list[task_pb2.Settlement] = []

    def on_failed(self, task: task_pb2.Task) -> None:
        if task.tool_id == self.tool_id:  # the sweep also reaps other tests' leftovers
            self.failed.append(task)

    async def on_settled(self, settlement: task_pb2.Settlement) -> None:
        await asyncio.sleep(0)  # a coroutine hook, awaited by the reconciler
        if self.task_ids is None or settlement.task_id in self.task_ids:
            self.settled.append(settlement)


async def queue(client: GenqClient, tool_id: str, **fields: Any) -> task_pb2.Task:
    response = await client.call(
        "QueueTask", task_pb2.QueueTaskRequest(tool_id=tool_id, input={}, **fields)
    )
    return response.task


async def claim(client: GenqClient, tool_id: str) -> task_pb2.ClaimNextTaskResponse:
    claimed = await client.call("ClaimNextTask", task_pb2.ClaimNextTaskRequest(tool_id=tool_id))
    assert claimed.HasField("task")
    return claimed


async def completed(client: GenqClient, tool_id: str, reserved: int, used: int) -> str:
    task = await queue(client, tool_id, reserved_token_amount=reserved)
    claimed = await claim(client, tool_id)
    assert claimed.task.id == task.id
    await client.call(
        "CompleteTask",
        task_pb2.CompleteTaskRequest(
            task_id=claimed.task.id,
            lease_token=claimed.lease_token,
            reported_usage=task_pb2.ReportedUsage(token_amount=used),
        ),
    )
    return str(claimed.task.id)


async def failed(client: GenqClient, tool_id: str, reserved: int) -> str:
    task = await queue(client, tool_id, reserved_token_amount=reserved, max_retries=1)
    claimed = await claim(client, tool_id)
    assert claimed.task.id == task.id
    await client.call(
        "FailTask",
        task_pb2.FailTaskRequest(
            task_id=claimed.task.id, lease_token=claimed.lease_token, error="provider refused"
        ),
    )
    return str(claimed.task.id)


# (a) The reaper


def test_a_sweep_fails_each_stale_population_once_and_leaves_live_tasks_alone(
    service: ServiceProcess, db: Db, tool_id: str
) -> None:
    # A live run of another tool (one of this tool would mean a worker for it, whose queue
    # then waits rather than being abandoned: tests/integration/test_watchdog.py, `busy`).
    other = service.stub.UpsertTool(task_pb2.UpsertToolRequest(name=f"{tool_id}-busy")).tool.id
    held = service.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=other)).task.id
    claimed = service.stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=other))
    assert claimed.task.id == held
    stale = stale_population(db, tool_id)
    stale["reaped: abandoned (dispatched)"] = add_row(
        db, tool_id, status="dispatched", **waited(db, 1000)
    )
    live = {
        "held": held,
        "young queued": add_row(db, tool_id, status="queued", **waited(db, 890)),
        "zombie within grace": add_row(
            db,
            tool_id,
            status="processing",
            retry_count=3,
            max_retries=3,
            lease_token=DEAD_LEASE,
            started_at=ago(db, 3600),
            claim_expires_at=ago(db, 60),
        ),
        "last try left": add_row(db, tool_id, status="queued", retry_count=2, max_retries=3),
    }
    hooks = Recorder(tool_id)

    async def scenario(client: GenqClient) -> list[SweepSummary]:
        live["fresh"] = (await queue(client, tool_id)).id
        reconciler = Reconciler(client, on_failed=hooks.on_failed)
        return [await reconciler.sweep(), await reconciler.sweep()]

    first, second = run(service, scenario)

    assert sorted(t.id for t in hooks.failed) == sorted(stale.values()), "each once"
    for task in hooks.failed:
        assert task.status == task_pb2.TASK_STATUS_FAILED
        assert task.completed_at.seconds > 0
    for error, task_id in stale.items():
        stored = row(db, task_id)
        assert (stored["status"], stored["error"]) == ("failed", error.split(" (")[0])
        assert stored["retry_count"] == (3 if "lapsed" in error else 0), "no retry charged"
    statuses = {name: row(db, task_id)["status"] for name, task_id in live.items()}
    assert statuses == {
        "held": "processing",
        "young queued": "queued",
        "zombie within grace": "processing",
        "last try left": "queued",
        "fresh": "queued",
    }
    assert first.failed >= len(stale) and first.errors == 0 and first.hook_errors == 0
    assert second.errors == 0


def test_what_stale_means_is_the_services_settings(
    service: ServiceProcess, db: Db, tool_id: str
) -> None:
    """The reconciler sends no thresholds: the service's settings (UpdateSettings) decide, for
    the list and for the forced fail alike."""
    assert not {"processing_grace_seconds", "queued_max_age_seconds"} & set(
        inspect.signature(Reconciler).parameters
    )
    zombie = add_row(
        db,
        tool_id,
        status="processing",
        retry_count=2,
        max_retries=3,
        lease_confirmed=True,
        lease_token=DEAD_LEASE,
        started_at=ago(db, 3600),
        claim_expires_at=ago(db, 60),
    )
    queued = add_row(db, tool_id, status="queued", **waited(db, 400))
    forget_waits(db, tool_id)
    hooks = Recorder(tool_id)

    async def sweep(client: GenqClient) -> SweepSummary:
        return await Reconciler(client, on_failed=hooks.on_failed).sweep()

    def thresholds(grace: int, max_age: int) -> None:
        service.stub.UpdateSettings(
            task_pb2.UpdateSettingsRequest(
                processing_grace_seconds=grace, queued_max_age_seconds=max_age
            )
        )

    run(service, sweep)  # the defaults (120 s, 900 s): both are alive
    assert hooks.failed == []
    thresholds(30, 300)
    try:
        run(service, sweep)
    finally:
        thresholds(120, 900)
    assert sorted(t.id for t in hooks.failed) == sorted([zombie, queued])
    assert (row(db, zombie)["error"], row(db, queued)["error"]) == (
        "lease lapsed on its last run",
        "reaped: abandoned",
    )


def test_a_task_that_comes_alive_before_its_forced_fail_is_skipped(
    service: ServiceProcess, db: Db, tool_id: str
) -> None:
    # The list is ordered by created_at: `first` is reaped first, and its hook revives `second`
    # (gives it retries again) between the list and `second`'s forced fail.
    first = add_row(db, tool_id, status="queued", max_retries=0, created_at=ago(db, 7200))
    second = add_row(db, tool_id, status="queued", max_retries=0)  # young: not abandoned
    failed_ids: list[str] = []

    def on_failed(task: task_pb2.Task) -> None:
        failed_ids.append(task.id)
        if task.id == first:
            db.execute("UPDATE generation.tasks SET max_retries = 3 WHERE id = %s", [second])

    async def scenario(client: GenqClient) -> SweepSummary:
        return await Reconciler(client, on_failed=on_failed).sweep()

    summary = run(service, scenario)

    assert first in failed_ids and second not in failed_ids
    assert summary.skipped >= 1 and summary.errors == 0
    assert row(db, first)["status"] == "failed"
    assert row(db, second)["status"] == "queued", "a task that is not stale is never killed"


def test_a_raising_hook_does_not_stop_the_sweep(
    service: ServiceProcess, db: Db, tool_id: str
) -> None:
    stale = stale_population(db, tool_id, reserved_token_amount=40)
    calls: Counter[str] = Counter()

    def on_failed(task: task_pb2.Task) -> None:
        if task.tool_id == tool_id:
            calls["failed"] += 1
            raise RuntimeError("chat message store is down")

    async def on_settled(settlement: task_pb2.Settlement) -> None:
        if settlement.task_id in stale.values():
            calls["settled"] += 1
            raise RuntimeError("ledger is down")

    async def scenario(client: GenqClient) -> list[SweepSummary]:
        reconciler = Reconciler(client, on_failed=on_failed, on_settled=on_settled)
        return [await reconciler.sweep(), await reconciler.sweep()]

    first, _ = run(service, scenario)

    assert calls == {"failed": 3, "settled": 3}, "every hook ran, once, despite the raises"
    assert (first.hook_errors, first.errors) == (6, 0)
    for task_id in stale.values():
        assert row(db, task_id)["status"] == "failed"
        assert row(db, task_id)["settled_at"] is not None, "the change stands in the service"
    assert settlement_counts(db, list(stale.values())) == dict.fromkeys(stale.values(), 1)


def test_sweeps_walk_every_page(service: ServiceProcess, db: Db, tool_id: str) -> None:
    stale = [
        add_row(db, tool_id, status="queued", max_retries=0, reserved_token_amount=5)
        for _ in range(7)
    ]
    hooks = Recorder(tool_id, set(stale))

    async def scenario(client: GenqClient) -> SweepSummary:
        reconciler = Reconciler(
            client, on_failed=hooks.on_failed, on_settled=hooks.on_settled, page_size=2
        )
        return await reconciler.sweep()

    summary = run(service, scenario)

    assert sorted(t.id for t in hooks.failed) == sorted(stale)
    assert sorted(s.task_id for s in hooks.settled) == sorted(stale)
    assert summary.errors == 0


# (b) Settlement


def test_settlement_charges_usage_up_to_the_reservation_and_refunds_the_rest(
    service: ServiceProcess, db: Db, tool_id: str
) -> None:
    hooks = Recorder()
    reaped = add_row(db, tool_id, status="queued", max_retries=0, reserved_token_amount=50)

    async def scenario(client: GenqClient) -> dict[str, str]:
        tasks = {
            "completed": await completed(client, tool_id, reserved=100, used=30),
            "failed": await failed(client, tool_id, reserved=100),
            "over": await completed(client, tool_id, reserved=100, used=130),
            "unreserved": await completed(client, tool_id, reserved=0, used=10),
            "reaped": reaped,
        }
        hooks.task_ids = set(tasks.values())
        await Reconciler(client, on_settled=hooks.on_settled).sweep()
        return tasks

    tasks = run(service, scenario)

    by_task = {s.task_id: s for s in hooks.settled}
    amounts = {
        name: (
            task_pb2.TaskStatus.Name(by_task[task_id].task_status),
            by_task[task_id].reserved_token_amount,
            by_task[task_id].charged_token_amount,
            by_task[task_id].refunded_token_amount,
        )
        for name, task_id in tasks.items()
        if task_id in by_task
    }
    assert amounts == {
        "completed": ("TASK_STATUS_COMPLETED", 100, 30, 70),
        "failed": ("TASK_STATUS_FAILED", 100, 0, 100),
        "over": ("TASK_STATUS_COMPLETED", 100, 100, 0),
        # Reaped and refunded in the same sweep.
        "reaped": ("TASK_STATUS_FAILED", 50, 0, 50),
    }, "a task without a reservation has nothing to settle"
    assert len(hooks.settled) == 4
    stored = db.execute(
        "SELECT task_id::text AS id, charged_token_amount AS charged, "
        "refunded_token_amount AS refunded FROM generation.settlements "
        "WHERE task_id = ANY(%s::uuid[])",
        [list(tasks.values())],
    ).fetchall()
    assert {r["id"]: (r["charged"], r["refunded"]) for r in stored} == {
        tasks["completed"]: (30, 70),
        tasks["failed"]: (0, 100),
        tasks["over"]: (100, 0),
        tasks["reaped"]: (0, 50),
    }
    for name in ("completed", "failed", "over", "reaped"):
        assert row(db, tasks[name])["settled_at"] is not None
    assert row(db, tasks["unreserved"])["settled_at"] is None


# (c) Several reconcilers at once


def test_concurrent_reconcilers_and_a_settle_burst_settle_each_task_exactly_once(
    service: ServiceProcess, db: Db, tool_id: str
) -> None:
    failed_calls: Counter[str] = Counter()
    settled_calls: Counter[str] = Counter()

    def on_failed(task: task_pb2.Task) -> None:
        if task.tool_id == tool_id:
            failed_calls[task.id] += 1

    def on_settled(settlement: task_pb2.Settlement) -> None:
        settled_calls[settlement.task_id] += 1

    async def scenario(client: GenqClient) -> tuple[list[str], list[str], str, list[bool]]:
        terminal = [await completed(client, tool_id, reserved=100, used=i) for i in range(10)]
        terminal += [await failed(client, tool_id, reserved=100) for _ in range(5)]
        # Written after the claims above, which would otherwise take the claimable stale rows.
        stale = list(stale_population(db, tool_id, reserved_token_amount=25).values())
        stale += [
            add_row(db, tool_id, status="queued", max_retries=0, reserved_token_amount=25)
            for _ in range(10)
        ]
        burst_task = terminal[0]
        async with GenqClient(service.address) as other:
            reconcilers = [
                Reconciler(c, on_failed=on_failed, on_settled=on_settled) for c in (client, other)
            ]
            burst = [
                client.call("SettleTask", task_pb2.SettleTaskRequest(task_id=burst_task))
                for _ in range(20)
            ]
            results = await asyncio.gather(
                *(r.sweep() for r in reconcilers), *burst, return_exceptions=True
            )
        summaries, answers = results[:2], results[2:]
        for summary in summaries:
            assert isinstance(summary, SweepSummary), summary
            assert (summary.errors, summary.hook_errors) == (0, 0)
        assert [a for a in answers if isinstance(a, BaseException)] == []
        settled_now = [a.settled_now for a in answers if not isinstance(a, BaseException)]
        return stale, terminal, burst_task, settled_now

    stale, terminal, burst_task, burst_settled_now = run(service, scenario)

    assert failed_calls == dict.fromkeys(stale, 1), "each stale task failed and projected once"
    everything = stale + terminal
    assert settlement_counts(db, everything) == dict.fromkeys(everything, 1)
    # The burst task was settled by exactly one caller: a reconciler (its hook ran) or a raw call.
    assert settled_calls[burst_task] + sum(burst_settled_now) == 1
    others = set(everything) - {burst_task}
    assert {t: n for t, n in settled_calls.items() if t in others} == dict.fromkeys(others, 1)


def test_every_concurrent_settle_of_one_task_is_answered_with_the_settlement(
    service: ServiceProcess, tool_id: str
) -> None:
    async def scenario(client: GenqClient) -> list[list[Any]]:
        rounds = []
        for _ in range(30):  # the race is narrow: many rounds make it show every time
            task_id = await completed(client, tool_id, reserved=100, used=40)
            request = task_pb2.SettleTaskRequest(task_id=task_id)
            rounds.append(
                await asyncio.gather(
                    *(client.call("SettleTask", request) for _ in range(20)),
                    return_exceptions=True,
                )
            )
        return rounds

    for answers in run(service, scenario):
        assert [a for a in answers if isinstance(a, BaseException)] == []
        assert sum(a.settled_now for a in answers) == 1
        assert {
            (a.settlement.charged_token_amount, a.settlement.refunded_token_amount) for a in answers
        } == {(40, 60)}


# (d) The `genq reconcile` command


def genq(*args: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "service", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_genq_reconcile_once_fails_a_stale_task_and_exits_0(
    service: ServiceProcess, db: Db, tool_id: str
) -> None:
    task_id = add_row(db, tool_id, status="queued", max_retries=0, reserved_token_amount=10)

    process = genq("reconcile", "--once", "--target", service.address)
    output, _ = process.communicate(timeout=60)

    assert process.returncode == 0, output
    assert "reconcile sweep: failed" in output
    stored = row(db, task_id)
    assert (stored["status"], stored["error"]) == ("failed", "reaped: unclaimable")
    assert settlement_counts(db, [task_id]) == {task_id: 1}


def test_genq_reconcile_sweeps_every_interval_until_sigterm(
    service: ServiceProcess, db: Db, tool_id: str
) -> None:
    process = genq("reconcile", GENQ_ADDR=service.address, GENQ_RECONCILE_INTERVAL_SECONDS="0.2")
    try:
        # Written while the command runs: its sweeps keep coming, so one must reap it.
        task_id = add_row(db, tool_id, status="queued", max_retries=0)
        wait_for(lambda: row(db, task_id)["status"] == "failed", what="a sweep to reap the task")
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output
    assert "reconciler stopped" in output


def test_genq_reconcile_once_against_no_service_exits_1() -> None:
    process = genq("reconcile", "--once", "--target", f"127.0.0.1:{free_port()}")
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 1, output
    assert "failed" in output
