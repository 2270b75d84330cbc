"""A gateway in miniature: enqueue an "image-gen" task with a reservation, then follow its events.

    GENQ_ADDR=localhost:50051 python examples/gateway.py "a lighthouse at dusk"

It prints each event as it arrives and ends at the terminal one (completed or failed), so run a
worker for "image-gen" alongside it, or it waits. The reservation (100 tokens here) is settled
by the reconciler (`genq reconcile`) once the task is terminal.

Against a secured service, the client reads GENQ_TOKEN (a gateway token: genq token create
--role gateway --tool image-gen), GENQ_TLS_CA_FILE and, for mutual TLS,
GENQ_TLS_CLIENT_CERT_FILE and GENQ_TLS_CLIENT_KEY_FILE (workers_sdk.client.Credentials).
"""

from __future__ import annotations

import asyncio
import os
import sys

from google.protobuf.json_format import MessageToDict

from generation.task.v1 import task_pb2
from workers_sdk.client import DEFAULT_TARGET, GenqClient
from workers_sdk.gateway import GatewayClient


async def main(prompt: str) -> int:
    async with GenqClient(os.environ.get("GENQ_ADDR", DEFAULT_TARGET)) as client:
        gateway = GatewayClient(client)
        tool = await gateway.upsert_tool("image-gen")
        task = await gateway.enqueue(
            tool.id,
            {"prompt": prompt},
            reserved_token_amount=100,
            idempotency_key=f"example-{os.getpid()}",
        )
        print(f"queued task {task.id}", flush=True)
        last = None
        async for event in gateway.follow(task.id):
            kind = task_pb2.TaskEventKind.Name(event.kind).removeprefix("TASK_EVENT_KIND_")
            print(f"{event.sequence:>6} {kind:<15} {MessageToDict(event.data)}", flush=True)
            last = event.kind
        return 0 if last == task_pb2.TASK_EVENT_KIND_COMPLETED else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(" ".join(sys.argv[1:]) or "a lighthouse at dusk")))
