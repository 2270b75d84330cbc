"""Fixtures: a fresh database per session (cloned from a migrated template), the service as a real
process, a gRPC stub, and a direct connection for moving time and checking rows.

Postgres (GENQ_TEST_ADMIN_URL) and Redis (GENQ_TEST_REDIS_URL) must be reachable: a test session
that cannot reach them fails; nothing is skipped. Tests live by kind: unit/ (no database),
integration/ (the service against Postgres and Redis), faults/ (kills, lost answers, a private
Postgres made to fail, races), migration/ (the baseline and the schema); each folder is a marker.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import psycopg
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from psycopg import sql
from psycopg.rows import dict_row

from generation.task.v1 import task_pb2, task_pb2_grpc
from service import migrations

ROOT = Path(__file__).resolve().parent.parent
ADMIN_URL = os.environ.get("GENQ_TEST_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
UNLIMITED = 10**17  # nanos: the largest cap the service takes (100 million units a day)
REDIS_URL = os.environ.get("GENQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
KINDS = ("unit", "integration", "faults", "migration")
"""The folders tests live in by kind, each a marker (`pytest -m unit`, `-m "not faults"`)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks each test with its folder's kind."""
    for item in items:
        kind = item.path.parent.name
        if kind in KINDS:
            item.add_marker(getattr(pytest.mark, kind))


def wait_for(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Polls `condition` until it returns something truthy; fails the test at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def noon_timezone() -> str:
    """A zone where it is about noon now. A new local day restarts the watchdog's clock (a new
    day's cap opens), so tests of "abandoned" run where midnight is hours away."""
    east = 12 - datetime.now(UTC).hour  # hours east of UTC, -11 to 12
    return "UTC" if east == 0 else f"Etc/GMT{-east:+d}"  # POSIX signs: Etc/GMT-3 is UTC+3


def forget_waits(db: psycopg.Connection[Any], tool_id: str, seconds: int = 86_400) -> None:
    """Moves every event that restarts the watchdog's clock for a tool `seconds` into the past:
    the last change of its gates and of the global ones, and the last claim call for it."""
    db.execute(
        "UPDATE generation.tools SET gates_changed_at = now() - make_interval(secs => %s) "
        "WHERE id = %s",
        [seconds, tool_id],
    )
    db.execute(
        "UPDATE generation.settings SET gates_changed_at = now() - make_interval(secs => %s)",
        [seconds],
    )
    db.execute("DELETE FROM generation.tool_polls WHERE tool_id = %s", [tool_id])


def url_for(database: str) -> str:
    return urlsplit(ADMIN_URL)._replace(path=f"/{database}").geturl()


class Databases:
    """Creates this session's databases (from the migrated template); drops them all at the end."""

    def __init__(self) -> None:
        self.prefix = f"genq_test_{uuid.uuid4().hex[:8]}"
        self.created: list[str] = []
        self.template = self.create("template", template=None)
        migrations.upgrade(url_for(self.template))
        with psycopg.connect(url_for(self.template), autocommit=True) as template:
            # With no daily cap nothing runs (by design). Tests of the queue itself get a cap
            # too large to matter and cooldowns that never trip; spend-control tests set their
            # own, in databases of their own.
            template.execute(
                "UPDATE generation.settings "
                "SET daily_cap_nanos = %s, cooldown_threshold = 1000, timezone = %s",
                [UNLIMITED, noon_timezone()],
            )

    def create(self, name: str, template: str | None = "default") -> str:
        database = f"{self.prefix}_{name}"
        source = self.template if template == "default" else template
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database))
            if source:
                statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(source))
            admin.execute(statement)
        self.created.append(database)
        return database

    def drop_all(self) -> None:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            for database in reversed(self.created):
                admin.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        sql.Identifier(database)
                    )
                )


@pytest.fixture(scope="session")
def databases() -> Iterator[Databases]:
    try:
        with psycopg.connect(ADMIN_URL, connect_timeout=5):
            pass
    except psycopg.OperationalError as error:
        pytest.fail(f"Postgres is not reachable at {ADMIN_URL}: {error}", pytrace=False)
    created = Databases()
    yield created
    created.drop_all()


@pytest.fixture(scope="session", autouse=True)
def redis_reachable() -> None:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5).ping()
    except redis.RedisError as error:
        pytest.fail(f"Redis is not reachable at {REDIS_URL}: {error}", pytrace=False)


@pytest.fixture(scope="session")
def database_url(databases: Databases) -> str:
    return url_for(databases.create("main"))


