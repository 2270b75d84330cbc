"""What a tool worker (or a gateway) installs to talk to the genq data plane over gRPC.

No database driver is imported here, nor by anything below: only the service holds the Postgres
credentials (`tests/unit/test_sdk_import.py` checks it).
"""

from workers_sdk.client import Credentials, GenqClient, current_traceparent, trace_metadata
from workers_sdk.errors import GenqError, LeaseLost, Reason
from workers_sdk.fleet import Handler, TaskContext, WorkerFleet
from workers_sdk.gateway import Enqueued, EnqueueIncomplete, GatewayClient, NewTask
from workers_sdk.outcomes import (
    AccountError,
    CancelledError,
    PermanentError,
    RetryableError,
    TaskOutcome,
)
from workers_sdk.reconciler import Reconciler

__all__ = [
    "AccountError",
    "CancelledError",
    "Credentials",
    "EnqueueIncomplete",
    "Enqueued",
    "GatewayClient",
    "GenqClient",
    "GenqError",
    "Handler",
    "LeaseLost",
    "NewTask",
    "PermanentError",
    "Reason",
    "Reconciler",
    "RetryableError",
    "TaskContext",
    "TaskOutcome",
    "WorkerFleet",
    "current_traceparent",
    "trace_metadata",
]
