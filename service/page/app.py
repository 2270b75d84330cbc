"""The operators' HTTP surface, served beside gRPC in the same process (aiohttp).

    GET /              the status page: what runs, what does not and why, the last hour's chart
    GET /status.json   the GetStatus answer as JSON (proto field names, every field, defaults too)
    GET /metrics       Prometheus text format (service/api/metrics.py)
    GET /healthz       200 while Postgres answers within HEALTHZ_TIMEOUT_SECONDS, else 503
    GET /tasks/<id>    one task: its status, attempts, events, input and output, why it waits
    GET /cap           the form that sets the daily cap
    POST /actions/...  the page's buttons, each one RPC (service/page/actions.py)

HEAD works wherever GET does; any other method on the read paths is 405, any other path 404.

The buttons are shown to a caller whose roles may call the RPC behind them (an operator; a
gateway cancels and retries tasks), as auth.py decides for gRPC: a viewer sees none. Each runs
through the RPC's own handler, so it keeps the RPC's rules and writes its audit row. Each form
carries a CSRF token (service/page/actions.py): a POST without it changes nothing and answers
403. Switching off, setting the cap, cancelling and retrying ask to confirm first, on a page of
their own; every action ends with a redirect to a page (POST-redirect-GET); nothing needs script.

Guarded like the gRPC port (service/api/auth.py): with GENQ_TLS_CERT_FILE it speaks TLS only (and
asks for a client certificate under GENQ_TLS_CLIENT_CA_FILE). Under GENQ_AUTH=required every
path but /healthz needs a token of a role that may call GetStatus: `Authorization: Bearer` for
scrapers; a person gets a login form instead, whose POST /login sets the token as an HttpOnly,
SameSite=Strict cookie (Secure under TLS), so it never appears in a URL, a history or a log;
POST /logout clears it. The Host header must be one of the names the port answers as
(GENQ_HTTP_HOSTS): a page on another site cannot read this one through a rebound DNS name.

The page and the JSON run the GetStatus statement through its binding, exactly as the RPC does,
so there is one copy of that SQL; the page adds the newest audit entries and the first stale
tasks, through their RPCs' statements too. It is drawn on the server from the Jinja2 templates
in service/page/templates/ (the chart is inline SVG), has no script and loads nothing else; it
reloads itself every REFRESH_SECONDS.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
import ssl
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from http import HTTPStatus
from typing import Any
from urllib.parse import quote, urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import jinja2
from aiohttp import web
from google.protobuf import json_format
from prometheus_client import CONTENT_TYPE_LATEST

from generation.task.v1 import task_pb2
from service.api.auth import RULES, Caller, anonymous, bearer
from service.api.errors import ServiceError, Unauthenticated
from service.api.handlers import Handlers
from service.api.metrics import Metrics
from service.api.rpcs import BINDINGS, STATEMENTS
from service.api.signals import Signals
from service.database import Database
from service.leader.waits import cap_in_force, over_cap
from service.page import actions
from service.page.task import CANCELLABLE, RETRYABLE, TaskView, read_task
from service.settings import Settings
from workers_sdk.money import money

log = logging.getLogger(__name__)

REFRESH_SECONDS = 10
# An idle connection, or one that never sends its request, is closed after this long.
READ_TIMEOUT_SECONDS = 10.0
# Readiness probes commonly give up after 1 s: the answer, 503 included, comes before that.
HEALTHZ_TIMEOUT_SECONDS = 0.8
# The largest body read: a login form (every other body is refused unread).
MAX_LOGIN_BYTES = 4096
READ_PATHS = ("/", "/status.json", "/metrics", "/healthz")
GUARDED_PATHS = frozenset({"/", "/status.json", "/metrics", "/tasks", "/cap"})
GUARDED_PREFIXES = ("/tasks/", "/actions/")

# The page needs nothing but its own inline style and inline SVG; its forms post to itself.
PAGE_POLICY = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'self'"
LOGIN_POLICY = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'self'"
COOKIE = "genq_token"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
AUDIT_SHOWN = 10
STALE_SHOWN = 5

TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("service.page", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


async def read_status(database: Database, settings: Settings) -> task_pb2.GetStatusResponse:
    """GetStatus with default arguments, through the RPC's own statement and binding."""
    binding = BINDINGS["GetStatus"]
    params = binding.bind(task_pb2.GetStatusRequest(), settings)
    rows = await database.fetch(STATEMENTS["GetStatus"], params)
    response = binding.respond(rows)
    assert isinstance(response, task_pb2.GetStatusResponse)
    return response


