"""The one place errors are translated: database error -> domain error -> gRPC status.

Handlers raise `ServiceError`s (or let psycopg errors through); `rpc_status_of` turns either
into a gRPC status carrying an `ErrorInfo` whose reason clients can branch on.
"""

from __future__ import annotations

import grpc
import psycopg
import psycopg_pool
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from generation.task.v1.reasons import DOMAIN, Reason


class ServiceError(Exception):
    """A request the service refuses; the message is shown to the caller."""

    code: grpc.StatusCode
    reason: Reason

    def __init__(self, message: str, **metadata: str) -> None:
        super().__init__(message)
        self.metadata = metadata


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = Reason.INVALID_ARGUMENT


class TaskNotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND
    reason = Reason.TASK_NOT_FOUND


class ToolNotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND
    reason = Reason.TOOL_NOT_FOUND


class LeaseLost(ServiceError):
    code = grpc.StatusCode.ABORTED
    reason = Reason.LEASE_LOST


class TaskNotStale(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.TASK_NOT_STALE


class TaskNotTerminal(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.TASK_NOT_TERMINAL


class TaskFinished(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.TASK_FINISHED


class TaskNotRetryable(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.TASK_NOT_RETRYABLE


class IdempotencyKeyReused(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS
    reason = Reason.IDEMPOTENCY_KEY_REUSED


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED
    reason = Reason.UNAUTHENTICATED


class RoleNotAllowed(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED
    reason = Reason.ROLE_NOT_ALLOWED


class ToolNotAllowed(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED
    reason = Reason.TOOL_NOT_ALLOWED


class Internal(ServiceError):
    """A bug; the caller sees no detail of it, the service log has the traceback."""

    code = grpc.StatusCode.INTERNAL
    reason = Reason.INTERNAL


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = Reason.DEADLINE_EXCEEDED


class DatabaseUnavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = Reason.DATABASE_UNAVAILABLE


RULES = {
    # The schema's CHECK constraints a request can break, as the rule a caller can act on.
    # Validation catches most first; these are what a combination of stored and new values
    # breaks (a backoff base above the stored maximum, say).
    "tools_name_length": "name must be 1 to 200 characters",
    "tools_max_attempts_range": "max_attempts must be between 0 and 100",
    "tools_backoff_range": (
        "backoff_base_seconds must be at least 0, and backoff_max_seconds at least "
        "backoff_base_seconds (stored values count for the fields not sent)"
    ),
    "tools_lease_floor": "lease_seconds must be at least 1",
    "tools_max_in_flight_positive": "max_in_flight must be at least 1",
    "tools_money_nonnegative": "amounts of money cannot be negative",
    "tasks_priority_range": "priority must be between -100 and 100",
    "tasks_max_retries_range": "max_retries must be between 0 and 100",
    "tasks_reserved_nonnegative": "reserved_token_amount cannot be negative",
    "tasks_cost_estimate_nonnegative": "cost_estimate_nanos cannot be negative",
    "tasks_source_length": "source must be at most 200 characters",
    "settings_cap_nonnegative": "daily_cap_nanos cannot be negative",
    "settings_cooldown_threshold_positive": "cooldown_threshold must be at least 1",
    "settings_durations_nonnegative": (
        "cooldown_seconds, account_hold_seconds and retention_days cannot be negative"
    ),
    "settings_stale_thresholds_positive": (
        "processing_grace_seconds and queued_max_age_seconds must be at least 1"
    ),
    "resource_limits_max_in_flight_positive": "max_in_flight must be at least 1",
    "tasks_rate_units_nonnegative": "rate_units cannot be negative",
    "rate_limits_positive": "max_calls and max_units must be at least 1",
    "rate_limits_some": "a rate limit needs max_calls or max_units",
    "rate_limits_window_range": "window must be 1 s to 1 day",
}


def from_database(error: psycopg.Error | psycopg_pool.PoolTimeout) -> ServiceError | None:
    """The domain error a database failure means, or None for a bug (reported as INTERNAL)."""
    if isinstance(error, psycopg.errors.CheckViolation):
        # The message names the rule, never the constraint (the schema is not the API).
        rule = RULES.get(error.diag.constraint_name or "")
        return InvalidArgument(rule or "a value is out of the range the service accepts")
    if isinstance(error, psycopg.errors.DataError):
        return InvalidArgument("a value is out of the range the service accepts")
    if isinstance(
        error,
        psycopg.OperationalError | psycopg_pool.PoolTimeout | psycopg.errors.QueryCanceled,
    ):
        return DatabaseUnavailable("database unavailable, retry later")
    return None


def rpc_status_of(error: ServiceError) -> grpc.Status:
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN, metadata=error.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(
        code=getattr(code_pb2, error.code.name), message=str(error), details=[detail]
    )
    return rpc_status.to_status(status)
