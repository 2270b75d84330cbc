"""`genq`: run and operate the data plane."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from service import migrations
from service.settings import Settings


def _database_url(settings: Settings) -> str:
    if settings.database_url:
        return settings.database_url
    from service import embedded

    return embedded.start(settings.data_dir)


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    from service import server

    url = _database_url(settings)
    migrations.upgrade(url)
    asyncio.run(
        server.serve(
            settings, url, ready=lambda port: print(f"genq serving gRPC on port {port}", flush=True)
        )
    )
    return 0


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    url = _database_url(settings)
    if args.downgrade:
        migrations.downgrade(url, args.revision or "base")
    else:
        migrations.upgrade(url, args.revision or "head")
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
    return top


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = parser().parse_args(argv)
    return int(args.run(args, Settings.from_env()))


if __name__ == "__main__":
    sys.exit(main())
