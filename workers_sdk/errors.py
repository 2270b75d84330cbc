"""Errors the data plane returns, unpacked from the gRPC status.

The service puts a `google.rpc.ErrorInfo` (domain "genq") in every error it returns; its reason
is one of `Reason`, generated from the `ErrorReason` enum of task.proto, which the service uses
too. Clients branch on the reason, never on the message text.
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from generation.task.v1.reasons import DOMAIN, Reason

__all__ = ["DOMAIN", "GenqError", "LeaseLost", "Reason", "from_rpc_error"]


class GenqError(Exception):
    """A call to the data plane failed; `reason` says why (None when the status carried none)."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: Reason | None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason


class LeaseLost(GenqError):
    """The task's lease lapsed or passed to another worker: drop the result, do not retry."""


def from_rpc_error(error: grpc.RpcError) -> GenqError:
    """The typed error behind a failed call (sync or asyncio)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    reason = None
    status = rpc_status.from_call(error) if hasattr(error, "trailing_metadata") else None
    for detail in status.details if status else []:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.domain == DOMAIN and info.reason in Reason.__members__:
            reason = Reason(info.reason)
    cls = LeaseLost if reason is Reason.LEASE_LOST else GenqError
    return cls(code, message or "", reason)
