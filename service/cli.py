"""`genq`: run and operate the data plane."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from decimal import Decimal, InvalidOperation

from service.settings import Settings


def _database_url(settings: Settings) -> str:
    if settings.database_url:
        return settings.database_url
    from service import embedded

    return embedded.start(settings.data_dir)


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    from service import migrations, server

    url = _database_url(settings)
    migrations.upgrade(url)
    asyncio.run(
        server.serve(
            settings, url, ready=lambda port: print(f"genq serving gRPC on port {port}", flush=True)
        )
    )
    return 0


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from service import migrations

    url = _database_url(settings)
    if args.downgrade:
        migrations.downgrade(url, args.revision or "base")
    else:
        migrations.upgrade(url, args.revision or "head")
    return 0


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw else default
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not a number") from None


def cmd_reconcile(args: argparse.Namespace, settings: Settings) -> int:
    # A gRPC client of the service like any gateway: no database, so none of `settings` is used.
    target = args.target or os.environ.get("GENQ_ADDR") or "localhost:50051"
    interval = _env_number("GENQ_RECONCILE_INTERVAL_SECONDS", 60)
    if interval <= 0:
        raise SystemExit("GENQ_RECONCILE_INTERVAL_SECONDS must be above 0")
    return asyncio.run(
        _reconcile(
            target,
            once=args.once,
            interval=interval,
            processing_grace=int(_env_number("GENQ_PROCESSING_GRACE_SECONDS", 120)),
            queued_max_age=int(_env_number("GENQ_QUEUED_MAX_AGE_SECONDS", 900)),
        )
    )


async def _reconcile(
    target: str, *, once: bool, interval: float, processing_grace: int, queued_max_age: int
) -> int:
    from workers_sdk.client import GenqClient
    from workers_sdk.errors import GenqError
    from workers_sdk.reconciler import Reconciler, describe

    log = logging.getLogger("genq.reconcile")
    async with GenqClient(target) as client:
        reconciler = Reconciler(
            client,
            reconcile_interval_seconds=interval,
            processing_grace_seconds=processing_grace,
            queued_max_age_seconds=queued_max_age,
        )
        if once:
            try:
                summary = await reconciler.sweep()
            except GenqError as error:
                log.error("reconcile sweep against %s failed: %s", target, error)
                return 1
            log.info("reconcile sweep: %s", describe(summary))
            return 1 if summary.errors else 0
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        log.info("reconciling against %s every %g s", target, interval)
        await reconciler.run(stop)
        log.info("reconciler stopped")
        return 0


NANOS = Decimal(1_000_000_000)


def to_nanos(amount: str) -> int:
    """A decimal amount of the currency unit as integer nanos (no floats on the way)."""
    try:
        value = Decimal(amount) * NANOS
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not an amount: {amount!r}") from None
    if value < 0 or value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"not a non-negative amount in nanos: {amount!r}")
    return int(value)


def cmd_cap(args: argparse.Namespace, settings: Settings) -> int:
    from generation.task.v1 import task_pb2
    from workers_sdk.client import GenqClient
    from workers_sdk.errors import GenqError

    async def update() -> task_pb2.Settings:
        async with GenqClient(args.target or os.environ.get("GENQ_ADDR") or "localhost:50051") as c:
            request = task_pb2.UpdateSettingsRequest(daily_cap_nanos=args.amount)
            if args.currency is not None:
                request.currency = args.currency
            answer = await c.call("UpdateSettings", request)
            return answer.settings  # type: ignore[no-any-return]

    try:
        stored = asyncio.run(update())
    except GenqError as error:
        print(f"genq cap: {error}", file=sys.stderr)
        return 1
    print(f"daily cap: {Decimal(stored.daily_cap_nanos) / NANOS} {stored.currency}".rstrip())
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="genq",
        description="The genq data plane. Settings come from the environment "
        "(see docs/OPERATIONS.md).",
    )
    commands = top.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="migrate, then serve gRPC (embedded Postgres when DATABASE_URL is unset)",
        description="Migrate the database to head, then serve GenerationDataService, health and "
        "reflection on GENQ_PORT (50051). Without DATABASE_URL an embedded Postgres runs in "
        "GENQ_DATA_DIR (.genq). SIGTERM stops gracefully.",
    )
    serve.set_defaults(run=cmd_serve)
    migrate = commands.add_parser(
        "migrate",
        help="migrate the database and exit",
        description="Upgrade DATABASE_URL (or the embedded database) to a revision (default head).",
    )
    migrate.add_argument(
        "revision", nargs="?", help="target revision (default: head, or base with --downgrade)"
    )
    migrate.add_argument("--downgrade", action="store_true", help="downgrade instead of upgrade")
    migrate.set_defaults(run=cmd_migrate)
    reconcile = commands.add_parser(
        "reconcile",
        help="reap stale tasks and settle reservations over gRPC (the gateway's reconciler)",
        description="Every GENQ_RECONCILE_INTERVAL_SECONDS (60): force-fail the tasks "
        "ListStaleTasks returns (dead zombies past GENQ_PROCESSING_GRACE_SECONDS, 120; "
        "unclaimable rows; never-claimed rows older than GENQ_QUEUED_MAX_AGE_SECONDS, 900), then "
        "settle the reservation of every terminal task exactly once. Talks to the service at "
        "--target over gRPC and needs no database credentials; any number may run at once. "
        "SIGTERM or SIGINT stops it after the sweep in progress. Exit codes: 0 done, "
        "1 the service could not be reached or some task could not be reaped or settled.",
    )
    reconcile.add_argument(
        "--once", action="store_true", help="sweep once, log the summary and exit"
    )
    reconcile.add_argument(
        "--target",
        metavar="HOST:PORT",
        help="the service's address (default: GENQ_ADDR, else localhost:50051)",
    )
    reconcile.set_defaults(run=cmd_reconcile)
    cap = commands.add_parser(
        "cap",
        help="set the global daily spend cap (until one is set, nothing runs)",
        description="Set the global daily spend cap, in currency units (e.g. 2.50; stored as "
        "integer nanos). A cap of 0 runs nothing. Talks to the service at --target over gRPC.",
    )
    cap.add_argument("amount", type=to_nanos, help="the cap in currency units, e.g. 2.50")
    cap.add_argument("--currency", help="a display label, e.g. EUR")
    cap.add_argument("--target", metavar="HOST:PORT", help="default: GENQ_ADDR or localhost:50051")
    cap.set_defaults(run=cmd_cap)
    return top


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = parser().parse_args(argv)
    return int(args.run(args, Settings.from_env()))


if __name__ == "__main__":
    sys.exit(main())
