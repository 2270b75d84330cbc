"""Prometheus metrics of one service host, in a registry of its own, served at /metrics.

- RPCs, under the names and labels of go-grpc-prometheus (and its Python ports), which stock
  gRPC dashboards read: `grpc_server_started_total{grpc_type,grpc_service,grpc_method}`,
  `grpc_server_handled_total{...,grpc_code}` and the histogram `grpc_server_handling_seconds`
  (unary calls; a stream lasts as long as its task). `grpc_service` is the full name
  (`generation.task.v1.GenerationDataService`), `grpc_type` `unary` or `server_stream`,
  `grpc_code` Go's spelling (`OK`, `InvalidArgument`, `Canceled`, ...). The handlers
  (service/api/handlers.py) record each call (`rpc_started`, `observe_rpc`); plus
  `genq_process_rpc_requests_total{process}`, the same calls by service process. With one
  process they count its calls. With several (GENQ_PROCESSES), every child records into
  prometheus_client's multiprocess files (PROMETHEUS_MULTIPROC_DIR, a directory the parent
  makes and removes), and the parent, which serves /metrics, sums them with a
  MultiProcessCollector (`Metrics(host_dir=...)`): the counts are the whole host's.
- The queue: gauges read from the database at scrape time, from the GetStatus statement (the
  same one the status page and the RPC run) and QUEUE_HEALTH_SQL beside it. They describe the
  whole database, so every replica reports the same values: aggregate them with max(), not sum().
- Money is integer nanos (`*_nanos`, labelled with the settings' `currency`), never a fraction.
- No `_created` series (prometheus_client's per-series creation timestamps): dashboards do not
  read them and they double the counters' series.
- A scrape's cost does not grow with the history: no statement of it reads more of the attempts
  ledger (never purged) than the runs of the last hour and ten minutes and the long runs that
  ended in the last hour, through index ranges (`generation.attempts_ended_since_v1`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from generation.task.v1 import task_pb2
from service.api.errors import ServiceError
from service.api.rpcs import SERVICE
from service.database import Database

log = logging.getLogger(__name__)

# Process-wide in prometheus_client (a module flag read at each collection): this process's
# counters and histograms, and those the parent sums from the children's files, come without
# `_created`. PROMETHEUS_DISABLE_CREATED_SERIES=True does the same from the environment.
disable_created_metrics()  # type: ignore[no-untyped-call]

GRPC_SERVICE = SERVICE.full_name
GRPC_TYPES = {
    method.name: "server_stream" if method.server_streaming else "unary"
    for method in SERVICE.methods
}
# grpc.StatusCode names as Go spells codes.Code (go-grpc-prometheus's grpc_code values).
GRPC_CODES = {
    "OK": "OK",
    "CANCELLED": "Canceled",
    "UNKNOWN": "Unknown",
    "INVALID_ARGUMENT": "InvalidArgument",
    "DEADLINE_EXCEEDED": "DeadlineExceeded",
    "NOT_FOUND": "NotFound",
    "ALREADY_EXISTS": "AlreadyExists",
    "PERMISSION_DENIED": "PermissionDenied",
    "RESOURCE_EXHAUSTED": "ResourceExhausted",
    "FAILED_PRECONDITION": "FailedPrecondition",
    "ABORTED": "Aborted",
    "OUT_OF_RANGE": "OutOfRange",
    "UNIMPLEMENTED": "Unimplemented",
    "INTERNAL": "Internal",
    "UNAVAILABLE": "Unavailable",
    "DATA_LOSS": "DataLoss",
    "UNAUTHENTICATED": "Unauthenticated",
}

# A claim with `wait` is held by the service up to GENQ_MAX_CLAIM_WAIT_SECONDS (30): its latency
# includes the wait, hence the long tail of buckets.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# The statuses a task waits or runs in; each tool reports all three (0 when none), so a series
# goes to 0 rather than disappearing when a queue drains.
LIVE_STATUSES = ("queued", "dispatched", "processing")

# What GetStatus does not say. One statement, read at each scrape:
# - dead tuples per table of the schema (the queue table is the one that bloats);
# - lease lapses of the last hour: attempts ended in it whose worker lost the lease,
#   `abandoned` (the lease lapsed and the rescuer or the reaper took the task back) or
#   `lease_lost` (the worker came back too late; the attempt keeps the lapse's ended_at);
# - reclaims of the last hour: of those, the ones whose task was claimed again (the next
#   attempt of the same task).
# The window keeps the cost flat: the last hour's ended attempts as GetStatus reads them for its
# chart (generation.attempts_ended_since_v1: index ranges of the runs started since, and of the
# long runs), then a primary-key probe for each lapsed attempt (OFFSET 0 keeps it a probe, never
# a join that reads the whole key); never the whole ledger, which keeps every run and is never
# purged.
QUEUE_HEALTH_SQL = """
WITH lapsed AS MATERIALIZED (
  SELECT task_id, attempt FROM generation.attempts_ended_since_v1(now() - interval '1 hour')
  WHERE outcome IN ('abandoned', 'lease_lost'))
