"""The server as an operator meets it: start, stop on SIGTERM, lose the database and get it back."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import psycopg
import pytest
from grpc_health.v1 import health_pb2
from psycopg.rows import dict_row

from generation.task.v1 import task_pb2
from service.api.server import HEALTH_CHECK_INTERVAL_SECONDS
from service.settings import Settings
from tests.conftest import ROOT, Databases, ServiceProcess, url_for, wait_for
from tests.tcp_proxy import TcpProxy
from workers_sdk.errors import Reason, from_rpc_error

# Health turns NOT_SERVING at most one ping interval plus one ping timeout after Postgres stops
# answering (service/api/server.py, watch_health): 2.5 s. On a loaded 2-core machine the event
# loop and the test's Check calls run late, so allow four times that.
NOT_SERVING_WITHIN = 4 * (HEALTH_CHECK_INTERVAL_SECONDS + Settings().ping_timeout_seconds)


def health_status(service: ServiceProcess) -> Any:
    try:
        return service.health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError as error:
        return error.code()


def new_tool(service: ServiceProcess) -> str:
    request = task_pb2.UpsertToolRequest(name=f"tool-{uuid.uuid4().hex[:8]}")
    return str(service.stub.UpsertTool(request, timeout=5).tool.id)


def test_sigterm_finishes_calls_in_flight_then_exits(database_url: str, tmp_path: Path) -> None:
    service = ServiceProcess(database_url, tmp_path / "serve.log")
    tool_id = new_tool(service)
    task_id = service.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id)).task.id
    claimed = service.stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool_id))
    answers: list[Any] = []

    with psycopg.connect(database_url, row_factory=dict_row) as blocker:
        # Hold the row lock: the heartbeat below stays in flight while the service stops.
        blocker.execute("SELECT 1 FROM generation.tasks WHERE id = %s FOR UPDATE", [task_id])

        def heartbeat() -> None:
            request = task_pb2.HeartbeatTaskRequest(
                task_id=task_id, lease_token=claimed.lease_token
            )
            answers.append(service.stub.HeartbeatTask(request, timeout=30))

        caller = threading.Thread(target=heartbeat)
        caller.start()
        with psycopg.connect(database_url, autocommit=True) as watcher:
            wait_for(
                lambda: watcher.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query LIKE '%%heartbeat_task_v1%%'"
                ).fetchone(),
                what="the heartbeat to wait on the row lock",
            )
        service.process.send_signal(signal.SIGTERM)
        wait_for(
            lambda: health_status(service) != health_pb2.HealthCheckResponse.SERVING,
            what="the service to stop serving new calls",
        )
        blocker.rollback()

    caller.join(timeout=30)
    assert len(answers) == 1, "the call in flight did not finish"
    assert answers[0].HasField("claim_expires_at")
    assert service.process.wait(timeout=30) == 0


def test_sigterm_answers_parked_claims_at_once(database_url: str, tmp_path: Path) -> None:
    """Claims parked with a long wait answer empty when the stop begins, as if their wait ran
    out: they held the stop for its whole grace (10 s), then failed UNAVAILABLE (found in
    review)."""
    service = ServiceProcess(database_url, tmp_path / "serve.log")
    tools = [new_tool(service) for _ in range(6)]
    parked = []
    for tool_id in tools:  # a tool each: its first claim notes the tool's poll, so it is seen
        request = task_pb2.ClaimTasksRequest(tool_id=tool_id, limit=10)
        request.wait.FromSeconds(30)
        parked.append(service.stub.ClaimTasks.future(request, timeout=60))
    with psycopg.connect(database_url, autocommit=True) as watcher:
        wait_for(
            lambda: watcher.execute(
                "SELECT 1 FROM generation.tool_polls WHERE tool_id = ANY(%s::uuid[]) "
                "HAVING count(*) = 6",
                [tools],
            ).fetchone(),
            what="every claim to have asked once",
        )
    stopped = time.monotonic()
    service.process.send_signal(signal.SIGTERM)
    wait_for(lambda: all(call.done() for call in parked), timeout=8, what="the parked claims")
    took = time.monotonic() - stopped
    answers = [call.result() for call in parked]  # an error would raise here
    assert all(not answer.tasks for answer in answers)
    assert took < Settings().shutdown_grace_seconds - 2, f"answered {took:.1f} s after SIGTERM"
    assert service.process.wait(timeout=30) == 0


def test_database_down_is_unavailable_and_the_pool_recovers(
    databases: Databases, tmp_path: Path
) -> None:
    target = urlsplit(url_for(databases.create("outage")))
    proxy = TcpProxy((target.hostname or "127.0.0.1", target.port or 5432))
    proxy.start()
    proxied = target._replace(netloc=f"{target.username}@127.0.0.1:{proxy.port}").geturl()
    service = ServiceProcess(
        proxied, tmp_path / "serve.log", GENQ_POOL_TIMEOUT_SECONDS="1", GENQ_POOL_MIN_SIZE="1"
    )
    try:
        tool_id = new_tool(service)
        proxy.cut()

        def unavailable() -> bool:
            try:
                service.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id), timeout=10)
            except grpc.RpcError as error:
                failure = from_rpc_error(error)
                assert failure.code == grpc.StatusCode.UNAVAILABLE, failure
                assert failure.reason == Reason.DATABASE_UNAVAILABLE
                return True
            return False

        wait_for(unavailable, what="UNAVAILABLE while the database is gone")
        wait_for(
            lambda: health_status(service) == health_pb2.HealthCheckResponse.NOT_SERVING,
            timeout=NOT_SERVING_WITHIN,
            what="health NOT_SERVING",
        )

        proxy.start()

        def recovered() -> bool:
            try:
                service.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id), timeout=10)
            except grpc.RpcError:
                return False
            return True

        wait_for(recovered, timeout=30, what="the pool to reconnect")
        wait_for(lambda: service.serving(), what="health SERVING again")
    finally:
        service.stop()
        proxy.cut()


def test_a_cut_leaves_no_link_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """The race behind the outage test's flake, made certain: the proxy's accept thread is
    still connecting upstream for a new client when the cut comes."""
    upstream = socket.socket()
    upstream.bind(("127.0.0.1", 0))
    upstream.listen()
    connect = socket.create_connection
    accepted = threading.Event()

    def late_connection(*args: Any, **kwargs: Any) -> socket.socket:
        accepted.set()
        time.sleep(0.3)  # the cut lands here, between accept() and the link's registration
        return connect(*args, **kwargs)

    proxy = TcpProxy(upstream.getsockname())
    proxy.start()
    monkeypatch.setattr(socket, "create_connection", late_connection)
    client = connect(("127.0.0.1", proxy.port))
    accepted.wait(5)
    proxy.cut()
    far, _ = upstream.accept()  # the upstream leg the accept thread opened after the cut
    monkeypatch.undo()
    with contextlib.suppress(OSError):  # the proxy may have closed its leg already
        far.sendall(b"x")
    client.settimeout(5)
    try:
        answer = client.recv(1)
    except OSError:
        answer = b""
    assert answer == b"", "a link accepted before the cut outlived it"
    for sock in (client, far):
        sock.close()
    upstream.close()


def test_serve_without_database_url_runs_an_embedded_postgres(tmp_path: Path) -> None:
    service = ServiceProcess(None, tmp_path / "serve.log", GENQ_DATA_DIR=str(tmp_path))
    try:
        tool_id = new_tool(service)
        task = service.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id)).task
        claim = task_pb2.ClaimNextTaskRequest(tool_id=tool_id)
        # A fresh database has no daily cap, and with no cap nothing runs.
        assert service.stub.ClaimNextTask(claim).idle_reason == task_pb2.IDLE_REASON_CAPPED
        service.stub.UpdateSettings(task_pb2.UpdateSettingsRequest(daily_cap_nanos=10**9))
        assert service.stub.ClaimNextTask(claim).task.id == task.id
        assert (tmp_path / "pgdata" / "PG_VERSION").exists()
    finally:
        assert service.stop() == 0
    wait_for(
        lambda: not (tmp_path / "pgdata" / "postmaster.pid").exists(),
        what="the embedded Postgres to stop with the service",
    )


def genq(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        env={**os.environ, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_genq_migrate_upgrades_a_database(databases: Databases) -> None:
    url = url_for(databases.create("cli_migrate", template=None))
    result = genq("migrate", DATABASE_URL=url)
    assert result.returncode == 0, result.stderr
    with psycopg.connect(url) as connection:
        assert connection.execute(
            "SELECT to_regclass('generation.tasks') IS NOT NULL"
        ).fetchone() == (True,)


@pytest.mark.parametrize("command", [[], ["serve"], ["migrate"]])
def test_genq_help(command: list[str]) -> None:
    result = genq(*command, "--help")
    assert result.returncode == 0
    assert "usage: genq" in result.stdout


def test_settings_from_environment() -> None:
    settings = Settings.from_env(
        {
            "DATABASE_URL": "postgresql://x/y",
            "GENQ_PORT": "6000",
            "GENQ_POOL_TIMEOUT_SECONDS": "2.5",
        }
    )
    assert settings.database_url == "postgresql://x/y"
    assert settings.port == 6000 and settings.pool_timeout_seconds == 2.5
    assert Settings.from_env({}).lease_seconds == 120
    with pytest.raises(SystemExit, match="GENQ_PORT"):
        Settings.from_env({"GENQ_PORT": "many"})
