"""Tracing (GUIDE A12): a gateway's enqueue, the service's handling of it, and the worker's run of
the task land in one trace. The service runs in this process here, so that one in-memory
exporter sees the spans of all three."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from service import server
from service.settings import Settings
from tests.conftest import free_port, wait_for
from tests.test_fleet import running
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
