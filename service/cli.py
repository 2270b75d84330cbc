"""The service's own `genq` commands: serve, migrate and token, which run where the database
credentials are. The operators' commands (gRPC clients) are in the SDK, workers_sdk/cli/; the
program there adds this module's COMMANDS through the `genq.commands` entry point
(pyproject.toml), so neither imports the other.

This module imports only where the service's libraries are installed (`genq[service]`): on an
SDK-only install it raises ImportError and `genq` offers the operators' commands alone, with a
stand-in for each of these that says what to install. The libraries themselves are imported by
each command as it runs, so that `genq status` never pays for alembic.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from service.settings import Settings
from workers_sdk.commands import DONE, Command, CommandError, UsageError, arg, flag, table


def _require(*libraries: str) -> None:
    """Raises ImportError unless the libraries are installed. find_spec, not import: alembic
    alone takes 0.4 s. A checkout's alembic/ folder (the migrations) passes for a namespace
    package, which has no location: that is not the library."""
    for library in libraries:
        found = importlib.util.find_spec(library)
        if found is None or not found.has_location:
            raise ModuleNotFoundError(f"the service needs {library}", name=library)


_require("psycopg", "alembic")


def _database_url(settings: Settings) -> str:
    if settings.database_url:
        return settings.database_url
    from service import embedded

    return embedded.start(settings.data_dir)


def cmd_serve(args: argparse.Namespace) -> int:
    from service import migrations
    from service.api import server

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
        print(token_table(tokens.list_all(url)))
    else:
        if not args.token:
            raise UsageError("token revoke needs the token's ID, or the token")
        revoked = tokens.revoke(url, args.token)
        if revoked is None:
            raise CommandError(f"no token {args.token!r}")
        print(f"revoked token {revoked.id}; every replica refuses it within 30 s")
    return DONE


def token_table(values: Sequence[Any]) -> str:
    """`genq token list`: service.tokens.Token rows, secrets never (only their hash is kept)."""
    if not values:
        return "no tokens"

    def moment_of(value: datetime | None) -> str:
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ") if value else "-"

    return table(
        ("ID", "ROLES", "TOOLS", "CREATED", "EXPIRES", "REVOKED", "NOTE"),
        (
            (
                value.id,
                ",".join(value.roles),
                ",".join(value.tools) or "(all)",
                moment_of(value.created_at),
                moment_of(value.expires_at),
                moment_of(value.revoked_at),
                value.note,
            )
            for value in values
        ),
    )


SPAN_UNITS = {"s": 1, "m": 60, "h": 3_600, "d": 86_400}
MAX_SPAN_SECONDS = 100 * 365 * 86_400
"""A century: longer is surely a typo, and far longer overflows the dates it is added to."""


def span(value: str) -> int:
    """A duration in seconds from 90, 90s, 15m, 12h or 30d (`genq token create --expires`)."""
    number, unit = (value[:-1], value[-1]) if value[-1:] in SPAN_UNITS else (value, "s")
    try:
        seconds = int(number) * SPAN_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a duration (90s, 15m, 12h, 30d): {value!r}"
        ) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0: {value!r}")
    if seconds > MAX_SPAN_SECONDS:
        raise argparse.ArgumentTypeError(f"must be at most 100 years: {value!r}")
    return seconds


def _roles() -> tuple[str, ...]:
    from service.tokens import ROLES

    return ROLES


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
                choices=_roles(),
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
]
