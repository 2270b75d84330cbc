"""/metrics (GUIDE X4): RPC counts and latency under the standard gRPC server names, and queue
health read from the database, checked against SQL on a service of its own; no `_created` series,
money in integer nanos, and a scrape whose statements read the attempts ledger only through
index ranges."""

from __future__ import annotations

import asyncio
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from generation.task.v1 import task_pb2
from service.api.messages import Row
from service.api.metrics import QUEUE_HEALTH_SQL, Metrics
from service.api.rpcs import BINDINGS, STATEMENTS
from service.database import Database
from service.settings import Settings
from tests.conftest import Databases, ServiceProcess, free_port, url_for, wait_for

LIVE = ("queued", "dispatched", "processing")
SERVICE_NAME = "generation.task.v1.GenerationDataService"
MONEY = ("genq_spend_today_nanos", "genq_reserved_nanos", "genq_daily_cap_nanos")


def rpc(method: str, **labels: str) -> dict[str, str]:
    """The labels of a unary method's series (grpc_code, when given, among `labels`)."""
    return {"grpc_type": "unary", "grpc_service": SERVICE_NAME, "grpc_method": method, **labels}


@dataclass
class Scraped:
    samples: list[Sample]
    types: dict[str, str]
    text: str

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
        return scrape(self.metrics_url)

    def sql(self, statement: str, *params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.database_url, autocommit=True) as db:
            cursor = db.execute(statement, params)
            return cursor.fetchall() if cursor.description else []


def scrape(url: str) -> Scraped:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=")
        text = response.read().decode()
    families = list(text_string_to_metric_families(text))
    return Scraped(
        [sample for family in families for sample in family.samples],
        {family.name: family.type for family in families},
        text,
    )


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


def test_rpc_counts_and_latency_under_the_standard_grpc_names(service: Service) -> None:
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

    # go-grpc-prometheus's names, labels and code spelling, which stock dashboards read.
    assert after.types["grpc_server_started"] == "counter"
    assert after.types["grpc_server_handled"] == "counter"
    assert after.types["grpc_server_handling_seconds"] == "histogram"
    assert not [s for s in after.samples if s.name.startswith("genq_rpc_")]

    def delta(name: str, **labels: str) -> float:
        return after.get(name, **labels) - before.get(name, **labels)

    assert delta("grpc_server_started_total", **rpc("QueueTask")) == 4
    assert delta("grpc_server_handled_total", **rpc("QueueTask", grpc_code="OK")) == 3
    assert delta("grpc_server_handled_total", **rpc("QueueTask", grpc_code="InvalidArgument")) == 1
    assert delta("grpc_server_handled_total", **rpc("UpsertTool", grpc_code="OK")) == 1
    assert delta("grpc_server_handled_total", **rpc("ClaimNextTask", grpc_code="OK")) == 1
    handled = after.series("grpc_server_handled_total")
    assert {s.labels["grpc_code"] for s in handled} == {"OK", "InvalidArgument"}
    assert {s.labels["grpc_service"] for s in handled} == {SERVICE_NAME}
    # Every method is there from the start (at 0), each with its type: the stream is the one.
    types = {s.labels["grpc_method"]: s.labels["grpc_type"] for s in handled}
    assert types["WatchTaskEvents"] == "server_stream"
    assert {kind for method, kind in types.items() if method != "WatchTaskEvents"} == {"unary"}
    assert after.value("grpc_server_started_total", **rpc("GetSettings")) >= 0

    # The histogram: every call observed once, refused ones included; buckets cumulative.
    assert delta("grpc_server_handling_seconds_count", **rpc("QueueTask")) == 4
    assert after.value("grpc_server_handling_seconds_sum", **rpc("QueueTask")) > 0
    buckets = [
        s
        for s in after.series("grpc_server_handling_seconds_bucket")
        if s.labels["grpc_method"] == "QueueTask"
    ]
    counts = [s.value for s in sorted(buckets, key=lambda s: float(s.labels["le"]))]
    assert counts == sorted(counts) and len(counts) > 10
    assert after.value("grpc_server_handling_seconds_bucket", **rpc("QueueTask", le="+Inf")) == (
        after.value("grpc_server_handling_seconds_count", **rpc("QueueTask"))
    )


def test_no_created_series(service: Service) -> None:
    _, tool = new_tool(service)
    service.process.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool))
    scraped = service.scrape()
    assert "grpc_server_handled_total{" in scraped.text
    assert "_created" not in scraped.text
    assert not [s for s in scraped.samples if s.name.endswith("_created")]


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
    (spent, reserved, cap, currency), *_ = service.sql(
        "SELECT sp.spent_nanos, sp.reserved_nanos, s.daily_cap_nanos, s.currency "
        "FROM generation.spend_today AS sp, generation.settings AS s"
    )
    assert status.settings.spent_today_nanos == spent >= 123_456
    assert scraped.value("genq_spend_today_nanos", currency=currency) == spent
    assert scraped.value("genq_reserved_nanos", currency=currency) == reserved >= 7_000
    assert scraped.value("genq_daily_cap_nanos", currency=currency) == cap
    # Money is integer nanos, the unit in the name and the currency in a label: never a
    # fraction.
    for name in MONEY:
        assert scraped.types[name] == "gauge"
        assert "nanos" in next(
            line for line in scraped.text.splitlines() if line.startswith(f"# HELP {name} ")
        )
        (sample,) = scraped.series(name)
        assert sample.value == int(sample.value), sample
    assert {s.name for s in scraped.samples if s.name.endswith("_nanos")} == set(MONEY)

    dead = {s.labels["table"]: s.value for s in scraped.series("genq_dead_tuples")}
    assert {"tasks", "attempts", "task_events"} <= set(dead)
    assert all(value >= 0 for value in dead.values())


