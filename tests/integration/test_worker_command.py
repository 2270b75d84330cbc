"""`genq worker MODULE:ATTR` run as a process against a real service: it drains a queue and exits
with each documented code (--until-empty: 0 empty, 3 disabled or paused, 4 capped; 1 an import
error), drains on SIGTERM with a task in flight (nothing lost, nothing run twice: the attempts
ledger and the task's events say so), and logs as the service does.

These tests turn the kill switch and the cap, so they run against a database and a service of
their own; every test starts from a running queue with a cap of 10 units and a tool of its own.
The worker runs tests/integration/worker_app.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from generation.task.v1 import task_pb2
from service import tokens
from tests.conftest import ROOT, Databases, ServiceProcess, url_for, wait_for
from workers_sdk.cli import worker
from workers_sdk.commands import CAPPED, DISABLED, DONE, ERROR, USAGE

Db = psycopg.Connection[dict[str, Any]]
UNIT = 1_000_000_000
APP = "tests.integration.worker_app:make_fleet"


@pytest.fixture(scope="module")
def worker_url(databases: Databases) -> str:
    return url_for(databases.create("worker_command"))


@pytest.fixture(scope="module")
def service(worker_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    process = ServiceProcess(worker_url, tmp_path_factory.mktemp("worker") / "serve.log")
    yield process
    process.stop()


@pytest.fixture
def wdb(worker_url: str, service: ServiceProcess) -> Iterator[Db]:
    with psycopg.connect(worker_url, autocommit=True, row_factory=dict_row) as connection:
        service.stub.UpdateSettings(
            task_pb2.UpdateSettingsRequest(enabled=True, daily_cap_nanos=10 * UNIT)
        )
        yield connection
        service.stub.UpdateSettings(
            task_pb2.UpdateSettingsRequest(enabled=True, daily_cap_nanos=10 * UNIT)
        )


@pytest.fixture
def tool(service: ServiceProcess, wdb: Db) -> task_pb2.Tool:
    name = f"worker-{uuid.uuid4().hex[:10]}"
    return service.stub.UpsertTool(task_pb2.UpsertToolRequest(name=name)).tool


def environment(service: ServiceProcess, tool: task_pb2.Tool, **env: str) -> dict[str, str]:
    return {**os.environ, "GENQ_ADDR": service.address, "GENQ_TOOL": tool.name, **env}


def genq_worker(
    service: ServiceProcess, tool: task_pb2.Tool, *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    """`genq worker ARGS` to its end (the entry point's module, from the repository's root)."""
    return subprocess.run(
        [sys.executable, "-m", "workers_sdk.cli", "worker", *args],
        env=environment(service, tool, **env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )


def queue(service: ServiceProcess, tool: task_pb2.Tool, **fields: Any) -> str:
    request = task_pb2.QueueTaskRequest(tool_id=tool.id, **fields)
    return str(service.stub.QueueTask(request).task.id)


def task(db: Db, task_id: str) -> dict[str, Any]:
    found = db.execute("SELECT * FROM generation.tasks WHERE id = %s", [task_id]).fetchone()
    assert found is not None
    return found


def attempts(db: Db, task_id: str) -> list[str]:
    """The outcome of each run of the task, from the attempts ledger, in order."""
    rows = db.execute(
        "SELECT outcome::text FROM generation.attempts WHERE task_id = %s ORDER BY attempt",
        [task_id],
    ).fetchall()
    return [row["outcome"] for row in rows]


def runs(db: Db, task_id: str) -> int:
    """How many times a handler started on the task (its "running" progress events)."""
    row = db.execute(
        "SELECT count(*) AS n FROM generation.task_events "
        "WHERE task_id = %s AND kind = 'progress' AND data->>'message' = 'running'",
        [task_id],
    ).fetchone()
    assert row is not None
    return int(row["n"])


def test_until_empty_drains_the_queue_and_exits_0(
    service: ServiceProcess, tool: task_pb2.Tool, wdb: Db
) -> None:
    tasks = [queue(service, tool, input={"seconds": 0.05}) for _ in range(6)]
    result = genq_worker(service, tool, APP, "--until-empty", "--concurrency", "3")
    assert result.returncode == DONE, result.stderr
    assert f"nothing due ({tool.name} empty): empty or waiting" in result.stdout
    assert f"tool {tool.name}: concurrency 3 (--concurrency)" in result.stderr
    for task_id in tasks:
        assert task(wdb, task_id)["status"] == "completed"
        assert attempts(wdb, task_id) == ["completed"]
        assert runs(wdb, task_id) == 1


@pytest.mark.parametrize("attr", ["fleet", "make_fleet_async"])
def test_attr_may_be_a_fleet_or_an_async_factory(
    service: ServiceProcess, tool: task_pb2.Tool, wdb: Db, attr: str
) -> None:
    task_id = queue(service, tool)
    result = genq_worker(service, tool, f"tests.integration.worker_app:{attr}", "--until-empty")
    assert result.returncode == DONE, result.stderr
    assert attempts(wdb, task_id) == ["completed"]


def test_until_empty_exits_0_when_the_work_waits(
    service: ServiceProcess, tool: task_pb2.Tool, wdb: Db
) -> None:
    later = task_pb2.QueueTaskRequest(tool_id=tool.id)
    later.run_after.FromSeconds(int(time.time()) + 3600)
    waiting = str(service.stub.QueueTask(later).task.id)
    result = genq_worker(service, tool, APP, "--until-empty")
    assert result.returncode == DONE, result.stderr
    assert f"nothing due ({tool.name} waiting)" in result.stdout
    assert task(wdb, waiting)["status"] == "queued" and attempts(wdb, waiting) == []


def test_until_empty_exits_0_when_the_key_is_rate_limited(
    service: ServiceProcess, tool: task_pb2.Tool, wdb: Db
) -> None:
    """One run an hour on the tool's key: the first task runs, the second waits its slot, and
    the run ends as waiting, not as an error."""
    limit = task_pb2.SetRateLimitRequest(resource_key=tool.name, max_calls=1)
    limit.window.FromSeconds(3600)
    service.stub.SetRateLimit(limit)
    ran, held = queue(service, tool), queue(service, tool)
    result = genq_worker(service, tool, APP, "--until-empty")
    assert result.returncode == DONE, result.stderr
    assert f"nothing due ({tool.name} rate_limited): empty or waiting" in result.stdout
    assert attempts(wdb, ran) == ["completed"]
    assert task(wdb, held)["status"] == "queued" and attempts(wdb, held) == []


def test_until_empty_exits_3_when_the_kill_switch_is_off(
    service: ServiceProcess, tool: task_pb2.Tool, wdb: Db
) -> None:
    task_id = queue(service, tool)
    service.stub.UpdateSettings(task_pb2.UpdateSettingsRequest(enabled=False))
    result = genq_worker(service, tool, APP, "--until-empty")
    assert result.returncode == DISABLED, result.stderr
    assert f"nothing due ({tool.name} disabled): disabled" in result.stdout
    assert task(wdb, task_id)["status"] == "queued" and attempts(wdb, task_id) == []


def test_until_empty_exits_3_when_the_tool_is_paused(
    service: ServiceProcess, tool: task_pb2.Tool, wdb: Db
) -> None:
    task_id = queue(service, tool)
    service.stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool.id, paused=True))
    result = genq_worker(service, tool, APP, "--until-empty")
    assert result.returncode == DISABLED, result.stderr
    assert f"nothing due ({tool.name} paused): disabled" in result.stdout
    assert attempts(wdb, task_id) == []


def test_until_empty_exits_4_when_the_cap_leaves_no_room(
    service: ServiceProcess, tool: task_pb2.Tool, wdb: Db
) -> None:
    """A cap of 1 unit and a task estimated at 2: it cannot start today."""
    service.stub.UpdateSettings(task_pb2.UpdateSettingsRequest(daily_cap_nanos=UNIT))
    service.stub.ConfigureTool(
        task_pb2.ConfigureToolRequest(tool_id=tool.id, cost_estimate_nanos=2 * UNIT)
    )
    task_id = queue(service, tool)
    result = genq_worker(service, tool, APP, "--until-empty")
    assert result.returncode == CAPPED, result.stderr
    assert f"nothing due ({tool.name} capped): capped" in result.stdout
    assert task(wdb, task_id)["status"] == "queued" and attempts(wdb, task_id) == []


@pytest.mark.parametrize(
    ("spec", "code", "message"),
    [
        ("tests.integration.no_such_module:fleet", ERROR, "cannot import"),
        ("tests.integration.worker_app:no_such_fleet", ERROR, "has no attribute 'no_such_fleet'"),
        ("tests.integration.worker_app:not_a_fleet", ERROR, "give a WorkerFleet or a function"),
        ("tests.integration.worker_app", USAGE, "give MODULE:ATTR"),
    ],
)
def test_what_cannot_be_loaded_exits_with_a_clear_message(
    spec: str, code: int, message: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "workers_sdk.cli", "worker", spec, "--until-empty"],
        env={**os.environ, "GENQ_ADDR": "127.0.0.1:1"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def secured(databases: Databases, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A service with GENQ_AUTH=required (plaintext on loopback), and its database's URL."""
    url = url_for(databases.create("worker_auth"))
    process = ServiceProcess(
        url, tmp_path_factory.mktemp("auth") / "serve.log", GENQ_AUTH="required"
    )
    yield process, url
    process.stop()


