"""A stand-in generation tool: "image-gen" pretends to render an image.

    GENQ_ADDR=localhost:50051 python examples/worker.py

It sleeps through a few steps, publishing progress and reporting what each step cost, and
returns a made-up image URL. Task input: {"prompt": "...", "seconds": 3.0}. SIGTERM or Ctrl-C
drains it; a cancel of a running render stops it, and the steps it paid for are recorded (see
workers_sdk.fleet).

Environment (each with its default):
    GENQ_ADDR (localhost:50051)          the data plane
    GENQ_TOOL (image-gen)                the tool name this worker hosts
    GENQ_CONCURRENCY (4)                 renders at once
    GENQ_POLL_INTERVAL (2.0)             seconds an idle claim parks in the service
    GENQ_HEARTBEAT_INTERVAL (60)         most seconds between lease heartbeats (a third of
                                         the lease when that is shorter)
    GENQ_DRAIN_TIMEOUT (30)              seconds in-flight renders get on SIGTERM
    GENQ_REPORT_DELAY (0.005)            most seconds a heartbeat or report waits to share
                                         its batch RPC with others (see workers_sdk.fleet)
    GENQ_TOKEN / GENQ_TOKEN_FILE         a worker token for the tool (genq token create
                                         --role worker --tool image-gen); none: anonymous
    GENQ_TLS_CA_FILE                     TLS: the CA the service's certificate is signed by
    GENQ_TLS_CLIENT_CERT_FILE, GENQ_TLS_CLIENT_KEY_FILE   mutual TLS: this worker's certificate
    GENQ_HEALTH_FILE (unset)             touched every HEALTH_TOUCH_SECONDS once the fleet has
                                         registered its tool with the service, while it works:
                                         a health check reads its age (docker-compose.yml)
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from pathlib import Path
from typing import Any

from generation.task.v1 import task_pb2
from workers_sdk import PermanentError, TaskContext, WorkerFleet

STEPS = 5
PRICE_TOKENS = 10
"""User tokens charged per image (at most the task's reservation, settled by the reconciler)."""
COST_NANOS_PER_SECOND = 2_000_000
"""What the pretend provider charges the operator: 0.002 currency units per second of render."""

WORKER = f"{socket.gethostname()}:{os.getpid()}"
HEALTH_TOUCH_SECONDS = 10.0
"""How often the health file is touched; a check allows a few missed touches."""


async def render(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
    prompt = ctx.input.get("prompt", "")
    seconds = float(ctx.input.get("seconds", 3.0))
    if not isinstance(prompt, str) or not 0 <= seconds <= 600:
        raise PermanentError("input needs a string prompt and 0-600 seconds")
    await ctx.streaming_url(f"https://preview.example.invalid/{task.id}")
    cost = int(seconds * COST_NANOS_PER_SECOND)
    for step in range(1, STEPS + 1):
        if ctx.is_lease_lost:
            # Another worker owns the task now; our result would be dropped anyway.
            return {}
        await asyncio.sleep(seconds / STEPS)
        # Billed as it goes: a render cancelled (or drained) half way reports half its cost.
        ctx.report_usage(cost_nanos=cost * step // STEPS - cost * (step - 1) // STEPS)
        await ctx.progress(step / STEPS, f"step {step}/{STEPS}")
    ctx.report_usage(
        token_amount=min(PRICE_TOKENS, task.reserved_token_amount), model="stand-in-diffusion"
    )
    return {"image_url": f"https://images.example.invalid/{task.id}.png", "worker": WORKER}


async def work(fleet: WorkerFleet, health_file: str | None) -> None:
    """Runs the fleet; with a health file, touches it while the fleet works: from when its tool
    is registered (the service answered, the token was accepted) until it drains."""
    if health_file is None:
        await fleet.run()
        return
    running = asyncio.create_task(fleet.run())
    ready = asyncio.create_task(fleet.ready.wait())
    await asyncio.wait([running, ready], return_when=asyncio.FIRST_COMPLETED)
    path = Path(health_file)
    while not running.done():
        await asyncio.to_thread(path.touch)
        await asyncio.wait([running], timeout=HEALTH_TOUCH_SECONDS)
    ready.cancel()
    await asyncio.to_thread(path.unlink, missing_ok=True)
    await running


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    env = os.environ.get
    tool = env("GENQ_TOOL", "image-gen")
    fleet = WorkerFleet(
        env("GENQ_ADDR", "localhost:50051"),
        poll_interval=float(env("GENQ_POLL_INTERVAL", "2.0")),
        heartbeat_interval=float(env("GENQ_HEARTBEAT_INTERVAL", "60")),
        drain_timeout=float(env("GENQ_DRAIN_TIMEOUT", "30")),
        report_delay=float(env("GENQ_REPORT_DELAY", "0.005")),
    )
    fleet.register(tool, render, concurrency=int(env("GENQ_CONCURRENCY", "4")))
    logging.getLogger(__name__).info("worker %s hosting %s", WORKER, tool)
    asyncio.run(work(fleet, env("GENQ_HEALTH_FILE")))


if __name__ == "__main__":
    main()
