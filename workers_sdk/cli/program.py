"""The `genq` program: the parser built from every command table, and `main`, which runs the
chosen command and turns what went wrong into an exit code.

The operators' commands (the topic modules here) are always there: they are gRPC clients and
need the SDK alone. The service's own commands (serve, migrate, token) are service/cli.py's
table, found through the entry-point group COMMAND_GROUP (workers_sdk/commands.py) and never
imported by name: that module imports only where the service is installed
(`pip install 'genq[service]'`); elsewhere each is a stand-in that says what to install.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import textwrap
from importlib.metadata import entry_points

from workers_sdk.cli import gates, history, reconcile, resources, tasks, worker
from workers_sdk.cli.command import CONNECTION, credentials, target
from workers_sdk.client import GenqClient
from workers_sdk.commands import (
    COMMAND_GROUP,
    ERROR,
    USAGE,
    Command,
    CommandError,
    UsageError,
)
from workers_sdk.errors import GenqError

WIDTH = 96  # help text is wrapped to this; the epilog is written to fit it

EPILOG = """\
exit codes:
  0  done; for status: the queue runs (its work may be empty or waiting); for worker
     --until-empty: nothing is due (empty, or waiting)
  1  error: the service could not be reached, or refused the call (NOT_FOUND, ...)
  2  bad usage
  3  disabled: status finds the kill switch off (stored, or GENQ_DISABLED in the service's
     environment); resume exits 3 when GENQ_DISABLED still keeps the queue off; worker
     --until-empty stopped on the kill switch or a paused tool
  4  capped: status finds no global daily cap, a cap of 0, or today's spend plus reservations
     at the cap; worker --until-empty stopped on a cap with no room

The operators' commands talk to the service over gRPC at --target (default: GENQ_ADDR, else
localhost:50051) and need no database credentials. Money is in currency units (2.50), stored as
integer nanos. See docs/OPERATIONS.md."""

SERVICE_COMMANDS = {
    "serve": "runs the service",
    "migrate": "migrates the service's database",
    "token": "makes, lists and revokes tokens on the service host",
}
"""What the service's commands do, for their stand-ins where the service is not installed."""


def commands() -> list[Command]:
    """Every command, in the order `genq --help` lists them."""
    operators = [
        *gates.COMMANDS,
        *tasks.COMMANDS,
        *resources.COMMANDS,
        *history.COMMANDS,
        *reconcile.COMMANDS,
        *worker.COMMANDS,
    ]
    return [*operators, *service_commands()]


SERVICE_IMPORTS = ("service", "psycopg", "alembic")
"""What loading the service's commands needs: the package, and the libraries it checks for."""


def service_commands() -> list[Command]:
    """The commands of the COMMAND_GROUP entry points (the service's), loaded as the program
    starts; stand-ins for the service's where its libraries are not installed."""
    try:
        return [command for point in entry_points(group=COMMAND_GROUP) for command in point.load()]
    except ImportError as missing:
        if (missing.name or "").partition(".")[0] not in SERVICE_IMPORTS:
            raise  # not an install without the service: a broken one, to be seen
        return [_stand_in(name, what, missing) for name, what in SERVICE_COMMANDS.items()]


def _stand_in(name: str, what: str, missing: ImportError) -> Command:
    message = (
        f"genq {name} {what}: install genq[service] (pip install 'genq[service]'); "
        f"this install has the operators' commands only (no {missing.name or missing})"
    )

    def run(args: argparse.Namespace) -> int:
        print(message, file=sys.stderr)
        return USAGE

    return Command(
        name, run, f"{what} (install genq[service])", message, client=False, takes_anything=True
    )


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
    subparsers = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in commands():
        sub = subparsers.add_parser(
            command.name,
            help=command.help,
            description=textwrap.fill(command.description, WIDTH),
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            parents=[common] if command.client else [],
        )
        for flags, options in command.arguments:
            sub.add_argument(*flags, **options)
        sub.set_defaults(
            run=command.run, remote=command.client, takes_anything=command.takes_anything
        )
    return top


async def _run_client(args: argparse.Namespace) -> int:
    try:
        client = GenqClient(target(args), credentials=credentials(args))
    except (ValueError, OSError) as error:  # a certificate without its key, an unreadable file
        raise UsageError(str(error)) from None
    async with client:
        args.client = client
        return int(await args.run(args))


def _refusal(error: GenqError, args: argparse.Namespace) -> str:
    if error.reason is None:  # not answered (UNAVAILABLE, DEADLINE_EXCEEDED): say where
        return f"{error.code.name} at {target(args)}: {error}"
    if str(error.reason) == error.code.name:  # INVALID_ARGUMENT is both: say it once
        return f"{error.code.name}: {error}"
    return f"{error.code.name} ({error.reason}): {error}"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    top = parser()
    args, rest = top.parse_known_args(argv)
    if rest and not args.takes_anything:
        top.error(f"unrecognized arguments: {' '.join(rest)}")
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
        print(f"genq {args.command}: {_refusal(error, args)}", file=sys.stderr)
        return ERROR
