"""The gRPC server: GenerationDataService bound to its SQL, health, reflection, graceful stop;
and, with GENQ_PROCESSES above 1, the parent that runs that many of them on one port.

Several processes (`serve_processes`): the parent binds nothing but the HTTP status port and a
reservation of the gRPC port (the free one GENQ_PORT=0 picks is chosen here, so every child gets
the same), then starts the children with the spawn start method. Each child is a whole service
(its own pool, health, wake listener, leader loop) bound to the port with SO_REUSEPORT, so the
kernel spreads new connections over them. The parent serves the status page and /metrics for
the host (the RPC metrics summed over the children's multiprocess files, service/api/metrics.py),
forwards SIGTERM and SIGINT to every child and waits for their graceful stop, and when a child
exits on its own it stops the others and exits 1. A child whose parent is gone stops itself.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service import logs, tracing
from service.api.auth import ReflectionGuard
from service.api.handlers import Handlers
from service.api.metrics import Metrics
from service.api.rpcs import SERVICE
from service.api.signals import Signals
from service.database import STOP_STATEMENT_SECONDS, Database
from service.leader.lease import Leadership
from service.leader.overrides import overrides, show_overrides, withdraw_overrides
from service.leader.run import run
from service.leader.waits import warn_at_start
from service.page.app import StatusServer, page_url
from service.settings import Settings

log = logging.getLogger(logs.SERVER_LOGGER)

# A ping every second, each bounded by GENQ_PING_TIMEOUT_SECONDS (1.5): health turns NOT_SERVING
# at most interval + ping timeout (2.5 s) after Postgres stops answering, idle or busy.
HEALTH_CHECK_INTERVAL_SECONDS = 1.0

# Beyond the grace the children give calls in flight, the time they get to exit before SIGKILL.
STOP_MARGIN_SECONDS = 10.0
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@dataclass(frozen=True)
class Role:
    """What one service process does besides answering gRPC."""

    process: int = 1
    """Its number among the host's processes, 1 to GENQ_PROCESSES (a metrics label)."""
    reuse_port: bool = False
    """SO_REUSEPORT on the gRPC port: several processes share it."""
    status_page: bool = True
    """Serves GENQ_HTTP_PORT (with several processes the parent does)."""
    purge_at_start: bool = True
    """Purges once at start (the host's first process), leader or not."""


def is_loopback(host: str) -> bool:
    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def authenticates(settings: Settings) -> bool:
    """Callers must prove who they are: a token on every RPC, or a client certificate."""
    return settings.auth_required or bool(settings.tls_client_ca_file)


def check(settings: Settings) -> None:
    """`genq serve`'s first step, before any slow work (the embedded Postgres, the migration):
    sets the logs up (GENQ_LOG_LEVEL, GENQ_LOG_FORMAT), then refuses settings it cannot run
    with and a port something already listens on, each in one line that names the setting."""
    validate(settings)
    logs.configure(settings)
    for name, port in (("GENQ_PORT", settings.port), ("GENQ_HTTP_PORT", settings.http_port)):
        if trouble := port_in_use(settings.host, port):
            raise SystemExit(
                f"{name}: cannot listen on {settings.host}:{port} ({trouble}); stop what "
                f"listens there, or set {name} to a free port (0 picks one)"
            )


def validate(settings: Settings) -> None:
    """Refuses settings `serve` cannot run with."""
    if trouble := logs.problem(settings):
        raise SystemExit(trouble)
    if settings.auth not in ("optional", "required"):
        raise SystemExit(f"GENQ_AUTH={settings.auth!r}: must be optional or required")
    if bool(settings.tls_cert_file) != bool(settings.tls_key_file):
        raise SystemExit("GENQ_TLS_CERT_FILE and GENQ_TLS_KEY_FILE go together")
    if settings.tls_client_ca_file and not settings.tls:
        raise SystemExit("GENQ_TLS_CLIENT_CA_FILE (mutual TLS) needs GENQ_TLS_CERT_FILE")
    if not (is_loopback(settings.host) or authenticates(settings) or settings.allow_insecure):
        raise SystemExit(
            f"GENQ_HOST={settings.host} is reachable from other hosts, and no caller has to "
            "authenticate: set GENQ_AUTH=required (tokens: genq token create) or "
            "GENQ_TLS_CLIENT_CA_FILE, or GENQ_ALLOW_INSECURE=true to let anyone who reaches "
            "the port do anything"
        )
    if settings.port and settings.port == settings.http_port:
        raise SystemExit(f"GENQ_PORT and GENQ_HTTP_PORT are both {settings.port}")
    if settings.processes < 1:
        raise SystemExit(f"GENQ_PROCESSES={settings.processes}: must be at least 1")
    if settings.leader_renew_seconds <= 0:
        raise SystemExit("GENQ_LEADER_RENEW_SECONDS must be above 0")
    if settings.leader_ttl_seconds <= settings.leader_renew_seconds:
        raise SystemExit("GENQ_LEADER_TTL_SECONDS must be above GENQ_LEADER_RENEW_SECONDS")
    if settings.min_lease_seconds < 1:
        raise SystemExit("GENQ_MIN_LEASE_SECONDS must be at least 1")
    if settings.token_cache_seconds < 0:
        raise SystemExit("GENQ_TOKEN_CACHE_SECONDS must not be negative")


