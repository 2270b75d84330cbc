"""The module tests/integration/test_worker_command.py runs with `genq worker`.

`make_fleet` (a factory) hosts the tool GENQ_TOOL, one task at a time, at GENQ_ADDR; claims
park GENQ_POLL_INTERVAL (0.3 s) and a drain waits GENQ_DRAIN_TIMEOUT (30 s). Its handler logs
"task <id>: running" (so a test knows a task is in flight), publishes the progress event
"running" (so a test counts the runs in SQL), sleeps `input.seconds` and returns {"pid": ...}.
`make_fleet_async` is the same factory as a coroutine, `fleet` a ready-made WorkerFleet of the
same tool, `not_a_fleet` is not one.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from generation.task.v1 import task_pb2
from workers_sdk import TaskContext, WorkerFleet

log = logging.getLogger("worker_app")


async def handle(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
    log.info("task %s: running", task.id)
    await ctx.progress(0.0, "running")
    await asyncio.sleep(float(ctx.input.get("seconds", 0.0)))
    return {"pid": os.getpid()}


def make_fleet() -> WorkerFleet:
    env = os.environ
    fleet = WorkerFleet(
        env["GENQ_ADDR"],
        poll_interval=float(env.get("GENQ_POLL_INTERVAL", "0.3")),
        drain_timeout=float(env.get("GENQ_DRAIN_TIMEOUT", "30")),
    )
    fleet.register(env["GENQ_TOOL"], handle)
    return fleet


async def make_fleet_async() -> WorkerFleet:
    """An async factory: awaited inside the command's event loop."""
    await asyncio.sleep(0)
    return make_fleet()


fleet = make_fleet() if "GENQ_TOOL" in os.environ else None
not_a_fleet = 42
