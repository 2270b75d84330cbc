"""API tokens: their format, and the `genq token` commands' work on generation.tokens.

A token reads `genq_<id>_<secret>`: the id (32 hex digits, the row's uuid) finds the row, and
only the SHA-256 of the secret is stored, so the table (or a backup of it) holds no credential;
the service compares hashes in constant time (service/api/auth.py). The commands run on the
service host with the database URL, like `genq migrate`: tokens are made where the
credentials already are, never over the API a token guards. Each command writes an audit row
in its own transaction.
"""

from __future__ import annotations

import getpass
import hashlib
import secrets
import socket
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

PREFIX = "genq"
ROLES = ("gateway", "worker", "reconciler", "operator", "viewer")
SECRET_BYTES = 32

AUDIT_SQL = (
    "INSERT INTO generation.audit (actor, action, detail) "
    "VALUES (%(actor)s, %(action)s, %(detail)s)"
)
"""One audit row; the service runs it in the transaction of the change it records."""


def secret_hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def parse(token: str) -> tuple[uuid.UUID, str] | None:
    """The id and secret of a well-formed token, else None (the secret may hold `_`)."""
    prefix, _, rest = token.partition("_")
    hex_id, _, secret = rest.partition("_")
    if prefix != PREFIX or len(hex_id) != 32 or not secret:
        return None
    try:
        return uuid.UUID(hex=hex_id), secret
    except ValueError:
        return None


@dataclass(frozen=True)
class Token:
    id: uuid.UUID
    roles: list[str]
    tools: list[str]
    note: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


def cli_actor() -> str:
    """Who runs a `genq token` command, as the audit log names them."""
    return f"cli:{getpass.getuser()}@{socket.gethostname()}"


def create(
    url: str,
    roles: list[str],
    tools: list[str],
    expires_in_seconds: int | None,
    note: str,
) -> str:
    """Stores a new token and returns it; the secret exists nowhere else afterwards."""
    token_id = uuid.uuid4()
    secret = secrets.token_urlsafe(SECRET_BYTES)
    with psycopg.connect(url) as connection, connection.transaction():
        connection.execute(
            "INSERT INTO generation.tokens (id, secret_sha256, roles, tools, note, expires_at) "
            "VALUES (%(id)s, %(hash)s, %(roles)s, %(tools)s, %(note)s, "
            "now() + make_interval(secs => %(expires)s))",
            {
                "id": token_id,
                "hash": secret_hash(secret),
                "roles": sorted(set(roles)),
                "tools": sorted(set(tools)),
                "note": note,
                "expires": expires_in_seconds,
            },
        )
        _audit(
            connection,
            "token create",
            {
                "token_id": str(token_id),
                "roles": sorted(set(roles)),
                "tools": sorted(set(tools)),
                "expires_in_seconds": expires_in_seconds,
                "note": note,
            },
        )
    return f"{PREFIX}_{token_id.hex}_{secret}"


def list_all(url: str) -> list[Token]:
    with psycopg.connect(url) as connection:
        rows = connection.execute(
            "SELECT id, roles, tools, note, created_at, expires_at, revoked_at "
            "FROM generation.tokens ORDER BY created_at, id"
        ).fetchall()
    return [Token(*row) for row in rows]


def revoke(url: str, id_or_token: str) -> Token | None:
    """Revokes a token given its id or the token itself; None when no such token exists.
    Revoking a revoked token keeps its first revocation time."""
    parsed = parse(id_or_token)
    try:
        token_id = parsed[0] if parsed else uuid.UUID(id_or_token)
    except ValueError:
        return None
    with psycopg.connect(url) as connection, connection.transaction():
        row = connection.execute(
            "UPDATE generation.tokens SET revoked_at = COALESCE(revoked_at, now()) "
            "WHERE id = %s RETURNING id, roles, tools, note, created_at, expires_at, revoked_at",
            [token_id],
        ).fetchone()
        if row is None:
            return None
        _audit(connection, "token revoke", {"token_id": str(token_id)})
    return Token(*row)


def _audit(connection: psycopg.Connection[Any], action: str, detail: dict[str, Any]) -> None:
    connection.execute(AUDIT_SQL, {"actor": cli_actor(), "action": action, "detail": Jsonb(detail)})
