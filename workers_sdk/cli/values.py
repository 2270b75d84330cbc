"""How `genq` reads values from its command line: money in currency units, whole numbers within
the range of the field they fill, task ids, JSON objects and times.

A value that does not parse, or that its field cannot hold, is an argparse error: bad usage, exit
2, nothing sent, and said in the units the user typed (an amount in currency units, never in
nanos). Money is never a float: "2.50" becomes 2500000000 nanos through `Decimal`.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

NANOS = Decimal(1_000_000_000)
MAX_AMOUNT_NANOS = 10**17
"""The most the service takes for a cap or a cost estimate (MAX_AMOUNT in
service/api/validation.py): 100 million currency units. Checked here too, so that a larger one is
bad usage before anything is sent; beyond int64 it could not even be put in the request."""
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

Parse = Callable[[str], Any]


def amount(value: str) -> int:
    """A decimal amount of the currency unit (2.50) as integer nanos."""
    try:
        units = Decimal(value)
    except InvalidOperation:
        units = Decimal("NaN")
    if not units.is_finite():
        raise argparse.ArgumentTypeError(f"not an amount in currency units (e.g. 2.50): {value!r}")
    if units < 0:
        raise argparse.ArgumentTypeError(
            f"must not be negative: {value} (an amount in currency units, e.g. 2.50)"
        )
    most = Decimal(MAX_AMOUNT_NANOS) / NANOS
    if units > most:
        raise argparse.ArgumentTypeError(f"must be at most {most:,f} units: {value}")
    nanos = units * NANOS
    if nanos != nanos.to_integral_value():
        raise argparse.ArgumentTypeError(
            f"at most 9 decimal places (a billionth of the unit): {value}"
        )
    return int(nanos)


def whole(low: int = 0, high: int = INT32_MAX) -> Parse:
    """A whole number from `low` to `high`: by default what an int32 field holds, else the
    bound the service documents (and the option's help states)."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
        if number < low:
            raise argparse.ArgumentTypeError(
                f"must not be negative: {value}"
                if low == 0
                else f"must be at least {low:,}: {value}"
            )
        if number > high:
            raise argparse.ArgumentTypeError(f"must be at most {high:,}: {value}")
        return number

    return parse


count = whole()
"""A whole number an int32 field holds, not negative: the common case."""


def task_id(value: str) -> str:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a task id (a UUID): {value!r}") from None


def json_object(value: str) -> dict[str, Any]:
    """A JSON object, or `-` to read one from stdin."""
    text = sys.stdin.read() if value == "-" else value
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(document, dict):
        raise argparse.ArgumentTypeError("the input must be a JSON object")
    return document


def moment(value: str) -> datetime:
    """An ISO 8601 time (UTC when it names no zone), or +SECONDS from now."""
    try:
        if value.startswith("+"):
            return datetime.now(UTC) + timedelta(seconds=float(value[1:]))
        parsed = datetime.fromisoformat(value)
    except (ValueError, OverflowError):  # OverflowError: +SECONDS past the year 9999
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 time (up to the year 9999) or +SECONDS: {value!r}"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
