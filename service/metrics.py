"""Prometheus metrics of one service host, in a registry of its own, served at /metrics.

- RPCs: `genq_rpc_requests_total{method,code}` and `genq_rpc_latency_seconds{method}`, recorded by
  the handlers (service/handlers.py) as each call ends, and
  `genq_process_rpc_requests_total{process}`, the same calls by service process. With one
  process they count its calls. With several (GENQ_PROCESSES), every child records into
  prometheus_client's multiprocess files (PROMETHEUS_MULTIPROC_DIR, a directory the parent
  makes and removes), and the parent, which serves /metrics, sums them with a
  MultiProcessCollector (`Metrics(host_dir=...)`): the counts are the whole host's.
- The queue: gauges read from the database at scrape time, from the GetStatus statement (the
  same one the status page and the RPC run) and QUEUE_HEALTH_SQL beside it. They describe the
  whole database, so every replica reports the same values: aggregate them with max(), not sum().
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from generation.task.v1 import task_pb2
from service.database import Database
from service.errors import ServiceError

log = logging.getLogger(__name__)

# A claim with `wait` is held by the service up to GENQ_MAX_CLAIM_WAIT_SECONDS (30): its latency
# includes the wait, hence the long tail of buckets.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# The statuses a task waits or runs in; each tool reports all three (0 when none), so a series
# goes to 0 rather than disappearing when a queue drains.
LIVE_STATUSES = ("queued", "dispatched", "processing")

# What GetStatus does not say. One statement, read at each scrape:
# - dead tuples per table of the schema (the queue table is the one that bloats);
# - lease lapses: attempts whose worker lost the lease, `abandoned` (the lease lapsed and the
#   rescuer or the reaper took the task back) or `lease_lost` (the worker came back too late);
# - reclaims: claims that took a task back after a lapse, i.e. attempts whose previous attempt
#   of the same task lapsed.
# Both counts read the whole attempts ledger (one sequential scan, then primary-key probes for
# the few lapsed attempts); the ledger keeps every run, so they only grow.
QUEUE_HEALTH_SQL = """
WITH lapsed AS MATERIALIZED (
  SELECT task_id, attempt FROM generation.attempts WHERE outcome IN ('abandoned', 'lease_lost'))
SELECT
  (SELECT COALESCE(jsonb_object_agg(relname, n_dead_tup), '{}')
   FROM pg_stat_user_tables WHERE schemaname = 'generation') AS dead_tuples,
  (SELECT count(*) FROM lapsed) AS lease_lapses,
  (SELECT count(*) FROM lapsed
   JOIN generation.attempts AS next
     ON next.task_id = lapsed.task_id AND next.attempt = lapsed.attempt + 1) AS reclaims
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
        self.rpc_requests = Counter(
            "genq_rpc_requests",
            "gRPC calls answered, by method and status code.",
            ["method", "code"],
            registry=own,
        )
        self.rpc_latency = Histogram(
            "genq_rpc_latency_seconds",
            "Time to answer a unary gRPC call, by method (a claim's `wait` included).",
            ["method"],
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
        self.queue = QueueCollector()
        self.registry.register(self.queue)

    def observe_rpc(self, method: str, code: str, seconds: float | None) -> None:
        """Records one call; `seconds` is None for a stream (it lasts as long as its task)."""
        self.rpc_requests.labels(method=method, code=code).inc()
        self.process_requests.labels(process=self.process).inc()
        if seconds is not None:
            self.rpc_latency.labels(method=method).observe(seconds)

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
    """The queue's gauges and counters as of the last scrape."""

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
        self._metrics = [
            _gauge("genq_database_up", "1 when Postgres answered this scrape.", 1),
            depth,
            oldest,
            _gauge(
                "genq_spend_today_nanos",
                "What today's attempts cost (local day of the settings' timezone), in nanos.",
                settings.spent_today_nanos,
            ),
            _gauge(
                "genq_reserved_nanos",
                "Cost estimates held by running tasks against the daily cap, in nanos.",
                settings.reserved_nanos,
            ),
            _gauge(
                "genq_daily_cap_nanos",
                "The global daily cap in force (GENQ_DAILY_CAP_NANOS or stored); 0: nothing runs.",
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
            dead,
            CounterMetricFamily(
                "genq_lease_lapses",
                "Attempts whose worker lost its lease (outcome abandoned or lease_lost).",
                value=health["lease_lapses"],
            ),
            CounterMetricFamily(
                "genq_reclaims",
                "Claims that took a task back after its previous attempt's lease lapsed.",
                value=health["reclaims"],
            ),
        ]


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
