"""How the service prints what its own `genq` commands show: the token table of `genq token
list` (the operators' commands print through workers_sdk/cli/render.py)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from workers_sdk.cli.render import table


def tokens(values: Sequence[Any]) -> str:
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
