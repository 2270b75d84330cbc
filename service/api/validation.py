"""Checks on request fields: each raises InvalidArgument naming the field."""

from __future__ import annotations

import math
import re
import uuid
from datetime import UTC, datetime
from typing import Any

from google.protobuf import duration_pb2, struct_pb2, timestamp_pb2
from psycopg.types.json import Jsonb

from service.api.errors import InvalidArgument

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def required_uuid(field: str, value: str) -> uuid.UUID:
    if not value:
        raise InvalidArgument(f"{field} is required", field=field)
    if not _UUID.fullmatch(value):
        raise InvalidArgument(f"{field} is not a UUID: {value[:64]!r}", field=field)
    return uuid.UUID(value)


def optional_uuid(field: str, value: str) -> uuid.UUID | None:
    return required_uuid(field, value) if value else None


def text(field: str, value: str, *, max_length: int, required: bool = False) -> str | None:
    """A string field as stored: None when empty and optional."""
    if not value:
        if required:
            raise InvalidArgument(f"{field} is required", field=field)
        return None
    if len(value) > max_length:
        raise InvalidArgument(f"{field} is longer than {max_length} characters", field=field)
    if "\x00" in value:
        raise InvalidArgument(f"{field} contains a NUL character", field=field)
    return value


def in_range(field: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise InvalidArgument(f"{field} must be between {low} and {high}, got {value}", field=field)
    return value


MAX_AMOUNT = 10**17
"""The most any one amount may be: daily caps, cost estimates, token amounts, in nanos 100 million
currency units. The database sums them in bigint, whose end is 2^63 - 1 (about 9.2 * 10^18):
spent + reserved + estimate, over all of a day's tasks. Claims are admitted only while that sum
stays within a cap, so with caps and estimates at most 10^17 (and each run's cost at most
MAX_COST_NANOS) the sums stay some 40 times below an overflow; 2^63 - 1 was accepted before, and
then every claim of its tool failed "bigint out of range"."""


def amount(field: str, value: int) -> int:
    """A non-negative integer amount (tokens or nanos), at most MAX_AMOUNT."""
    return in_range(field, value, 0, MAX_AMOUNT)


def traceparent(field: str, value: str) -> str | None:
    """A W3C traceparent (version-traceid-parentid-flags), or None when empty."""
    if not value:
        return None
    match = _TRACEPARENT.fullmatch(value)
    if (
        match is None
        or match.group(1) == "ff"
        or set(match.group(2)) == {"0"}
        or set(match.group(3)) == {"0"}
    ):
        raise InvalidArgument(f"{field} is not a W3C traceparent", field=field)
    return value


MAX_DEPTH = 20
"""How deeply a Struct may nest objects and lists, the Struct itself being level 1.

Each level costs protobuf about 3 message levels (Struct -> map entry -> Value -> Struct, or
ListValue -> Value), and the messages carrying it (a Task in a response) a few more: 20 levels are
about 65, well within the recursion limit of 100 that protobuf clients decode with by default in
every language. Deeper documents were stored but could not be read back: a worker lost a claim
it could not decode."""


def struct(field: str, value: struct_pb2.Struct, *, max_bytes: int) -> Jsonb:
    """A Struct as a jsonb parameter: bounded in size and depth, free of NUL characters (jsonb
    refuses NUL) and of numbers JSON cannot hold. One walk converts and checks it: the three
    walks it took before (depth, MessageToDict, NUL) were a third to two fifths of a batch
    enqueue's binding."""
    if value.ByteSize() > max_bytes:
        raise InvalidArgument(f"{field} is larger than {max_bytes} bytes", field=field)
    return Jsonb(_json_object(field, value, 1))


def _json_object(field: str, value: struct_pb2.Struct, depth: int) -> dict[str, Any]:
    document = {}
    fields = value.fields
    # By key: the map's items() is collections.abc's, in Python, and took twice as long.
    for key in fields:
        if "\x00" in key:
            raise InvalidArgument(f"{field} contains a NUL character", field=field)
        document[key] = _json_value(field, fields[key], depth)
    return document


def _json_value(field: str, value: struct_pb2.Value, depth: int) -> Any:
    """What json_format.MessageToDict makes of a Value (a number stays a float), checked."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        if "\x00" in value.string_value:
            raise InvalidArgument(f"{field} contains a NUL character", field=field)
        return value.string_value
    if kind == "number_value":
        if not math.isfinite(value.number_value):
            raise InvalidArgument(
                f"{field} holds a number JSON cannot (NaN or Infinity)", field=field
            )
        return value.number_value
    if kind == "bool_value":
        return value.bool_value
    if kind in ("struct_value", "list_value"):
        if depth == MAX_DEPTH:
            raise InvalidArgument(
                f"{field} nests objects and lists deeper than {MAX_DEPTH} levels", field=field
            )
        if kind == "struct_value":
            return _json_object(field, value.struct_value, depth + 1)
        return [_json_value(field, item, depth + 1) for item in value.list_value.values]
    return None  # null_value, or no kind at all (MessageToDict's reading too)


MAX_COST_NANOS = 10**15
"""A million currency units for one run: more is a bug, and would overflow the day's counters."""

_TIMESTAMP_RANGE = (0, 253_402_300_799)  # 1970-01-01 .. 9999-12-31
_NANOS_PER_SECOND = 10**9


def cost(field: str, value: int) -> int:
    """What one run cost, in nanos."""
    return in_range(field, value, 0, MAX_COST_NANOS)


def seconds(field: str, value: duration_pb2.Duration, *, most: float) -> float:
    """A Duration as seconds, between 0 and `most`."""
    if not -_NANOS_PER_SECOND < value.nanos < _NANOS_PER_SECOND or (
        value.seconds * value.nanos < 0
    ):
        raise InvalidArgument(
            f"{field} is not a valid Duration: nanos must be within +-999999999"
            f" and of the same sign as seconds, got seconds={value.seconds} nanos={value.nanos}",
            field=field,
        )
    if value.seconds < 0 or value.nanos < 0:
        raise InvalidArgument(f"{field} must not be negative", field=field)
    total = value.seconds + value.nanos / 1e9
    if total > most:
        raise InvalidArgument(f"{field} must be at most {most:g} s", field=field)
    return total


def timestamp(field: str, value: timestamp_pb2.Timestamp) -> datetime:
    """A Timestamp as an aware datetime, within years 1970 to 9999."""
    low, high = _TIMESTAMP_RANGE
    if not low <= value.seconds <= high or not 0 <= value.nanos < _NANOS_PER_SECOND:
        raise InvalidArgument(f"{field} is out of range", field=field)
    return value.ToDatetime(tzinfo=UTC)
