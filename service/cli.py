"""`genq`: run the data plane (serve, migrate) and operate it over gRPC (every other command).

The operators' commands are gRPC clients of the service like any gateway: they hold no database
credentials and find the service at --target, else GENQ_ADDR, else localhost:50051. Each is one
small async function below, calling RPCs through `_call`; COMMANDS is the table that builds the
parser. Printing lives in service/cli_format.py.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import textwrap
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from generation.task.v1 import task_pb2 as pb
from service import cli_format as show
from service.cli_format import count, json_object, moment, span, task_id, to_nanos
from service.settings import Settings
from workers_sdk.client import Credentials, GenqClient
from workers_sdk.errors import GenqError, Reason

DONE, ERROR, USAGE, DISABLED, CAPPED = 0, 1, 2, 3, 4
WIDTH = 96  # help text is wrapped to this; the epilog is written to fit it

EPILOG = """\
exit codes:
  0  done; for status: the queue runs (its work may be empty or waiting)
  1  error: the service could not be reached, or refused the call (NOT_FOUND, ...)
  2  bad usage
  3  disabled: status finds the kill switch off (stored, or GENQ_DISABLED in the service's
     environment); resume exits 3 when GENQ_DISABLED still keeps the queue off
  4  capped: status finds no global daily cap, a cap of 0, or today's spend plus reservations
     at the cap

The operators' commands talk to the service over gRPC at --target (default: GENQ_ADDR, else
localhost:50051) and need no database credentials. Money is in currency units (2.50), stored as
integer nanos. See docs/OPERATIONS.md."""

STATUSES = ("queued", "dispatched", "processing", "completed", "failed", "cancelled", "expired")
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


class UsageError(Exception):
    """Bad usage found after parsing (exit 2)."""


class CommandError(Exception):
    """The command could not be done (exit 1)."""


# ---- the shared plumbing of the operators' commands ----


async def _call(args: argparse.Namespace, method: str, request: Any) -> Any:
    """One RPC on the command's channel; a refusal raises GenqError (exit 1 in `main`)."""
    return await args.client.call(method, request)


def _print(args: argparse.Namespace, message: Any, text: str) -> None:
    """The answer: the proto message as JSON with --format json, else the text."""
    print(show.as_json(message) if args.format == "json" else text, flush=True)


async def _tool_id(args: argparse.Namespace, tool: str, *, create: bool = False) -> str:
    """A tool id, or a tool's name looked up in GetStatus (created with UpsertTool if `create`)."""
    try:
        uuid.UUID(tool)
    except ValueError:
        pass
    else:
        try:
            found = await _call(args, "GetTool", pb.GetToolRequest(tool_id=tool))
            return str(found.tool.id)
        except GenqError as error:  # an unknown id may still be some tool's name
            if error.reason is not Reason.TOOL_NOT_FOUND:
                raise
    status = (await _call(args, "GetStatus", pb.GetStatusRequest())).status
    for known in status.tools:
        if known.name == tool:
            return str(known.tool_id)
    if create:
        made = await _call(args, "UpsertTool", pb.UpsertToolRequest(name=tool))
        return str(made.tool.id)
    hint = " (enqueue --create-tool creates it)" if args.command == "enqueue" else ""
    raise CommandError(f"no tool with the id or name {tool!r}{hint}")


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


# ---- the operators' commands ----


async def cmd_status(args: argparse.Namespace) -> int:
    request = pb.GetStatusRequest(worker_silence_seconds=args.worker_silence_seconds)
    answer = await _call(args, "GetStatus", request)
    code, word = verdict(answer.status.settings)
    _print(args, answer, show.status(answer.status, word))
    return code


async def cmd_list(args: argparse.Namespace) -> int:
    request = pb.ListTasksRequest(limit=args.limit)
    if args.tool:
        request.tool_id = await _tool_id(args, args.tool)
    if args.status:
        request.status = pb.TaskStatus.Value(f"TASK_STATUS_{args.status.upper()}")
    if args.before:
        request.before.FromDatetime(args.before)
        request.before_id = args.before_id or ""
    answer = await _call(args, "ListTasks", request)
    _print(args, answer, show.tasks(answer.tasks))
    return DONE