def announce(settings: Settings) -> None:
    """Says at start how the ports are guarded, loudly when they are not."""
    if not is_loopback(settings.host) and not authenticates(settings):
        log.warning(
            "INSECURE: listening on %s without auth (GENQ_ALLOW_INSECURE=true): anyone who "
            "reaches the ports can change settings, read and cancel every task",
            settings.host,
        )
    elif not authenticates(settings):
        log.info(
            "no auth configured (GENQ_AUTH=required, GENQ_TLS_CLIENT_CA_FILE): listening on "
            "loopback (%s) only",
            settings.host,
        )
    log.info(
        "TLS %s; client certificates %s; tokens %s; reflection %s",
        "on" if settings.tls else "off (plaintext)",
        "required" if settings.tls_client_ca_file else "not asked for",
        "required" if settings.auth_required else "optional (no token: every role)",
        "on" if settings.reflection else "off",
    )


def server_credentials(settings: Settings) -> grpc.ServerCredentials:
    """TLS for the gRPC port; with a client CA, a client certificate signed by it is required."""
    client_ca = (
        Path(settings.tls_client_ca_file).read_bytes() if settings.tls_client_ca_file else None
    )
    return grpc.ssl_server_credentials(
        [
            (
                Path(str(settings.tls_key_file)).read_bytes(),
                Path(str(settings.tls_cert_file)).read_bytes(),
            )
        ],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


async def watch_health(database: Database, health_servicer: health.aio.HealthServicer) -> None:
    """NOT_SERVING while Postgres does not answer, so load balancers and probes can tell.

    The ping goes through the pool, as every call does: a pool whose connections are wedged
    (backends stopped, a frozen server) or all held past the ping timeout is NOT_SERVING too.
    """
    serving = None
    while True:
        up = await database.ping()  # bounded: it never waits past the ping timeout
        if up != serving:
            state = (
                health_pb2.HealthCheckResponse.SERVING
                if up
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for name in ("", SERVICE.full_name):
                await health_servicer.set(name, state)
            if not up:
                log.warning("database DOWN")
            elif serving is not None:
                log.info("database up")
            serving = up
        await asyncio.sleep(HEALTH_CHECK_INTERVAL_SECONDS)


async def serve(
    settings: Settings,
    database_url: str,
    ready: Callable[[int], None] | None = None,
    stop: asyncio.Event | None = None,
    role: Role = Role(),
) -> None:
    """Serves until SIGTERM or SIGINT (or `stop` is set, when given), then stops taking calls
    and lets those in flight finish."""
    validate(settings)
    tracing.configure()  # OTEL_* -> a TracerProvider, once per service process
    database = Database(database_url, settings)
    await database.open()
    try:
        await _serve(database, database_url, settings, ready, stop, role)
    finally:
        # Also when the start fails (a port in use): an open pool would keep the process alive.
        await database.close()


async def _serve(
    database: Database,
    database_url: str,
    settings: Settings,
    ready: Callable[[int], None] | None,
    stop: asyncio.Event | None,
    role: Role,
) -> None:
    signals = Signals(settings, database_url)
    metrics = Metrics(process=role.process)
    handlers = Handlers(database, signals, settings, metrics)
    server = grpc.aio.server(
        interceptors=[ReflectionGuard(handlers.guard)],
        options=[
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.so_reuseport", 1 if role.reuse_port else 0),
        ],
    )
    server.add_generic_rpc_handlers([handlers.generic_handler()])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if settings.reflection:
        reflection.enable_server_reflection(
            [SERVICE.full_name, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
    replica = uuid.uuid4()  # this process: its overrides' row, its claim on the leader lease
    leadership = Leadership(database, settings, replica)
    if overrides(settings):
        # Shown before this replica serves, and refreshed by the leader loop while it runs.
        try:
            await show_overrides(database, settings, replica)
        except Exception as error:
            log.warning("could not show this replica's overrides yet: %s", error)
    # The status page and /metrics; a port in use fails the start, like the gRPC port.
    status_server = StatusServer(database, settings, metrics) if role.status_page else None
    http_port = await status_server.start() if status_server else None
    try:
        address = f"{settings.host}:{settings.port}"
        port = (
            server.add_secure_port(address, server_credentials(settings))
            if settings.tls
            else server.add_insecure_port(address)
        )
    except BaseException:
        if status_server:
            await status_server.close()
        raise
    await server.start()
    log.info("GenerationDataService listening on %s:%d", settings.host, port)
    if http_port is not None:
        announce(settings)  # once per host: by the process serving the page
        log.info("status page and /metrics on %s", page_url(settings, http_port))
        await warn_at_start(database, settings)
    if ready:
        ready(port)

    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    background = [
        asyncio.create_task(watch_health(database, health_servicer)),
        asyncio.create_task(
            run(
                database,
                signals,
                settings,
                replica,
                leadership,
                purge_at_start=role.purge_at_start,
            )
        ),
        asyncio.create_task(signals.listen()),
    ]
    await stop.wait()
    log.info("stopping: finishing calls in flight (up to %.0f s)", settings.shutdown_grace_seconds)
    await health_servicer.enter_graceful_shutdown()
    if status_server:
        await status_server.close()
    handlers.stop()
    await server.stop(settings.shutdown_grace_seconds)
    await handlers.hand_backs_done(STOP_STATEMENT_SECONDS)
    for job in background:
        job.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    await leadership.resign()  # after the sweeps stopped: the next leader never overlaps them
    await signals.close()
    if overrides(settings):
        try:
            await withdraw_overrides(database, replica)
        except Exception as error:  # it lapses in 30 s anyway
            log.warning("could not withdraw this replica's overrides: %s", error)
    log.info("stopped")


# -- several processes ---------------------------------------------------------------------------


def serve_processes(
    settings: Settings, database_url: str, ready: Callable[[int], None] | None = None
) -> int:
    """Runs GENQ_PROCESSES service processes on one port until SIGTERM or SIGINT; returns the
    exit status: 0 after a clean stop, 1 when a child exited on its own or did not stop cleanly.
    `ready` gets the port once every child serves."""
    validate(settings)
    return asyncio.run(_supervise(settings, database_url, ready))


class Child:
    """One service process and what the parent knows of it."""

    def __init__(self, process: BaseProcess, messages: Connection, number: int) -> None:
        self.process = process
        self.number = number
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[int] = loop.create_future()
        self.exited: asyncio.Future[int] = loop.create_future()
        self._messages = messages
        self._reaper: asyncio.Future[None] | None = None
        loop.add_reader(messages.fileno(), self._message)
        loop.add_reader(process.sentinel, self._ended)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def _message(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            port = self._messages.recv()
        except (EOFError, OSError):
            port = None
        loop.remove_reader(self._messages.fileno())
        self._messages.close()
        if port is not None and not self.ready.done():
            self.ready.set_result(int(port))

    def _ended(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        self._reaper = asyncio.ensure_future(self._reap())

    async def _reap(self) -> None:
        await asyncio.to_thread(self.process.join)  # the sentinel closes a moment before the reap
        if not self._messages.closed:
            self._message()  # a ready message sent just before exiting still counts
        code = self.process.exitcode
        self.exited.set_result(-1 if code is None else code)


async def _supervise(
    settings: Settings, database_url: str, ready: Callable[[int], None] | None
) -> int:
    loop = asyncio.get_running_loop()
    reservation = reserve_port(settings.host, settings.port)
    port = int(reservation.getsockname()[1])
    host_dir = Path(tempfile.mkdtemp(prefix="genq-metrics-"))
    # Read by prometheus_client when each child imports it: the children record there.
    os.environ[MULTIPROC_ENV] = str(host_dir)
    # The parent's pool serves only the status page, /metrics and /healthz.
    database = Database(database_url, replace(settings, pool_min_size=1, pool_max_size=2))
    await database.open()
    status_server = StatusServer(database, settings, Metrics(host_dir=host_dir))
    children: list[Child] = []
    stopped = False
    try:
        http_port = await status_server.start()
        announce(settings)
        log.info("status page and /metrics on %s", page_url(settings, http_port))
        await warn_at_start(database, settings)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        context = multiprocessing.get_context("spawn")
        child_settings = replace(settings, port=port)
        for number in range(1, settings.processes + 1):
            receive, send = context.Pipe(duplex=False)
            process = context.Process(
                target=_child_main,
                args=(child_settings, database_url, number, send),
                name=f"genq-{number}",
            )
            process.start()
            send.close()
            children.append(Child(process, receive, number))
        stopped = await _watch(children, stop, reservation, port, ready)
    finally:
        reservation.close()
        clean = await _stop_children(children, settings.shutdown_grace_seconds)
        await status_server.close()
        await database.close()
        os.environ.pop(MULTIPROC_ENV, None)
        shutil.rmtree(host_dir, ignore_errors=True)
    if stopped and clean:
        log.info("stopped")
        return 0
    return 1


async def _watch(
    children: list[Child],
    stop: asyncio.Event,
    reservation: socket.socket,
    port: int,
    ready: Callable[[int], None] | None,
) -> bool:
    """Waits for a stop (True) or a child's exit (False); calls `ready` once all serve."""
    stopping = asyncio.ensure_future(stop.wait())
    serving = asyncio.ensure_future(asyncio.gather(*(child.ready for child in children)))
    exits = {child.exited for child in children}
    try:
        while True:
            waiting: set[asyncio.Future[Any]] = {stopping, *exits}
            if not serving.done():
                waiting.add(serving)
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if stopping.done():
                log.info("stopping: %d service processes", len(children))
                return True
            for child in children:
                if child.exited.done():
                    log.error(
                        "service process %d (pid %s) exited with status %s; stopping the others",
                        child.number,
                        child.pid,
                        child.exited.result(),
                    )
                    return False
            if serving.done():
                reservation.close()  # every child holds the port now
                log.info(
                    "%d service processes serving gRPC on port %d (pids %s)",
                    len(children),
                    port,
                    ", ".join(str(child.pid) for child in children),
                )
                if ready:
                    ready(port)
    finally:
        stopping.cancel()
        serving.cancel()


async def _stop_children(children: list[Child], grace: float) -> bool:
    """SIGTERM to every child still running, SIGKILL to any still there after the grace and a
    margin; True when every child exited 0."""
    running = [child for child in children if not child.exited.done()]
    for child in running:
        child.process.terminate()
    if running:
        await asyncio.wait([child.exited for child in running], timeout=grace + STOP_MARGIN_SECONDS)
    for child in running:
        if not child.exited.done():
            log.warning("service process %d (pid %s) did not stop: killed", child.number, child.pid)
            child.process.kill()
    if running:
        await asyncio.wait([child.exited for child in running], timeout=STOP_MARGIN_SECONDS)
    return all(child.exited.done() and child.exited.result() == 0 for child in children)


def reserve_port(host: str, port: int) -> socket.socket:
    """Binds host:port (0: a free one) with SO_REUSEPORT for the children, which bind it the
    same way; held (never listening) until they all serve, so a port 0 picked is not given
    away meanwhile. A port something already listens on fails the start, as with one process:
    a second `genq serve` must not silently share the port."""
    if trouble := port_in_use(host, port):
        raise OSError(f"GENQ_PORT: cannot listen on {host}:{port} ({trouble})")
    family, kind, address = _address(host, port)
    reservation = socket.socket(family, kind)
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        reservation.bind(address)
    except OSError:
        reservation.close()
        raise
    return reservation


def port_in_use(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on (e.g. "Address already in use"), or None; port 0
    (any free one) always can. A bind without SO_REUSEPORT: any listener there refuses it."""
    if not port:
        return None
    try:
        family, kind, address = _address(host, port)
    except OSError as error:  # a GENQ_HOST that does not resolve
        return str(error)
    probe = socket.socket(family, kind)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
    except OSError as error:
        return error.strerror or str(error)
    finally:
        probe.close()
    return None


def _address(host: str, port: int) -> tuple[socket.AddressFamily, socket.SocketKind, Any]:
    bind_host = host.strip("[]") or "0.0.0.0"
    family, kind, _, _, address = socket.getaddrinfo(
        bind_host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return family, kind, address


def _child_main(settings: Settings, database_url: str, number: int, ready: Connection) -> None:
    """A child's entry point (spawned: a fresh interpreter)."""
    logs.configure(settings, child=True)
    # Ctrl-C reaches the whole process group; the parent forwards it as SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    role = Role(process=number, reuse_port=True, status_page=False, purge_at_start=number == 1)
    asyncio.run(_child(settings, database_url, role, ready))


async def _child(settings: Settings, database_url: str, role: Role, ready: Connection) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    parent = multiprocessing.parent_process()
    if parent is not None:

        def orphaned() -> None:
            loop.remove_reader(parent.sentinel)
            log.error("the parent process is gone; stopping")
            stop.set()

        loop.add_reader(parent.sentinel, orphaned)

    def serving(port: int) -> None:
        ready.send(port)
        ready.close()

    await serve(settings, database_url, ready=serving, stop=stop, role=role)
