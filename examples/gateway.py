"""A gateway in miniature: enqueue an "image-gen" task with a reservation, then follow its events.

    GENQ_ADDR=localhost:50051 python examples/gateway.py "a lighthouse at dusk"

It prints each event as it arrives and ends at the terminal one (completed or failed), so run a
worker for "image-gen" alongside it, or it waits. While the task stays queued it says why every
few seconds, as far as the service's status tells (GetStatus): no daily cap set, the kill switch
off, the tool paused, a cap spent, or no worker asking, with the command that frees it.
The reservation (100 tokens here) is settled by the reconciler (`genq reconcile`) once the task
is terminal.

Against a secured service, the client reads GENQ_TOKEN (a gateway token: genq token create
--role gateway --tool image-gen), GENQ_TLS_CA_FILE and, for mutual TLS,
GENQ_TLS_CLIENT_CERT_FILE and GENQ_TLS_CLIENT_KEY_FILE (workers_sdk.client.Credentials).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys

from google.protobuf.json_format import MessageToDict

from generation.task.v1 import task_pb2
from workers_sdk.client import DEFAULT_TARGET, GenqClient
from workers_sdk.errors import GenqError
from workers_sdk.gateway import GatewayClient

TOOL = "image-gen"
EXPLAIN_EVERY_SECONDS = 3.0
"""How long the task may sit queued before (and between) saying why it waits."""


def why_waiting(status: task_pb2.Status, tool: str) -> str:
    """Why a queued task of `tool` is not running, from what GetStatus shows: the first gate
    that holds it, in the order the claim checks them."""
    settings = status.settings
    mine = next((t for t in status.tools if t.name == tool), None)
    if settings.disabled_by_environment:
        return "the kill switch is forced off (GENQ_DISABLED on a service replica)"
    if not settings.enabled:
        return "the kill switch is off: run `genq resume`"
    if mine is not None and mine.paused:
        return f"the tool is paused: run `genq resume {tool}`"
    overridden = settings.HasField("cap_override_nanos")
    cap = (
        settings.cap_override_nanos
        if overridden
        else settings.daily_cap_nanos
        if settings.HasField("daily_cap_nanos")
        else None
    )
    if cap is None:
        return "no daily cap set: run `genq cap 10` (10 currency units a day)"
    if cap == 0:
        return "the daily cap is 0: run `genq cap 10`"
    if settings.spent_today_nanos + settings.reserved_nanos >= cap:
        return "today's spend reached the daily cap: raise it with `genq cap N`"
    if (
        mine is not None
        and mine.HasField("daily_cap_nanos")
        and mine.spent_today_nanos + mine.reserved_nanos >= mine.daily_cap_nanos
    ):
        return f"the tool's own daily cap is spent: raise it with `genq cap N --tool {tool}`"
    return f"no worker has taken it yet: is a worker for {tool} running (examples/worker.py)?"


async def explain(client: GenqClient, gateway: GatewayClient, task_id: str) -> None:
    """Says why the task waits, each time the reason changes, for as long as it is queued."""
    said = None
    while True:
        await asyncio.sleep(EXPLAIN_EVERY_SECONDS)
        try:
            if (await gateway.get(task_id)).status != task_pb2.TASK_STATUS_QUEUED:
                return
            answer = await client.call("GetStatus", task_pb2.GetStatusRequest())
        except GenqError as error:  # e.g. a token without the viewer or gateway role
            print(f"still queued; cannot ask the service why: {error}", flush=True)
            return
        reason = why_waiting(answer.status, TOOL)
        if reason != said:
            print(f"still queued: {reason}", flush=True)
            said = reason


async def main(prompt: str) -> int:
    async with GenqClient(os.environ.get("GENQ_ADDR", DEFAULT_TARGET)) as client:
        gateway = GatewayClient(client)
        tool = await gateway.upsert_tool(TOOL)
        task = await gateway.enqueue(
            tool.id,
            {"prompt": prompt},
            reserved_token_amount=100,
            idempotency_key=f"example-{os.getpid()}",
        )
        print(f"queued task {task.id}", flush=True)
        explaining = asyncio.create_task(explain(client, gateway, task.id))
        last = None
        try:
            async for event in gateway.follow(task.id):
                kind = task_pb2.TaskEventKind.Name(event.kind).removeprefix("TASK_EVENT_KIND_")
                print(f"{event.sequence:>6} {kind:<15} {MessageToDict(event.data)}", flush=True)
                last = event.kind
        finally:
            explaining.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await explaining
        return 0 if last == task_pb2.TASK_EVENT_KIND_COMPLETED else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(" ".join(sys.argv[1:]) or "a lighthouse at dusk")))
