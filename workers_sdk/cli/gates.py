"""The commands on what lets work run: status (and its exit codes), the kill switch and a tool's
pause (pause, resume), the daily caps (cap), and the global settings."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from generation.task.v1 import task_pb2 as pb
from workers_sdk.cli import render
from workers_sdk.cli.command import TOOL_ID, answer, call, find_tool
from workers_sdk.cli.values import amount, count, whole
from workers_sdk.commands import CAPPED, DISABLED, DONE, Command, UsageError, arg, flag
from workers_sdk.money import money

SETTING_OPTIONS = (
    "timezone",
    "currency",
    "cooldown_threshold",
    "cooldown_seconds",
    "account_hold_seconds",
    "retention_days",
    "processing_grace_seconds",
    "queued_max_age_seconds",
)


def verdict(settings: Any) -> tuple[int, str]:
    """What the switch and the global cap allow now: (exit code, word)."""
    if not settings.enabled or settings.disabled_by_environment:
        return DISABLED, "disabled"
    cap = (
        settings.cap_override_nanos
        if settings.HasField("cap_override_nanos")
        else settings.daily_cap_nanos
    )
    if cap <= 0 or settings.spent_today_nanos + settings.reserved_nanos >= cap:
        return CAPPED, "capped"
    return DONE, "running"


async def cmd_status(args: argparse.Namespace) -> int:
    request = pb.GetStatusRequest(worker_silence_seconds=args.worker_silence_seconds)
    found = await call(args, "GetStatus", request)
    code, word = verdict(found.status.settings)
    answer(args, found, render.status(found.status, word))
    return code


async def _switch(args: argparse.Namespace, on: bool) -> int:
    """pause / resume: a tool (ConfigureTool paused) or, with no tool, the global kill switch."""
    if args.tool:
        tool = await find_tool(args, args.tool)
        done = await call(
            args, "ConfigureTool", pb.ConfigureToolRequest(tool_id=tool.id, paused=not on)
        )
        answer(args, done, render.tool(done.tool))
        return DONE
    done = await call(args, "UpdateSettings", pb.UpdateSettingsRequest(enabled=on))
    answer(args, done, render.settings(done.settings))
    if on and done.settings.disabled_by_environment:
        print("genq resume: GENQ_DISABLED still keeps the queue off", file=sys.stderr)
        return DISABLED
    return DONE


async def cmd_pause(args: argparse.Namespace) -> int:
    return await _switch(args, on=False)


async def cmd_resume(args: argparse.Namespace) -> int:
    return await _switch(args, on=True)


async def cmd_cap(args: argparse.Namespace) -> int:
    if (args.amount is None) == (not args.clear):
        raise UsageError("give either an AMOUNT or --clear")
    if args.tool and args.currency is not None:
        raise UsageError("--currency is global; it does not go with --tool")
    clear = ["daily_cap_nanos"] if args.clear else []
    if args.tool:
        tool = await find_tool(args, args.tool)
        per_tool = pb.ConfigureToolRequest(tool_id=tool.id, clear=clear)
        if args.amount is not None:
            per_tool.daily_cap_nanos = args.amount
        done = await call(args, "ConfigureTool", per_tool)
        stored_tool = done.tool
        cap = (
            money(stored_tool.daily_cap_nanos)
            if stored_tool.HasField("daily_cap_nanos")
            else "none"
        )
        answer(args, done, f"daily cap of {stored_tool.name}: {cap}")
        return DONE
    request = pb.UpdateSettingsRequest(clear=clear)
    if args.amount is not None:
        request.daily_cap_nanos = args.amount
    if args.currency is not None:
        request.currency = args.currency
    done = await call(args, "UpdateSettings", request)
    stored = done.settings
    cap = (
        money(stored.daily_cap_nanos, stored.currency)
        if stored.HasField("daily_cap_nanos")
        else "none (nothing runs)"
    )
    answer(args, done, f"daily cap: {cap}")
    if stored.HasField("cap_override_nanos"):
        print("genq cap: GENQ_DAILY_CAP_NANOS replaces the stored cap", file=sys.stderr)
    return DONE


async def cmd_settings(args: argparse.Namespace) -> int:
    changes = {name: getattr(args, name) for name in SETTING_OPTIONS}
    changes = {name: value for name, value in changes.items() if value is not None}
    if changes:
        found = await call(args, "UpdateSettings", pb.UpdateSettingsRequest(**changes))
    else:
        found = await call(args, "GetSettings", pb.GetSettingsRequest())
    answer(args, found, render.settings(found.settings))
    return DONE


COMMANDS = [
    Command(
        "status",
        cmd_status,
        "the switch, the cap and today's spend, tools, depths, cooldowns, holds",
        "Everything GetStatus knows, in one call. Exits 3 when the kill switch is off (stored or "
        "GENQ_DISABLED), 4 when the global cap is unset or 0 or today's spend plus reservations "
        "reached it, else 0.",
        [
            arg(
                "--worker-silence-seconds N",
                "flag a tool with queued work unclaimed this long (600)",
                type=count,
                default=0,
            )
        ],
    ),
    Command(
        "pause",
        cmd_pause,
        "pause a tool, or turn the kill switch off",
        "Pause TOOL (its tasks wait and keep their attempts), or with no TOOL turn the global "
        "kill switch off: nothing is claimed, and expiry waits too.",
        [arg("tool", f"{TOOL_ID} (none: the whole queue)", nargs="?")],
    ),
    Command(
        "resume",
        cmd_resume,
        "resume a tool, or turn the kill switch on",
        "Resume TOOL, or with no TOOL turn the global kill switch back on. Exits 3 when "
        "GENQ_DISABLED in the service's environment still keeps the queue off.",
        [arg("tool", f"{TOOL_ID} (none: the whole queue)", nargs="?")],
    ),
    Command(
        "cap",
        cmd_cap,
        "set the global daily spend cap, or a tool's (until a global one is set, nothing runs)",
        "Set the global daily spend cap, or with --tool a tool's own cap on top of it, in "
        "currency units (e.g. 2.50; stored as integer nanos; at most 100,000,000). A global cap "
        "of 0 runs nothing; --clear removes a cap (the global one: then nothing runs).",
        [
            arg("amount", "the cap in currency units, e.g. 2.50", type=amount, nargs="?"),
            arg("--tool TOOL", TOOL_ID),
            flag("--clear", "remove the cap"),
            arg("--currency LABEL", "a display label for the global cap, e.g. EUR"),
        ],
    ),
    Command(
        "settings",
        cmd_settings,
        "show the global settings, or change them",
        "Show the global settings and today's spend (GetSettings); with options, change them "
        "(UpdateSettings). The switch and the cap have their own commands: pause, resume, cap.",
        [
            arg("--timezone TZ", "IANA name; spend counts on its local day"),
            arg("--currency LABEL", "display only"),
            arg(
                "--cooldown-threshold N",
                "retryable failures in a row that cool a key (2)",
                type=whole(-(2**31)),
            ),
            arg("--cooldown-seconds N", "how long a key cools (600)", type=count),
            arg("--account-hold-seconds N", "how long a group is held (3600)", type=count),
            arg(
                "--retention-days N",
                "finished tasks older are purged (30; 0 keeps all)",
                type=count,
            ),
            arg(
                "--processing-grace-seconds N",
                "a processing task this long past its lapsed lease is stale (120)",
                type=count,
            ),
            arg(
                "--queued-max-age-seconds N",
                "a queued task that could run this long, no worker asking, is stale (900)",
                type=count,
            ),
        ],
    ),
]
