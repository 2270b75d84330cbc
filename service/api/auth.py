"""Who calls, and what they may do: the one place the roles, tool scopes and audit rule of every
RPC (its `roles`, `tool_field` and `audited` options, read from the descriptor) are enforced.

The handlers ask in this order, inside their one error boundary:

1. `caller`: the identity behind the `authorization: Bearer <token>` metadata. A token sent is
   always checked (unknown, malformed, expired, revoked: UNAUTHENTICATED). No token: under
   GENQ_AUTH=required UNAUTHENTICATED, else the anonymous caller, who holds every role.
2. `admit`: the caller holds a role the RPC allows (an operator may call every RPC), else
   PERMISSION_DENIED.
3. `scope`: a token naming tools reaches only those tools. The request field in `tool_field`
   says which tool the call acts on; a task id is resolved to its tool from the claims this
   process answered (`learn`), else with one primary-key query. Ids that name nothing pass:
   the RPC itself then answers NOT_FOUND, revealing nothing.
   An RPC acting on no one tool is open to a restricted token unless its answer holds tasks.
4. `audit`: the audit row an `audited` RPC writes in its statement's transaction.
5. `redact`: a caller reaching an RPC only as a viewer gets the tasks in the answer without
   their input and output.

The other services on the port are not the data plane's: gRPC health answers anyone (probes),
and reflection, under GENQ_AUTH=required, any valid token (`ReflectionGuard`).

Validated tokens are cached for at most GENQ_TOKEN_CACHE_SECONDS (15), so a revocation (or an
expiry) takes effect on every replica within that time; tool names never change, so a tool id's
name is cached for good.
"""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, MethodDescriptor
from google.protobuf.message import Message
from psycopg.types.json import Jsonb

from generation.task.v1 import options_pb2, task_pb2
from service import tokens
from service.api.errors import RoleNotAllowed, ToolNotAllowed, Unauthenticated, rpc_status_of
from service.api.rpcs import SERVICE, Params
from service.database import Database
from service.settings import Settings

MAX_CACHED = 10_000
"""Tokens and tool names kept; past it the cache starts over (it only saves lookups)."""
TASK_CACHE = 50_000
"""Tasks whose tool is remembered, learned from claims: enough for the tasks in flight
through one process, whose heartbeats and reports then need no lookup."""

ROLE_NAMES = {
    options_pb2.ROLE_GATEWAY: "gateway",
    options_pb2.ROLE_WORKER: "worker",
    options_pb2.ROLE_RECONCILER: "reconciler",
    options_pb2.ROLE_OPERATOR: "operator",
    options_pb2.ROLE_VIEWER: "viewer",
}
VIEWER = "viewer"
TASK = task_pb2.Task.DESCRIPTOR

TOKEN_SQL = (
    "SELECT secret_sha256, roles, tools, note, "
    "revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now()) AS live, "
    "extract(epoch FROM expires_at - now())::float8 AS expires_in "
    "FROM generation.tokens WHERE id = %(id)s"
)
# Database time decides expiry (as every time comparison of the service): the cache keeps an
# entry no longer than the token has left.
TOOL_NAMES_SQL = "SELECT id, name FROM generation.tools WHERE id = ANY(%(ids)s::uuid[])"
TASK_TOOLS_SQL = (
    "SELECT t.id, tl.name FROM generation.tasks t "
    "JOIN generation.tools tl ON tl.id = t.tool_id WHERE t.id = ANY(%(ids)s::uuid[])"
)


def _holds_tasks(message: Descriptor, seen: frozenset[str] = frozenset()) -> bool:
    """Whether a message of this type can carry a Task, at any depth."""
    if message is TASK:
        return True
    if message.full_name in seen:
        return False
    return any(
        field.message_type is not None
        and _holds_tasks(field.message_type, seen | {message.full_name})
        for field in message.fields
    )


@dataclass(frozen=True)
class Rule:
    """What one RPC's options say about its callers."""

    roles: frozenset[str]
    """Who may call it, the operator included."""
    tool_field: str
    audited: bool
    reads_tasks: bool
    """Its answer can hold tasks (their input and output)."""

    @classmethod
    def of(cls, method: MethodDescriptor) -> Rule:
        options = method.GetOptions()
        return cls(
            roles=frozenset(ROLE_NAMES[role] for role in options.Extensions[options_pb2.roles])
            | {"operator"},
            tool_field=options.Extensions[options_pb2.tool_field],
            audited=options.Extensions[options_pb2.audited],
            reads_tasks=_holds_tasks(method.output_type),
        )


RULES: dict[str, Rule] = {method.name: Rule.of(method) for method in SERVICE.methods}


