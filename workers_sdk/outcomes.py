"""How a handler says why a task did not succeed (GUIDE B7).

A handler returns its output to complete the task, or raises one of these:

| raise            | the fleet calls FailTask with | the task                                    |
|------------------|-------------------------------|---------------------------------------------|
| `RetryableError` | FAILURE_KIND_RETRYABLE        | requeued with backoff while attempts remain |
| `AccountError`   | FAILURE_KIND_ACCOUNT          | requeued, no attempt used; its group held   |
| `PermanentError` | FAILURE_KIND_PERMANENT        | failed at once                              |
| `CancelledError` | FAILURE_KIND_CANCELLED        | cancelled                                   |
| anything else    | FAILURE_KIND_PERMANENT        | failed, only the class name stored          |

Every FailTask carries what the run cost so far (`ctx.report_usage`): billed is billed.

The message of these four is stored as the task's error (the handler wrote it for that purpose;
an empty message stores the class name). Any other exception is a bug in the handler: the task
fails and only the exception's class name is stored, never its message, which may quote the
user's prompt or a provider's secret. See `WorkerFleet` (`retry_unknown_errors`) for why a bug
fails at once rather than burning paid retries.
"""

from __future__ import annotations

from generation.task.v1 import task_pb2


class TaskOutcome(Exception):
    """Base of the outcomes a handler may raise; its message is stored as the task's error."""

    failure: task_pb2.FailureKind.ValueType = task_pb2.FAILURE_KIND_PERMANENT
    """The FailureKind sent with FailTask."""

    def stored_error(self) -> str:
        """The text kept in the task's `error` column."""
        return str(self) or type(self).__name__


class RetryableError(TaskOutcome):
    """Worth another attempt (a timeout, a truncated response, a 5xx): requeued while attempts
    remain, failed once they are used up."""

    failure = task_pb2.FAILURE_KIND_RETRYABLE


class PermanentError(TaskOutcome):
    """Will never succeed (the input is refused, the content is blocked): failed at once."""

    failure = task_pb2.FAILURE_KIND_PERMANENT


class AccountError(TaskOutcome):
    """The provider account is the problem (quota, billing, revoked key), not the task: the task
    is requeued without using an attempt and the tool's account group is held (GUIDE B4), so the
    other tasks on that account wait instead of burning their retries."""

    failure = task_pb2.FAILURE_KIND_ACCOUNT


class CancelledError(TaskOutcome):
    """The work was called off (the user cancelled, the result is no longer wanted).

    Not `asyncio.CancelledError`: this one is raised by a handler on purpose. The task ends
    `cancelled`.
    """

    failure = task_pb2.FAILURE_KIND_CANCELLED

    def stored_error(self) -> str:
        return "cancelled"