def test_the_token_option_reaches_the_service_and_a_refusal_exits_1(secured: Any) -> None:
    """--token is the fleet's token: a worker token of the tool drains it; a viewer's is refused
    at registration (exit 1, the refusal said); none at all, too."""
    service, url = secured
    operator = tokens.create(url, ["operator"], [], None, "test operator")
    admin = ("authorization", f"Bearer {operator}")
    name = f"worker-{uuid.uuid4().hex[:10]}"
    tool = service.stub.UpsertTool(task_pb2.UpsertToolRequest(name=name), metadata=[admin]).tool
    service.stub.UpdateSettings(
        task_pb2.UpdateSettingsRequest(daily_cap_nanos=10 * UNIT), metadata=[admin]
    )
    request = task_pb2.QueueTaskRequest(tool_id=tool.id)
    task_id = service.stub.QueueTask(request, metadata=[admin]).task.id
    worker_token = tokens.create(url, ["worker"], [name], None, "test worker")
    viewer = tokens.create(url, ["viewer"], [], None, "test viewer")

    refused = genq_worker(service, tool, APP, "--until-empty", "--token", viewer)
    assert refused.returncode == ERROR, refused.stderr
    assert "genq worker: PERMISSION_DENIED" in refused.stderr
    anonymous = genq_worker(service, tool, APP, "--until-empty", GENQ_TOKEN="")
    assert anonymous.returncode == ERROR and "UNAUTHENTICATED" in anonymous.stderr

    done = genq_worker(service, tool, APP, "--until-empty", "--token", worker_token)
    assert done.returncode == DONE, done.stderr
    with psycopg.connect(url, row_factory=dict_row) as db:
        assert task(db, task_id)["status"] == "completed"
        assert attempts(db, task_id) == ["completed"]


