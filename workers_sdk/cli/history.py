"""The commands on what happened: attempts and cost per day (stats), who changed what (audit)."""

from __future__ import annotations

import argparse

from generation.task.v1 import task_pb2 as pb
from workers_sdk.cli import render
from workers_sdk.cli.command import answer, call
from workers_sdk.cli.values import INT64_MAX, whole
from workers_sdk.commands import DONE, Command, arg


async def cmd_stats(args: argparse.Namespace) -> int:
    found = await call(args, "GetStats", pb.GetStatsRequest(days=args.days))
    if args.format == "json":
        answer(args, found, "")
        return DONE
    # GetStats carries no currency: the settings' label, one more call for the text alone.
    currency = (await call(args, "GetSettings", pb.GetSettingsRequest())).settings.currency
    answer(args, found, render.stats(found.days, currency))
    return DONE


async def cmd_audit(args: argparse.Namespace) -> int:
    found = await call(
        args,
        "ListAuditEntries",
        pb.ListAuditEntriesRequest(limit=args.limit, before_id=args.before_id),
    )
    answer(args, found, render.audit(found.entries))
    return DONE


COMMANDS = [
    Command(
        "stats",
        cmd_stats,
        "attempts and cost per local day and tool",
        "Attempts (completed, failed, lost) and cost per local day and tool, from the attempts "
        "ledger (GetStats), in the settings' currency.",
        [
            arg(
                "--days N",
                "the last N local days, at most 3660 (7)",
                type=whole(0, 3_660),
                default=7,
            )
        ],
    ),
    Command(
        "audit",
        cmd_audit,
        "who changed what, when (the audit log), newest first",
        "Every change of settings, tools, caps, pauses, limits, releases, purges, cancels and "
        "tokens, newest first (ListAuditEntries): when, who (token:<id> (<note>), cert:<name>, "
        "anonymous or cli:<user>@<host>), the RPC or command, and its request. Page with "
        "--before-id.",
        [
            arg("--limit N", "at most 10000 (50)", type=whole(0, 10_000), default=50),
            arg(
                "--before-id ID",
                "entries older than this one",
                type=whole(0, INT64_MAX),
                default=0,
            ),
        ],
    ),
]