async def cmd_show(args: argparse.Namespace) -> int:
    answer = await _call(args, "GetTask", pb.GetTaskRequest(task_id=args.task_id))
    _print(args, answer, show.task(answer.task))
    return DONE


async def cmd_enqueue(args: argparse.Namespace) -> int:
    request = pb.QueueTaskRequest(
        tool_id=await _tool_id(args, args.tool, create=args.create_tool),
        idempotency_key=args.idempotency_key or "",
        resource_key=args.resource_key or "",
        account_group=args.account_group or "",
        on_conflict=pb.OnConflict.Value(f"ON_CONFLICT_{args.on_conflict.upper()}"),
    )
    request.input.update(args.input)
    for name in ("priority", "max_retries", "cost_estimate_nanos"):
        if getattr(args, name) is not None:
            setattr(request, name, getattr(args, name))
    if args.run_after is not None:
        request.run_after.FromDatetime(args.run_after)
    if args.ttl is not None:
        request.ttl.FromSeconds(args.ttl)
    answer = await _call(args, "QueueTask", request)
    task = answer.task
    _print(args, answer, f"task {task.id} {show.status_name(task.status)}")
    return DONE


async def cmd_cancel(args: argparse.Namespace) -> int:
    if (args.task_id is None) == (args.tool is None):
        raise UsageError("give either a TASK_ID or --tool")
    if args.task_id is not None:
        if args.prefix is not None or args.include_processing:
            raise UsageError("--prefix and --include-processing go with --tool")
        answer = await _call(args, "CancelTask", pb.CancelTaskRequest(task_id=args.task_id))
        _print(args, answer, f"task {answer.task.id} {show.status_name(answer.task.status)}")
        return DONE
    request = pb.CancelTasksRequest(
        tool_id=await _tool_id(args, args.tool),
        include_processing=args.include_processing,
        idempotency_key_prefix=args.prefix or "",
        limit=1_000,
    )
    cancelled = asked = 0
    while True:  # batches until one comes back short: tasks queued meanwhile end it too
        answer = await _call(args, "CancelTasks", request)
        cancelled, asked = cancelled + answer.cancelled, asked + answer.cancel_requested
        if answer.cancelled + answer.cancel_requested < request.limit:
            break
        print(f"cancelled {cancelled} ...", file=sys.stderr, flush=True)
    text = f"cancelled {cancelled} tasks"
    if asked:
        text += f"; asked {asked} running ones to stop (they end cancelled when their run does)"
    _print(args, pb.CancelTasksResponse(cancelled=cancelled, cancel_requested=asked), text)
    return DONE


async def cmd_retry(args: argparse.Namespace) -> int:
    request = pb.RetryTaskRequest(
        task_id=args.task_id, reserved_token_amount=args.reserved_token_amount
    )
    answer = await _call(args, "RetryTask", request)
    _print(args, answer, f"task {answer.task.id} {show.status_name(answer.task.status)}")
    return DONE


async def _switch(args: argparse.Namespace, on: bool) -> int:
    """pause / resume: a tool (ConfigureTool paused) or, with no tool, the global kill switch."""
    if args.tool:
        request = pb.ConfigureToolRequest(tool_id=await _tool_id(args, args.tool), paused=not on)
        answer = await _call(args, "ConfigureTool", request)
        _print(args, answer, show.tool(answer.tool))
        return DONE
    answer = await _call(args, "UpdateSettings", pb.UpdateSettingsRequest(enabled=on))
    _print(args, answer, show.settings(answer.settings))
    if on and answer.settings.disabled_by_environment:
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
        per_tool = pb.ConfigureToolRequest(tool_id=await _tool_id(args, args.tool), clear=clear)
        if args.amount is not None:
            per_tool.daily_cap_nanos = args.amount
        answer = await _call(args, "ConfigureTool", per_tool)
        tool = answer.tool
        cap = show.money(tool.daily_cap_nanos) if tool.HasField("daily_cap_nanos") else "none"
        _print(args, answer, f"daily cap of {tool.name}: {cap}")
        return DONE
    request = pb.UpdateSettingsRequest(clear=clear)
    if args.amount is not None:
        request.daily_cap_nanos = args.amount
    if args.currency is not None:
        request.currency = args.currency
    answer = await _call(args, "UpdateSettings", request)
    stored = answer.settings
    cap = (
        show.money(stored.daily_cap_nanos, stored.currency)
        if stored.HasField("daily_cap_nanos")
        else "none (nothing runs)"
    )
    _print(args, answer, f"daily cap: {cap}")
    if stored.HasField("cap_override_nanos"):
        print("genq cap: GENQ_DAILY_CAP_NANOS replaces the stored cap", file=sys.stderr)
    return DONE


