"""A worker process for tests/faults/test_worker_processes.py: one WorkerFleet hosting one tool.

Environment: GENQ_ADDR, GENQ_TOOL, WORKER_ID, GENQ_CONCURRENCY, GENQ_POLL_INTERVAL,
GENQ_HEARTBEAT_INTERVAL, GENQ_DRAIN_TIMEOUT.

The handler first publishes a progress event "started by <WORKER_ID>" (so a test sees in SQL
which worker runs what), then sleeps `input.seconds` in one sleep (no event after it: a worker
resumed after SIGSTOP must reach CompleteTask, not learn of its lost lease from a publish) and
returns {"worker": WORKER_ID}; it logs "task <id>: sleeping" right before that sleep (so a test
knows the publish's answer is in and the sleep's clock runs). When `input.hang_on` names this
worker it never finishes on its own: it runs until the process is killed or the drain gives up
on it. A task with `input.poison` kills the worker's process (exit 137, as an OOM kill would)
right after that first event.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from generation.task.v1 import task_pb2
from workers_sdk import TaskContext, WorkerFleet

WORKER_ID = os.environ["WORKER_ID"]


async def handle(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
    await ctx.progress(0.0, f"started by {WORKER_ID}")
    if ctx.input.get("poison"):
        os._exit(137)
    if ctx.input.get("hang_on") == WORKER_ID:
        await asyncio.Event().wait()
    logging.getLogger(__name__).info("task %s: sleeping", task.id)
    await asyncio.sleep(float(ctx.input.get("seconds", 0.0)))
    return {"worker": WORKER_ID}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format=f"{WORKER_ID} %(levelname)s %(message)s")
    env = os.environ
    fleet = WorkerFleet(
        env["GENQ_ADDR"],
        poll_interval=float(env["GENQ_POLL_INTERVAL"]),
        heartbeat_interval=float(env["GENQ_HEARTBEAT_INTERVAL"]),
        drain_timeout=float(env["GENQ_DRAIN_TIMEOUT"]),
    )
    fleet.register(env["GENQ_TOOL"], handle, concurrency=int(env["GENQ_CONCURRENCY"]))
    asyncio.run(fleet.run())


if __name__ == "__main__":
    main()