class Worker:
    """`genq worker` in the background, its stderr in a file."""

    def __init__(
        self, service: ServiceProcess, tool: task_pb2.Tool, log: Path, *args: str, **env: str
    ) -> None:
        self.log_path = log
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "workers_sdk.cli", "worker", *args],
            env=environment(service, tool, **env),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            text=True,
        )

    def output(self) -> str:
        return self.log_path.read_text()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture
def background(service: ServiceProcess, tool: task_pb2.Tool, tmp_path: Path) -> Iterator[Any]:
    started: list[Worker] = []

    def start(*args: str, **env: str) -> Worker:
        started.append(Worker(service, tool, tmp_path / f"worker{len(started)}.log", *args, **env))
        return started[-1]

    yield start
    for each in started:
        each.close()


def test_sigterm_finishes_the_task_in_flight_and_exits_0(
    service: ServiceProcess, tool: task_pb2.Tool, wdb: Db, background: Any
) -> None:
    running = background(APP, GENQ_LOG_FORMAT="json")
    task_id = queue(service, tool, input={"seconds": 2})
    wait_for(
        lambda: f"task {task_id}: running" in running.output(), timeout=30, what="the task to run"
    )
    running.process.send_signal(signal.SIGTERM)
    assert running.process.wait(timeout=40) == DONE, running.output()
    assert task(wdb, task_id)["status"] == "completed"
    assert attempts(wdb, task_id) == ["completed"]
    assert runs(wdb, task_id) == 1
    lines = [json.loads(line) for line in running.output().splitlines() if line.strip()]
    assert {"time", "level", "logger", "message"} <= set(lines[0])
    assert any(line["message"].startswith("stopping: no new claims") for line in lines)


def test_sigterm_past_the_drain_timeout_releases_the_task_unharmed(
    service: ServiceProcess, tool: task_pb2.Tool, wdb: Db, background: Any
) -> None:
    """The handler outlasts the drain: the task is handed back, queued again with no attempt
    used, and a second worker runs it once more to completion (two runs, one of them
    released, none lost)."""
    first = background(APP, GENQ_DRAIN_TIMEOUT="0.5")
    task_id = queue(service, tool, input={"seconds": 600})
    wait_for(lambda: f"task {task_id}: running" in first.output(), timeout=30, what="a run")
    first.process.send_signal(signal.SIGTERM)
    assert first.process.wait(timeout=30) == DONE, first.output()
    released = task(wdb, task_id)
    assert (released["status"], released["retry_count"]) == ("queued", 0)
    assert attempts(wdb, task_id) == ["released"]
    assert runs(wdb, task_id) == 1


def test_the_exit_code_of_several_tools() -> None:
    """The most blocking reason wins: disabled (3), then capped (4), then 0."""
    empty, paused, capped = (
        task_pb2.IDLE_REASON_EMPTY,
        task_pb2.IDLE_REASON_PAUSED,
        task_pb2.IDLE_REASON_CAPPED,
    )
    assert worker.exit_code({"a": empty, "b": task_pb2.IDLE_REASON_WAITING}) == DONE
    assert worker.exit_code({"a": empty, "b": capped}) == CAPPED
    assert worker.exit_code({"a": capped, "b": paused}) == DISABLED
    assert worker.exit_code({"a": 99}) == DONE  # a reason a newer service adds: a wait
    assert worker.reason_word(99) == "idle reason 99"
