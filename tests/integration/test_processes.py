"""GENQ_PROCESSES: several service processes on one gRPC port (SO_REUSEPORT), one parent that
serves /metrics for all of them, stops them together, and fails when one dies."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from generation.task.v1 import task_pb2, task_pb2_grpc
from tests.conftest import ROOT, Databases, ServiceProcess, free_port, url_for, wait_for
from tests.tcp_proxy import TcpProxy
from workers_sdk.client import GenqClient

SERVING = re.compile(r"(\d+) service processes serving gRPC on port (\d+) \(pids ([\d, ]+)\)")


def children(service: ServiceProcess) -> list[int]:
    """The child pids the parent logged once they all served."""
    found = wait_for(
        lambda: SERVING.search(service.log_path.read_text()),
        what=f"the parent to log its children ({service.log_path})",
    )
    return [int(pid) for pid in found.group(3).split(", ")]


def gone(pid: int) -> bool:
    """No such process any more (or only its zombie, waiting for whoever adopted it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(value for (found, _), value in samples.items() if found == name)


def by_process(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    return {
        dict(labels)["process"]: value
        for (name, labels), value in samples.items()
        if name == "genq_process_rpc_requests_total"
    }


@pytest.fixture(scope="module")
def database_url(databases: Databases) -> str:
    return url_for(databases.create("processes"))


@dataclass
class Host:
    service: ServiceProcess
    metrics_url: str


@pytest.fixture(scope="module")
def host(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    http_port = free_port()
    service = ServiceProcess(
        database_url,
        tmp_path_factory.mktemp("processes") / "serve.log",
        GENQ_PROCESSES="3",
        GENQ_HTTP_PORT=str(http_port),
    )
    yield Host(service, f"http://127.0.0.1:{http_port}/metrics")
    assert service.stop() == 0


def test_every_process_serves_one_port_and_parent_metrics_count_them_all(host: Host) -> None:
    service = host.service
    pids = children(service)
    assert len(pids) == 3 and os.getpid() not in pids
    log = service.log_path.read_text()
    assert f"genq serving gRPC on port {service.port}" in log
    for number in (1, 2, 3):
        assert f"genq-{number} service.api: GenerationDataService listening on" in log
    # One process of the host leads the maintenance sweeps, whatever else runs on the database.
    assert len(re.findall(r"genq-\d service\.leader: leader: this process", log)) == 1

    before = scrape(host.metrics_url)
    # Each channel its own TCP connection (no shared subchannel), spread by the kernel.
    connections, calls_each = 40, 3
    for _ in range(connections):
        with grpc.insecure_channel(
            service.address, options=[("grpc.use_local_subchannel_pool", 1)]
        ) as channel:
            stub = task_pb2_grpc.GenerationDataServiceStub(channel)
            for _ in range(calls_each):
                stub.GetSettings(task_pb2.GetSettingsRequest(), timeout=10)
    after = scrape(host.metrics_url)

    calls = connections * calls_each
    labels = (
        ("grpc_method", "GetSettings"),
        ("grpc_service", "generation.task.v1.GenerationDataService"),
        ("grpc_type", "unary"),
    )
    method = ("grpc_server_handled_total", (("grpc_code", "OK"), *labels))
    assert after[method] - before.get(method, 0) == calls
    assert (
        total(after, "genq_process_rpc_requests_total")
        - total(before, "genq_process_rpc_requests_total")
        == calls
    )
    spread = {
        process: count - by_process(before).get(process, 0)
        for process, count in by_process(after).items()
    }
    print(f"\n{calls} calls over {connections} connections, by process: {sorted(spread.items())}")
    assert {process for process, count in spread.items() if count > 0} == {"1", "2", "3"}
    latency = ("grpc_server_handling_seconds_count", labels)
    assert after[latency] - before.get(latency, 0) == calls


def test_sigterm_stops_every_process_and_removes_the_metrics_files(
    database_url: str, tmp_path: Path
) -> None:
    service = ServiceProcess(database_url, tmp_path / "serve.log", GENQ_PROCESSES="2")
    pids = children(service)
    environ = Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0")
    (directory,) = [
        Path(entry.split(b"=", 1)[1].decode())
        for entry in environ
        if entry.startswith(b"PROMETHEUS_MULTIPROC_DIR=")
    ]
    assert directory.is_dir()
    service.process.send_signal(signal.SIGTERM)
    assert service.process.wait(30) == 0
    service.stop()
    wait_for(lambda: all(gone(pid) for pid in pids), what="every child to exit")
    assert not directory.exists()


def test_a_child_that_dies_stops_the_others_and_the_host_fails(
    database_url: str, tmp_path: Path
) -> None:
    service = ServiceProcess(database_url, tmp_path / "serve.log", GENQ_PROCESSES="2")
    first, second = children(service)
    os.kill(second, signal.SIGKILL)
    assert service.process.wait(30) == 1
    service.stop()
    wait_for(lambda: gone(first), what="the surviving child to be stopped")
    log = service.log_path.read_text()
    assert f"service process 2 (pid {second}) exited with status -9; stopping the others" in log
    assert "genq-1 service.api: stopped" in log


def test_children_of_a_killed_parent_stop_on_their_own(database_url: str, tmp_path: Path) -> None:
    service = ServiceProcess(
        database_url, tmp_path / "serve.log", GENQ_PROCESSES="2", GENQ_SHUTDOWN_GRACE_SECONDS="1"
    )
    pids = children(service)
    service.process.kill()
    service.process.wait(10)
    service.stop()
    wait_for(lambda: all(gone(pid) for pid in pids), 20, "the orphaned children to stop")
    assert service.log_path.read_text().count("the parent process is gone; stopping") == 2


def test_port_zero_is_picked_once_for_every_process(database_url: str, tmp_path: Path) -> None:
    log_path = tmp_path / "serve.log"
    environment = {
        **os.environ,
        "DATABASE_URL": database_url,
        "GENQ_HOST": "127.0.0.1",
        "GENQ_PORT": "0",
        "GENQ_HTTP_PORT": "0",
        "GENQ_PROCESSES": "2",
    }
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "service", "serve"],
            env=environment,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        found = wait_for(
            lambda: (
                process.poll() is None
                and re.search(r"genq serving gRPC on port (\d+)", log_path.read_text())
            ),
            30,
            "the port to be printed",
        )
        port = int(found.group(1))
        assert port != 0
        text = log_path.read_text()
        assert text.count(f"GenerationDataService listening on 127.0.0.1:{port}") == 2
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            stub = task_pb2_grpc.GenerationDataServiceStub(channel)
            name = f"port0-{uuid.uuid4().hex[:8]}"
            assert stub.UpsertTool(task_pb2.UpsertToolRequest(name=name), timeout=10).tool.id
    finally:
        process.terminate()
        assert process.wait(30) == 0


def test_a_port_in_use_fails_the_start(database_url: str, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        environment = {
            **os.environ,
            "DATABASE_URL": database_url,
            "GENQ_HOST": "127.0.0.1",
            "GENQ_PORT": str(port),
            "GENQ_HTTP_PORT": "0",
            "GENQ_PROCESSES": "2",
        }
        result = subprocess.run(
            [sys.executable, "-m", "service", "serve"],
            env=environment,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode != 0
    assert f"GENQ_PORT: cannot listen on 127.0.0.1:{port}" in result.stderr


def test_one_sdk_client_takes_turns_on_connections_of_its_own(host: Host) -> None:
    """GenqClient's calls take turns on `connections` TCP connections, so one fleet or gateway
    reaches several of the host's processes (SO_REUSEPORT spreads connections, not calls)."""
    proxy = TcpProxy(("127.0.0.1", host.service.port))
    proxy.start()

    async def calls(connections: int) -> int:
        before = len(proxy.connections)
        async with GenqClient(f"127.0.0.1:{proxy.port}", connections=connections) as client:
            for _ in range(2 * connections):
                await client.call("GetSettings", task_pb2.GetSettingsRequest())
            return (len(proxy.connections) - before) // 2  # a client socket and its upstream

    try:
        assert asyncio.run(calls(3)) == 3
        assert asyncio.run(calls(1)) == 1
    finally:
        proxy.cut()