async def cmd_purge(args: argparse.Namespace) -> int:
    request = pb.PurgeTasksRequest(batch_size=args.batch_size)
    if args.older_than_days is not None:
        request.older_than_days = args.older_than_days
    total = 0
    while True:  # until a batch purges nothing
        answer = await _call(args, "PurgeTasks", request)
        if not answer.purged:
            break
        total += answer.purged
        print(f"purged {total} ...", file=sys.stderr, flush=True)
    days = answer.retention_days
    text = (
        "retention is 0 days: everything is kept, nothing purged"
        if days == 0
        else f"purged {total} finished tasks older than {days} days"
    )
    _print(args, pb.PurgeTasksResponse(purged=total, retention_days=days), text)
    return DONE


async def cmd_stats(args: argparse.Namespace) -> int:
    answer = await _call(args, "GetStats", pb.GetStatsRequest(days=args.days))
    _print(args, answer, show.stats(answer.days))
    return DONE


async def cmd_settings(args: argparse.Namespace) -> int:
    changes = {name: getattr(args, name) for name in SETTING_OPTIONS}
    changes = {name: value for name, value in changes.items() if value is not None}
    if changes:
        answer = await _call(args, "UpdateSettings", pb.UpdateSettingsRequest(**changes))
    else:
        answer = await _call(args, "GetSettings", pb.GetSettingsRequest())
    _print(args, answer, show.settings(answer.settings))
    return DONE


async def cmd_audit(args: argparse.Namespace) -> int:
    answer = await _call(
        args,
        "ListAuditEntries",
        pb.ListAuditEntriesRequest(limit=args.limit, before_id=args.before_id),
    )
    _print(args, answer, show.audit(answer.entries))
    return DONE


# ---- the commands that run the data plane itself ----


def _database_url(settings: Settings) -> str:
    if settings.database_url:
        return settings.database_url
    from service import embedded

    return embedded.start(settings.data_dir)


def cmd_serve(args: argparse.Namespace) -> int:
    from service import migrations, server

    settings = Settings.from_env()
    server.check(settings)
    # The one-time work, in this process: the embedded Postgres (it lives as long as this
    # process), the migration; then one service process, or GENQ_PROCESSES children.
    url = _database_url(settings)
    migrations.upgrade(url)

    def ready(port: int) -> None:
        print(f"genq serving gRPC on port {port}", flush=True)

    if settings.processes > 1:
        return server.serve_processes(settings, url, ready)
    asyncio.run(server.serve(settings, url, ready=ready))
    return DONE


def cmd_migrate(args: argparse.Namespace) -> int:
    if args.downgrade and not args.revision:
        # A downgrade drops what it undoes (base: every table): never by default.
        raise UsageError("--downgrade needs an explicit REVISION (e.g. -1, a revision id, or base)")
    from service import migrations

    url = _database_url(Settings.from_env())
    if args.downgrade:
        migrations.downgrade(url, args.revision)
    else:
        migrations.upgrade(url, args.revision or "head")
    return DONE


def cmd_token(args: argparse.Namespace) -> int:
    """create, list or revoke, straight on the database (the service host's DATABASE_URL)."""
    from service import tokens

    if args.action != "revoke" and args.token:
        raise UsageError(f"token {args.action} takes no ID|TOKEN")
    if args.action != "create" and (args.role or args.tool or args.expires or args.note):
        raise UsageError("--role, --tool, --expires and --note are for token create")
    url = _database_url(Settings.from_env())
    if args.action == "create":
        if not args.role:
            raise UsageError("token create needs at least one --role")
        token = tokens.create(url, args.role, args.tool, args.expires, args.note or "")
        scope = ", ".join(sorted(set(args.tool))) or "every tool"
        print(f"roles {', '.join(sorted(set(args.role)))} on {scope}; shown once, keep it secret:")
        print(token)
    elif args.action == "list":
        print(show.tokens(tokens.list_all(url)))
    else:
        if not args.token:
            raise UsageError("token revoke needs the token's ID, or the token")
        revoked = tokens.revoke(url, args.token)
        if revoked is None:
            raise CommandError(f"no token {args.token!r}")
        print(f"revoked token {revoked.id}; every replica refuses it within 30 s")
    return DONE


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
        _reconcile(_target(args), _credentials(args), once=args.once, interval=interval)
    )