SELECT
  (SELECT COALESCE(jsonb_object_agg(relname, n_dead_tup), '{}')
   FROM pg_stat_user_tables WHERE schemaname = 'generation') AS dead_tuples,
  (SELECT count(*) FROM lapsed) AS lease_lapses,
  (SELECT count(*) FROM lapsed
   WHERE EXISTS (SELECT 1 FROM generation.attempts AS next
                 WHERE next.task_id = lapsed.task_id AND next.attempt = lapsed.attempt + 1
                 OFFSET 0)) AS reclaims
"""


class Metrics:
    """The registry: RPC metrics fed by the handlers, queue metrics read at scrape.

    `process` labels this process's calls in `genq_process_rpc_requests_total` (1 when alone).
    With `host_dir` the registry serves the RPC metrics every process of the host recorded
    there instead of its own (the parent of several processes, which answers no RPC)."""

    def __init__(self, process: int = 1, host_dir: Path | None = None) -> None:
        self.registry = CollectorRegistry()
        own = self.registry if host_dir is None else None
        self.process = str(process)
        self.started = Counter(
            "grpc_server_started",
            "Total number of RPCs started on the server.",
            ["grpc_type", "grpc_service", "grpc_method"],
            registry=own,
        )
        self.handled = Counter(
            "grpc_server_handled",
            "Total number of RPCs completed on the server, regardless of success or failure "
            "(grpc_code Canceled: the caller went away).",
            ["grpc_type", "grpc_service", "grpc_method", "grpc_code"],
            registry=own,
        )
        self.handling = Histogram(
            "grpc_server_handling_seconds",
            "Time the server took to answer a unary RPC (a claim's `wait` included).",
            ["grpc_type", "grpc_service", "grpc_method"],
            buckets=LATENCY_BUCKETS,
            registry=own,
        )
        self.process_requests = Counter(
            "genq_process_rpc_requests",
            "gRPC calls answered, by service process of this host (1 to GENQ_PROCESSES).",
            ["process"],
            registry=own,
        )
        if host_dir is not None:
            MultiProcessCollector(self.registry, path=str(host_dir))  # type: ignore[no-untyped-call]
        else:
            # Every method's series from the start, at 0, so rate() sees a method's first call.
            for method, kind in GRPC_TYPES.items():
                self.started.labels(kind, GRPC_SERVICE, method)
                self.handled.labels(kind, GRPC_SERVICE, method, "OK")
        self.queue = QueueCollector()
        self.registry.register(self.queue)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def rpc_started(self, method: str) -> None:
        """Counts a call as it starts (grpc_server_started_total)."""
        kind = GRPC_TYPES.get(method, "unary")
        self._child(self.started, kind, GRPC_SERVICE, method).inc()

    def observe_rpc(self, method: str, code: str, seconds: float | None) -> None:
        """Records one call as it ends: `code` a grpc.StatusCode name, `seconds` None for a
        stream (it lasts as long as its task)."""
        kind = GRPC_TYPES.get(method, "unary")
        self._child(self.handled, kind, GRPC_SERVICE, method, GRPC_CODES.get(code, code)).inc()
        self._child(self.process_requests, self.process).inc()
        if seconds is not None:
            self._child(self.handling, kind, GRPC_SERVICE, method).observe(seconds)

    def _child(self, metric: Counter | Histogram, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once per label set: labels() checks its values on
        every call, and a call's four counts took 6.8 µs with it, 3.2 without."""
        key = (id(metric), labels)
        if (child := self._children.get(key)) is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    async def scrape(
        self, database: Database, read_status: Callable[[], Awaitable[task_pb2.Status]]
    ) -> bytes:
        """Reads the queue from the database, then renders every metric in the text format.

        With the database down the RPC metrics still come out, with `genq_database_up 0` and no
        queue gauges (a stale value would look like a healthy queue)."""
        try:
            status, rows = await asyncio.gather(read_status(), database.fetch(QUEUE_HEALTH_SQL, {}))
        except ServiceError as error:
            log.warning("metrics: the queue could not be read (%s)", error)
            self.queue.clear()
        else:
            self.queue.update(status, rows[0])
        return generate_latest(self.registry)


