"""The commands on tasks: list, show, enqueue, cancel, retry, purge."""

from __future__ import annotations

import argparse
import shlex
import sys

from generation.task.v1 import task_pb2 as pb
from workers_sdk.cli import render
from workers_sdk.cli.command import TOOL_ID, answer, call, find_tool, tool_names
from workers_sdk.cli.values import INT64_MAX, amount, count, json_object, moment, task_id, whole
from workers_sdk.commands import DONE, Command, UsageError, arg, flag

STATUSES = ("queued", "dispatched", "processing", "completed", "failed", "cancelled", "expired")
DEFAULT_PAGE = 50


async def cmd_list(args: argparse.Namespace) -> int:
    request = pb.ListTasksRequest(limit=args.limit)
    names: dict[str, str] = {}
    if args.tool:
        tool = await find_tool(args, args.tool)
        request.tool_id, names = tool.id, {tool.id: tool.name}
    if args.status:
        request.status = pb.TaskStatus.Value(f"TASK_STATUS_{args.status.upper()}")
    if args.before:
        request.before.FromDatetime(args.before)
        request.before_id = args.before_id or ""
    found = await call(args, "ListTasks", request)
    if args.format == "json":
        answer(args, found, "")
        return DONE
    if found.tasks and not names:
        names = await tool_names(args)
    text = render.tasks(found.tasks, names)
    if len(found.tasks) == (args.limit or DEFAULT_PAGE):
        text += f"\nnext page: {_next_page(args, found.tasks[-1])}"
    print(text, flush=True)
    return DONE


def _next_page(args: argparse.Namespace, last: pb.Task) -> str:
    """The command that lists the next page: the same filters, the last task as the cursor, its
    created_at to the microsecond and its id (tasks of one QueueTasks share an instant)."""
    words = ["genq", "list"]
    for option in ("target", "tool", "status"):
        if getattr(args, option):
            words += [f"--{option}", getattr(args, option)]
    if args.limit != DEFAULT_PAGE:
        words += ["--limit", str(args.limit)]
    words += ["--before", render.exact(last.created_at), "--before-id", last.id]
    return shlex.join(words)


async def cmd_show(args: argparse.Namespace) -> int:
    found = await call(args, "GetTask", pb.GetTaskRequest(task_id=args.task_id))
    answer(args, found, render.task(found.task))
    return DONE


async def cmd_enqueue(args: argparse.Namespace) -> int:
    if args.ttl is not None and args.expires_at is not None:
        raise UsageError("give --ttl or --expires-at, not both")
    if args.requeue_key and args.on_conflict != "requeue":
        raise UsageError("--requeue-key goes with --on-conflict requeue")
    tool = await find_tool(args, args.tool, create=args.create_tool)
    request = pb.QueueTaskRequest(
        tool_id=tool.id,
        requeue_key=args.requeue_key or "",
        idempotency_key=args.idempotency_key or "",
        resource_key=args.resource_key or "",
        account_group=args.account_group or "",
        source=args.source or "",
        on_conflict=pb.OnConflict.Value(f"ON_CONFLICT_{args.on_conflict.upper()}"),
    )
    request.input.update(args.input)
    for name in ("priority", "max_retries", "cost_estimate_nanos", "rate_units"):
        if getattr(args, name) is not None:
            setattr(request, name, getattr(args, name))
    if args.run_after is not None:
        request.run_after.FromDatetime(args.run_after)
    if args.ttl is not None:
        request.ttl.FromSeconds(args.ttl)
    if args.expires_at is not None:
        request.expires_at.FromDatetime(args.expires_at)
    queued = await call(args, "QueueTask", request)
    task = queued.task
    text = f"task {task.id} {render.status_name(task.status)}"
    if not queued.created:
        note = (
            f"existing task (idempotency key {args.idempotency_key!r}, "
            f"created {render.when(task.created_at)}"
        )
        if args.on_conflict == "requeue":
            note += ", queued again" if queued.requeued_now else ", not queued again"
        note += ")"
        text += f": {note}"
        if args.format == "json":  # stdout keeps the message alone
            print(f"genq enqueue: {note}", file=sys.stderr, flush=True)
    answer(args, queued, text)
    return DONE


async def cmd_cancel(args: argparse.Namespace) -> int:
    if (args.task_id is None) == (args.tool is None):
        raise UsageError("give either a TASK_ID or --tool")
    if args.task_id is not None:
        if args.prefix is not None or args.include_processing:
            raise UsageError("--prefix and --include-processing go with --tool")
        done = await call(args, "CancelTask", pb.CancelTaskRequest(task_id=args.task_id))
        answer(args, done, f"task {done.task.id} {render.status_name(done.task.status)}")
        return DONE
    request = pb.CancelTasksRequest(
        tool_id=(await find_tool(args, args.tool)).id,
        include_processing=args.include_processing,
        idempotency_key_prefix=args.prefix or "",
        limit=1_000,
    )
    cancelled = asked = 0
    while True:  # batches until one comes back short: tasks queued meanwhile end it too
        batch = await call(args, "CancelTasks", request)
        cancelled, asked = cancelled + batch.cancelled, asked + batch.cancel_requested
        if batch.cancelled + batch.cancel_requested < request.limit:
            break
        print(f"cancelled {cancelled} ...", file=sys.stderr, flush=True)
    text = f"cancelled {cancelled} tasks"
    if asked:
        text += f"; asked {asked} running ones to stop (they end cancelled when their run does)"
    answer(args, pb.CancelTasksResponse(cancelled=cancelled, cancel_requested=asked), text)
    return DONE