@dataclass(frozen=True)
class Caller:
    actor: str
    """As the audit log names it: `token:<id> (<note>)`, `cert:<common name>`, `anonymous`."""
    roles: frozenset[str]
    tools: frozenset[str]
    """The tool names the caller reaches; empty: every tool."""


def anonymous(actor: str = "anonymous") -> Caller:
    return Caller(actor, frozenset(ROLE_NAMES.values()), frozenset())


@dataclass(frozen=True)
class _Cached:
    secret_sha256: bytes
    caller: Caller | None
    """None: no live token has this id (unknown, revoked or expired)."""
    until: float


def bearer(value: str) -> str:
    """The token in an `authorization` value; UNAUTHENTICATED when it is not `Bearer <token>`."""
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("authorization must be `Bearer <token>`")
    return token.strip()


class Guard:
    def __init__(self, database: Database, settings: Settings) -> None:
        self.database = database
        self.required = settings.auth_required
        self.token_cache_seconds = settings.token_cache_seconds
        self._tokens: dict[uuid.UUID, _Cached] = {}
        self._tool_names: dict[str, str] = {}
        self._task_tools: dict[str, str] = {}
        """Task id -> its tool's name, learned from claims and lookups (a task never moves)."""

    async def caller(self, context: grpc.aio.ServicerContext, timeout: float | None) -> Caller:
        authorization = [
            value for key, value in context.invocation_metadata() or () if key == "authorization"
        ]
        if authorization:
            return await self.identify(bearer(str(authorization[0])), timeout)
        if self.required:
            raise Unauthenticated("a token is required: send `authorization: Bearer <token>`")
        return anonymous(_certificate_actor(context))

    async def identify(self, token: str, timeout: float | None = None) -> Caller:
        """The caller a token stands for; UNAUTHENTICATED unless it is live."""
        parsed = tokens.parse(token)
        if parsed is None:
            raise Unauthenticated("the token is not a genq token (genq_<id>_<secret>)")
        token_id, secret = parsed
        cached = self._tokens.get(token_id)
        if cached is None or cached.until <= time.monotonic():
            cached = await self._look_up(token_id, timeout)
        # Compared even for an unknown id (against nothing), in constant time.
        matches = hmac.compare_digest(cached.secret_sha256, tokens.secret_hash(secret))
        if cached.caller is None or not matches:
            raise Unauthenticated("the token is unknown, expired or revoked")
        return cached.caller

    async def _look_up(self, token_id: uuid.UUID, timeout: float | None) -> _Cached:
        rows = await self.database.fetch(TOKEN_SQL, {"id": token_id}, timeout=timeout)
        lifetime = self.token_cache_seconds
        if not rows:
            cached = _Cached(b"", None, time.monotonic() + lifetime)
        else:
            row = rows[0]
            if row["live"] and row["expires_in"] is not None:  # a dead one stays dead: cache it
                lifetime = max(0.0, min(lifetime, row["expires_in"]))
            note = f" ({row['note']})" if row["note"] else ""
            caller = Caller(
                f"token:{token_id}{note}", frozenset(row["roles"]), frozenset(row["tools"])
            )
            cached = _Cached(
                bytes(row["secret_sha256"]),
                caller if row["live"] else None,
                time.monotonic() + lifetime,
            )
        if len(self._tokens) >= MAX_CACHED:
            self._tokens.clear()
        self._tokens[token_id] = cached
        return cached

    def admit(self, caller: Caller, method: str) -> None:
        allowed = RULES[method].roles
        if not caller.roles & allowed:
            raise RoleNotAllowed(
                f"{method} needs the role {' or '.join(sorted(allowed))}; "
                f"the token has {', '.join(sorted(caller.roles))}"
            )

    async def scope(
        self, caller: Caller, method: str, request: Message, timeout: float | None
    ) -> None:
        if not caller.tools:
            return
        rule = RULES[method]
        reach = ", ".join(sorted(caller.tools))
        if not rule.tool_field:
            if rule.reads_tasks:
                raise ToolNotAllowed(
                    f"{method} reads the tasks of every tool; this token reaches only {reach}"
                )
            return
        values = _values(request, rule.tool_field)
        if not values:
            raise ToolNotAllowed(
                f"this token reaches only {reach}: {method} must name one in {rule.tool_field}"
            )
        names = await self._tools(rule.tool_field.rpartition(".")[2], values, timeout)
        if not names <= caller.tools:
            raise ToolNotAllowed(f"{method} acts on a tool this token does not reach ({reach})")

    async def _tools(self, kind: str, values: list[str], timeout: float | None) -> set[str]:
        """The names of the tools that `values` (tool names, tool ids or task ids) belong to;
        ids that are malformed or name nothing add none (the RPC refuses them itself)."""
        if kind == "name":
            return set(values)
        # Canonical form: the caches hold the database's (lower case), and Postgres takes an
        # id in any case, so "ABCD…" must not miss the cache and pass for an unknown id.
        ids = [str(uuid.UUID(value)) for value in values if _is_uuid(value)]
        if not ids:
            return set()
        if kind == "task_id":
            unknown = [task_id for task_id in ids if task_id not in self._task_tools]
            if unknown:
                rows = await self.database.fetch(TASK_TOOLS_SQL, {"ids": unknown}, timeout=timeout)
                self._remember({str(row["id"]): row["name"] for row in rows})
            return {self._task_tools[task_id] for task_id in ids if task_id in self._task_tools}
        unknown = [tool_id for tool_id in ids if tool_id not in self._tool_names]
        if unknown:
            rows = await self.database.fetch(TOOL_NAMES_SQL, {"ids": unknown}, timeout=timeout)
            if len(self._tool_names) >= MAX_CACHED:
                self._tool_names.clear()
            self._tool_names.update({str(row["id"]): row["name"] for row in rows})
        return {self._tool_names[tool_id] for tool_id in ids if tool_id in self._tool_names}

    def audit(self, caller: Caller, method: str, request: Message) -> tuple[str, Params] | None:
        """The audit row an audited RPC writes in its own transaction; None for the others."""
        if not RULES[method].audited:
            return None
        detail = json_format.MessageToDict(request, preserving_proto_field_name=True)
        return tokens.AUDIT_SQL, {"actor": caller.actor, "action": method, "detail": Jsonb(detail)}

    def learn(self, caller: Caller, response: Message) -> None:
        """Remembers the tool of each task a restricted caller was just handed (a claim's
        answer), so that its heartbeats and reports need no lookup."""
        if caller.tools:
            self._remember(
                {
                    task.id: self._tool_names[task.tool_id]
                    for task in _tasks_in(response)
                    if task.tool_id in self._tool_names
                }
            )

    def _remember(self, tools_of_tasks: dict[str, str]) -> None:
        if len(self._task_tools) + len(tools_of_tasks) > TASK_CACHE:
            self._task_tools.clear()
        self._task_tools.update(tools_of_tasks)

    def redact(self, caller: Caller, method: str, response: Message) -> None:
        rule = RULES[method]
        if rule.reads_tasks and caller.roles & rule.roles == {VIEWER}:
            _clear_task_bodies(response)


