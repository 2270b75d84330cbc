"""/metrics (GUIDE X4): RPC counts and latency by method and code, and queue health read from the
database, checked against SQL on a service of its own."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from generation.task.v1 import task_pb2
from tests.conftest import Databases, ServiceProcess, free_port, url_for, wait_for

LIVE = ("queued", "dispatched", "processing")


@dataclass
class Scraped:
    samples: list[Sample]
    types: dict[str, str]

    def value(self, name: str, **labels: str) -> float:
        found = [s.value for s in self.samples if s.name == name and s.labels == labels]
        assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
        return found[0]

    def get(self, name: str, **labels: str) -> float:
        """0 when the series does not exist (yet)."""
        found = [s.value for s in self.samples if s.name == name and s.labels == labels]
        return found[0] if found else 0.0

    def series(self, name: str) -> list[Sample]:
        return [s for s in self.samples if s.name == name]


@dataclass
class Service:
    process: ServiceProcess
    metrics_url: str
    database_url: str

    def scrape(self) -> Scraped:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain; version=")
            text = response.read().decode()
        families = list(text_string_to_metric_families(text))
        return Scraped(
            [sample for family in families for sample in family.samples],
            {family.name: family.type for family in families},
        )

    def sql(self, statement: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.database_url, autocommit=True) as db:
            cursor = db.execute(statement, params)
            return cursor.fetchall() if cursor.description else []


@pytest.fixture(scope="module")
def service(databases: Databases, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    database_url = url_for(databases.create("metrics"))
    http_port = free_port()
    process = ServiceProcess(
        database_url,
        tmp_path_factory.mktemp("metrics") / "serve.log",
        GENQ_HTTP_PORT=str(http_port),
    )
    yield Service(process, f"http://127.0.0.1:{http_port}/metrics", database_url)
    process.stop()


def new_tool(service: Service) -> tuple[str, str]:
    name = f"metrics-{uuid.uuid4().hex[:8]}"
    tool = service.process.stub.UpsertTool(task_pb2.UpsertToolRequest(name=name)).tool.id
    return name, tool


def test_rpc_counts_and_latency_by_method_and_code(service: Service) -> None:
    stub = service.process.stub
    before = service.scrape()
    _, tool = new_tool(service)
    for _ in range(3):
        stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool))
    with pytest.raises(grpc.RpcError) as refused:
        stub.QueueTask(task_pb2.QueueTaskRequest(tool_id="not-a-uuid"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool))
    after = service.scrape()

    assert after.types["genq_rpc_requests"] == "counter"
    assert after.types["genq_rpc_latency_seconds"] == "histogram"

    def delta(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    assert delta("genq_rpc_requests_total", method="QueueTask", code="OK") == 3
    assert delta("genq_rpc_requests_total", method="QueueTask", code="INVALID_ARGUMENT") == 1
    assert delta("genq_rpc_requests_total", method="UpsertTool", code="OK") == 1
    assert delta("genq_rpc_requests_total", method="ClaimNextTask", code="OK") == 1
    codes = {s.labels["code"] for s in after.series("genq_rpc_requests_total")}
    assert codes == {"OK", "INVALID_ARGUMENT"}

    # The histogram: every call observed once, refused ones included; buckets cumulative.
    assert delta("genq_rpc_latency_seconds_count", method="QueueTask") == 4
    assert after.value("genq_rpc_latency_seconds_sum", method="QueueTask") > 0
    buckets = [
        s
        for s in after.series("genq_rpc_latency_seconds_bucket")
        if s.labels["method"] == "QueueTask"
    ]
    counts = [s.value for s in sorted(buckets, key=lambda s: float(s.labels["le"]))]
    assert counts == sorted(counts) and len(counts) > 10
    assert after.value("genq_rpc_latency_seconds_bucket", method="QueueTask", le="+Inf") == (
        after.value("genq_rpc_latency_seconds_count", method="QueueTask")
    )


def test_queue_depth_and_age_match_the_table(service: Service) -> None:
    stub = service.process.stub
    busy_name, busy = new_tool(service)
    idle_name, idle = new_tool(service)
    for _ in range(3):
        stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=busy))
    stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=idle))
    assert stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=busy)).task.id
    service.sql(
        "UPDATE generation.tasks SET created_at = now() - interval '5 minutes' WHERE tool_id = %s",
        idle,
    )

    scraped = service.scrape()
    expected = {
        (name, status): (count, age)
        for name, status, count, age in service.sql(
            "SELECT t.name, s.status, count(k.id), "
            "       COALESCE(extract(epoch FROM now() - min(k.created_at)), 0)::float "
            "FROM generation.tools AS t "
            "CROSS JOIN unnest(%s::text[]) AS s(status) "
            "LEFT JOIN generation.tasks AS k ON k.tool_id = t.id AND k.status::text = s.status "
            "GROUP BY t.name, s.status",
            list(LIVE),
        )
    }
    depth = {
        (s.labels["tool"], s.labels["status"]): s.value for s in scraped.series("genq_queue_depth")
    }
    assert depth == {key: count for key, (count, _) in expected.items()}
    assert depth[(busy_name, "queued")] == 2 and depth[(busy_name, "processing")] == 1
    assert depth[(idle_name, "queued")] == 1 and depth[(idle_name, "dispatched")] == 0

    age = {
        (s.labels["tool"], s.labels["status"]): s.value
        for s in scraped.series("genq_queue_oldest_age_seconds")
    }
    assert set(age) == set(expected)
    for key, (_, seconds) in expected.items():
        assert age[key] == pytest.approx(seconds, abs=5), key
    assert age[(idle_name, "queued")] >= 300
    assert age[(idle_name, "processing")] == 0


def test_spend_reservations_stale_and_dead_tuples(service: Service) -> None:
    stub = service.process.stub
    _, tool = new_tool(service)
    stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool, cost_estimate_nanos=7_000))
    for _ in range(2):
        stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool))
    claim = stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool))
    stub.CompleteTask(
        task_pb2.CompleteTaskRequest(
            task_id=claim.task.id,
            lease_token=claim.lease_token,
            reported_usage=task_pb2.ReportedUsage(cost_nanos=123_456),
        )
    )
    assert stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool)).task.id  # reserves

    scraped = service.scrape()
    status = stub.GetStatus(task_pb2.GetStatusRequest()).status
    (spent, reserved, cap), *_ = service.sql(
        "SELECT sp.spent_nanos, sp.reserved_nanos, s.daily_cap_nanos "
        "FROM generation.spend_today AS sp, generation.settings AS s"
    )
    assert status.settings.spent_today_nanos == spent >= 123_456
    assert scraped.value("genq_spend_today_nanos") == spent
    assert scraped.value("genq_reserved_nanos") == reserved >= 7_000
    assert scraped.value("genq_daily_cap_nanos") == cap
    assert scraped.value("genq_enabled") == 1
    assert scraped.value("genq_database_up") == 1
    assert scraped.value("genq_stale_tasks") == status.stale_tasks

    dead = {s.labels["table"]: s.value for s in scraped.series("genq_dead_tuples")}
    assert {"tasks", "attempts", "task_events"} <= set(dead)
    assert all(value >= 0 for value in dead.values())


def test_lease_lapses_and_reclaims_follow_the_ledger(service: Service) -> None:
    stub = service.process.stub
    before = service.scrape()
    _, tool = new_tool(service)
    task = stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool)).task.id
    first = stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool))
    assert first.task.id == task
    stub.HeartbeatTask(task_pb2.HeartbeatTaskRequest(task_id=task, lease_token=first.lease_token))

    # The worker (which had the claim: it beat once) vanishes: its lease lapses, the rescuer
    # (every 0.2 s here) charges the run a retry, closes the attempt
    # `abandoned` and queues the task again, and the next claim takes it back.
    service.sql(
        "UPDATE generation.tasks SET claim_expires_at = now() - interval '1 second' WHERE id = %s",
        task,
    )
    wait_for(
        lambda: service.sql(
            "SELECT 1 FROM generation.attempts WHERE task_id = %s AND outcome = 'abandoned'", task
        ),
        what="the rescuer to close the lapsed attempt",
    )
    second = stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool))
    assert second.task.id == task and second.task.retry_count == 1

    after = service.scrape()
    assert after.types["genq_lease_lapses"] == after.types["genq_reclaims"] == "counter"
    assert after.value("genq_lease_lapses_total") - before.value("genq_lease_lapses_total") == 1
    assert after.value("genq_reclaims_total") - before.value("genq_reclaims_total") == 1
    ((lapses,),) = service.sql(
        "SELECT count(*) FROM generation.attempts WHERE outcome IN ('abandoned', 'lease_lost')"
    )
    assert after.value("genq_lease_lapses_total") == lapses