async def cmd_retry(args: argparse.Namespace) -> int:
    request = pb.RetryTaskRequest(
        task_id=args.task_id, reserved_token_amount=args.reserved_token_amount, retry_key=args.key
    )
    retried = await call(args, "RetryTask", request)
    text = f"task {retried.task.id} {render.status_name(retried.task.status)}"
    if args.key and not retried.retried_now:
        text += " (retried already with this key: nothing changed)"
    answer(args, retried, text)
    return DONE


async def cmd_purge(args: argparse.Namespace) -> int:
    request = pb.PurgeTasksRequest(batch_size=args.batch_size, dry_run=args.dry_run)
    if args.older_than_days is not None:
        request.older_than_days = args.older_than_days
    if args.dry_run:
        counted = await call(args, "PurgeTasks", request)
        days = counted.retention_days
        text = (
            "retention is 0 days: everything is kept, nothing would be purged"
            if days == 0
            else f"would purge {counted.purged} finished tasks older than {days} days "
            "(dry run: none deleted)"
        )
        answer(args, counted, text)
        return DONE
    total = 0
    while True:  # until a batch purges nothing
        batch = await call(args, "PurgeTasks", request)
        if not batch.purged:
            break
        total += batch.purged
        print(f"purged {total} ...", file=sys.stderr, flush=True)
    days = batch.retention_days
    text = (
        "retention is 0 days: everything is kept, nothing purged"
        if days == 0
        else f"purged {total} finished tasks older than {days} days"
    )
    answer(args, pb.PurgeTasksResponse(purged=total, retention_days=days), text)
    return DONE


COMMANDS = [
    Command(
        "list",
        cmd_list,
        "list tasks, newest first",
        "List tasks newest first (ListTasks), optionally of one tool and one status, with tool "
        "names (one GetStatus call). A full page ends with the command that lists the next one: "
        "--before the exact created_at and --before-id the id of the last task shown.",
        [
            arg("--tool TOOL", TOOL_ID),
            arg("--status", choices=STATUSES),
            arg("--before TIME", "only tasks created before this ISO 8601 time", type=moment),
            arg("--before-id TASK_ID", "with --before: the last task shown, to page exactly"),
            arg("--limit N", "at most 1000 (50)", type=whole(0, 1_000), default=DEFAULT_PAGE),
        ],
    ),
    Command(
        "show",
        cmd_show,
        "show one task",
        "Show one task (GetTask): its status, input, output, usage, retries, source and times.",
        [arg("task_id TASK_ID", type=task_id)],
    ),
    Command(
        "enqueue",
        cmd_enqueue,
        "queue one task",
        "Queue one task of TOOL (a tool id, or the name of a known tool) with INPUT_JSON, a JSON "
        "object ('-' reads it from stdin). Options left out take the tool's settings. An "
        "idempotency key already used answers with its existing task, and says so.",
        [
            arg("tool", TOOL_ID),
            arg("input INPUT_JSON", "a JSON object, or - for stdin", type=json_object),
            flag("--create-tool", "create the tool (UpsertTool) when no tool has this name"),
            arg("--priority N", "-100 to 100, higher first (0)", type=whole(-100, 100)),
            arg("--max-retries N", "attempts allowed, 0 to 100", type=whole(0, 100)),
            arg("--idempotency-key KEY", "one task per key and tool"),
            arg(
                "--on-conflict",
                "a used key: return its task (return), or queue it again if finished (requeue)",
                choices=("return", "requeue"),
                default="return",
            ),
            arg(
                "--requeue-key KEY",
                "with requeue: makes it safe to run again, a requeue with a key the task's "
                "requeues already used changes nothing",
            ),
            arg(
                "--run-after TIME",
                "not before: ISO 8601 (UTC without a zone), or +SECONDS",
                type=moment,
            ),
            arg("--ttl SECONDS", "expires this long after run-after (7 days; 0 never)", type=count),
            arg(
                "--expires-at TIME",
                "expires at this time if still queued (instead of --ttl): ISO 8601 or +SECONDS",
                type=moment,
            ),
            arg("--source TEXT", "who or what enqueues it, shown in list and show"),
            arg("--resource-key KEY", "what cooldowns and concurrency limits are kept against"),
            arg("--account-group GROUP", "what account holds are kept against"),
            arg(
                "--cost-estimate AMOUNT",
                "reserved against the caps while it runs, in currency units",
                type=amount,
                dest="cost_estimate_nanos",
            ),
            arg(
                "--rate-units N",
                "the units its run is expected to use, for its key's rate limit (--units)",
                type=whole(0, 10**12),
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
                type=whole(0, INT64_MAX),
                default=0,
            ),
            arg(
                "--key KEY",
                "makes it safe to run again: a retry with a key the task's retries already "
                "used changes nothing",
                default="",
            ),
        ],
    ),
    Command(
        "purge",
        cmd_purge,
        "delete finished tasks older than the retention",
        "Delete finished tasks older than the retention (settings retention_days, 30; 0 keeps "
        "everything) in batches until none is left, showing progress on stderr. Tasks whose "
        "reservation is not settled yet stay; the attempts ledger and the settlements stay. The "
        "service also purges by itself, at start and then hourly. --dry-run counts what would "
        "go (over ListTasks, by this machine's clock) and deletes nothing.",
        [
            arg(
                "--older-than-days N",
                "instead of the stored retention (0 keeps all)",
                type=whole(0, 36_500),
            ),
            arg(
                "--batch-size N",
                "tasks per batch, at most 10000 (1000)",
                type=whole(0, 10_000),
                default=1000,
            ),
            flag("--dry-run", "count what would be purged; delete nothing"),
        ],
    ),
]
