"""The commands on what a task runs against: a tool's settings (configure), the concurrency
limit, rate limit and state of a resource key (limit, rate-limit, key), and the early end of a
cooldown or an account hold (release-cooldown, release-hold: the spec's "release it early")."""

from __future__ import annotations

import argparse

from generation.task.v1 import task_pb2 as pb
from workers_sdk.cli import render
from workers_sdk.cli.command import TOOL_ID, answer, call, find_tool
from workers_sdk.cli.values import amount, whole
from workers_sdk.commands import DONE, Command, UsageError, arg, flag

MAX_IN_FLIGHT = 100_000
"""The highest concurrency limit the service takes (MAX_IN_FLIGHT in service/api/rpcs.py)."""
in_flight = whole(1, MAX_IN_FLIGHT)
MAX_RATE_CALLS = 1_000_000
MAX_RATE_LIMIT_UNITS = 10**15
MAX_RATE_WINDOW_SECONDS = 86_400
"""A rate limit's bounds as the service takes them (MAX_RATE_* in service/api/rpcs.py)."""

TOOL_SETTINGS = (
    "max_attempts",
    "backoff_base_seconds",
    "backoff_max_seconds",
    "lease_seconds",
    "resource_key",
    "account_group",
    "cost_estimate_nanos",
    "max_in_flight",
)
"""ConfigureToolRequest's fields that `configure` sets; the cap and the pause have their own
commands (cap, pause, resume)."""
CLEARABLE = ("lease_seconds", "resource_key", "account_group", "max_in_flight")


async def cmd_configure(args: argparse.Namespace) -> int:
    tool = await find_tool(args, args.tool)
    changes = {name: getattr(args, name) for name in TOOL_SETTINGS}
    changes = {name: value for name, value in changes.items() if value is not None}
    clear = [name.replace("-", "_") for name in args.clear]
    if both := sorted(set(clear) & set(changes)):
        raise UsageError(f"--clear {both[0].replace('_', '-')} and a value for it: give one")
    if changes or clear:
        request = pb.ConfigureToolRequest(tool_id=tool.id, clear=clear, **changes)
        done = await call(args, "ConfigureTool", request)
    else:
        done = await call(args, "GetTool", pb.GetToolRequest(tool_id=tool.id))
    answer(args, done, render.tool(done.tool))
    return DONE


async def cmd_limit(args: argparse.Namespace) -> int:
    if (args.max_in_flight is None) == (not args.clear):
        raise UsageError("give either N or --clear")
    request = pb.SetResourceLimitRequest(resource_key=args.key)
    if args.max_in_flight is not None:
        request.max_in_flight = args.max_in_flight
    done = await call(args, "SetResourceLimit", request)
    limit = (
        f"at most {done.max_in_flight} in flight" if done.HasField("max_in_flight") else "no limit"
    )
    answer(args, done, f"resource key {done.resource_key}: {limit}")
    return DONE


async def cmd_rate_limit(args: argparse.Namespace) -> int:
    bounds = args.calls is not None or args.units is not None
    if bounds == args.clear:
        raise UsageError("give --calls and/or --units, or --clear")
    request = pb.SetRateLimitRequest(resource_key=args.key)
    if args.calls is not None:
        request.max_calls = args.calls
    if args.units is not None:
        request.max_units = args.units
    if args.window is not None:
        request.window.FromSeconds(args.window)
    done = await call(args, "SetRateLimit", request)
    shown = render.rate_limit(done.rate_limit) if done.HasField("rate_limit") else "no rate limit"
    answer(args, done, f"resource key {args.key}: {shown}")
    return DONE


async def cmd_key(args: argparse.Namespace) -> int:
    found = await call(args, "GetResourceKey", pb.GetResourceKeyRequest(resource_key=args.key))
    answer(args, found, render.resource_key(found))
    return DONE


async def cmd_release_cooldown(args: argparse.Namespace) -> int:
    done = await call(args, "ReleaseCooldown", pb.ReleaseCooldownRequest(resource_key=args.key))
    text = (
        f"released the cooldown of {args.key}: its tasks may run, its failure count starts at 0"
        if done.released
        else f"{args.key} has no cooldown: nothing to release"
    )
    answer(args, done, text)
    return DONE


