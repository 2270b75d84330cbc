"""The operators' CLI (GUIDE B9, B10): `genq` run as a process against a real service, each
command's answer checked against the rows, and the exit codes scripts rely on. The SDK-only
install (no service libraries) is tests/unit/test_sdk_import.py's.

These tests change the global settings, so they run against a database and a service of their
own (the fixture `service` here replaces conftest's); every test starts from a running queue with
a cap of 10 units, and tasks go to a tool of the test's own.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from generation.task.v1 import task_pb2, task_pb2_grpc
from service.api import rpcs, validation
from tests.conftest import ROOT, Databases, ServiceProcess, free_port, url_for, wait_for
from workers_sdk.cli import program, resources, values
from workers_sdk.commands import CAPPED, DISABLED, ERROR, USAGE

Stub = task_pb2_grpc.GenerationDataServiceStub
Db = psycopg.Connection[dict[str, Any]]
UNIT = 1_000_000_000  # nanos in one currency unit
# Each service of this module picks a free port for its status page, so several can run at once.
HTTP = {"GENQ_HTTP_PORT": "0"}


@pytest.fixture(scope="module")
def cli_url(databases: Databases) -> str:
    return url_for(databases.create("cli"))


@pytest.fixture(scope="module")
def service(cli_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    process = ServiceProcess(cli_url, tmp_path_factory.mktemp("cli") / "serve.log", **HTTP)
    yield process
    process.stop()


@pytest.fixture
def cdb(cli_url: str) -> Iterator[Db]:
    with psycopg.connect(cli_url, autocommit=True, row_factory=dict_row) as connection:
        connection.execute(
            "UPDATE generation.settings SET enabled = true, daily_cap_nanos = %s, currency = '', "
            "timezone = 'UTC', granted_day = NULL, granted_nanos = 0, "
            "cooldown_threshold = 1000, cooldown_seconds = 600, account_hold_seconds = 3600, "
            "retention_days = 30",
            [10 * UNIT],
        )
        connection.execute(
            "UPDATE generation.tools SET spent_day = NULL, spent_nanos = 0, reserved_nanos = 0, "
            "granted_nanos = 0"
        )
        yield connection


@pytest.fixture
def stub(service: ServiceProcess, cdb: Db) -> Stub:
    return service.stub


@pytest.fixture
def tool(stub: Stub) -> task_pb2.Tool:
    """A tool of the test's own: `.id` and `.name`."""
    answer = stub.UpsertTool(task_pb2.UpsertToolRequest(name=f"cli-{uuid.uuid4().hex[:10]}"))
    return answer.tool


def genq(
    service: ServiceProcess | str, *args: str, stdin: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """`genq ARGS` as an operator runs it (the entry point's module), finding the service
    through GENQ_ADDR."""
    address = service if isinstance(service, str) else service.address
    return subprocess.run(
        [sys.executable, "-m", "workers_sdk.cli", *args],
        env={**os.environ, "GENQ_ADDR": address, **env},
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def genq_json(service: ServiceProcess, *args: str, code: int = 0, **kw: Any) -> dict[str, Any]:
    result = genq(service, *args, "--format", "json", **kw)
    assert result.returncode == code, result.stderr
    answer: dict[str, Any] = json.loads(result.stdout)
    return answer


def queue(stub: Stub, tool_id: str, **fields: Any) -> task_pb2.Task:
    return stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id, **fields)).task


def task_row(db: Db, task_id: str) -> dict[str, Any] | None:
    return db.execute("SELECT * FROM generation.tasks WHERE id = %s", [task_id]).fetchone()


def settings_row(db: Db) -> dict[str, Any]:
    found = db.execute(
        "SELECT s.*, sp.spent_nanos, sp.reserved_nanos "
        "FROM generation.settings AS s, generation.spend_today AS sp"
    ).fetchone()
    assert found is not None
    return found


def run_one(stub: Stub, tool_id: str, cost: int = 0) -> str:
    """Queues, claims and completes one task of the tool; returns its id."""
    queue(stub, tool_id)
    claimed = stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id))
    assert claimed.HasField("task"), claimed
    stub.CompleteTask(
        task_pb2.CompleteTaskRequest(
            task_id=claimed.task.id,
            lease_token=claimed.lease_token,
            reported_usage=task_pb2.ReportedUsage(cost_nanos=cost),
        )
    )
    return str(claimed.task.id)


def finish_long_ago(db: Db, task_ids: list[str], days: int) -> None:
    """The tasks as if created and finished `days` ago (created a minute before finishing)."""
    db.execute(
        "UPDATE generation.tasks SET status = 'completed', claim_expires_at = NULL, "
        "lease_token = NULL, completed_at = now() - make_interval(days => %s), "
        "created_at = now() - make_interval(days => %s, mins => 1) "
        "WHERE id = ANY(%s::uuid[])",
        [days, days, task_ids],
    )


# ---- status ----


