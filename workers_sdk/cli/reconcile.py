"""`genq reconcile`: the gateway's reconciler (workers_sdk/reconciler.py) as its own process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from workers_sdk.cli.command import CONNECTION, credentials, target
from workers_sdk.client import Credentials, GenqClient
from workers_sdk.commands import DONE, ERROR, Command, arg, flag
from workers_sdk.errors import GenqError
from workers_sdk.reconciler import Reconciler, describe


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw else default
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not a number") from None


def cmd_reconcile(args: argparse.Namespace) -> int:
    interval = _env_number("GENQ_RECONCILE_INTERVAL_SECONDS", 60)
    if interval <= 0:
        raise SystemExit("GENQ_RECONCILE_INTERVAL_SECONDS must be above 0")
    return asyncio.run(
        _reconcile(target(args), credentials(args), once=args.once, interval=interval)
    )


async def _reconcile(address: str, creds: Credentials, *, once: bool, interval: float) -> int:
    log = logging.getLogger("genq.reconcile")
    async with GenqClient(address, credentials=creds) as client:
        reconciler = Reconciler(client, reconcile_interval_seconds=interval)
        if once:
            try:
                summary = await reconciler.sweep()
            except GenqError as error:
                log.error("reconcile sweep against %s failed: %s", address, error)
                return ERROR
            log.info("reconcile sweep: %s", describe(summary))
            return ERROR if summary.errors else DONE
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        log.info("reconciling against %s every %g s", address, interval)
        await reconciler.run(stop)
        log.info("reconciler stopped")
        return DONE


COMMANDS = [
    Command(
        "reconcile",
        cmd_reconcile,
        "reap stale tasks and settle reservations over gRPC (the gateway's reconciler)",
        "Every GENQ_RECONCILE_INTERVAL_SECONDS (60): force-fail the tasks ListStaleTasks returns "
        "(as the service's settings judge them: dead zombies past processing_grace_seconds, "
        "unclaimable rows, tasks waiting past queued_max_age_seconds; see genq settings), then "
        "settle the reservation of every terminal task exactly once. Talks to the service at "
        "--target over gRPC and needs no database credentials; any number may run at once. "
        "SIGTERM or SIGINT stops it after the sweep in progress. Exit codes: 0 done, 1 the "
        "service could not be reached or some task could not be reaped or settled.",
        [
            flag("--once", "sweep once, log the summary and exit"),
            arg("--target HOST:PORT", "default: GENQ_ADDR or localhost:50051"),
            *CONNECTION,
        ],
        client=False,
    ),
]