def free_port() -> int:
    """A port nothing holds now, below the kernel's ephemeral range. A port got by binding to 0
    comes from that range, and an outgoing connection (a client's, to Postgres or to another
    service) could be given it before the service under test binds it, which then fails to
    start: "Address already in use"."""
    low = ephemeral_low()
    while True:
        port = random.randrange(PORTS_FROM, low) if low > PORTS_FROM + 1_000 else 0
        if port in _handed_out:  # picked before, maybe not bound yet: two callers, one port
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        _handed_out.add(port)
        return port


_handed_out: set[int] = set()


PORTS_FROM = 10_000
"""The lowest port `free_port` picks (well above the well-known ones, Postgres' and Redis')."""


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


class ServiceProcess:
    """`genq serve` in its own process, as an operator would run it."""

    def __init__(
        self,
        database_url: str | None,
        log_path: Path,
        credentials: grpc.ChannelCredentials | None = None,
        **env: str,
    ) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        environment = {
            **os.environ,
            "GENQ_PORT": str(self.port),
            "GENQ_HTTP_PORT": "0",  # many services at once: the status page takes a free port
            "GENQ_HOST": "127.0.0.1",
            "GENQ_RESCUE_INTERVAL_SECONDS": "0.2",
            # One process per service: dozens of services share the machine's Postgres and its
            # max_connections; tests/integration/test_processes.py runs several on purpose.
            "GENQ_PROCESSES": "1",
            **env,
        }
        environment.pop("DATABASE_URL", None)
        if database_url:
            environment["DATABASE_URL"] = database_url
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "service", "serve"],
            env=environment,
            cwd=env.get("GENQ_DATA_DIR", str(ROOT)),
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        # A TLS service (GENQ_TLS_CERT_FILE) is reached with the test's `credentials`.
        self.channel = (
            grpc.secure_channel(self.address, credentials)
            if credentials
            else grpc.insecure_channel(self.address)
        )
        self.stub = task_pb2_grpc.GenerationDataServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        wait_for(self.serving, timeout=60, what=f"genq serve on {self.address} ({log_path})")

    def serving(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"genq serve exited: {self.log_path.read_text()[-3000:]}")
        try:
            response = self.health.Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    def stop(self) -> int:
        self.channel.close()
        end_process(self.process)
        self.log.close()
        return self.process.returncode


@pytest.fixture(scope="session")
def service(
    database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    process = ServiceProcess(database_url, tmp_path_factory.mktemp("service") / "serve.log")
    yield process
    process.stop()


@pytest.fixture
def stub(service: ServiceProcess) -> task_pb2_grpc.GenerationDataServiceStub:
    return service.stub


@pytest.fixture
def db(database_url: str) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    """A direct connection to the service's database, for moving time and checking rows."""
    with psycopg.connect(database_url, autocommit=True, row_factory=dict_row) as connection:
        # As in the service's sessions: tests run its statements too, and a never-analyzed
        # one-row table (settings) can make a per-row function look costly enough to JIT-compile
        # on every call (seen: 0.3 s a row).
        connection.execute("SET jit = off")
        yield connection


@pytest.fixture
def tool_id(stub: task_pb2_grpc.GenerationDataServiceStub) -> str:
    """A tool of this test's own, so tests never see each other's tasks."""
    name = f"tool-{uuid.uuid4().hex[:12]}"
    tool = str(stub.UpsertTool(task_pb2.UpsertToolRequest(name=name)).tool.id)
    # No backoff: the queue's own tests requeue and reclaim at once, as the spec's FailTask does.
    stub.ConfigureTool(
        task_pb2.ConfigureToolRequest(tool_id=tool, backoff_base_seconds=0, backoff_max_seconds=0)
    )
    return tool


@pytest.fixture(scope="session")
def redis_environment() -> str:
    """An ENVIRONMENT of this session's own, so its Redis keys and channels are its alone."""
    return f"test{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def redis_service(
    database_url: str, redis_environment: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """The service with Redis: wakes cross replicas, events are mirrored into Redis Streams."""
    process = ServiceProcess(
        database_url,
        tmp_path_factory.mktemp("redis_service") / "serve.log",
        REDIS_ADDR=REDIS_URL,
        ENVIRONMENT=redis_environment,
    )
    yield process
    process.stop()
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(f"{redis_environment}:*"):
        client.delete(key)


def end_process(process: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 30 s; waits for it either way."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
