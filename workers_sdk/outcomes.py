"""How a handler says why a task did not succeed (GUIDE B7).

A handler returns its output to complete the task, or raises one of these:

| raise            | the fleet calls                      | the task                        |
|------------------|--------------------------------------|---------------------------------|
| `RetryableError` | FailTask(increment_retry=true)       | requeued while attempts remain  |
| `AccountError`   | FailTask(increment_retry=true)       | for now the same as retryable   |
| `PermanentError` | FailTask(increment_retry=false)      | failed at once                  |
| `CancelledError` | FailTask(false, error "cancelled")   | failed at once                  |
| anything else    | FailTask(increment_retry=false)      | failed, only class name stored  |

The message of these four is stored as the task's error (the handler wrote it for that purpose;
an empty message stores the class name). Any other exception is a bug in the handler: the task
fails and only the exception's class name is stored, never its message, which may quote the
user's prompt or a provider's secret. See `WorkerFleet` (`retry_unknown_errors`) for why a bug
fails at once rather than burning paid retries.
"""

from __future__ import annotations


class TaskOutcome(Exception):
    """Base of the outcomes a handler may raise; its message is stored as the task's error."""

    increment_retry: bool = False
    """Whether FailTask is asked to requeue (true) or to fail the task at once (false)."""

    def stored_error(self) -> str:
        """The text kept in the task's `error` column."""
        return str(self) or type(self).__name__


class RetryableError(TaskOutcome):
    """Worth another attempt (a timeout, a truncated response, a 5xx): requeued while attempts
    remain, failed once they are used up."""

    increment_retry = True


class PermanentError(TaskOutcome):
    """Will never succeed (the input is refused, the content is blocked): failed at once."""

    increment_retry = False


class AccountError(TaskOutcome):
    """The provider account is the problem (quota, billing, revoked key), not the task.

    For now this behaves like `RetryableError` and uses an attempt. Spend control (GUIDE B4) will
    requeue it without using an attempt and hold the whole provider group for a while; handlers
    that raise it today need no change then.
    """

    increment_retry = True


class CancelledError(TaskOutcome):
    """The work was called off (the user cancelled, the result is no longer wanted).

    Not `asyncio.CancelledError`: this one is raised by a handler on purpose. For now the task
    fails at once with the error "cancelled"; a dedicated `cancelled` status comes with the
    cancel RPCs (GUIDE B6).
    """

    increment_retry = False

    def stored_error(self) -> str:
        return "cancelled"