async def read_audit(
    database: Database, settings: Settings, limit: int
) -> list[task_pb2.AuditEntry]:
    """The newest audit entries, through ListAuditEntries's statement and binding."""
    binding = BINDINGS["ListAuditEntries"]
    request = task_pb2.ListAuditEntriesRequest(limit=limit)
    rows = await database.fetch(STATEMENTS["ListAuditEntries"], binding.bind(request, settings))
    response = binding.respond(rows)
    assert isinstance(response, task_pb2.ListAuditEntriesResponse)
    return list(response.entries)


async def read_stale(
    database: Database, settings: Settings, limit: int
) -> list[task_pb2.StaleTask]:
    """The oldest stale tasks, through ListStaleTasks's statement and binding."""
    binding = BINDINGS["ListStaleTasks"]
    request = task_pb2.ListStaleTasksRequest(limit=limit)
    rows = await database.fetch(STATEMENTS["ListStaleTasks"], binding.bind(request, settings))
    response = binding.respond(rows)
    assert isinstance(response, task_pb2.ListStaleTasksResponse)
    return list(response.tasks)


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """The HTTP port's TLS, from the same files as the gRPC port's; None without TLS."""
    if not settings.tls:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(settings.tls_cert_file), str(settings.tls_key_file))
    if settings.tls_client_ca_file:
        context.load_verify_locations(settings.tls_client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def page_url(settings: Settings, port: int) -> str:
    scheme = "https" if settings.tls else "http"
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"{scheme}://{host}:{port}/"


def allowed_hosts(settings: Settings) -> frozenset[str]:
    """The names the HTTP port answers as: loopback, GENQ_HOST, and GENQ_HTTP_HOSTS."""
    names = {*LOOPBACK_NAMES, settings.host.strip("[]")}
    names.update(name.strip().lower() for name in settings.http_hosts.split(",") if name.strip())
    return frozenset(names)


def host_name(header: str) -> str:
    """The name in a Host header, port aside ([::1]:8080 -> ::1)."""
    if header.startswith("["):
        return header[1:].partition("]")[0].lower()
    return header.rpartition(":")[0].lower() if header.count(":") == 1 else header.lower()


def _text(status: HTTPStatus, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=f"{message}\n", headers=headers)


def _html(status: HTTPStatus, page: str, policy: str) -> web.Response:
    return web.Response(
        status=status,
        text=page,
        content_type="text/html",
        headers={"Content-Security-Policy": policy},
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class StatusServer:
    """The HTTP listener; `start` binds GENQ_HOST:GENQ_HTTP_PORT and returns the port."""

    def __init__(self, database: Database, settings: Settings, metrics: Metrics) -> None:
        self.database = database
        self.settings = settings
        self.metrics = metrics
        # The actions run through the RPCs' own handler; its wakes reach every process through
        # Postgres NOTIFY (and Redis when configured), as another replica's would.
        conninfo = database.pool.conninfo
        self.signals = Signals(settings, conninfo if isinstance(conninfo, str) else None)
        self.handlers = Handlers(database, self.signals, settings, metrics)
        self.guard = self.handlers.guard
        self.runner = actions.Runner(self.handlers)
        self.hosts = allowed_hosts(settings)
        self.app = web.Application(middlewares=[self._guarded], client_max_size=MAX_LOGIN_BYTES)
        self.app.router.add_get("/", self._page)  # and HEAD, as every add_get
        self.app.router.add_get("/status.json", self._status_json)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/healthz", self._healthz)
        self.app.router.add_get("/tasks", self._find_task)
        self.app.router.add_get("/cap", self._cap_page)
        self.app.router.add_get("/tasks/{task_id}", self._task_page)
        self.app.router.add_post("/actions/{name}", self._act)
        self.app.router.add_post("/login", self._log_in)
        self.app.router.add_post("/logout", self._log_out)
        self.app.on_response_prepare.append(_common_headers)
        # No access log: a person's requests are the page's reloads, and nothing to audit.
        self._runner = web.AppRunner(
            self.app, access_log=None, keepalive_timeout=READ_TIMEOUT_SECONDS
        )

    async def start(self) -> int:
        host, port = self.settings.host, self.settings.http_port
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=tls_context(self.settings))
        try:
            await site.start()
        except OSError as error:
            await self._runner.cleanup()
            raise OSError(
                error.errno,
                f"GENQ_HTTP_PORT: cannot listen on {host}:{port} ({error.strerror}); "
                "choose another port, or 0 for a free one",
            ) from error
        return int(self._runner.addresses[0][1])

    async def close(self) -> None:
        await self._runner.cleanup()
        await self.signals.close()

    @web.middleware
    async def _guarded(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The Host check, the token check of the read paths, and every failure as plain text."""
        path = request.path
        if path != "/healthz" and host_name(request.headers.get("Host", "")) not in self.hosts:
            return _text(
                HTTPStatus.MISDIRECTED_REQUEST,
                "this port does not answer as that host name (GENQ_HTTP_HOSTS lists the names)",
            )
        try:
            routed = request.match_info.http_exception is None
            guarded = path in GUARDED_PATHS or path.startswith(GUARDED_PREFIXES)
            if routed and guarded and self.settings.auth_required:
                page = path not in ("/status.json", "/metrics")
                refusal = await self._refusal(request, page=page)
                if refusal is not None:
                    return refusal
            return await handler(request)
        except web.HTTPMethodNotAllowed as error:
            allowed = ", ".join(sorted(error.allowed_methods))
            message = (
                "read-only: the page's buttons post to /actions/..., or use gRPC and the genq CLI"
                if path in READ_PATHS
                else f"{path} takes {allowed} only (the page's form)"
            )
            return _text(HTTPStatus.METHOD_NOT_ALLOWED, message, {"Allow": allowed})
        except web.HTTPNotFound:
            return _text(
                HTTPStatus.NOT_FOUND, "not found: try / /status.json /metrics /healthz /tasks/<id>"
            )
        except web.HTTPException:
            raise  # aiohttp's own answers (a body too large, say): already plain text
        except ServiceError as error:
            return _text(HTTPStatus.SERVICE_UNAVAILABLE, str(error))
        except Exception:
            log.exception("%s %s failed", request.method, path)
            return _text(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error; see the service log")

    async def _caller(self, request: web.Request) -> Caller:
        """The caller behind an Authorization header, else behind the login cookie."""
        if "Authorization" in request.headers:
            return await self.guard.identify(bearer(request.headers["Authorization"]))
        token = request.cookies.get(COOKIE)
        if token is None:
            raise Unauthenticated("a token is required: send `Authorization: Bearer <token>`")
        return await self.guard.identify(token)

    async def _refusal(self, request: web.Request, *, page: bool) -> web.Response | None:
        """None when the caller may read the page (as GetStatus), else the refusal: the login
        form for the page, a 401 or 403 for the JSON and the metrics."""
        try:
            caller = await self._caller(request)
        except Unauthenticated as error:
            if page:
                return _login_form(HTTPStatus.UNAUTHORIZED, "")
            return _text(
                HTTPStatus.UNAUTHORIZED, str(error), {"WWW-Authenticate": 'Bearer realm="genq"'}
            )
        if not caller.roles & RULES["GetStatus"].roles:
            readers = " or ".join(sorted(RULES["GetStatus"].roles))
            message = f"this token's roles may not read the status ({readers} may)"
            if page:
                return _login_form(HTTPStatus.FORBIDDEN, message)
            return _text(HTTPStatus.FORBIDDEN, message)
        request["caller"] = caller
        return None

    async def _log_in(self, request: web.Request) -> web.Response:
        if self._foreign(request):
            return _text(HTTPStatus.FORBIDDEN, "a login must come from this page's own form")
        token = str((await request.post()).get("token", "")).strip()
        try:
            caller = await self.guard.identify(token)
        except Unauthenticated:
            return _login_form(HTTPStatus.UNAUTHORIZED, "That token is not valid.")
        if not caller.roles & RULES["GetStatus"].roles:
            return _login_form(HTTPStatus.FORBIDDEN, "That token may not read the status.")
        response = web.Response(status=HTTPStatus.SEE_OTHER, headers={"Location": "/"})
        response.set_cookie(
            COOKIE, token, path="/", httponly=True, samesite="Strict", secure=self.settings.tls
        )
        return response

    def _foreign(self, request: web.Request) -> bool:
        """A POST another site's page made: its Origin names another host, or the browser says
        it is cross-site (Sec-Fetch-Site). A browser sends `Origin: null` for the page's own
        forms (its Referrer-Policy is no-referrer): then Sec-Fetch-Site and the CSRF token tell."""
        origin = request.headers.get("Origin", "null")
        if origin != "null" and host_name(urlsplit(origin).netloc) not in self.hosts:
            return True
        return request.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none")

    async def _log_out(self, request: web.Request) -> web.Response:
        response = web.Response(status=HTTPStatus.SEE_OTHER, headers={"Location": "/"})
        response.del_cookie(
            COOKIE, path="/", httponly=True, samesite="Strict", secure=self.settings.tls
        )
        return response

    def _token(self, request: web.Request) -> str | None:
        """The token the person sent: an Authorization header, else the login cookie."""
        if "Authorization" in request.headers:
            try:
                return bearer(request.headers["Authorization"])
            except Unauthenticated:
                return None
        return request.cookies.get(COOKIE)

    async def _person(self, request: web.Request) -> tuple[Caller, str | None]:
        """Who reads the page and the token they sent. Under GENQ_AUTH=required the middleware
        identified them; else a valid token sent is honoured, and without one the caller is
        anonymous (every role, as on the gRPC port). An invalid token is shown the page as
        anonymous, but is still the one an action sends: its RPC refuses it, as over gRPC."""
        token = self._token(request)
        caller: Caller | None = request.get("caller")
        if caller is None:
            caller = anonymous(_certificate_actor(request))
            if token is not None:
                with contextlib.suppress(Unauthenticated):
                    caller = await self.guard.identify(token)
        return caller, token

    def _session(self, request: web.Request) -> tuple[str, bool]:
        """The browser's session (the CSRF key), and whether it is new (to be set)."""
        session = request.cookies.get(actions.SESSION_COOKIE, "")
        if 32 <= len(session) <= 128:
            return session, False
        return actions.new_session(), True

    def _with_session(self, response: web.Response, session: str, fresh: bool) -> web.Response:
        if fresh:
            response.set_cookie(
                actions.SESSION_COOKIE,
                session,
                path="/",
                httponly=True,
                samesite="Strict",
                secure=self.settings.tls,
            )
        return response

    async def _page(self, request: web.Request) -> web.Response:
        # The page shows the stale tasks and the audit log only to a caller who may read them
        # over gRPC too (their RPCs' roles; a token restricted to tools reads neither: both
        # span every tool).
        caller, token = await self._person(request)
        session, fresh = self._session(request)
        controls = Controls(caller, actions.form_token(session, token))
        response = await read_status(self.database, self.settings)
        stale: Sequence[task_pb2.StaleTask] = ()
        audit: Sequence[task_pb2.AuditEntry] | None = None  # None: no such section
        if _may_read(caller, "ListStaleTasks"):
            stale = await read_stale(self.database, self.settings, STALE_SHOWN)
        if _may_read(caller, "ListAuditEntries"):
            audit = await read_audit(self.database, self.settings, AUDIT_SHOWN)
        now = response.status.as_of.ToDatetime(tzinfo=UTC)  # the database's clock, as the rows'
        page = render_page(response.status, now, stale, audit, controls=controls)
        return self._with_session(_html(HTTPStatus.OK, page, PAGE_POLICY), session, fresh)

    async def _find_task(self, request: web.Request) -> web.Response:
        """The page's "open a task" form (GET /tasks?id=...) goes to the task's page."""
        task_id = request.query.get("id", "").strip()
        location = f"/tasks/{quote(task_id, safe='')}" if task_id else "/"
        return web.Response(status=HTTPStatus.SEE_OTHER, headers={"Location": location})

    async def _cap_page(self, request: web.Request) -> web.Response:
        """The form that sets the daily cap (UpdateSettings), on a page that does not reload."""
        caller, token = await self._person(request)
        if not actions.may(caller, "UpdateSettings"):
            allowed = " or ".join(sorted(RULES["UpdateSettings"].roles))
            return _message(HTTPStatus.FORBIDDEN, "Refused", f"setting the cap needs {allowed}")
        session, fresh = self._session(request)
        settings = (await read_status(self.database, self.settings)).status.settings
        cap = cap_in_force(settings)
        current = money(cap, settings.currency, grouped=True) if cap else "not set (nothing runs)"
        if settings.HasField("cap_override_nanos"):
            current += " (GENQ_DAILY_CAP_NANOS replaces the stored cap)"
        page = TEMPLATES.get_template("cap.html").render(
            current=current,
            zone=_zone(settings.timezone).key,
            currency=settings.currency,
            csrf=actions.form_token(session, token),
            csrf_field=actions.CSRF_FIELD,
        )
        return self._with_session(_html(HTTPStatus.OK, page, PAGE_POLICY), session, fresh)

    async def _task_page(self, request: web.Request) -> web.Response:
        caller, token = await self._person(request)
        session, fresh = self._session(request)
        controls = Controls(caller, actions.form_token(session, token))
        status = (await read_status(self.database, self.settings)).status
        zone = _zone(status.settings.timezone)
        try:
            view = await read_task(
                self.database,
                self.settings,
                self.guard,
                caller,
                request.match_info["task_id"],
                status,
                zone,
            )
        except ServiceError as error:
            return _message(actions.http_status(error.code), "Task", str(error), "/")
        page = render_task(view, zone, controls)
        return self._with_session(_html(HTTPStatus.OK, page, PAGE_POLICY), session, fresh)

    async def _act(self, request: web.Request) -> web.Response:
        """One of the page's buttons: the CSRF and origin checks, the confirmation of a
        destructive action, then its RPC through the handler; a redirect to a page after."""
        action = actions.ACTIONS.get(request.match_info["name"])
        if action is None:
            return _text(HTTPStatus.NOT_FOUND, "no such action: " + ", ".join(actions.ACTIONS))
        if self._foreign(request):
            return _message(
                HTTPStatus.FORBIDDEN, "Refused", "an action must come from this page's own form"
            )
        form = {key: str(value) for key, value in (await request.post()).items()}
        caller, token = await self._person(request)
        session = request.cookies.get(actions.SESSION_COOKIE)
        if not actions.form_token_matches(session, token, form.get(actions.CSRF_FIELD, "")):
            return _message(
                HTTPStatus.FORBIDDEN,
                "Refused",
                "this form did not come from this page, or has expired (a new login): "
                "nothing was changed; reload the page and try again",
            )
        back = action.back(form)
        if not caller.roles & RULES[action.method].roles:
            allowed = " or ".join(sorted(RULES[action.method].roles))
            return _message(
                HTTPStatus.FORBIDDEN,
                "Refused",
                f"{action.method} needs the role {allowed}; nothing was changed",
                back,
            )
        try:
            rpc_request = action.build(form)
        except actions.BadForm as error:
            return _message(HTTPStatus.BAD_REQUEST, "Not done", str(error), back)
        if form.get(actions.CONFIRM_FIELD) != "yes":
            currency = ""
            if action.method == "UpdateSettings":
                status = (await read_status(self.database, self.settings)).status
                currency = status.settings.currency
            question = action.confirm(form, currency)
            if question is not None:
                page = TEMPLATES.get_template("confirm.html").render(
                    question=question,
                    path=request.path,
                    fields=[(name, form.get(name, "")) for name in action.fields],
                    csrf=form[actions.CSRF_FIELD],
                    back=back,
                )
                return _html(HTTPStatus.OK, page, PAGE_POLICY)
        call = actions.PageCall(token, _certificate_name(request))
        try:
            await self.runner.run(action.method, rpc_request, call)
        except actions.Refused as refused:
            return _message(actions.http_status(refused.code), "Not done", refused.details, back)
        return web.Response(status=HTTPStatus.SEE_OTHER, headers={"Location": back})

    async def _status_json(self, request: web.Request) -> web.Response:
        response = await read_status(self.database, self.settings)
        document = json_format.MessageToDict(
            response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        return web.Response(body=json.dumps(document, indent=2), content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        async def status() -> task_pb2.Status:
            return (await read_status(self.database, self.settings)).status

        body = await self.metrics.scrape(self.database, status)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _healthz(self, request: web.Request) -> web.Response:
        try:
            await self.database.fetch("SELECT 1", {}, timeout=HEALTHZ_TIMEOUT_SECONDS)
        except Exception:
            return _text(
                HTTPStatus.SERVICE_UNAVAILABLE, "NOT_SERVING: the database does not answer"
            )
        return _text(HTTPStatus.OK, "SERVING")


async def _common_headers(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = "genq"
    response.headers["Cache-Control"] = "no-store"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"


def _message(status: HTTPStatus, title: str, message: str, back: str = "/") -> web.Response:
    """An action refused or failed, or a task not shown: what happened, and a way back."""
    page = TEMPLATES.get_template("message.html").render(title=title, message=message, back=back)
    return _html(status, page, PAGE_POLICY)


def _certificate_name(request: web.Request) -> str | None:
    """The common name of the client certificate (mutual TLS), if one was presented."""
    transport = request.transport
    peer = transport.get_extra_info("peercert") if transport is not None else None
    for entry in (peer or {}).get("subject", ()):
        for key, value in entry:
            if key == "commonName":
                return str(value)
    return None


def _certificate_actor(request: web.Request) -> str:
    name = _certificate_name(request)
    return f"cert:{name}" if name else "anonymous"


def _login_form(status: HTTPStatus, message: str) -> web.Response:
    """The page a browser gets without a token: the token goes in a POST body, never a URL."""
    return _html(status, TEMPLATES.get_template("login.html").render(message=message), LOGIN_POLICY)


# --- the page -------------------------------------------------------------------------------------
#
# What the page says is decided here (which banners, which badges, where each bar goes); how it
# looks is in service/page/templates/page.html. Every value reaches the HTML through Jinja2's
# autoescape.


@dataclass(frozen=True)
class Banner:
    """A reason work is not getting done, and the command that ends it."""

    text: str
    command: str
    after: str = ""
    """Said after the command."""
    kind: str = "bad"
    """bad: it needs someone; wait: a deliberate or automatic wait, which ends by itself too."""


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    kind: str
    label: str


@dataclass(frozen=True)
class Chart:
    completed: int
    failed: int
    bars: list[Bar]
    grid: list[tuple[int, float]]
    """(value, y) of each gridline."""
    ticks: list[tuple[str, float]]
    """(label, x) under the axis."""


@dataclass(frozen=True)
class Controls:
    """What the page offers its reader: the buttons their roles may press, and the CSRF token
    every form carries."""

    caller: Caller
    csrf: str

    def may(self, method: str, tool: str | None = None) -> bool:
        return actions.may(self.caller, method, tool)

    def offers(self, method: str) -> bool:
        """The caller's roles may call the RPC (on some tool at least)."""
        return bool(self.caller.roles & RULES[method].roles)


def _may_read(caller: Caller, method: str) -> bool:
    return bool(caller.roles & RULES[method].roles) and not caller.tools


def render_page(
    status: task_pb2.Status,
    now: datetime,
    stale: Sequence[task_pb2.StaleTask] = (),
    audit: Sequence[task_pb2.AuditEntry] | None = (),
    controls: Controls | None = None,
) -> str:
    zone = _zone(status.settings.timezone)

    def clock(stamp: datetime, layout: str = "%H:%M:%S") -> str:
        return stamp.astimezone(zone).strftime(layout)

    def left(stamp: datetime) -> str:
        return _duration(stamp - now)

    return TEMPLATES.get_template("page.html").render(
        status=status,
        settings=status.settings,
        zone=zone.key,
        now=clock(now),
        refresh=REFRESH_SECONDS,
        banners=banners(status, stale, zone),
        cap=(cap_in_force(status.settings) or 0),
        cap_source=(
            "GENQ_DAILY_CAP_NANOS" if status.settings.HasField("cap_override_nanos") else "stored"
        ),
        chart=chart(status.last_hour, now, zone),
        tools=[
            (tool, _tool_badges(tool, status.settings), _last_claim(tool, now))
            for tool in status.tools
        ],
        audit=audit,
        money=lambda nanos: money(nanos, status.settings.currency, grouped=True),
        clock=clock,
        left=left,
        at=lambda stamp: stamp.ToDatetime(tzinfo=UTC),
        age=lambda span: _duration(span.ToTimedelta()),
        status_name=_status_name,
        rate_limit=_rate_limit,
        detail=lambda entry: json.dumps(json_format.MessageToDict(entry.detail), sort_keys=True),
        chart_size=(CHART_WIDTH, CHART_HEIGHT, PLOT_LEFT, PLOT_RIGHT, PLOT_BOTTOM),
        controls=controls,
        csrf_field=actions.CSRF_FIELD,
    )


def render_task(view: TaskView, zone: ZoneInfo, controls: Controls) -> str:
    """The task's page."""
    task = view.task
    settings = view.status.settings

    def stamp(moment: datetime | None) -> str:
        return moment.astimezone(zone).strftime("%Y-%m-%d %H:%M:%S") if moment else "—"

    def body(message: Any) -> str:
        return json.dumps(json_format.MessageToDict(message), indent=2, sort_keys=True)

    return TEMPLATES.get_template("task.html").render(
        task=task,
        view=view,
        zone=zone.key,
        status_name=_status_name,
        event_kind=lambda kind: (
            task_pb2.TaskEventKind.Name(kind).removeprefix("TASK_EVENT_KIND_").lower()
        ),
        stamp=stamp,
        at=lambda moment: moment.ToDatetime(tzinfo=UTC),
        money=lambda nanos: money(nanos, settings.currency, grouped=True),
        body=body,
        readers=" or ".join(sorted(RULES["GetTask"].roles)),
        controls=controls,
        csrf_field=actions.CSRF_FIELD,
        cancellable=task.status in CANCELLABLE and not task.HasField("cancel_requested_at"),
        retryable=task.status in RETRYABLE,
        retry_key=str(uuid.uuid4()),
    )


def banners(
    status: task_pb2.Status, stale: Sequence[task_pb2.StaleTask], zone: ZoneInfo
) -> list[Banner]:
    settings = status.settings
    found = []
    if settings.disabled_by_environment:
        found.append(
            Banner(
                "Disabled: GENQ_DISABLED is set in the service's environment; nothing runs.",
                "unset GENQ_DISABLED",
                " in the service's environment, then restart it",
            )
        )
    elif not settings.enabled:
        found.append(Banner("Disabled: the kill switch is off; nothing runs.", "genq resume"))
    cap = cap_in_force(settings) or 0
    if not cap:
        found.append(
            Banner(
                "No daily cap: with no cap (or a cap of 0) nothing runs.",
                "genq cap AMOUNT",
                f" (in {settings.currency or 'currency units'}, e.g. 10)",
            )
        )
    elif settings.spent_today_nanos + settings.reserved_nanos >= cap:
        found.append(
            Banner(
                "Capped: today's spend and reservations have reached the daily cap.",
                "genq cap AMOUNT",
                " with a higher amount, or wait for the next local day",
            )
        )
    for tool in status.tools:
        name = shlex.quote(tool.name)
        if tool.paused and tool.queued:
            found.append(
                Banner(
                    f"Paused: tool {tool.name} has {tool.queued} queued, waiting to be resumed.",
                    f"genq resume {name}",
                    kind="wait",
                )
            )
        if tool.HasField("daily_cap_nanos") and _tool_capped(tool):
            found.append(
                Banner(
                    f"Capped: tool {tool.name} has reached its own daily cap.",
                    f"genq cap AMOUNT --tool {name}",
                    f" with a higher amount, or genq cap --clear --tool {name}",
                )
            )
        if tool.no_worker_seen:
            found.append(
                Banner(
                    f"No worker: tool {tool.name} has {tool.queued} queued and no claim "
                    "for 10 minutes or more. Start a worker for it, or",
                    f"genq pause {name}",
                    " if its work is meant to wait",
                )
            )
    for cooldown in status.cooling:
        until = cooldown.cooling_until.ToDatetime(tzinfo=UTC).astimezone(zone)
        found.append(
            Banner(
                f"Cooling: resource key {cooldown.resource_key} after retryable failures; its "
                f"tasks wait until {until:%H:%M:%S}.",
                f"genq release-cooldown {shlex.quote(cooldown.resource_key)}",
                kind="wait",
            )
        )
    for hold in status.holds:
        until = hold.held_until.ToDatetime(tzinfo=UTC).astimezone(zone)
        reason = f" ({hold.reason})" if hold.reason else ""
        found.append(
            Banner(
                f"Held: account group {hold.account_group}{reason}; its tasks wait until "
                f"{until:%H:%M:%S}.",
                f"genq release-hold {shlex.quote(hold.account_group)}",
                kind="wait",
            )
        )
    if status.stale_tasks:
        listed = ", ".join(_stale_item(item) for item in stale)
        more = status.stale_tasks - len(stale)
        found.append(
            Banner(
                f"Stale: {status.stale_tasks} live task(s) can never finish on their own: "
                f"{listed}{f' and {more} more' if more > 0 else ''}.",
                "genq reconcile --once",
                " fails them",
            )
        )
    return found


def _stale_item(item: task_pb2.StaleTask) -> str:
    reason = task_pb2.StaleReason.Name(item.reason).removeprefix("STALE_REASON_").lower()
    source = f", from {item.task.source}" if item.task.source else ""
    return f"{item.task.id} ({reason.replace('_', ' ')}{source})"


def _tool_badges(tool: task_pb2.ToolStatus, settings: task_pb2.Settings) -> list[tuple[str, str]]:
    """(class, word) of each state the tool is in; "ok" when none holds it up."""
    badges = []
    if tool.paused:
        badges.append(("warn", "paused"))
    if tool.HasField("daily_cap_nanos") and _tool_capped(tool):
        badges.append(("bad", "capped"))
    if over_cap(tool, settings):
        badges.append(("bad", "a task over the cap"))
    if tool.HasField("cooling_until"):
        badges.append(("warn", "cooling"))
    if tool.HasField("held_until"):
        badges.append(("warn", "held"))
    if tool.busy:
        limit = f" of {tool.max_in_flight}" if tool.HasField("max_in_flight") else ""
        badges.append(("warn", f"busy {tool.in_flight}{limit} running"))
    if tool.HasField("rate_limited_until"):
        badges.append(("warn", "rate limited"))
    if tool.no_worker_seen:
        badges.append(("bad", "no worker seen"))
    return badges or [("ok", "ok")]


def _rate_limit(rate: task_pb2.RateLimit) -> str:
    """A rate limit's bounds and what its window holds: "12/30 calls per 1m"."""
    window = _duration(rate.window.ToTimedelta())
    bounds = []
    if rate.HasField("max_calls"):
        bounds.append(f"{rate.calls}/{rate.max_calls} calls")
    if rate.HasField("max_units"):
        bounds.append(f"{rate.units:,}/{rate.max_units:,} units")
    return f"{', '.join(bounds)} per {window}"


def _last_claim(tool: task_pb2.ToolStatus, now: datetime) -> str:
    if not tool.HasField("last_claim_at"):
        return "never"
    return f"{_duration(now - tool.last_claim_at.ToDatetime(tzinfo=UTC))} ago"


# The chart: one slot per minute of the last hour, completed (green) under failed (red).
CHART_WIDTH, CHART_HEIGHT = 1200, 200
PLOT_LEFT, PLOT_RIGHT, PLOT_TOP, PLOT_BOTTOM = 44, 1190, 12, 176
MINUTES = 61  # the current minute and the 60 before it (the oldest one partly)


def chart(last_hour: Sequence[task_pb2.ThroughputMinute], now: datetime, zone: ZoneInfo) -> Chart:
    this_minute = now.replace(second=0, microsecond=0)
    slots = [(0, 0)] * MINUTES
    for row in last_hour:
        back = round((this_minute - row.minute.ToDatetime(tzinfo=UTC)).total_seconds() / 60)
        if 0 <= back < MINUTES:
            slots[MINUTES - 1 - back] = (row.completed, row.failed)
    top = _nice_ceiling(max((c + f for c, f in slots), default=0))
    height = PLOT_BOTTOM - PLOT_TOP
    step = (PLOT_RIGHT - PLOT_LEFT) / MINUTES
    width = max(1.0, step * 0.75)
    bars, ticks = [], []
    for index, (done, bad) in enumerate(slots):
        x = PLOT_LEFT + index * step + (step - width) / 2
        minute = (this_minute - timedelta(minutes=MINUTES - 1 - index)).astimezone(zone)
        label = f"{minute:%H:%M}: {done} completed, {bad} failed"
        y = float(PLOT_BOTTOM)
        for kind, value in (("completed", done), ("failed", bad)):
            if value:
                h = height * value / top
                y -= h
                bars.append(Bar(x, y, width, h, kind, label))
        if index % 10 == 0 or index == MINUTES - 1:
            ticks.append(("now" if index == MINUTES - 1 else f"{minute:%H:%M}", x + width / 2))
    return Chart(
        completed=sum(c for c, _ in slots),
        failed=sum(f for _, f in slots),
        bars=bars,
        grid=[(value, PLOT_BOTTOM - height * value / top) for value in (0, top // 2, top)],
        ticks=ticks,
    )


def _nice_ceiling(value: int) -> int:
    """The smallest of 2, 4, 10, 20, 40, 100, ... at least `value` (even, so halves are whole)."""
    scale = 1
    while True:
        for step in (2, 4, 10):
            if step * scale >= value:
                return step * scale
        scale *= 10


# --- formatting -----------------------------------------------------------------------------------


def _tool_capped(tool: task_pb2.ToolStatus) -> bool:
    return tool.spent_today_nanos + tool.reserved_nanos >= tool.daily_cap_nanos


def _status_name(status: task_pb2.TaskStatus.ValueType) -> str:
    return task_pb2.TaskStatus.Name(status).removeprefix("TASK_STATUS_").lower()


def _duration(span: timedelta) -> str:
    seconds = max(0, int(span.total_seconds()))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s" if minutes < 10 and seconds else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def _zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name or "UTC")
    except (ZoneInfoNotFoundError, ValueError):
        return ZoneInfo("UTC")
