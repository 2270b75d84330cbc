"""Where the service's spans go: the OpenTelemetry SDK configured from the standard `OTEL_*`
environment variables, once per service process, when it starts (`configure`).

The spans themselves are opened by the handlers (service/api/handlers.py, one server span per call,
child of the caller's `traceparent`) through the global tracer provider. This module only
decides whether that provider is a real one, and where it exports:

- No exporter named (`OTEL_TRACES_EXPORTER`, `OTEL_METRICS_EXPORTER`, `OTEL_LOGS_EXPORTER` all
  unset or `none`), or `OTEL_SDK_DISABLED=true`: nothing is configured. The API's no-op provider
  stays, so a span costs nothing.
- Otherwise the SDK's own auto-configuration (what `opentelemetry-instrument` runs) does the rest:
  `OTEL_TRACES_EXPORTER=otlp` (gRPC to `OTEL_EXPORTER_OTLP_ENDPOINT`, default localhost:4317;
  `OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf` for OTLP over HTTP, port 4318), `console` (spans as
  JSON on stdout, for a look), several comma-separated; the sampler (`OTEL_TRACES_SAMPLER`,
  `OTEL_TRACES_SAMPLER_ARG`), the batch processor (`OTEL_BSP_*`) and the resource
  (`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_SERVICE_NAME`; the service name defaults to `genq`).
- A provider already set (running under `opentelemetry-instrument`, or a test that installed
  its own) is left alone.

Spans still queued in the batch processor are exported when the process exits (the SDK's
provider shuts down at exit).
"""

from __future__ import annotations

import logging
import os

from opentelemetry import trace
from opentelemetry.sdk._configuration import _OTelSDKConfigurator
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "genq"
EXPORTER_VARIABLES = ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_LOGS_EXPORTER")


def exporters_named() -> list[str]:
    """The `OTEL_*_EXPORTER` variables that name an exporter (not unset, empty or `none`)."""
    return [
        name
        for name in EXPORTER_VARIABLES
        if os.environ.get(name, "").strip().lower() not in ("", "none")
    ]


def configure() -> bool:
    """Configures the OpenTelemetry SDK from the environment when it names an exporter; True
    when this call configured it. Called once by each service process at start."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    named = exporters_named()
    if not named:
        return False
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        log.info("tracing: a tracer provider is already configured; OTEL_* left to it")
        return False
    attributes = {}
    # Resource.create reads OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME; attributes given
    # here would override them, so the default name is given only when they name none.
    if str(Resource.create().attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        attributes[SERVICE_NAME] = DEFAULT_SERVICE_NAME
    # The SDK's own configurator (private module, the one `opentelemetry-instrument` runs):
    # exporters by name through their entry points, sampler, batch processor, resource.
    configurator = _OTelSDKConfigurator()  # type: ignore[no-untyped-call]
    configurator.configure(resource_attributes=attributes)  # type: ignore[no-untyped-call]
    log.info(
        "tracing: %s",
        ", ".join(f"{name}={os.environ[name].strip()}" for name in named),
    )
    return True