async def cmd_release_hold(args: argparse.Namespace) -> int:
    done = await call(args, "ReleaseHold", pb.ReleaseHoldRequest(account_group=args.group))
    text = (
        f"released the hold of {args.group}: its tasks may run"
        if done.released
        else f"{args.group} is not held: nothing to release"
    )
    answer(args, done, text)
    return DONE


COMMANDS = [
    Command(
        "configure",
        cmd_configure,
        "show a tool's settings, or change them",
        "Show TOOL's settings (GetTool); with options, change them (ConfigureTool). Options left "
        "out keep their value; --clear puts one back to its default. The cap and the pause have "
        "their own commands: cap --tool, pause, resume.",
        [
            arg("tool", TOOL_ID),
            arg(
                "--max-in-flight N",
                "at most N of its tasks run at once (1 to 100000)",
                type=in_flight,
            ),
            arg(
                "--max-attempts N",
                "max_retries of tasks queued without one (0 to 100)",
                type=whole(0, 100),
            ),
            arg("--backoff-base-seconds N", "retry backoff: the first step", type=whole()),
            arg("--backoff-max-seconds N", "retry backoff: the longest", type=whole()),
            arg(
                "--lease-seconds N",
                "the lease of its claims (default GENQ_LEASE_SECONDS)",
                type=whole(),
            ),
            arg("--resource-key KEY", "what its cooldowns and limits are kept against (its name)"),
            arg("--account-group GROUP", "what its account holds are kept against (its name)"),
            arg(
                "--cost-estimate AMOUNT",
                "reserved against the caps while a task runs, in currency units",
                type=amount,
                dest="cost_estimate_nanos",
            ),
            arg(
                "--clear SETTING",
                "put a setting back to its default (repeat for more)",
                action="append",
                choices=[name.replace("_", "-") for name in CLEARABLE],
                default=[],
            ),
        ],
    ),
    Command(
        "limit",
        cmd_limit,
        "limit how many tasks of a resource key run at once, or --clear the limit",
        "Set the concurrency limit of resource key KEY across tools (SetResourceLimit): a claim "
        "beyond it leaves the key's tasks queued (IDLE_REASON_BUSY). --clear removes it.",
        [
            arg("key KEY", "a resource key"),
            arg("max_in_flight N", "at most N in flight (1 to 100000)", type=in_flight, nargs="?"),
            flag("--clear", "remove the limit"),
        ],
    ),
    Command(
        "rate-limit",
        cmd_rate_limit,
        "limit how many tasks of a resource key start per window, or --clear the limit",
        "Set the rate limit of resource key KEY across tools and replicas (SetRateLimit): in any "
        "window (--window, 60 s unless given) at most --calls runs of the key start and at most "
        "--units of their tasks' rate_units are admitted. A claim beyond it leaves the key's tasks "
        "queued (IDLE_REASON_RATE_LIMITED, with when the next slot frees). Setting it again "
        "replaces both bounds; --clear removes it. Audited.",
        [
            arg("key KEY", "a resource key"),
            arg(
                "--calls N",
                f"at most N runs start per window (1 to {MAX_RATE_CALLS})",
                type=whole(1, MAX_RATE_CALLS),
            ),
            arg(
                "--units N",
                f"at most N units admitted per window (1 to {MAX_RATE_LIMIT_UNITS})",
                type=whole(1, MAX_RATE_LIMIT_UNITS),
            ),
            arg(
                "--window SECONDS",
                f"the window's length (1 to {MAX_RATE_WINDOW_SECONDS}; default 60)",
                type=whole(1, MAX_RATE_WINDOW_SECONDS),
            ),
            flag("--clear", "remove the rate limit"),
        ],
    ),
    Command(
        "key",
        cmd_key,
        "a resource key: cooling, failures in a row, its limits",
        "Show resource key KEY (GetResourceKey): whether it cools and until when, its retryable "
        "failures in a row, its concurrency limit, and its rate limit with what its window "
        "holds now.",
        [arg("key KEY", "a resource key")],
    ),
    Command(
        "release-cooldown",
        cmd_release_cooldown,
        "end a resource key's cooldown now",
        "End the cooldown of resource key KEY now (ReleaseCooldown), and start its count of "
        "failures in a row again. Audited.",
        [arg("key KEY", "a resource key")],
    ),
    Command(
        "release-hold",
        cmd_release_hold,
        "end an account group's hold now",
        "End the hold of account group GROUP now (ReleaseHold): its tasks may be claimed again. "
        "Audited.",
        [arg("group GROUP", "an account group")],
    ),
]
