"""A stand-in generation tool: "image-gen" pretends to render an image.

    genq worker examples.worker:make_fleet          # from the repository's root
    python examples/worker.py                       # the same, without the genq program

`make_fleet` builds the WorkerFleet from the environment; `genq worker` runs it (SIGTERM or
Ctrl-C drains it, --until-empty stops when nothing is due, --concurrency overrides
GENQ_CONCURRENCY, GENQ_HEALTH_FILE is touched while it works: see "Running workers: genq worker"
in docs/OPERATIONS.md). It sleeps through a few steps, publishing progress and reporting what
each step cost, and returns a made-up image URL. Task input: {"prompt": "...", "seconds": 3.0}.
A cancel of a running render stops it, and the steps it paid for are recorded (see
workers_sdk.fleet).

Environment (each with its default):
    GENQ_ADDR (localhost:50051)          the data plane
    GENQ_TOOL (image-gen)                the tool name this worker hosts
    GENQ_CONCURRENCY (4)                 renders at once
    GENQ_POLL_INTERVAL (2.0)             seconds an idle claim parks in the service
    GENQ_HEARTBEAT_INTERVAL (60)         most seconds between lease heartbeats (a third of
                                         the lease when that is shorter)
    GENQ_DRAIN_TIMEOUT (30)              seconds in-flight renders get on SIGTERM
    GENQ_REPORT_DELAY (0)                most seconds a heartbeat or report waits to share
                                         its batch RPC with others (see workers_sdk.fleet)
    GENQ_TOKEN / GENQ_TOKEN_FILE         a worker token for the tool (genq token create
                                         --role worker --tool image-gen); none: anonymous
    GENQ_TLS_CA_FILE                     TLS: the CA the service's certificate is signed by
    GENQ_TLS_CLIENT_CERT_FILE, GENQ_TLS_CLIENT_KEY_FILE   mutual TLS: this worker's certificate
    GENQ_LOG_LEVEL, GENQ_LOG_FORMAT      as the service's (info, text; or json)
    GENQ_HEALTH_FILE (unset)             touched every 10 s once the fleet has registered its
                                         tool with the service, while it works: a health
                                         check reads its age (docker-compose.yml)
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from typing import Any

from generation.task.v1 import task_pb2
from workers_sdk import PermanentError, TaskContext, WorkerFleet
from workers_sdk.cli import main as genq

STEPS = 5
PRICE_TOKENS = 10
"""User tokens charged per image (at most the task's reservation, settled by the reconciler)."""
COST_NANOS_PER_SECOND = 2_000_000
"""What the pretend provider charges the operator: 0.002 currency units per second of render."""

WORKER = f"{socket.gethostname()}:{os.getpid()}"


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


def make_fleet() -> WorkerFleet:
    """The fleet, from the environment: `genq worker examples.worker:make_fleet`."""
    env = os.environ.get
    tool = env("GENQ_TOOL", "image-gen")
    fleet = WorkerFleet(
        env("GENQ_ADDR", "localhost:50051"),
        poll_interval=float(env("GENQ_POLL_INTERVAL", "2.0")),
        heartbeat_interval=float(env("GENQ_HEARTBEAT_INTERVAL", "60")),
        drain_timeout=float(env("GENQ_DRAIN_TIMEOUT", "30")),
        report_delay=float(env("GENQ_REPORT_DELAY", "0")),
    )
    fleet.register(tool, render, concurrency=int(env("GENQ_CONCURRENCY", "4")))
    logging.getLogger(__name__).info("worker %s hosting %s", WORKER, tool)
    return fleet


def main() -> int:
    """`genq worker` on this module's factory (this very module, when run as a script)."""
    return genq(["worker", f"{__name__}:make_fleet", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
