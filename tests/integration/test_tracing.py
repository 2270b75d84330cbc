"""Tracing (GUIDE A12): a gateway's enqueue, the service's handling of it, and the worker's run of
the task land in one trace. The service runs in this process here, so that one in-memory
exporter sees the spans of all three. And where a service's spans go (service/tracing.py): the
standard OTEL_* variables, nowhere when none names an exporter."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from generation.task.v1 import task_pb2
from service.api import server
from service.settings import Settings
from tests.conftest import ROOT, ServiceProcess, free_port, wait_for
from tests.integration.test_fleet import running
from workers_sdk import GatewayClient, GenqClient, WorkerFleet


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    """The process-wide tracer provider (the service reads the global one), set once."""
    spans = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return spans


@pytest.fixture
def in_process_service(database_url: str) -> Iterator[str]:
    port = free_port()
    settings = Settings(host="127.0.0.1", port=port, http_port=0, rescue_interval_seconds=0.2)
    started = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(
            server.serve(settings, database_url, ready=lambda _: started.set(), stop=stop)
        )

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    wait_for(started.is_set, what="the in-process service")
    yield f"127.0.0.1:{port}"
    loop.call_soon_threadsafe(stop.set)
    thread.join(30)


def test_gateway_service_and_worker_spans_share_one_trace(
    exporter: InMemorySpanExporter, in_process_service: str
) -> None:
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    tool = f"traced-{uuid.uuid4().hex[:8]}"
    done = threading.Event()

    async def render(task: Any, ctx: Any) -> dict[str, Any]:
        done.set()
        return {"ok": True}

    fleet = WorkerFleet(in_process_service, poll_interval=0.5, tracer_provider=provider)
    fleet.register(tool, render)

    async def enqueue() -> tuple[str, str]:
        async with GenqClient(in_process_service) as client:
            gateway = GatewayClient(client, tracer_provider=provider)
            tool_id = (await gateway.upsert_tool(tool)).id
            with provider.get_tracer("gateway").start_as_current_span("user request") as root:
                task = await gateway.enqueue(tool_id, {"prompt": "a cat"})
            return task.id, format(root.get_span_context().trace_id, "032x")

    with running(fleet):
        task_id, trace_id = asyncio.run(enqueue())
        wait_for(done.is_set, what="the worker to run the task")
        wait_for(
            lambda: any(s.name.endswith("/CompleteTask") for s in exporter.get_finished_spans()),
            what="the completion's server span",
        )

    in_trace = {
        span.name
        for span in exporter.get_finished_spans()
        if format(span.context.trace_id, "032x") == trace_id
    }
    assert "user request" in in_trace
    assert any(name.startswith("enqueue") for name in in_trace), in_trace
    assert "generation.task.v1.GenerationDataService/QueueTask" in in_trace, in_trace
    assert any(name.startswith("process") for name in in_trace), in_trace
    assert "generation.task.v1.GenerationDataService/CompleteTask" in in_trace, in_trace
    assert task_id


def without_otel() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}


def configure_in_a_process(**env: str) -> subprocess.CompletedProcess[str]:
    """service.tracing.configure() in a fresh interpreter, then one span; prints what it did."""
    script = (
        "from opentelemetry import trace\n"
        "from service import tracing\n"
        "configured = tracing.configure()\n"
        "with trace.get_tracer('probe').start_as_current_span('probe span'):\n"
        "    pass\n"
        "print('configured', configured, type(trace.get_tracer_provider()).__name__)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script],
        env={**without_otel(), **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_no_exporter_named_leaves_the_no_op_provider() -> None:
    for env in ({}, {"OTEL_TRACES_EXPORTER": "none"}):
        result = configure_in_a_process(**env)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == ["configured False ProxyTracerProvider"], env
    disabled = configure_in_a_process(OTEL_TRACES_EXPORTER="console", OTEL_SDK_DISABLED="true")
    assert disabled.stdout.splitlines() == ["configured False ProxyTracerProvider"]


def test_console_exporter_and_service_name() -> None:
    result = configure_in_a_process(OTEL_TRACES_EXPORTER="console")
    assert result.returncode == 0, result.stderr
    assert "configured True TracerProvider" in result.stdout
    # The batch goes out at exit, after the print: the span is the output's other lines.
    span = json.loads(
        "\n".join(line for line in result.stdout.splitlines() if not line.startswith("configured"))
    )
    assert span["name"] == "probe span"
    assert span["resource"]["attributes"]["service.name"] == "genq"
    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES name it when set.
    for env in (
        {"OTEL_SERVICE_NAME": "genq-eu"},
        {"OTEL_RESOURCE_ATTRIBUTES": "service.name=genq-eu"},
    ):
        named = configure_in_a_process(OTEL_TRACES_EXPORTER="console", **env)
        assert '"service.name": "genq-eu"' in named.stdout, named.stdout


def test_otlp_exporter_is_installed() -> None:
    """OTEL_TRACES_EXPORTER=otlp finds its exporter (gRPC, or HTTP by OTEL_EXPORTER_OTLP_PROTOCOL);
    nothing listens on the endpoint here, which costs the process no more than a logged error."""
    for protocol in ("grpc", "http/protobuf"):
        result = configure_in_a_process(
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{free_port()}",
            OTEL_EXPORTER_OTLP_TIMEOUT="1",
        )
        assert result.returncode == 0, result.stderr
        assert "configured True TracerProvider" in result.stdout, result.stderr


def test_a_service_started_with_the_console_exporter_prints_its_spans(
    database_url: str, tmp_path: Path
) -> None:
    """Needs service/api/server.py to call service.tracing.configure() as each process starts."""
    log = tmp_path / "serve.log"
    service = ServiceProcess(
        database_url,
        log,
        OTEL_TRACES_EXPORTER="console",
        OTEL_BSP_SCHEDULE_DELAY="100",  # ms: the batch goes out at once, not in 5 s
    )
    try:
        name = f"console-{uuid.uuid4().hex[:8]}"
        service.stub.UpsertTool(task_pb2.UpsertToolRequest(name=name), timeout=10)
        wanted = '"name": "generation.task.v1.GenerationDataService/UpsertTool"'
        wait_for(lambda: wanted in log.read_text(), what=f"the UpsertTool span in {log}")
    finally:
        assert service.stop() == 0
    text = log.read_text()
    assert '"service.name": "genq"' in text
    assert '"kind": "SpanKind.SERVER"' in text