async def _reconcile(target: str, credentials: Credentials, *, once: bool, interval: float) -> int:
    from workers_sdk.reconciler import Reconciler, describe

    log = logging.getLogger("genq.reconcile")
    async with GenqClient(target, credentials=credentials) as client:
        reconciler = Reconciler(client, reconcile_interval_seconds=interval)
        if once:
            try:
                summary = await reconciler.sweep()
            except GenqError as error:
                log.error("reconcile sweep against %s failed: %s", target, error)
                return ERROR
            log.info("reconcile sweep: %s", describe(summary))
            return ERROR if summary.errors else DONE
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        log.info("reconciling against %s every %g s", target, interval)
        await reconciler.run(stop)
        log.info("reconciler stopped")
        return DONE


# ---- the table of commands and the parser ----


Argument = tuple[tuple[str, ...], dict[str, Any]]


def arg(spec: str, help: str | None = None, **options: Any) -> Argument:
    """An argument from "NAME", "--flag" or "--option METAVAR" (a positional's metavar: its
    name in capitals), its help, and argparse's other options."""
    name, _, metavar = spec.partition(" ")
    if metavar:
        options["metavar"] = metavar
    elif not name.startswith("-") and "choices" not in options:
        options["metavar"] = name.upper()
    return (name,), {"help": help, **options}


def flag(spec: str, help: str) -> Argument:
    return arg(spec, help, action="store_true")


TOOL_ID = "a tool id or name"

CONNECTION = [
    arg("--token TOKEN", "the caller's token (default: GENQ_TOKEN; prefer it: argv is visible)"),
    arg("--tls-ca-file PEM", "TLS: the CA of the service's certificate (GENQ_TLS_CA_FILE)"),
    arg("--tls-client-cert-file PEM", "mutual TLS: this client's (GENQ_TLS_CLIENT_CERT_FILE)"),
    arg("--tls-client-key-file PEM", "its key (GENQ_TLS_CLIENT_KEY_FILE)"),
]
"""How every client command reaches a secured service."""


def tokens_roles() -> tuple[str, ...]:
    from service.tokens import ROLES

    return ROLES


@dataclass(frozen=True)
class Command:
    name: str
    run: Callable[[argparse.Namespace], Awaitable[int]] | Callable[[argparse.Namespace], int]
    help: str
    description: str
    arguments: list[Argument] = field(default_factory=list)
    client: bool = True
    """A gRPC client of the service: --target and --format, and errors exit 1."""


