"""The page's actions: each is one RPC of GenerationDataService, run in this process through the
very handler the gRPC port runs (service/api/handlers.py), so it has the RPC's rules and leaves
the RPC's audit row: the caller is identified from the person's token and admitted and scoped by
service/api/auth.py, the request bound and validated, the statement and its audit row run in one
transaction, the wakes and events sent after the commit, the RPC metrics counted.

    POST /actions/switch            UpdateSettings enabled (off asks to confirm)
    POST /actions/cap               UpdateSettings daily_cap_nanos (asks to confirm)
    POST /actions/pause, /resume    ConfigureTool paused
    POST /actions/release-cooldown  ReleaseCooldown
    POST /actions/release-hold      ReleaseHold
    POST /actions/cancel            CancelTask (asks to confirm)
    POST /actions/retry             RetryTask (asks to confirm; its form's retry key makes a second
                                    send of the same form change nothing)

CSRF: every form carries a token derived from the browser's session cookie (random, HttpOnly,
SameSite=Strict) and the login token (`form_token`); a POST whose token is missing or does not
match, or whose Origin is another site's, changes nothing and answers 403.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from http import HTTPStatus
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message

from generation.task.v1 import task_pb2
from service.api.auth import RULES, Caller
from service.api.handlers import Handlers
from service.api.rpcs import BINDINGS, SERVICE
from workers_sdk.money import money

SESSION_COOKIE = "genq_session"
CSRF_FIELD = "csrf"
CONFIRM_FIELD = "confirm"
ACTION_SECONDS = 10.0
"""The deadline an action's RPC runs under, as a CLI call's."""

HTTP_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.OUT_OF_RANGE: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED: HTTPStatus.FORBIDDEN,
    grpc.StatusCode.UNAUTHENTICATED: HTTPStatus.UNAUTHORIZED,
    grpc.StatusCode.FAILED_PRECONDITION: HTTPStatus.CONFLICT,
    grpc.StatusCode.ALREADY_EXISTS: HTTPStatus.CONFLICT,
    grpc.StatusCode.ABORTED: HTTPStatus.CONFLICT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPStatus.TOO_MANY_REQUESTS,
    grpc.StatusCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: HTTPStatus.GATEWAY_TIMEOUT,
}


def http_status(code: Any) -> HTTPStatus:
    return HTTP_OF_CODE.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)


class Refused(Exception):
    """An action's RPC refused (or failed): its gRPC code and message."""

    def __init__(self, code: Any, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class BadForm(Exception):
    """A form field the page itself cannot turn into a request (an amount that is not one)."""


# --- CSRF -----------------------------------------------------------------------------------------


def new_session() -> str:
    return secrets.token_urlsafe(32)


def form_token(session: str, token: str | None) -> str:
    """The hidden field of every form: an HMAC keyed by the session cookie, over the login token.
    A page of another site can read neither cookie, so it cannot make the field; a session
    cookie planted by a sibling site still lacks the login token."""
    message = b"genq page form\0" + (token or "").encode()
    return hmac.new(session.encode(), message, hashlib.sha256).hexdigest()


def form_token_matches(session: str | None, token: str | None, sent: str) -> bool:
    if not session or not sent:
        return False
    return hmac.compare_digest(form_token(session, token), sent)


# --- the actions ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    method: str
    """The RPC behind it."""
    build: Callable[[Mapping[str, str]], Message]
    confirm: Callable[[Mapping[str, str], str], str | None] = lambda form, currency: None
    """The question asked before it runs (a destructive action), None: none asked."""
    back: Callable[[Mapping[str, str]], str] = lambda form: "/"
    """Where the browser goes after it (POST-redirect-GET)."""
    fields: tuple[str, ...] = ()
    """The form fields it reads (carried through the confirmation)."""


def _switch(form: Mapping[str, str]) -> Message:
    if form.get("enabled") not in ("on", "off"):
        raise BadForm("enabled must be on or off")
    return task_pb2.UpdateSettingsRequest(enabled=form["enabled"] == "on")


NANOS = Decimal(1_000_000_000)
MAX_NANOS = 2**63 - 1


def amount(text: str) -> int:
    """A decimal amount of the currency unit (12.50) as integer nanos, through Decimal (never a
    float), as `genq cap` reads it; the RPC checks the range it takes."""
    try:
        units = Decimal(text.strip())
    except InvalidOperation:
        units = Decimal("NaN")
    if not units.is_finite():
        raise BadForm(f"daily cap: not an amount in currency units (e.g. 12.50): {text!r}")
    nanos = units * NANOS
    if nanos != nanos.to_integral_value():
        raise BadForm(f"daily cap: at most 9 decimal places (a billionth of the unit): {text}")
    if not 0 <= nanos <= MAX_NANOS:
        raise BadForm(f"daily cap: out of range: {text}")
    return int(nanos)


def _cap(form: Mapping[str, str]) -> Message:
    text = form.get("amount", "").strip()
    if not text:
        raise BadForm("give the daily cap as an amount in currency units, e.g. 10")
    return task_pb2.UpdateSettingsRequest(daily_cap_nanos=amount(text))


def _confirm_cap(form: Mapping[str, str], currency: str) -> str:
    try:
        nanos = amount(form.get("amount", ""))
    except BadForm:
        return "Set the daily cap?"  # refused when it runs, with the reason
    shown = money(nanos, currency, grouped=True)
    return f"Set the daily cap to {shown}? Claims stop once today's spend reaches it."


def _task_back(form: Mapping[str, str]) -> str:
    task_id = form.get("task_id", "")
    return f"/tasks/{task_id}" if _plain_id(task_id) else "/"


def _plain_id(value: str) -> bool:
    return bool(value) and all(c in "0123456789abcdefABCDEF-" for c in value) and len(value) <= 64


ACTIONS: dict[str, Action] = {
    "switch": Action(
        "UpdateSettings",
        _switch,
        confirm=lambda form, currency: (
            "Switch the queue off? No task is claimed until it is switched on again; "
            "tasks running now finish."
            if form.get("enabled") == "off"
            else None
        ),
        fields=("enabled",),
    ),
    "cap": Action("UpdateSettings", _cap, confirm=_confirm_cap, fields=("amount",)),
    "pause": Action(
        "ConfigureTool",
        lambda form: task_pb2.ConfigureToolRequest(tool_id=form.get("tool_id", ""), paused=True),
        fields=("tool_id",),
    ),
    "resume": Action(
        "ConfigureTool",
        lambda form: task_pb2.ConfigureToolRequest(tool_id=form.get("tool_id", ""), paused=False),
        fields=("tool_id",),
    ),
    "release-cooldown": Action(
        "ReleaseCooldown",
        lambda form: task_pb2.ReleaseCooldownRequest(resource_key=form.get("resource_key", "")),
        fields=("resource_key",),
    ),
    "release-hold": Action(
        "ReleaseHold",
        lambda form: task_pb2.ReleaseHoldRequest(account_group=form.get("account_group", "")),
        fields=("account_group",),
    ),
    "cancel": Action(
        "CancelTask",
        lambda form: task_pb2.CancelTaskRequest(task_id=form.get("task_id", "")),
        confirm=lambda form, currency: (
            f"Cancel task {form.get('task_id', '')}? A queued task never runs; a running one is "
            "asked to stop, and its cost so far is kept."
        ),
        back=_task_back,
        fields=("task_id",),
    ),
    "retry": Action(
        "RetryTask",
        lambda form: task_pb2.RetryTaskRequest(
            task_id=form.get("task_id", ""), retry_key=form.get("retry_key", "")
        ),
        confirm=lambda form, currency: (
            f"Retry task {form.get('task_id', '')}? It is queued again with fresh retries, and "
            "runs (and is paid for) again."
        ),
        back=_task_back,
        fields=("task_id", "retry_key"),
    ),
}


def may(caller: Caller, method: str, tool: str | None = None) -> bool:
    """Whether the page offers the caller an action's button: its roles admit the RPC, and a
    token restricted to tools reaches the tool it acts on (auth.py decides again when it runs)."""
    if not caller.roles & RULES[method].roles:
        return False
    return not (caller.tools and RULES[method].tool_field and tool not in caller.tools)


# --- running one ----------------------------------------------------------------------------------


class PageCall:
    """What the handler reads of a gRPC call, for a call made by the page: the person's token
    as its `authorization` metadata, a deadline, the client certificate's name if any; an abort
    raises Refused."""

    def __init__(self, token: str | None, certificate_name: str | None) -> None:
        self.token = token
        self.certificate_name = certificate_name
        self.deadline = time.monotonic() + ACTION_SECONDS

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def time_remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def auth_context(self) -> dict[str, list[bytes]]:
        if self.certificate_name:
            return {"x509_common_name": [self.certificate_name.encode()]}
        return {}

    async def abort(self, code: Any, details: str, trailing_metadata: Any = None) -> None:
        raise Refused(code, details)


class Runner:
    """Each action's RPC, bound once to the handler's unary path."""

    def __init__(self, handlers: Handlers) -> None:
        self._calls: dict[str, Callable[[bytes, Any], Awaitable[bytes]]] = {}
        self._answers: dict[str, type[Message]] = {}
        for method in {action.method for action in ACTIONS.values()}:
            descriptor = SERVICE.methods_by_name[method]
            self._calls[method] = handlers.unary(descriptor, BINDINGS[method])
            self._answers[method] = message_factory.GetMessageClass(descriptor.output_type)

    async def run(self, method: str, request: Message, call: PageCall) -> Message:
        answer = await self._calls[method](request.SerializeToString(), call)
        return self._answers[method].FromString(answer)