def _values(message: Message, path: str) -> list[str]:
    """The non-empty values at `path` (`field`, or `repeated_field.field`)."""
    head, _, rest = path.partition(".")
    if rest:
        return [value for item in getattr(message, head) for value in _values(item, rest)]
    value = getattr(message, head)
    return [value] if value else []


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def _tasks_in(message: Message) -> Iterable[Any]:
    """Every Task in a message, at any depth."""
    for field, value in message.ListFields():
        if field.message_type is None or not _holds_tasks(field.message_type):
            continue
        for item in value if field.is_repeated else [value]:
            if field.message_type is TASK:
                yield item
            else:
                yield from _tasks_in(item)


def _clear_task_bodies(message: Message) -> None:
    for task in _tasks_in(message):  # Structs are skipped: inputs are maps, not tasks
        task.ClearField("input")
        task.ClearField("output")


def _certificate_actor(context: grpc.aio.ServicerContext) -> str:
    """`cert:<common name>` for a caller with a client certificate (mTLS), else `anonymous`."""
    names = (context.auth_context() or {}).get("x509_common_name") or []
    return f"cert:{names[0].decode(errors='replace')}" if names else "anonymous"


REFLECTION_PREFIX = "/grpc.reflection."


class ReflectionGuard(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no stubs
    """Under GENQ_AUTH=required, reflection (it serves every method's SQL) needs a valid token."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if not self.guard.required or not details.method.startswith(REFLECTION_PREFIX):
            return await continuation(details)
        sent = [value for key, value in details.invocation_metadata or () if key == "authorization"]
        try:
            if not sent:
                raise Unauthenticated("a token is required: send `authorization: Bearer <token>`")
            await self.guard.identify(bearer(str(sent[0])))
        except Unauthenticated as error:
            status = rpc_status_of(error)

            async def refuse(requests: AsyncIterator[Any], context: Any) -> None:
                await context.abort(status.code, status.details, status.trailing_metadata)

            return grpc.stream_stream_rpc_method_handler(refuse)
        return await continuation(details)
