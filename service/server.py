"""The gRPC server: GenerationDataService bound to its SQL, health, reflection, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service import housekeeping
from service.database import Database
from service.handlers import Handlers
from service.http import StatusServer
from service.metrics import Metrics
from service.rpcs import SERVICE
from service.settings import Settings
from service.signals import Signals

log = logging.getLogger(__name__)

# A ping every second, each bounded by GENQ_PING_TIMEOUT_SECONDS (1.5): health turns NOT_SERVING
# at most interval + ping timeout (2.5 s) after Postgres stops answering, idle or busy.
HEALTH_CHECK_INTERVAL_SECONDS = 1.0


async def watch_health(database: Database, health_servicer: health.aio.HealthServicer) -> None:
    """NOT_SERVING while Postgres does not answer, so load balancers and probes can tell.

    The ping goes through the pool, as every call does: a pool whose connections are wedged
    (backends stopped, a frozen server) or all held past the ping timeout is NOT_SERVING too.
    """
    serving = None
    while True:
        up = await database.ping()  # bounded: it never waits past the ping timeout
        if up != serving:
            serving = up
            state = (
                health_pb2.HealthCheckResponse.SERVING
                if up
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for name in ("", SERVICE.full_name):
                await health_servicer.set(name, state)
            log.log(logging.INFO if up else logging.WARNING, "database %s", "up" if up else "DOWN")
        await asyncio.sleep(HEALTH_CHECK_INTERVAL_SECONDS)


async def serve(
    settings: Settings,
    database_url: str,
    ready: Callable[[int], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serves until SIGTERM or SIGINT (or `stop` is set, when given), then stops taking calls
    and lets those in flight finish."""
    database = Database(database_url, settings)
    await database.open()
    try:
        await _serve(database, settings, ready, stop)
    finally:
        # Also when the start fails (a port in use): an open pool would keep the process alive.
        await database.close()


async def _serve(
    database: Database,
    settings: Settings,
    ready: Callable[[int], None] | None,
    stop: asyncio.Event | None,
) -> None:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
    )
    signals = Signals(settings)
    metrics = Metrics()
    handlers = Handlers(database, signals, settings, metrics)
    server.add_generic_rpc_handlers([handlers.generic_handler()])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE.full_name, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    replica = uuid.uuid4()
    if housekeeping.overrides(settings):
        # Shown before this replica serves, and refreshed by housekeeping while it runs.
        try:
            await housekeeping.show_overrides(database, settings, replica)
        except Exception as error:
            log.warning("could not show this replica's overrides yet: %s", error)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    # The status page and /metrics; a port in use fails the start, like the gRPC port.
    status_server = StatusServer(database, settings, metrics)
    http_port = await status_server.start()
    await server.start()
    log.info("GenerationDataService listening on %s:%d", settings.host, port)
    log.info("status page and /metrics on http://%s:%d/", settings.host, http_port)
    if ready:
        ready(port)

    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    background = [
        asyncio.create_task(watch_health(database, health_servicer)),
        asyncio.create_task(housekeeping.run(database, signals, settings, replica)),
        asyncio.create_task(signals.listen()),
    ]
    await stop.wait()
    log.info("stopping: finishing calls in flight (up to %.0f s)", settings.shutdown_grace_seconds)
    await health_servicer.enter_graceful_shutdown()
    await status_server.close()
    await server.stop(settings.shutdown_grace_seconds)
    for job in background:
        job.cancel()
    await asyncio.gather(*background, return_exceptions=True)
    await signals.close()
    if housekeeping.overrides(settings):
        try:
            await housekeeping.withdraw_overrides(database, replica)
        except Exception as error:  # it lapses in 30 s anyway
            log.warning("could not withdraw this replica's overrides: %s", error)
    log.info("stopped")
