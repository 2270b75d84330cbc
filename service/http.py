"""The operators' read-only HTTP surface, served beside gRPC in the same process.

    GET /              the status page: what runs, what does not and why, the last hour's chart
    GET /status.json   the GetStatus answer as JSON (proto field names, as grpcurl prints it)
    GET /metrics       Prometheus text format (service/metrics.py)
    GET /healthz       200 while Postgres answers, 503 when it does not

HEAD works wherever GET does; any other method is 405 (changes go through gRPC and the CLI), any
other path 404. A tiny HTTP/1.1 server on asyncio: one request per connection, no framework.

Guarded like the gRPC port (service/auth.py): with GENQ_TLS_CERT_FILE it speaks TLS only (and
asks for a client certificate under GENQ_TLS_CLIENT_CA_FILE). Under GENQ_AUTH=required every
path but /healthz needs a token of a role that may call GetStatus: `Authorization: Bearer` for
scrapers; a person gets a login form instead, whose POST /login sets the token as an HttpOnly,
SameSite=Strict cookie (Secure under TLS), so it never appears in a URL, a history or a log;
POST /logout clears it. The Host header must be one of the names the port answers as
(GENQ_HTTP_HOSTS): a page on another site cannot read this one through a rebound DNS name.

The page and the JSON run the GetStatus statement through its binding, exactly as the RPC does,
so there is one copy of that SQL. The page is drawn on the server (the chart is inline SVG), has
no script and loads nothing else; it reloads itself every REFRESH_SECONDS.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import html
import json
import logging
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from google.protobuf import json_format
from prometheus_client import CONTENT_TYPE_LATEST

from generation.task.v1 import task_pb2
from service.auth import RULES, Caller, Guard, bearer
from service.database import Database
from service.errors import ServiceError, Unauthenticated
from service.metrics import Metrics
from service.rpcs import BINDINGS, STATEMENTS
from service.settings import Settings

log = logging.getLogger(__name__)

REFRESH_SECONDS = 10
READ_TIMEOUT_SECONDS = 10.0
MAX_HEAD_BYTES = 16 * 1024
MAX_DISCARDED_BODY_BYTES = 1 << 20
NANOS_PER_UNIT = Decimal(10**9)
READ_METHODS = ("GET", "HEAD")

TEXT = "text/plain; charset=utf-8"
HTML = "text/html; charset=utf-8"
JSON = "application/json"
# The page needs nothing but its own inline style and inline SVG.
PAGE_POLICY = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
LOGIN_POLICY = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; form-action 'self'"
COOKIE = "genq_token"
MAX_LOGIN_BYTES = 4096
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
AUDIT_SHOWN = 10
AUDIT_SQL = STATEMENTS["ListAuditEntries"]


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
    rows = await database.fetch(AUDIT_SQL, binding.bind(request, settings))
    response = binding.respond(rows)
    assert isinstance(response, task_pb2.ListAuditEntriesResponse)
    return list(response.entries)


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


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    headers: dict[str, str]
    """Lower-case names."""
    body: bytes = b""


@dataclass(frozen=True)
class Response:
    status: HTTPStatus
    body: bytes
    content_type: str = TEXT
    headers: tuple[tuple[str, str], ...] = ()


def _text(status: HTTPStatus, message: str, *headers: tuple[str, str]) -> Response:
    return Response(status, f"{message}\n".encode(), TEXT, headers)


class StatusServer:
    """The HTTP listener; `start` binds GENQ_HOST:GENQ_HTTP_PORT and returns the port."""

    def __init__(self, database: Database, settings: Settings, metrics: Metrics) -> None:
        self.database = database
        self.settings = settings
        self.metrics = metrics
        self.guard = Guard(database, settings)
        self.hosts = allowed_hosts(settings)
        self._server: asyncio.Server | None = None
        self._routes = {
            "/": self._page,
            "/status.json": self._status_json,
            "/metrics": self._metrics,
            "/healthz": self._healthz,
        }

    async def start(self) -> int:
        host, port = self.settings.host, self.settings.http_port
        context = tls_context(self.settings)
        try:
            self._server = await asyncio.start_server(
                self._connection,
                host,
                port,
                limit=MAX_HEAD_BYTES,
                ssl=context,
                ssl_handshake_timeout=READ_TIMEOUT_SECONDS if context else None,
            )
        except OSError as error:
            raise OSError(
                error.errno,
                f"GENQ_HTTP_PORT: cannot listen on {host}:{port} ({error.strerror}); "
                "choose another port, or 0 for a free one",
            ) from error
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def respond(self, request: Request) -> Response:
        path = urlsplit(request.target).path
        if path != "/healthz" and host_name(request.headers.get("host", "")) not in self.hosts:
            return _text(
                HTTPStatus.MISDIRECTED_REQUEST,
                "this port does not answer as that host name (GENQ_HTTP_HOSTS lists the names)",
            )
        try:
            if request.method == "POST" and path in ("/login", "/logout"):
                return await self._log_in(request) if path == "/login" else self._log_out()
            if request.method not in READ_METHODS:
                return _text(
                    HTTPStatus.METHOD_NOT_ALLOWED,
                    "read-only: change settings through gRPC or the genq CLI",
                    ("Allow", ", ".join(READ_METHODS)),
                )
            route = self._routes.get(path)
            if route is None:
                return _text(
                    HTTPStatus.NOT_FOUND, "not found: try / /status.json /metrics /healthz"
                )
            if route != self._healthz and self.settings.auth_required:
                refusal = await self._refusal(request, page=path == "/")
                if refusal is not None:
                    return refusal
            return await route()
        except ServiceError as error:
            return _text(HTTPStatus.SERVICE_UNAVAILABLE, str(error))
        except Exception:
            log.exception("%s %s failed", request.method, path)
            return _text(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error; see the service log")

    async def _caller(self, request: Request) -> Caller:
        """The caller behind an Authorization header, else behind the login cookie."""
        if "authorization" in request.headers:
            return await self.guard.identify(bearer(request.headers["authorization"]))
        token = _cookies(request.headers.get("cookie", "")).get(COOKIE)
        if token is None:
            raise Unauthenticated("a token is required: send `Authorization: Bearer <token>`")
        return await self.guard.identify(token)

    async def _refusal(self, request: Request, *, page: bool) -> Response | None:
        """None when the caller may read the page (as GetStatus), else the refusal: the login
        form for the page, a 401 or 403 for the JSON and the metrics."""
        try:
            caller = await self._caller(request)
        except Unauthenticated as error:
            if page:
                return _login_form(HTTPStatus.UNAUTHORIZED, "")
            return _text(
                HTTPStatus.UNAUTHORIZED, str(error), ("WWW-Authenticate", 'Bearer realm="genq"')
            )
        if not caller.roles & RULES["GetStatus"].roles:
            message = "this token's roles may not read the status (viewer or operator may)"
            if page:
                return _login_form(HTTPStatus.FORBIDDEN, message)
            return _text(HTTPStatus.FORBIDDEN, message)
        return None

    async def _log_in(self, request: Request) -> Response:
        origin = request.headers.get("origin")
        if origin and host_name(urlsplit(origin).netloc) not in self.hosts:
            return _text(HTTPStatus.FORBIDDEN, "a login must come from this page's own form")
        token = parse_qs(request.body.decode("latin-1")).get("token", [""])[0].strip()
        try:
            caller = await self.guard.identify(token)
        except Unauthenticated:
            return _login_form(HTTPStatus.UNAUTHORIZED, "That token is not valid.")
        if not caller.roles & RULES["GetStatus"].roles:
            return _login_form(HTTPStatus.FORBIDDEN, "That token may not read the status.")
        secure = "; Secure" if self.settings.tls else ""
        cookie = f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict{secure}"
        return Response(
            HTTPStatus.SEE_OTHER, b"", TEXT, (("Location", "/"), ("Set-Cookie", cookie))
        )

    def _log_out(self) -> Response:
        secure = "; Secure" if self.settings.tls else ""
        cookie = f"{COOKIE}=; Path=/; Max-Age=0; HttpOnly; SameSite=Strict{secure}"
        return Response(
            HTTPStatus.SEE_OTHER, b"", TEXT, (("Location", "/"), ("Set-Cookie", cookie))
        )

    async def _page(self) -> Response:
        response = await read_status(self.database, self.settings)
        audit = await read_audit(self.database, self.settings, AUDIT_SHOWN)
        page = render_page(response.status, datetime.now(UTC), audit)
        return Response(
            HTTPStatus.OK, page.encode(), HTML, (("Content-Security-Policy", PAGE_POLICY),)
        )

    async def _status_json(self) -> Response:
        response = await read_status(self.database, self.settings)
        document = json_format.MessageToDict(response, preserving_proto_field_name=True)
        return Response(HTTPStatus.OK, json.dumps(document, indent=2).encode(), JSON)

    async def _metrics(self) -> Response:
        async def status() -> task_pb2.Status:
            return (await read_status(self.database, self.settings)).status

        body = await self.metrics.scrape(self.database, status)
        return Response(HTTPStatus.OK, body, CONTENT_TYPE_LATEST)

    async def _healthz(self) -> Response:
        if await self.database.ping():
            return _text(HTTPStatus.OK, "SERVING")
        return _text(HTTPStatus.SERVICE_UNAVAILABLE, "NOT_SERVING: the database does not answer")

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(_read_request(reader), READ_TIMEOUT_SECONDS)
            if request is None:
                return
            if isinstance(request, Response):
                method, response = "GET", request
            else:
                method, response = request.method, await self.respond(request)
            writer.write(_serialize(response, with_body=method != "HEAD"))
            await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # the client went away, never finished its request, or spoke no TLS
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> Request | Response | None:
    """The request; a Response when it is malformed; None when no request came."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        return _text(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head too large")
    except asyncio.IncompleteReadError as error:
        if not error.partial:
            return None
        raise
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return _text(HTTPStatus.BAD_REQUEST, "bad request line")
    method, target, _ = parts
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    # A refused POST may carry a body: read it, so that closing does not reset the connection
    # before the client has read the 405. A login's body is the form.
    length = headers.get("content-length", "0")
    body = b""
    if length.isdigit() and 0 < int(length) <= MAX_DISCARDED_BODY_BYTES:
        body = await reader.readexactly(int(length))
    return Request(method, target, headers, body[:MAX_LOGIN_BYTES])


