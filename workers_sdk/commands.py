"""What a `genq` command is, for every package that adds commands to the program: the exit
codes, the errors that choose them, a command's table entry and its arguments, and the plain
table commands print.

The operators' commands (workers_sdk/cli/) and the service's own (service/cli.py) are both
written with these. The program (workers_sdk/cli/program.py) builds its parser from their
tables; it finds the service's table through the entry-point group COMMAND_GROUP, so neither
package imports the other's commands.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

DONE, ERROR, USAGE, DISABLED, CAPPED = 0, 1, 2, 3, 4

COMMAND_GROUP = "genq.commands"
"""The entry-point group (pyproject.toml) whose entries are lists of `Command`s the program adds
after the operators' own: the service's serve, migrate and token."""


class UsageError(Exception):
    """Bad usage found after parsing (exit 2)."""


class CommandError(Exception):
    """The command could not be done (exit 1)."""


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


@dataclass(frozen=True)
class Command:
    name: str
    run: Callable[[argparse.Namespace], Awaitable[int]] | Callable[[argparse.Namespace], int]
    help: str
    description: str
    arguments: list[Argument] = field(default_factory=list)
    client: bool = True
    """A gRPC client of the service: --target, --format and the connection options, a channel
    opened for it (`args.client`), and errors exit 1."""
    takes_anything: bool = False
    """Runs whatever follows its name (a stand-in for a command this install lacks)."""


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Left-aligned columns, two spaces apart."""
    cells = [list(headers), *([str(cell) for cell in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in cells
    )