def test_status_reports_the_queue_as_the_rows_say(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    for _ in range(3):
        queue(stub, tool.id)
    run_one(stub, tool.id, cost=UNIT // 4)
    answer = genq_json(service, "status")
    status = answer["status"]
    stored = settings_row(cdb)
    assert status["settings"]["enabled"] is True
    assert int(status["settings"]["daily_cap_nanos"]) == stored["daily_cap_nanos"] == 10 * UNIT
    assert int(status["settings"]["spent_today_nanos"]) == stored["spent_nanos"] == UNIT // 4
    (mine,) = [t for t in status["tools"] if t["tool_id"] == tool.id]
    queued = cdb.execute(
        "SELECT count(*) AS n FROM generation.tasks WHERE tool_id = %s AND status = 'queued'",
        [tool.id],
    ).fetchone()
    assert queued is not None
    assert (mine["name"], int(mine["queued"])) == (tool.name, queued["n"]) == (tool.name, 3)
    assert mine["last_claim_at"]

    text = genq(service, "status")
    assert text.returncode == 0, text.stderr
    assert "queue: running" in text.stdout
    assert tool.name in text.stdout
    assert "spent 0.25" in text.stdout  # money from nanos, in units


def test_status_exits_3_when_the_switch_is_off(
    service: ServiceProcess, stub: Stub, cdb: Db
) -> None:
    paused = genq_json(service, "pause")
    assert paused["settings"]["enabled"] is False
    assert settings_row(cdb)["enabled"] is False
    off = genq(service, "status")
    assert off.returncode == DISABLED, off.stderr
    assert "queue: disabled" in off.stdout
    assert genq_json(service, "status", code=DISABLED)["status"]["settings"]["enabled"] is False

    resumed = genq_json(service, "resume")
    assert resumed["settings"]["enabled"] is True
    assert settings_row(cdb)["enabled"] is True
    assert genq(service, "status").returncode == 0


def test_status_and_resume_exit_3_while_the_environment_disables(
    cli_url: str, cdb: Db, tmp_path: Path
) -> None:
    disabled = ServiceProcess(cli_url, tmp_path / "serve.log", GENQ_DISABLED="true", **HTTP)
    try:
        status = genq_json(disabled, "status", code=DISABLED)["status"]
        assert status["settings"]["enabled"] is True  # stored: on; the environment wins
        assert status["settings"]["disabled_by_environment"] is True
        resumed = genq(disabled, "resume")
        assert resumed.returncode == DISABLED
        assert "GENQ_DISABLED" in resumed.stderr
        assert settings_row(cdb)["enabled"] is True
    finally:
        disabled.stop()


def test_status_exits_4_without_a_cap_or_at_the_cap(
    service: ServiceProcess, stub: Stub, cdb: Db
) -> None:
    cleared = genq_json(service, "cap", "--clear")
    assert "daily_cap_nanos" not in cleared["settings"]  # unset: nothing runs
    assert settings_row(cdb)["daily_cap_nanos"] is None
    assert genq(service, "status").returncode == CAPPED

    assert genq(service, "cap", "0").returncode == 0
    assert settings_row(cdb)["daily_cap_nanos"] == 0
    assert genq(service, "status").returncode == CAPPED

    assert genq(service, "cap", "10").returncode == 0
    assert genq(service, "status").returncode == 0
    # Today's spend plus what running tasks hold reserved reaches the cap: capped.
    tool = stub.UpsertTool(task_pb2.UpsertToolRequest(name="spent-today")).tool
    cdb.execute(
        "UPDATE generation.tools SET spent_day = (now() AT TIME ZONE 'UTC')::date, "
        "spent_nanos = %s, reserved_nanos = %s, granted_nanos = %s WHERE id = %s",
        [4 * UNIT, 6 * UNIT, 10 * UNIT, tool.id],
    )
    capped = genq(service, "status")
    assert capped.returncode == CAPPED
    assert "queue: capped" in capped.stdout
    assert "left 0.00" in capped.stdout


# ---- tasks: list, show, enqueue, cancel, retry ----


def test_list_pages_newest_first_by_tool_and_status(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    ids = [queue(stub, tool.id, input={"n": n}).id for n in range(3)]
    stub.CancelTask(task_pb2.CancelTaskRequest(task_id=ids[1]))

    listed = genq_json(service, "list", "--tool", tool.name)["tasks"]
    expected = cdb.execute(
        "SELECT id::text FROM generation.tasks WHERE tool_id = %s ORDER BY created_at DESC",
        [tool.id],
    ).fetchall()
    assert [t["id"] for t in listed] == [r["id"] for r in expected] == ids[::-1]
    assert [t["input"]["n"] for t in listed] == [2, 1, 0]

    cancelled = genq_json(service, "list", "--tool", tool.id, "--status", "cancelled")["tasks"]
    assert [(t["id"], t["status"]) for t in cancelled] == [(ids[1], "TASK_STATUS_CANCELLED")]

    first = genq_json(service, "list", "--tool", tool.id, "--limit", "2")["tasks"]
    assert [t["id"] for t in first] == ids[:0:-1]
    rest = genq_json(service, "list", "--tool", tool.id, "--before", first[-1]["created_at"])[
        "tasks"
    ]
    assert [t["id"] for t in rest] == ids[:1]

    text = genq(service, "list", "--tool", tool.id)
    assert text.returncode == 0, text.stderr
    assert all(task_id in text.stdout for task_id in ids)
    assert "cancelled" in text.stdout
    assert tool.name in text.stdout and tool.id not in text.stdout  # names, not UUIDs


def test_list_names_the_tools_of_every_row(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    other = stub.UpsertTool(task_pb2.UpsertToolRequest(name=f"cli-{uuid.uuid4().hex[:10]}")).tool
    mine = queue(stub, tool.id, source="batch-7").id
    theirs = queue(stub, other.id).id
    listed = genq(service, "list", "--limit", "1000")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == [
        "ID", "TOOL", "STATUS", "PRI", "RETRIES", "CREATED", "SOURCE", "ERROR"
    ]  # fmt: skip
    by_id = {row.split()[0]: row.split() for row in rows}
    assert (by_id[mine][1], by_id[mine][6]) == (tool.name, "batch-7")
    assert (by_id[theirs][1], by_id[theirs][6]) == (other.name, "-")


def test_text_cursors_page_through_tasks_of_one_second(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    """The CREATED column was rounded to the second, so a cursor copied from it skipped the
    rest of that second; two tasks of one QueueTasks share an instant, so the id goes too."""
    ids = [queue(stub, tool.id).id for _ in range(5)]
    stamps = ["12:00:00.9", "12:00:00.5", "12:00:00.5", "12:00:00.2", "11:59:59.7"]
    for task_id, stamp in zip(ids, stamps, strict=True):
        cdb.execute(
            "UPDATE generation.tasks SET created_at = %s WHERE id = %s",
            [f"2030-01-01 {stamp}+00", task_id],
        )
    expected = cdb.execute(
        "SELECT id::text FROM generation.tasks WHERE tool_id = %s "
        "ORDER BY created_at DESC, id DESC",
        [tool.id],
    ).fetchall()

    seen: list[str] = []
    command = ["list", "--tool", tool.name, "--limit", "2"]
    while True:
        page = genq(service, *command)
        assert page.returncode == 0, page.stderr
        lines = page.stdout.splitlines()
        hint = [line for line in lines if line.startswith("next page: ")]
        seen += [line.split()[0] for line in lines[1:] if not line.startswith("next page: ")]
        if not hint:
            break
        words = shlex.split(hint[0].removeprefix("next page: "))
        assert words[:2] == ["genq", "list"]
        command = words[1:]
    assert seen == [row["id"] for row in expected]
    assert "2030-01-01T12:00:00.500Z" in genq(service, "list", "--tool", tool.id).stdout


def test_show_prints_one_task(service: ServiceProcess, stub: Stub, cdb: Db, tool: Any) -> None:
    task = queue(
        stub, tool.id, input={"prompt": "a cat", "n": 2}, priority=7, cost_estimate_nanos=UNIT
    )
    shown = genq_json(service, "show", task.id)["task"]
    row = task_row(cdb, task.id)
    assert row is not None
    assert (shown["id"], shown["tool_id"], shown["status"]) == (
        str(row["id"]),
        str(row["tool_id"]),
        "TASK_STATUS_QUEUED",
    )
    assert (shown["priority"], shown["input"]) == (row["priority"], row["input"])
    assert int(shown["cost_estimate_nanos"]) == row["cost_estimate_nanos"] == UNIT

    text = genq(service, "show", task.id)
    assert text.returncode == 0, text.stderr
    assert f"id: {task.id}" in text.stdout
    assert "status: queued" in text.stdout
    assert "cost_estimate: 1.00" in text.stdout  # money in units
    assert 'input: {"n": 2, "prompt": "a cat"}' in text.stdout


def test_enqueue_by_id_with_every_option(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    run_after = (datetime.now(UTC) + timedelta(hours=1)).replace(microsecond=0)
    answer = genq_json(
        service,
        "enqueue",
        tool.id,
        '{"prompt": "a dog", "n": 2}',
        "--priority",
        "5",
        "--max-retries",
        "2",
        "--idempotency-key",
        "k-1",
        "--run-after",
        run_after.isoformat(),
        "--ttl",
        "60",
        "--resource-key",
        "provider/model",
        "--account-group",
        "provider",
        "--cost-estimate",
        "0.25",
    )
    task = answer["task"]
    row = task_row(cdb, task["id"])
    assert row is not None
    assert str(row["tool_id"]) == tool.id
    assert row["input"] == {"prompt": "a dog", "n": 2}
    assert (row["priority"], row["max_retries"], row["idempotency_key"]) == (5, 2, "k-1")
    assert row["run_at"] == run_after
    assert row["expires_at"] == run_after + timedelta(seconds=60)
    assert (row["resource_key"], row["account_group"]) == ("provider/model", "provider")
    assert row["cost_estimate_nanos"] == UNIT // 4
    assert task["status"] == "TASK_STATUS_QUEUED"

    again = genq_json(
        service,
        "enqueue",
        tool.id,
        '{"n": 2, "prompt": "a dog"}',
        "--idempotency-key",
        "k-1",
    )
    assert again["task"]["id"] == task["id"]  # the same key and input: the same task


def test_enqueue_says_when_the_key_answered_an_existing_task(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    first = genq(service, "enqueue", tool.id, "{}", "--idempotency-key", "k-2")
    assert first.returncode == 0, first.stderr
    assert "existing" not in first.stdout
    task_id = first.stdout.split()[1]
    # The same command again, at once: QueueTask says the task is the one of the first run.
    again = genq(service, "enqueue", tool.name, "{}", "--idempotency-key", "k-2")
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"task {task_id} queued: existing task (idempotency key 'k-2'")
    as_json = genq(
        service, "enqueue", tool.id, "{}", "--idempotency-key", "k-2", "--format", "json"
    )
    assert json.loads(as_json.stdout)["task"]["id"] == task_id  # stdout: the message alone
    assert "existing task (idempotency key 'k-2'" in as_json.stderr

    # A finished task the key names is an existing one too.
    stub.CancelTask(
        task_pb2.CancelTaskRequest(task_id=queue(stub, tool.id, idempotency_key="k-3").id)
    )
    finished = genq(service, "enqueue", tool.id, "{}", "--idempotency-key", "k-3")
    assert ": existing task (idempotency key 'k-3'" in finished.stdout
    assert " cancelled: " in finished.stdout
    fresh = genq(service, "enqueue", tool.id, "{}", "--idempotency-key", "k-4")
    assert (fresh.returncode, "existing" in fresh.stdout) == (0, False)

    # Queued again with a requeue key, then the same command once more: nothing changes.
    requeue = ("enqueue", tool.id, "{}", "--idempotency-key", "k-3", "--on-conflict", "requeue")
    again = genq(service, *requeue, "--requeue-key", "r-1")
    assert again.stdout.rstrip().endswith(", queued again)"), again.stdout
    twice = genq(service, *requeue, "--requeue-key", "r-1")
    assert twice.stdout.rstrip().endswith(", not queued again)"), twice.stdout
    alone = genq(service, "enqueue", tool.id, "{}", "--requeue-key", "r-2")
    assert (alone.returncode, "--requeue-key goes with" in alone.stderr) == (USAGE, True)


def test_enqueue_with_a_source_and_an_expiry(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    expires = (datetime.now(UTC) + timedelta(hours=2)).replace(microsecond=0)
    task = genq_json(
        service,
        "enqueue",
        tool.id,
        "{}",
        "--source",
        "nightly-backfill",
        "--expires-at",
        expires.isoformat(),
    )["task"]
    row = task_row(cdb, task["id"])
    assert row is not None
    assert (row["source"], row["expires_at"]) == ("nightly-backfill", expires)
    assert task["source"] == "nightly-backfill"
    shown = genq(service, "show", task["id"])
    assert "source: nightly-backfill" in shown.stdout
    both = genq(service, "enqueue", tool.id, "{}", "--ttl", "60", "--expires-at", "+60")
    assert both.returncode == USAGE and "--ttl or --expires-at" in both.stderr


def test_enqueue_by_name_from_stdin_and_create_tool(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    by_name = genq(service, "enqueue", tool.name, "-", stdin='{"from": "stdin"}')
    assert by_name.returncode == 0, by_name.stderr
    task_id = by_name.stdout.split()[1]
    row = task_row(cdb, task_id)
    assert row is not None
    assert (str(row["tool_id"]), row["input"]) == (tool.id, {"from": "stdin"})

    name = f"cli-new-{uuid.uuid4().hex[:8]}"
    unknown = genq(service, "enqueue", name, "{}")
    assert unknown.returncode == ERROR
    assert "--create-tool" in unknown.stderr
    assert cdb.execute("SELECT 1 FROM generation.tools WHERE name = %s", [name]).fetchone() is None

    created = genq_json(service, "enqueue", name, "{}", "--create-tool")["task"]
    made = cdb.execute("SELECT id::text FROM generation.tools WHERE name = %s", [name]).fetchone()
    assert made is not None and made["id"] == created["tool_id"]


def test_cancel_one_task_or_a_tools_tasks_by_prefix(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    one = queue(stub, tool.id)
    cancelled = genq_json(service, "cancel", one.id)["task"]
    assert cancelled["status"] == "TASK_STATUS_CANCELLED"
    assert (task_row(cdb, one.id) or {})["status"] == "cancelled"

    keyed = {key: queue(stub, tool.id, idempotency_key=key).id for key in ("a-1", "a-2", "b-1")}
    answer = genq_json(service, "cancel", "--tool", tool.name, "--prefix", "a-")
    assert answer == {"cancelled": 2, "cancel_requested": 0}
    statuses = {key: (task_row(cdb, i) or {})["status"] for key, i in keyed.items()}
    assert statuses == {"a-1": "cancelled", "a-2": "cancelled", "b-1": "queued"}

    claimed = stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool.id)).task
    assert claimed.id == keyed["b-1"]
    queued_only = genq(service, "cancel", "--tool", tool.id)
    assert (queued_only.returncode, queued_only.stdout.strip()) == (0, "cancelled 0 tasks")
    assert (task_row(cdb, claimed.id) or {})["status"] == "processing"
    running_too = genq_json(service, "cancel", "--tool", tool.id, "--include-processing")
    assert running_too == {"cancelled": 0, "cancel_requested": 1}
    asked = task_row(cdb, claimed.id) or {}
    assert (asked["status"], asked["cancel_requested_at"] is not None) == ("processing", True)


def test_retry_queues_a_cancelled_task_again(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    task = queue(stub, tool.id)
    refused = genq(service, "retry", task.id)  # still queued: nothing to retry
    assert refused.returncode == ERROR
    assert "FAILED_PRECONDITION (TASK_NOT_RETRYABLE)" in refused.stderr
    stub.CancelTask(task_pb2.CancelTaskRequest(task_id=task.id))
    retried = genq_json(service, "retry", task.id, "--key", "k1")
    assert (retried["task"]["status"], retried["retried_now"]) == ("TASK_STATUS_QUEUED", True)
    row = task_row(cdb, task.id)
    assert row is not None
    assert (row["status"], row["retry_count"], row["completed_at"]) == ("queued", 0, None)
    again = genq(service, "retry", task.id, "--key", "k1")  # run twice: nothing changes
    assert (again.returncode, "retried already with this key" in again.stdout) == (0, True)


# ---- switches and money: pause, resume, cap, settings, stats ----


def test_pause_and_resume_a_tool(service: ServiceProcess, stub: Stub, cdb: Db, tool: Any) -> None:

    def paused() -> bool:
        found = cdb.execute("SELECT paused FROM generation.tools WHERE id = %s", [tool.id])
        return bool((found.fetchone() or {})["paused"])

    answer = genq_json(service, "pause", tool.name)
    assert (answer["tool"]["id"], answer["tool"]["paused"]) == (tool.id, True)
    assert paused()
    assert settings_row(cdb)["enabled"] is True  # a tool's pause leaves the switch alone
    queue(stub, tool.id)
    idle = stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool.id))
    assert idle.idle_reason == task_pb2.IDLE_REASON_PAUSED

    text = genq(service, "resume", tool.id)
    assert text.returncode == 0, text.stderr
    assert "paused: no" in text.stdout
    assert not paused()


def test_cap_global_per_tool_and_clear(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    text = genq(service, "cap", "2.50", "--currency", "EUR")
    assert (text.returncode, text.stdout.strip()) == (0, "daily cap: 2.50 EUR")
    stored = settings_row(cdb)
    assert (stored["daily_cap_nanos"], stored["currency"]) == (2_500_000_000, "EUR")

    answer = genq_json(service, "cap", "--tool", tool.name, "0.000000001")
    assert answer["tool"]["daily_cap_nanos"] == "1"

    def tool_cap() -> Any:
        found = cdb.execute("SELECT daily_cap_nanos FROM generation.tools WHERE id = %s", [tool.id])
        return (found.fetchone() or {})["daily_cap_nanos"]

    assert tool_cap() == 1
    assert genq(service, "cap", "--tool", tool.id, "--clear").returncode == 0
    assert tool_cap() is None
    assert settings_row(cdb)["daily_cap_nanos"] == 2_500_000_000  # the global one is untouched


def test_settings_show_and_change(service: ServiceProcess, stub: Stub, cdb: Db) -> None:
    shown = genq_json(service, "settings")["settings"]
    stored = settings_row(cdb)
    for name in ("enabled", "currency", "timezone", "cooldown_threshold", "cooldown_seconds"):
        assert shown[name] == stored[name], name
    assert (shown["account_hold_seconds"], shown["retention_days"]) == (3600, 30)
    assert int(shown["daily_cap_nanos"]) == stored["daily_cap_nanos"]

    changed = genq_json(
        service,
        "settings",
        "--timezone",
        "Asia/Kolkata",
        "--currency",
        "INR",
        "--cooldown-threshold",
        "3",
        "--cooldown-seconds",
        "60",
        "--account-hold-seconds",
        "120",
        "--retention-days",
        "7",
    )["settings"]
    stored = settings_row(cdb)
    expected = {
        "timezone": "Asia/Kolkata",
        "currency": "INR",
        "cooldown_threshold": 3,
        "cooldown_seconds": 60,
        "account_hold_seconds": 120,
        "retention_days": 7,
    }
    assert {name: stored[name] for name in expected} == expected
    assert {name: changed[name] for name in expected} == expected

    text = genq(service, "settings")
    assert text.returncode == 0, text.stderr
    assert "timezone: Asia/Kolkata" in text.stdout
    assert "daily cap: 10.00 INR" in text.stdout


def test_stats_show_attempts_and_cost_per_day(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    run_one(stub, tool.id, cost=1_234_567_891)
    run_one(stub, tool.id, cost=1)
    days = genq_json(service, "stats", "--days", "1")["days"]
    (mine,) = [d for d in days if d["tool_id"] == tool.id]
    ledger = cdb.execute(
        "SELECT local_day::text AS day, count(*) AS n, sum(cost_nanos) AS cost "
        "FROM generation.attempts WHERE tool_id = %s GROUP BY local_day",
        [tool.id],
    ).fetchone()
    assert ledger is not None
    assert (mine["local_day"], int(mine["attempts"]), int(mine["completed"])) == (
        ledger["day"],
        ledger["n"],
        2,
    )
    assert int(mine["cost_nanos"]) == ledger["cost"] == 1_234_567_892
    cdb.execute("UPDATE generation.settings SET currency = 'EUR'")
    text = genq(service, "stats")
    assert text.returncode == 0, text.stderr
    assert "1.234567892 EUR" in text.stdout  # exact: Decimal, never a float; and the currency


# ---- resources: configure, limit, key, release-cooldown, release-hold ----


def claim(stub: Stub, tool_id: str) -> task_pb2.ClaimNextTaskResponse:
    return stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id))


def test_release_hold_lets_the_groups_tasks_run(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    group = f"acct-{uuid.uuid4().hex[:8]}"
    task = queue(stub, tool.id, account_group=group)
    cdb.execute(
        "INSERT INTO generation.holds (account_group, held_until, reason) "
        "VALUES (%s, now() + interval '1 hour', 'quota')",
        [group],
    )
    assert claim(stub, tool.id).idle_reason == task_pb2.IDLE_REASON_HELD

    released = genq(service, "release-hold", group)
    assert (released.returncode, released.stdout.strip()) == (
        0,
        f"released the hold of {group}: its tasks may run",
    )
    ended = cdb.execute(
        "SELECT held_until <= now() AS ended FROM generation.holds WHERE account_group = %s",
        [group],
    ).fetchone()
    assert ended == {"ended": True}, "the hold ends now; its row stays for the watchdog's clock"
    assert claim(stub, tool.id).task.id == task.id
    again = genq_json(service, "release-hold", group)
    assert again == {"released": False}
    assert (
        genq(service, "release-hold", group).stdout.strip()
        == f"{group} is not held: nothing to release"
    )
    audited = cdb.execute(
        "SELECT detail FROM generation.audit WHERE action = 'ReleaseHold' ORDER BY id DESC LIMIT 1"
    ).fetchone()
    assert audited == {"detail": {"account_group": group}}


def test_key_shows_a_cooldown_and_release_cooldown_ends_it(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    key = f"provider/{uuid.uuid4().hex[:8]}"
    task = queue(stub, tool.id, resource_key=key)
    cdb.execute(
        "INSERT INTO generation.cooldowns (resource_key, consecutive_failures, cooling_until) "
        "VALUES (%s, 1, now() + interval '10 minutes')",
        [key],
    )
    assert claim(stub, tool.id).idle_reason == task_pb2.IDLE_REASON_COOLING
    shown = genq_json(service, "key", key)
    assert (shown["resource_key"], shown["cooling"], shown["consecutive_failures"]) == (
        key,
        True,
        1,
    )
    assert "max_in_flight" not in shown  # no limit
    text = genq(service, "key", key).stdout
    assert "cooling: yes, until " in text and "max in flight: none" in text

    released = genq(service, "release-cooldown", key)
    assert released.returncode == 0, released.stderr
    assert released.stdout.startswith(f"released the cooldown of {key}")
    row = cdb.execute(
        "SELECT * FROM generation.cooldowns WHERE resource_key = %s", [key]
    ).fetchone()
    assert row is not None and row["consecutive_failures"] == 0
    ended = cdb.execute("SELECT %s <= now() AS ended", [row["cooling_until"]]).fetchone()
    assert ended == {"ended": True}, "the cooldown ends now; it does not vanish"
    assert genq_json(service, "key", key)["cooling"] is False
    assert claim(stub, tool.id).task.id == task.id
    unknown = genq(service, "release-cooldown", f"{key}-never-cooled")
    assert (unknown.returncode, "nothing to release" in unknown.stdout) == (0, True)


def test_limit_sets_and_clears_a_resource_keys_concurrency(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    key = f"provider/{uuid.uuid4().hex[:8]}"

    def stored() -> Any:
        found = cdb.execute(
            "SELECT max_in_flight FROM generation.resource_limits WHERE resource_key = %s", [key]
        ).fetchone()
        return found and found["max_in_flight"]

    set_ = genq(service, "limit", key, "1")
    assert (set_.returncode, set_.stdout.strip()) == (0, f"resource key {key}: at most 1 in flight")
    assert stored() == 1
    assert genq_json(service, "key", key)["max_in_flight"] == 1
    first, second = (queue(stub, tool.id, resource_key=key).id for _ in range(2))
    assert claim(stub, tool.id).task.id == first
    assert claim(stub, tool.id).idle_reason == task_pb2.IDLE_REASON_BUSY

    cleared = genq_json(service, "limit", key, "--clear")
    assert cleared == {"resource_key": key}  # no max_in_flight: no limit
    assert stored() is None
    assert claim(stub, tool.id).task.id == second
    assert genq(service, "limit", key).returncode == USAGE  # neither N nor --clear
    assert genq(service, "limit", key, "2", "--clear").returncode == USAGE


def test_configure_shows_and_changes_a_tools_settings(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    shown = genq(service, "configure", tool.name)
    assert shown.returncode == 0, shown.stderr
    assert f"tool {tool.name} ({tool.id})" in shown.stdout
    assert "max in flight: none" in shown.stdout

    changed = genq_json(
        service,
        "configure",
        tool.name,
        "--max-in-flight",
        "3",
        "--max-attempts",
        "5",
        "--resource-key",
        "provider/model",
        "--cost-estimate",
        "0.10",
    )["tool"]
    row = cdb.execute("SELECT * FROM generation.tools WHERE id = %s", [tool.id]).fetchone()
    assert row is not None
    assert (row["max_in_flight"], row["max_attempts"], row["resource_key"]) == (
        3,
        5,
        "provider/model",
    )
    assert row["cost_estimate_nanos"] == UNIT // 10
    assert (changed["max_in_flight"], changed["resource_key"]) == (3, "provider/model")

    cleared = genq_json(
        service, "configure", tool.id, "--clear", "max-in-flight", "--clear", "resource-key"
    )["tool"]
    assert "max_in_flight" not in cleared and "resource_key" not in cleared
    row = cdb.execute("SELECT * FROM generation.tools WHERE id = %s", [tool.id]).fetchone()
    assert row is not None and (row["max_in_flight"], row["resource_key"]) == (None, None)
    both = genq(service, "configure", tool.id, "--max-in-flight", "2", "--clear", "max-in-flight")
    assert both.returncode == USAGE, both.stderr


# ---- purge, by hand and on the service's schedule ----


def test_purge_deletes_old_finished_tasks_in_batches(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    ran = run_one(stub, tool.id)  # has an attempt in the ledger
    old = [ran, *(queue(stub, tool.id).id for _ in range(4))]
    recent = queue(stub, tool.id).id
    unsettled = queue(stub, tool.id, reserved_token_amount=5).id
    stub.CancelTask(task_pb2.CancelTaskRequest(task_id=old[1]))  # an event that goes with it
    finish_long_ago(cdb, [*old, unsettled], days=40)
    finish_long_ago(cdb, [recent], days=10)

    dry = genq(service, "purge", "--dry-run")
    assert (dry.returncode, dry.stdout.strip()) == (
        0,
        "would purge 5 finished tasks older than 30 days (dry run: none deleted)",
    )
    assert genq_json(service, "purge", "--dry-run") == {"purged": "5", "retention_days": 30}
    assert all(task_row(cdb, task_id) is not None for task_id in old)
    assert genq(service, "purge", "--dry-run", "--older-than-days", "5").stdout.startswith(
        "would purge 6 "
    )
    assert genq(service, "purge", "--dry-run", "--older-than-days", "0").stdout.strip() == (
        "retention is 0 days: everything is kept, nothing would be purged"
    )

    result = genq(service, "purge", "--batch-size", "2", "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"purged": "5", "retention_days": 30}
    assert result.stderr.splitlines() == ["purged 2 ...", "purged 4 ...", "purged 5 ..."]
    assert all(task_row(cdb, task_id) is None for task_id in old)
    assert task_row(cdb, recent) is not None  # inside the 30 days
    assert task_row(cdb, unsettled) is not None  # its reservation is not settled yet
    events = cdb.execute(
        "SELECT count(*) AS n FROM generation.task_events WHERE task_id = ANY (%s::uuid[])", [old]
    ).fetchone()
    assert events == {"n": 0}  # the run's, the cancel's: purged with their tasks
    attempts = cdb.execute(
        "SELECT count(*) AS n FROM generation.attempts WHERE task_id = %s", [ran]
    ).fetchone()
    assert attempts == {"n": 1}  # the money history stays

    again = genq(service, "purge", "--older-than-days", "5")
    assert (again.returncode, again.stdout.strip()) == (
        0,
        "purged 1 finished tasks older than 5 days",
    )
    assert task_row(cdb, recent) is None
    kept = genq(service, "purge", "--older-than-days", "0")
    assert kept.stdout.strip() == "retention is 0 days: everything is kept, nothing purged"
    assert task_row(cdb, unsettled) is not None


def test_the_service_purges_at_start(
    stub: Stub, cdb: Db, tool: Any, cli_url: str, tmp_path: Path
) -> None:
    old = [queue(stub, tool.id).id for _ in range(3)]
    recent = queue(stub, tool.id).id
    unsettled = queue(stub, tool.id, reserved_token_amount=5).id
    finish_long_ago(cdb, [*old, unsettled], days=31)
    finish_long_ago(cdb, [recent], days=29)

    replica = ServiceProcess(cli_url, tmp_path / "serve.log", **HTTP)  # its purge is due at start
    try:
        wait_for(
            lambda: all(task_row(cdb, task_id) is None for task_id in old),
            what="the new replica's purge to delete the old finished tasks",
        )
        assert task_row(cdb, recent) is not None
        assert task_row(cdb, unsettled) is not None
        wait_for(
            lambda: "purged 3 finished tasks older than 30 days" in replica.log_path.read_text(),
            what="the purge to be logged",
        )
    finally:
        replica.stop()


# ---- errors, usage and help ----


def test_unknown_task_and_unreachable_service_exit_1(service: ServiceProcess, stub: Stub) -> None:
    missing = genq(service, "show", str(uuid.uuid4()))
    assert missing.returncode == ERROR
    assert "NOT_FOUND (TASK_NOT_FOUND): task not found" in missing.stderr
    assert genq(service, "pause", "no-such-tool").returncode == ERROR

    nowhere = f"127.0.0.1:{free_port()}"
    unreachable = genq(nowhere, "status")
    assert unreachable.returncode == ERROR
    assert "UNAVAILABLE" in unreachable.stderr and nowhere in unreachable.stderr
    # --target wins over GENQ_ADDR.
    assert genq(nowhere, "status", "--target", service.address).returncode == 0


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["nonsense"],
        ["show"],
        ["show", "not-a-uuid"],
        ["enqueue", "tool"],
        ["enqueue", "tool", "not json"],
        ["enqueue", "tool", "[1, 2]"],
        ["enqueue", "tool", "{}", "--run-after", "tomorrow"],
        ["cancel"],
        ["cancel", str(uuid.uuid4()), "--tool", "t"],
        ["cancel", str(uuid.uuid4()), "--prefix", "a"],
        ["cap"],
        ["cap", "abc"],
        ["cap", "-1"],
        ["cap", "1", "--clear"],
        ["cap", "1", "--tool", "t", "--currency", "EUR"],
        ["list", "--status", "bogus"],
        ["purge", "--older-than-days", "-1"],
        ["status", "--format", "xml"],
        ["limit", "provider/model"],
        ["release-hold"],
        ["configure", "t", "--clear", "daily-cap"],
        ["enqueue", "tool", "{}", "--ttl", "1", "--expires-at", "+5"],
        ["status", "--tls-client-cert-file", "/no/such/cert.pem"],
    ],
)
def test_bad_usage_exits_2(args: list[str]) -> None:
    # An address where nothing listens: bad usage is found before any call.
    result = genq(f"127.0.0.1:{free_port()}", *args)
    assert result.returncode == USAGE, (args, result.stdout, result.stderr)
    assert "usage: genq" in result.stderr or "error:" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["cap", "99999999999999"], "must be at most 100,000,000 units: 99999999999999"),
        (["cap", "100000000.000000001"], "must be at most 100,000,000 units"),
        (["cap", "-1"], "must not be negative: -1 (an amount in currency units, e.g. 2.50)"),
        (["cap", "0.0000000001"], "at most 9 decimal places"),
        (["cap", "NaN"], "not an amount in currency units"),
        (["cap", "--tool", "t", "1e30"], "must be at most 100,000,000 units"),
        (["enqueue", "t", "{}", "--cost-estimate", "2e8"], "must be at most 100,000,000 units"),
        (["enqueue", "t", "{}", "--priority", "101"], "must be at most 100: 101"),
        (["enqueue", "t", "{}", "--priority", "99999999999"], "must be at most 100"),
        (["enqueue", "t", "{}", "--ttl", "99999999999999999999"], "must be at most 2,147,483,647"),
        (["enqueue", "t", "{}", "--run-after", "+1e20"], "not an ISO 8601 time"),
        (["list", "--limit", "1001"], "must be at most 1,000: 1001"),
        (["settings", "--cooldown-seconds", "9999999999"], "must be at most 2,147,483,647"),
        (["purge", "--batch-size", "10001"], "must be at most 10,000"),
        (["audit", "--before-id", "99999999999999999999"], "must be at most"),
        (["limit", "k", "0"], "must be at least 1: 0"),
        (["limit", "k", "100001"], "must be at most 100,000: 100001"),
        (["configure", "t", "--max-in-flight", "-3"], "must be at least 1: -3"),
        (
            ["retry", str(uuid.uuid4()), "--reserved-token-amount", "1" + "0" * 19],
            "must be at most",
        ),
    ],
)
def test_out_of_range_numbers_are_bad_usage_in_the_units_typed(
    args: list[str], message: str
) -> None:
    result = genq(f"127.0.0.1:{free_port()}", *args)
    assert result.returncode == USAGE, (args, result.stderr)
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "nanos" not in result.stderr


def test_the_cli_bounds_are_the_services() -> None:
    assert values.MAX_AMOUNT_NANOS == validation.MAX_AMOUNT
    assert resources.MAX_IN_FLIGHT == rpcs.MAX_IN_FLIGHT


def test_a_refused_argument_names_its_code_once(
    service: ServiceProcess, stub: Stub, tool: Any
) -> None:
    # Beyond what the service takes (10 years), within what the field holds: the service says.
    refused = genq(service, "enqueue", tool.id, "{}", "--ttl", str(20 * 365 * 86_400))
    assert refused.returncode == ERROR
    assert refused.stderr.count("INVALID_ARGUMENT") == 1, refused.stderr
    assert refused.stderr.startswith("genq enqueue: INVALID_ARGUMENT: ttl must be at most")


def test_every_command_has_help() -> None:
    top = genq("127.0.0.1:1", "--help")
    assert top.returncode == 0
    assert "exit codes:" in top.stdout and "4  capped" in top.stdout
    for command in program.commands():
        result = genq("127.0.0.1:1", command.name, "--help")
        assert result.returncode == 0, command.name
        assert f"usage: genq {command.name}" in result.stdout
        assert command.name in top.stdout
        if command.client:
            assert "--format" in result.stdout and "--target" in result.stdout


def test_rate_limit_sets_shows_and_clears_a_keys_rate_limit(
    service: ServiceProcess, stub: Stub, cdb: Db, tool: Any
) -> None:
    key = f"provider/{uuid.uuid4().hex[:8]}"
    done = genq(service, "rate-limit", key, "--calls", "1", "--units", "500", "--window", "120")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"resource key {key}: 0/1 calls, 0/500 units per 2m00s"
    queue(stub, tool.id, resource_key=key, rate_units=20)
    queue(stub, tool.id, resource_key=key)
    assert claim(stub, tool.id).task.resource_key == key
    assert claim(stub, tool.id).idle_reason == task_pb2.IDLE_REASON_RATE_LIMITED
    text = genq(service, "key", key).stdout
    assert "rate limit: 1/1 calls, 20/500 units per 2m00s; at its limit until " in text
    shown = genq_json(service, "key", key)["rate_limit"]
    assert (shown["max_calls"], shown["calls"], shown["units"]) == (1, "1", "20")
    assert f"rate limit: {key}: 1/1 calls" in genq(service, "status").stdout
    refused = genq(service, "rate-limit", key)
    assert refused.returncode == USAGE, refused.stdout
    cleared = genq(service, "rate-limit", key, "--clear")
    assert cleared.stdout.strip() == f"resource key {key}: no rate limit"
    left = cdb.execute(
        "SELECT count(*) AS n FROM generation.rate_limits WHERE resource_key = %s", [key]
    ).fetchone()
    assert left == {"n": 0}