def _cookies(header: str) -> dict[str, str]:
    pairs = (part.strip().partition("=") for part in header.split(";"))
    return {name: value for name, _, value in pairs if name}


def _login_form(status: HTTPStatus, message: str) -> Response:
    """The page a browser gets without a token: the token goes in a POST body, never a URL."""
    notice = f'<p class="bad">{esc(message)}</p>' if message else ""
    page = f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>genq status: log in</title><style>{STYLE}</style></head>
<body>
<header id="header"><h1>genq status</h1></header>
<section class="panel" id="login">
  <h2>A token is needed</h2>
  {notice}
  <form method="post" action="/login">
    <label>Token (genq token create --role viewer)
      <input type="password" name="token" autocomplete="current-password" required></label>
    <button type="submit">Log in</button>
  </form>
</section>
</body>
</html>
"""
    return Response(status, page.encode(), HTML, (("Content-Security-Policy", LOGIN_POLICY),))


def _serialize(response: Response, with_body: bool) -> bytes:
    status = response.status
    headers = [
        ("Date", email.utils.formatdate(usegmt=True)),
        ("Server", "genq"),
        ("Content-Type", response.content_type),
        ("Content-Length", str(len(response.body))),
        ("Cache-Control", "no-store"),
        ("X-Content-Type-Options", "nosniff"),
        ("Referrer-Policy", "no-referrer"),
        ("Connection", "close"),
        *response.headers,
    ]
    head = f"HTTP/1.1 {status.value} {status.phrase}\r\n" + "".join(
        f"{name}: {value}\r\n" for name, value in headers
    )
    return (head + "\r\n").encode("latin-1") + (response.body if with_body else b"")


# --- the page -------------------------------------------------------------------------------------
#
# A few functions, each returning one piece of HTML. Every value from the database goes through
# `esc` (html.escape); numbers and fixed words are written as they are.

esc = html.escape

STYLE = """
:root { --red: #b3261e; --red-bg: #fdecea; --amber: #8a5a00; --amber-bg: #fff4d6;
        --green: #1b7f3b; --green-bg: #e6f4ea; --ink: #1f2328; --muted: #5f6670;
        --line: #d8dde3; --panel: #ffffff; --page: #f4f6f8; }
* { box-sizing: border-box; }
body { margin: 0; padding: 24px 32px; background: var(--page); color: var(--ink);
       font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
header { display: flex; align-items: baseline; gap: 16px; flex-wrap: wrap; margin-bottom: 16px; }
h1 { font-size: 24px; margin: 0; }
h2 { font-size: 13px; text-transform: uppercase; letter-spacing: .06em; color: var(--muted);
     margin: 0 0 10px; }
header .meta { color: var(--muted); }
header nav { margin-left: auto; }
a { color: #0b5cad; }
.warnings { list-style: none; margin: 0 0 16px; padding: 0; }
.warnings li { background: var(--red-bg); color: var(--red); border: 1px solid #f3b8b3;
               border-left: 6px solid var(--red); border-radius: 6px; padding: 10px 14px;
               margin-bottom: 8px; font-weight: 600; }
.cards { display: grid; grid-template-columns: repeat(5, 1fr); gap: 12px; margin-bottom: 16px; }
.card, .panel { background: var(--panel); border: 1px solid var(--line); border-radius: 8px;
                padding: 14px 16px; }
.card .value { font-size: 22px; font-weight: 700; }
.card .note { color: var(--muted); font-size: 13px; }
.on { color: var(--green); } .off, .bad { color: var(--red); } .warn { color: var(--amber); }
.meter { height: 8px; background: #e9edf1; border-radius: 4px; overflow: hidden; margin-top: 8px;
         display: flex; }
.meter span { display: block; height: 100%; }
.meter .spent { background: #0b5cad; } .meter .reserved { background: #8fb8e6; }
.grid { display: grid; grid-template-columns: 3fr 2fr; gap: 12px; margin-bottom: 12px; }
.trio { display: grid; grid-template-columns: repeat(3, 1fr); gap: 12px; margin-bottom: 12px; }
.panel { margin-bottom: 12px; }
.grid .panel, .trio .panel { margin-bottom: 0; }
table { width: 100%; border-collapse: collapse; font-size: 14px; }
th, td { text-align: left; padding: 6px 8px; border-bottom: 1px solid var(--line); }
th { color: var(--muted); font-weight: 600; font-size: 12px; text-transform: uppercase; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr:last-child td { border-bottom: none; }
.badge { display: inline-block; border-radius: 10px; padding: 1px 8px; font-size: 12px;
         font-weight: 600; margin-right: 4px; }
.badge.bad { background: var(--red-bg); } .badge.warn { background: var(--amber-bg); }
.badge.ok { background: var(--green-bg); color: var(--green); }
.empty { color: var(--muted); }
ul.plain { list-style: none; margin: 0; padding: 0; }
ul.plain li { padding: 4px 0; border-bottom: 1px solid var(--line); }
ul.plain li:last-child { border-bottom: none; }
.key { font-weight: 600; }
.legend { display: flex; gap: 16px; color: var(--muted); font-size: 13px; margin-bottom: 6px; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px;
          margin-right: 6px; vertical-align: baseline; }
svg text { font: 11px system-ui, sans-serif; fill: var(--muted); }
svg rect.completed { fill: #2e8b57; } svg rect.failed { fill: #d0453a; }
svg line.grid { stroke: #e3e7eb; } svg line.axis { stroke: #9aa3ad; }
@media (max-width: 900px) {
  .cards { grid-template-columns: repeat(2, 1fr); }
  .grid, .trio { grid-template-columns: 1fr; }
}
"""


def render_page(
    status: task_pb2.Status, now: datetime, audit: Sequence[task_pb2.AuditEntry] = ()
) -> str:
    zone = _zone(status.settings.timezone)
    warnings = _warnings(status)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="refresh" content="{REFRESH_SECONDS}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{"⚠ " if warnings else ""}genq status</title>
<style>{STYLE}</style>
</head>
<body>
<header id="header">
  <h1>genq status</h1>
  <span class="meta">local day {esc(status.settings.local_day)} ({esc(zone.key)}) ·
    as of {now.astimezone(zone):%H:%M:%S} · refreshes every {REFRESH_SECONDS} s</span>
  <nav><a href="/status.json">status.json</a> · <a href="/metrics">metrics</a></nav>
</header>
{_warning_list(warnings)}
{_cards(status)}
{_chart(status.last_hour, now, zone)}
<div class="grid">
{_tools_table(status, now)}
{_depth_table(status.depths)}
</div>
<div class="trio">
{_paused(status.tools)}
{_cooling(status.cooling, now)}
{_holds(status.holds, now)}
</div>
{_audit(audit, zone)}
</body>
</html>
"""


def _warnings(status: task_pb2.Status) -> list[str]:
    settings = status.settings
    found = []
    if settings.disabled_by_environment:
        found.append("Disabled: GENQ_DISABLED is set in the service's environment; nothing runs.")
    elif not settings.enabled:
        found.append("Disabled: the kill switch is off; nothing runs.")
    cap = _cap(settings)
    if not cap:
        found.append("No daily cap: with no cap (or a cap of 0) nothing runs.")
    elif settings.spent_today_nanos + settings.reserved_nanos >= cap:
        found.append("Capped: today's spend and reservations have reached the daily cap.")
    for tool in status.tools:
        if tool.HasField("daily_cap_nanos") and _tool_capped(tool):
            found.append(f"Capped: tool {esc(tool.name)} has reached its own daily cap.")
        if tool.no_worker_seen:
            found.append(
                f"No worker: tool {esc(tool.name)} has {tool.queued} queued and no claim "
                "for 10 minutes or more."
            )
    if status.stale_tasks:
        found.append(
            f"Stale: {status.stale_tasks} live task(s) can never finish on their own "
            "(ListStaleTasks; genq reconcile fails them)."
        )
    return found


def _warning_list(warnings: list[str]) -> str:
    if not warnings:
        return ""
    items = "".join(f"<li>{text}</li>" for text in warnings)  # each already escaped
    return f'<ul class="warnings" id="warnings">{items}</ul>'


def _cards(status: task_pb2.Status) -> str:
    settings = status.settings
    currency = settings.currency
    if settings.disabled_by_environment:
        switch = '<div class="value off">disabled</div><div class="note">by GENQ_DISABLED</div>'
    elif not settings.enabled:
        switch = '<div class="value off">disabled</div><div class="note">switched off</div>'
    else:
        switch = '<div class="value on">enabled</div><div class="note">claims may run</div>'
    cap = _cap(settings)
    source = "GENQ_DAILY_CAP_NANOS" if settings.HasField("cap_override_nanos") else "stored"
    cap_text = (
        f'<div class="value">{esc(money(cap, currency))}</div><div class="note">{source}</div>'
        if cap
        else '<div class="value off">not set</div><div class="note">nothing runs</div>'
    )
    stale_class = "bad" if status.stale_tasks else "on"
    return f"""<div class="cards">
  <div class="card" id="switch"><h2>Kill switch</h2>{switch}</div>
  <div class="card" id="cap"><h2>Daily cap</h2>{cap_text}</div>
  <div class="card" id="spend"><h2>Spent today</h2>
    <div class="value">{esc(money(settings.spent_today_nanos, currency))}</div>
    {_spend_bar(settings.spent_today_nanos, settings.reserved_nanos, cap)}</div>
  <div class="card" id="reserved"><h2>Reserved</h2>
    <div class="value">{esc(money(settings.reserved_nanos, currency))}</div>
    <div class="note">held by running tasks</div></div>
  <div class="card" id="stale"><h2>Stale tasks</h2>
    <div class="value {stale_class}">{status.stale_tasks}</div>
    <div class="note">cannot finish on their own</div></div>
</div>"""


def _spend_bar(spent: int, reserved: int, cap: int) -> str:
    if not cap:
        return '<div class="note">no cap</div>'
    used = min(100.0, 100 * spent / cap)
    held = min(100.0 - used, 100 * reserved / cap)
    return (
        f'<div class="meter" title="spent and reserved of the cap">'
        f'<span class="spent" style="width:{used:.1f}%"></span>'
        f'<span class="reserved" style="width:{held:.1f}%"></span></div>'
        f'<div class="note">{100 * (spent + reserved) / cap:.1f}% of the cap, reservations '
        "included</div>"
    )


def _tools_table(status: task_pb2.Status, now: datetime) -> str:
    currency = status.settings.currency
    rows = []
    for tool in status.tools:
        badges = []
        if tool.paused:
            badges.append('<span class="badge warn">paused</span>')
        if tool.HasField("daily_cap_nanos") and _tool_capped(tool):
            badges.append('<span class="badge bad">capped</span>')
        if tool.no_worker_seen:
            badges.append('<span class="badge bad">no worker seen</span>')
        if not badges:
            badges.append('<span class="badge ok">ok</span>')
        last = (
            f"{_duration(now - tool.last_claim_at.ToDatetime(tzinfo=UTC))} ago"
            if tool.HasField("last_claim_at")
            else "never"
        )
        cap = money(tool.daily_cap_nanos, currency) if tool.HasField("daily_cap_nanos") else "—"
        rows.append(
            f"<tr><td class='key'>{esc(tool.name)}</td><td>{''.join(badges)}</td>"
            f"<td class='num'>{tool.queued}</td><td>{esc(last)}</td>"
            f"<td class='num'>{esc(money(tool.spent_today_nanos, currency))}</td>"
            f"<td class='num'>{esc(money(tool.reserved_nanos, currency))}</td>"
            f"<td class='num'>{esc(cap)}</td></tr>"
        )
    body = "".join(rows) or '<tr><td colspan="7" class="empty">no tools yet</td></tr>'
    return f"""<section class="panel" id="tools"><h2>Tools</h2>
<table><thead><tr><th>tool</th><th>state</th><th class="num">queued</th><th>last claim</th>
<th class="num">spent today</th><th class="num">reserved</th><th class="num">cap</th></tr></thead>
<tbody>{body}</tbody></table></section>"""


def _depth_table(depths: Sequence[task_pb2.QueueDepth]) -> str:
    rows = "".join(
        f"<tr><td class='key'>{esc(d.tool_name)}</td>"
        f"<td>{esc(task_pb2.TaskStatus.Name(d.status).removeprefix('TASK_STATUS_').lower())}</td>"
        f"<td class='num'>{d.count}</td>"
        f"<td class='num'>{esc(_duration(d.oldest_age.ToTimedelta()))}</td></tr>"
        for d in depths
    )
    body = rows or '<tr><td colspan="4" class="empty">nothing queued or running</td></tr>'
    return f"""<section class="panel" id="depths"><h2>Queue depth</h2>
<table><thead><tr><th>tool</th><th>status</th><th class="num">tasks</th>
<th class="num">oldest</th></tr></thead><tbody>{body}</tbody></table></section>"""


def _paused(tools: Sequence[task_pb2.ToolStatus]) -> str:
    items = [
        f"<li><span class='key'>{esc(t.name)}</span> · {t.queued} queued</li>"
        for t in tools
        if t.paused
    ]
    return _list_panel("paused", "Paused tools", items, "no tool is paused")


def _cooling(cooling: Sequence[task_pb2.Cooldown], now: datetime) -> str:
    items = [
        f"<li><span class='key'>{esc(c.resource_key)}</span> · "
        f"{esc(_duration(c.cooling_until.ToDatetime(tzinfo=UTC) - now))} left · "
        f"{c.consecutive_failures} failures in a row</li>"
        for c in cooling
    ]
    return _list_panel("cooling", "Cooling keys", items, "no resource key is cooling")


def _holds(holds: Sequence[task_pb2.Hold], now: datetime) -> str:
    items = [
        f"<li><span class='key'>{esc(h.account_group)}</span> · "
        f"{esc(_duration(h.held_until.ToDatetime(tzinfo=UTC) - now))} left"
        + (f" · {esc(h.reason)}" if h.reason else "")
        + "</li>"
        for h in holds
    ]
    return _list_panel("holds", "Held groups", items, "no account group is held")


def _audit(entries: Sequence[task_pb2.AuditEntry], zone: ZoneInfo) -> str:
    """The newest changes: who, when, what (`genq audit` lists them all)."""
    items = [
        f"<li><b>{esc(entry.action)}</b> by {esc(entry.actor)} at "
        f"{entry.at.ToDatetime(UTC).astimezone(zone):%Y-%m-%d %H:%M:%S} "
        f"<code>{esc(json.dumps(json_format.MessageToDict(entry.detail), sort_keys=True))}</code>"
        "</li>"
        for entry in entries
    ]
    return _list_panel("audit", "Recent changes", items, "no change recorded yet")


def _list_panel(section: str, title: str, items: list[str], empty: str) -> str:
    body = f"<ul class='plain'>{''.join(items)}</ul>" if items else f"<p class='empty'>{empty}</p>"
    return f'<section class="panel" id="{section}"><h2>{title}</h2>{body}</section>'


# The chart: one slot per minute of the last hour, completed (green) under failed (red).
CHART_WIDTH, CHART_HEIGHT = 1200, 200
PLOT_LEFT, PLOT_RIGHT, PLOT_TOP, PLOT_BOTTOM = 44, 1190, 12, 176
MINUTES = 61  # the current minute and the 60 before it (the oldest one partly)


def _chart(last_hour: Sequence[task_pb2.ThroughputMinute], now: datetime, zone: ZoneInfo) -> str:
    this_minute = now.replace(second=0, microsecond=0)
    slots = [(0, 0)] * MINUTES
    for row in last_hour:
        back = round((this_minute - row.minute.ToDatetime(tzinfo=UTC)).total_seconds() / 60)
        if 0 <= back < MINUTES:
            slots[MINUTES - 1 - back] = (row.completed, row.failed)
    completed = sum(c for c, _ in slots)
    failed = sum(f for _, f in slots)
    top = _nice_ceiling(max((c + f for c, f in slots), default=0))
    height = PLOT_BOTTOM - PLOT_TOP
    step = (PLOT_RIGHT - PLOT_LEFT) / MINUTES
    width = max(1.0, step * 0.75)
    parts = []
    for value in (0, top // 2, top):  # gridlines and their labels
        y = PLOT_BOTTOM - height * value / top
        parts.append(
            f'<line class="grid" x1="{PLOT_LEFT}" x2="{PLOT_RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text x="{PLOT_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{value}</text>'
        )
    for index, (done, bad) in enumerate(slots):
        x = PLOT_LEFT + index * step + (step - width) / 2
        minute = this_minute - timedelta(minutes=MINUTES - 1 - index)
        label = f"{minute.astimezone(zone):%H:%M}: {done} completed, {bad} failed"
        y = float(PLOT_BOTTOM)
        for kind, value in (("completed", done), ("failed", bad)):
            if value:
                h = height * value / top
                y -= h
                parts.append(
                    f'<rect class="bar {kind}" x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" '
                    f'height="{h:.1f}"><title>{esc(label)}</title></rect>'
                )
        if index % 10 == 0 or index == MINUTES - 1:
            text = "now" if index == MINUTES - 1 else f"{minute.astimezone(zone):%H:%M}"
            parts.append(
                f'<text x="{x + width / 2:.1f}" y="{PLOT_BOTTOM + 16}" '
                f'text-anchor="middle">{text}</text>'
            )
    parts.append(
        f'<line class="axis" x1="{PLOT_LEFT}" x2="{PLOT_RIGHT}" '
        f'y1="{PLOT_BOTTOM}" y2="{PLOT_BOTTOM}"/>'
    )
    return f"""<section class="panel" id="chart"><h2>Last hour, per minute</h2>
<div class="legend"><span><span class="swatch" style="background:#2e8b57"></span>completed
 ({completed})</span><span><span class="swatch" style="background:#d0453a"></span>failed, retried
 or lost ({failed})</span></div>
<svg viewBox="0 0 {CHART_WIDTH} {CHART_HEIGHT}" width="100%" role="img"
 aria-label="attempts per minute over the last hour: {completed} completed, {failed} failed">
{"".join(parts)}
</svg></section>"""


def _nice_ceiling(value: int) -> int:
    """The smallest of 2, 4, 10, 20, 40, 100, ... at least `value` (even, so halves are whole)."""
    scale = 1
    while True:
        for step in (2, 4, 10):
            if step * scale >= value:
                return step * scale
        scale *= 10


# --- formatting -----------------------------------------------------------------------------------


def money(nanos: int, currency: str) -> str:
    """Integer nanos as decimal units with the currency label: 2500000000 -> '2.50 EUR'.

    At least two decimals, more when the amount has them (0.000001234), never rounded."""
    units = (Decimal(nanos) / NANOS_PER_UNIT).normalize()
    exponent = units.as_tuple().exponent
    if isinstance(exponent, int) and exponent > -2:
        units = units.quantize(Decimal("0.01"))
    text = f"{units:,f}"
    return f"{text} {currency}" if currency else text


def _cap(settings: task_pb2.Settings) -> int:
    """The global cap in force (the environment's, else the stored one); 0 when none."""
    if settings.HasField("cap_override_nanos"):
        return settings.cap_override_nanos
    return settings.daily_cap_nanos if settings.HasField("daily_cap_nanos") else 0


def _tool_capped(tool: task_pb2.ToolStatus) -> bool:
    return tool.spent_today_nanos + tool.reserved_nanos >= tool.daily_cap_nanos


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