COMMANDS = [
    Command(
        "serve",
        cmd_serve,
        "migrate, then serve gRPC (embedded Postgres when DATABASE_URL is unset)",
        "Migrate the database to head, then serve GenerationDataService, health and reflection "
        "on GENQ_PORT (50051). Without DATABASE_URL an embedded Postgres runs in GENQ_DATA_DIR "
        "(.genq). SIGTERM stops gracefully.",
        client=False,
    ),
    Command(
        "migrate",
        cmd_migrate,
        "migrate the database and exit",
        "Upgrade DATABASE_URL (or the embedded database) to a revision (default head), or with "
        "--downgrade down to an explicit one. Replicas migrating at once take turns (a Postgres "
        "advisory lock): the first migrates, the others find head.",
        [
            arg(
                "revision",
                "target revision (default: head); --downgrade needs one: -1, an id, or base",
                nargs="?",
            ),
            flag("--downgrade", "downgrade to REVISION instead (base drops every table)"),
        ],
        client=False,
    ),
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
    Command(
        "token",
        cmd_token,
        "create, list or revoke API tokens (on the service host, with DATABASE_URL)",
        "token create --role ROLE [--role ROLE]... [--tool NAME]... [--expires DURATION] "
        "[--note TEXT] prints a new token as the last word of its last line (only its hash is "
        "stored: it is shown once). Roles: gateway, worker, reconciler, operator, viewer; "
        "--tool limits the token to those tools (none: every tool). token list shows every "
        "token but its secret; token revoke ID|TOKEN ends one: every replica refuses it within "
        "30 s. Runs against DATABASE_URL (or the embedded database), like migrate, and records "
        "each change in the audit log.",
        [
            arg("action", "create, list or revoke", choices=("create", "list", "revoke")),
            arg("token ID|TOKEN", "for revoke: the token's id, or the token", nargs="?"),
            arg(
                "--role ROLE",
                "a role of the token (repeat for more)",
                action="append",
                choices=tokens_roles(),
                default=[],
            ),
            arg(
                "--tool NAME",
                "a tool the token reaches (repeat; none: every tool)",
                action="append",
                default=[],
            ),
            arg(
                "--expires DURATION",
                "lifetime: 90s, 15m, 12h, 30d (none: until revoked)",
                type=span,
            ),
            arg("--note TEXT", "who or what it is for; the audit log names it"),
        ],
        client=False,
    ),
    Command(
        "audit",
        cmd_audit,
        "who changed what, when (the audit log), newest first",
        "Every change of settings, tools, caps, pauses, purges, cancels and tokens, newest first "
        "(ListAuditEntries): when, who (token:<id> (<note>), cert:<name>, anonymous or "
        "cli:<user>@<host>), the RPC or command, and its request. Page with --before-id.",
        [
            arg("--limit N", "at most 10000 (50)", type=count, default=50),
            arg("--before-id ID", "entries older than this one", type=count, default=0),
        ],
    ),
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
        "list",
        cmd_list,
        "list tasks, newest first",
        "List tasks newest first (ListTasks), optionally of one tool and one status. Page with "
        "--before the created_at and --before-id the id of the last task shown.",
        [
            arg("--tool TOOL", TOOL_ID),
            arg("--status", choices=STATUSES),
            arg("--before TIME", "only tasks created before this ISO 8601 time", type=moment),
            arg("--before-id TASK_ID", "with --before: the last task shown, to page exactly"),
            arg("--limit N", "at most 1000 (50)", type=count, default=50),
        ],
    ),
    Command(
        "show",
        cmd_show,
        "show one task",
        "Show one task (GetTask): its status, input, output, usage, retries and times.",
        [arg("task_id TASK_ID", type=task_id)],
    ),
    Command(
        "enqueue",
        cmd_enqueue,
        "queue one task",
        "Queue one task of TOOL (a tool id, or the name of a known tool) with INPUT_JSON, a JSON "
        "object ('-' reads it from stdin). Options left out take the tool's settings.",
        [
            arg("tool", TOOL_ID),
            arg("input INPUT_JSON", "a JSON object, or - for stdin", type=json_object),
            flag("--create-tool", "create the tool (UpsertTool) when no tool has this name"),
            arg("--priority N", "-100 to 100, higher first (0)", type=int),
            arg("--max-retries N", "attempts allowed", type=count),
            arg("--idempotency-key KEY", "one task per key and tool"),
            arg(
                "--on-conflict",
                "a used key: return its task (return), or queue it again if finished (requeue)",
                choices=("return", "requeue"),
                default="return",
            ),
            arg(
                "--run-after TIME",
                "not before: ISO 8601 (UTC without a zone), or +SECONDS",
                type=moment,
            ),
            arg("--ttl SECONDS", "expires this long after run-after (7 days; 0 never)", type=count),
            arg("--resource-key KEY", "what cooldowns are kept against"),
            arg("--account-group GROUP", "what account holds are kept against"),
            arg(
                "--cost-estimate AMOUNT",
                "reserved against the caps while it runs",
                type=to_nanos,
                dest="cost_estimate_nanos",
            ),
        ],
    ),
    Command(
        "cancel",
        cmd_cancel,
        "cancel a task, or a tool's queued tasks",
        "Cancel one unfinished task (CancelTask), or with --tool every queued task of a tool "
        "(CancelTasks, in batches of 1000), optionally only those whose idempotency key starts "
        "with --prefix, and running ones too with --include-processing: a running task is asked "
        "to stop, its worker hears it on its next heartbeat, and it ends cancelled when its run "
        "does, with what the run cost recorded.",
        [
            arg("task_id TASK_ID", type=task_id, nargs="?"),
            arg("--tool TOOL", TOOL_ID),
            arg("--prefix P", "only tasks whose idempotency key starts with P"),
            flag("--include-processing", "ask running tasks to stop too"),
        ],
    ),
    Command(
        "retry",
        cmd_retry,
        "queue a failed, cancelled or expired task again",
        "Queue a failed, cancelled or expired task again with fresh retries (RetryTask).",
        [
            arg("task_id TASK_ID", type=task_id),
            arg(
                "--reserved-token-amount N",
                "the new reservation, used only when the old one was settled",
                type=count,
                default=0,
            ),
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
        "currency units (e.g. 2.50; stored as integer nanos). A global cap of 0 runs nothing; "
        "--clear removes a cap (the global one: then nothing runs).",
        [
            arg("amount", "the cap in currency units, e.g. 2.50", type=to_nanos, nargs="?"),
            arg("--tool TOOL", TOOL_ID),
            flag("--clear", "remove the cap"),
            arg("--currency LABEL", "a display label for the global cap, e.g. EUR"),
        ],
    ),
    Command(
        "purge",
        cmd_purge,
        "delete finished tasks older than the retention",
        "Delete finished tasks older than the retention (settings retention_days, 30; 0 keeps "
        "everything) in batches until none is left, showing progress on stderr. Tasks whose "
        "reservation is not settled yet stay; the attempts ledger and the settlements stay. The "
        "service also purges by itself, at start and then hourly.",
        [
            arg("--older-than-days N", "instead of the stored retention (0 keeps all)", type=count),
            arg(
                "--batch-size N", "tasks per batch, at most 10000 (1000)", type=count, default=1000
            ),
        ],
    ),
    Command(
        "stats",
        cmd_stats,
        "attempts and cost per local day and tool",
        "Attempts (completed, failed, lost) and cost per local day and tool, from the attempts "
        "ledger (GetStats).",
        [arg("--days N", "the last N local days (7)", type=count, default=7)],
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
                type=int,
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


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="genq",
        description=textwrap.fill(
            "The genq data plane: run it (serve, migrate) and operate it over gRPC. Settings of "
            "the service come from the environment (see docs/OPERATIONS.md).",
            WIDTH,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--target", metavar="HOST:PORT", help="the service (default: GENQ_ADDR or localhost:50051)"
    )
    common.add_argument(
        "--format", choices=("text", "json"), default="text", help="json: the proto message"
    )
    for flags, options in CONNECTION:
        common.add_argument(*flags, **options)
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        sub = commands.add_parser(
            command.name,
            help=command.help,
            description=textwrap.fill(command.description, WIDTH),
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            parents=[common] if command.client else [],
        )
        for flags, options in command.arguments:
            sub.add_argument(*flags, **options)
        sub.set_defaults(run=command.run, remote=command.client)
    return top


def _target(args: argparse.Namespace) -> str:
    return str(args.target or os.environ.get("GENQ_ADDR") or "localhost:50051")


def _credentials(args: argparse.Namespace) -> Credentials:
    return Credentials.from_env(
        token=args.token,
        ca_file=args.tls_ca_file,
        client_cert_file=args.tls_client_cert_file,
        client_key_file=args.tls_client_key_file,
    )


async def _run_client(args: argparse.Namespace) -> int:
    async with GenqClient(_target(args), credentials=_credentials(args)) as client:
        args.client = client
        return int(await args.run(args))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = parser().parse_args(argv)
    try:
        if not args.remote:
            return int(args.run(args))
        return asyncio.run(_run_client(args))
    except UsageError as error:
        print(f"genq {args.command}: error: {error}", file=sys.stderr)
        return USAGE
    except CommandError as error:
        print(f"genq {args.command}: {error}", file=sys.stderr)
        return ERROR
    except GenqError as error:
        # With no reason the service did not answer (UNAVAILABLE, DEADLINE_EXCEEDED): say where.
        why = f" ({error.reason})" if error.reason else f" at {_target(args)}"
        print(f"genq {args.command}: {error.code.name}{why}: {error}", file=sys.stderr)
        return ERROR


if __name__ == "__main__":
    sys.exit(main())