class QueueCollector:
    """The queue's gauges as of the last scrape."""

    def __init__(self) -> None:
        self._metrics: list[Metric] = []

    def collect(self) -> Iterable[Metric]:
        return list(self._metrics)

    def clear(self) -> None:
        self._metrics = [_gauge("genq_database_up", "1 when Postgres answered this scrape.", 0)]

    def update(self, status: task_pb2.Status, health: dict[str, Any]) -> None:
        settings = status.settings
        depth = GaugeMetricFamily(
            "genq_queue_depth",
            "Tasks per tool and live status (queued, dispatched, processing).",
            labels=["tool", "status"],
        )
        oldest = GaugeMetricFamily(
            "genq_queue_oldest_age_seconds",
            "Age (since enqueue) of the oldest task per tool and live status; 0 when none.",
            labels=["tool", "status"],
        )
        found = {
            (d.tool_id, task_pb2.TaskStatus.Name(d.status).removeprefix("TASK_STATUS_").lower()): d
            for d in status.depths
        }
        for tool in status.tools:
            for name in LIVE_STATUSES:
                row = found.get((tool.tool_id, name))
                depth.add_metric([tool.name, name], row.count if row else 0)
                age = row.oldest_age.ToTimedelta().total_seconds() if row else 0.0
                oldest.add_metric([tool.name, name], age)
        calls = GaugeMetricFamily(
            "genq_rate_limit_calls",
            "Runs a rate-limited resource key started in its window that ends now.",
            labels=["resource_key"],
        )
        units = GaugeMetricFamily(
            "genq_rate_limit_units",
            "Units (rate_units) a rate-limited resource key admitted in its window that ends now.",
            labels=["resource_key"],
        )
        limited = GaugeMetricFamily(
            "genq_rate_limited",
            "1 while a rate-limited resource key is at its limit (claims answer rate_limited).",
            labels=["resource_key"],
        )
        for rate in status.rate_limits:
            calls.add_metric([rate.resource_key], rate.calls)
            units.add_metric([rate.resource_key], rate.units)
            limited.add_metric([rate.resource_key], int(rate.HasField("limited_until")))
        dead = GaugeMetricFamily(
            "genq_dead_tuples",
            "Dead tuples per table of the generation schema (pg_stat_user_tables.n_dead_tup).",
            labels=["table"],
        )
        for table, count in sorted(health["dead_tuples"].items()):
            dead.add_metric([table], count)
        cap = (
            settings.cap_override_nanos
            if settings.HasField("cap_override_nanos")
            else settings.daily_cap_nanos
        )
        currency = settings.currency
        self._metrics = [
            _gauge("genq_database_up", "1 when Postgres answered this scrape.", 1),
            depth,
            oldest,
            _money(
                "genq_spend_today_nanos",
                "What today's attempts cost (local day of the settings' timezone), in integer "
                "nanos (10^-9) of `currency`.",
                currency,
                settings.spent_today_nanos,
            ),
            _money(
                "genq_reserved_nanos",
                "Cost estimates held by running tasks against the daily cap, in integer nanos "
                "(10^-9) of `currency`.",
                currency,
                settings.reserved_nanos,
            ),
            _money(
                "genq_daily_cap_nanos",
                "The global daily cap in force (GENQ_DAILY_CAP_NANOS or stored), in integer nanos "
                "(10^-9) of `currency`; 0: nothing runs.",
                currency,
                cap,
            ),
            _gauge(
                "genq_enabled",
                "1 when the kill switch lets claims run (stored switch on, GENQ_DISABLED unset).",
                int(settings.enabled and not settings.disabled_by_environment),
            ),
            _gauge(
                "genq_stale_tasks",
                "Live tasks that can never finish on their own (see ListStaleTasks).",
                status.stale_tasks,
            ),
            calls,
            units,
            limited,
            dead,
            _gauge(
                "genq_lease_lapses_last_hour",
                "Attempts ended in the last hour whose worker lost its lease (outcome abandoned "
                "or lease_lost).",
                int(health["lease_lapses"]),
            ),
            _gauge(
                "genq_reclaims_last_hour",
                "Lease lapses of the last hour whose task was claimed again.",
                int(health["reclaims"]),
            ),
        ]


def _gauge(name: str, documentation: str, value: int | float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _money(name: str, documentation: str, currency: str, nanos: int) -> GaugeMetricFamily:
    """A money gauge: integer nanos, labelled with the currency they count."""
    assert isinstance(nanos, int), f"{name}: money is integer nanos, not {nanos!r}"
    gauge = GaugeMetricFamily(name, documentation, labels=["currency"])
    gauge.add_metric([currency], nanos)
    return gauge