def test_lease_lapses_and_reclaims_of_the_last_hour_follow_the_ledger(service: Service) -> None:
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
    lapses, reclaims = "genq_lease_lapses_last_hour", "genq_reclaims_last_hour"
    assert after.types[lapses] == after.types[reclaims] == "gauge"
    assert after.value(lapses) - before.value(lapses) == 1
    assert after.value(reclaims) - before.value(reclaims) == 1
    ((count,),) = service.sql(
        "SELECT count(*) FROM generation.attempts "
        "WHERE outcome IN ('abandoned', 'lease_lost') AND ended_at > now() - interval '1 hour'"
    )
    assert after.value(lapses) == count

    # A lapse older than the hour leaves the window (the ledger keeps it).
    service.sql(
        "UPDATE generation.attempts SET ended_at = now() - interval '61 minutes' "
        "WHERE task_id = %s AND outcome = 'abandoned'",
        task,
    )
    later = service.scrape()
    assert later.value(lapses) == after.value(lapses) - 1
    assert later.value(reclaims) == after.value(reclaims) - 1


class RecordingDatabase(Database):
    """The service's Database, listing every statement run through it."""

    def __init__(self, url: str) -> None:
        super().__init__(url, Settings())
        self.statements: list[tuple[str, dict[str, Any]]] = []

    async def fetch(
        self,
        sql: str,
        params: dict[str, Any],
        timeout: float | None = None,
        then: tuple[str, dict[str, Any]] | None = None,
        rerun_deadlocks: bool = False,
    ) -> list[Row]:
        self.statements.append((sql, params))
        return await super().fetch(sql, params, timeout, then, rerun_deadlocks)


def ledger_scans(plan: dict[str, Any]) -> list[str]:
    """The plan's reads of generation.attempts that are not bounded by an index condition."""
    found = []
    if plan.get("Relation Name") == "attempts" and not (
        plan.get("Index Cond") or plan.get("Recheck Cond")
    ):
        found.append(f"{plan['Node Type']} on attempts")
    for child in plan.get("Plans", []):
        found += ledger_scans(child)
    return found


def test_a_scrape_reads_the_ledger_only_through_index_ranges(service: Service) -> None:
    """The scrape's cost is flat: its statements (the ones /metrics runs, listed) never read the
    attempts ledger, which is never purged, but by an index condition: a tool's newest claim,
    the last hour's ended attempts, a primary-key probe. Checked on the plans Postgres makes
    with sequential scans off, so that a small test ledger cannot hide a full scan."""

    async def scrape() -> tuple[bytes, list[tuple[str, dict[str, Any]]]]:
        database = RecordingDatabase(service.database_url)
        await database.open()
        try:

            async def read_status() -> task_pb2.Status:
                binding = BINDINGS["GetStatus"]
                params = binding.bind(task_pb2.GetStatusRequest(), Settings())
                rows = await database.fetch(STATEMENTS["GetStatus"], params)
                response = binding.respond(rows)
                assert isinstance(response, task_pb2.GetStatusResponse)
                return response.status

            body = await Metrics().scrape(database, read_status)
            return body, database.statements
        finally:
            await database.close()

    body, statements = asyncio.run(scrape())
    assert b"genq_database_up 1.0" in body
    assert sorted(sql for sql, _ in statements) == sorted(
        [STATEMENTS["GetStatus"], QUEUE_HEALTH_SQL]
    )
    with psycopg.connect(service.database_url, autocommit=True) as db:
        db.execute("SET enable_seqscan = off")
        db.execute("SET jit = off")
        for sql, params in statements:
            cursor = psycopg.ClientCursor(db)
            cursor.execute("EXPLAIN (FORMAT JSON) " + sql, params)
            ((plan,),) = cursor.fetchall()
            # Subplans and init plans are children in "Plans" too.
            assert ledger_scans(plan[0]["Plan"]) == [], (sql[:60], plan)


def test_several_processes_sum_into_the_parents_metrics(service: Service, tmp_path: Path) -> None:
    """GENQ_PROCESSES: the children record, the parent serves their sum; no `_created` either."""
    http_port = free_port()
    host = ServiceProcess(
        service.database_url,
        tmp_path / "serve.log",
        GENQ_PROCESSES="2",
        GENQ_HTTP_PORT=str(http_port),
    )
    try:
        url = f"http://127.0.0.1:{http_port}/metrics"
        before = scrape(url)
        for _ in range(5):
            host.stub.GetSettings(task_pb2.GetSettingsRequest(), timeout=10)
        after = scrape(url)
    finally:
        host.stop()
    ok = rpc("GetSettings", grpc_code="OK")
    assert (
        after.get("grpc_server_handled_total", **ok) - before.get("grpc_server_handled_total", **ok)
        == 5
    )
    assert (
        after.get("grpc_server_started_total", **rpc("GetSettings"))
        - before.get("grpc_server_started_total", **rpc("GetSettings"))
        == 5
    )
    assert after.value("genq_database_up") == 1
    assert "_created" not in after.text
