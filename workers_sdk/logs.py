"""Log lines in the service's format, for the SDK's long-running processes (`genq worker`):
GENQ_LOG_LEVEL (info: debug, info, warning or error) and GENQ_LOG_FORMAT (text, or json: one
JSON object a line with time, level, logger, message, and exception when there is one).

The same lines as `genq serve` writes (service/logs.py), so one log collector reads both. The
format lives here, in the SDK, because the SDK imports nothing of the service; the service
imports it from here.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message; `process` in a
    child process; `exception` (the traceback's text) when the record carries one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, str] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.processName != "MainProcess":
            entry["process"] = str(record.processName)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False)


def problem(level: str, format: str) -> str | None:
    """What is wrong with a log level and format, or None."""
    if level.lower() not in LEVELS:
        return f"GENQ_LOG_LEVEL={level!r}: must be one of {', '.join(LEVELS)}"
    if format.lower() not in FORMATS:
        return f"GENQ_LOG_FORMAT={format!r}: must be one of {', '.join(FORMATS)}"
    return None


def from_env(env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(level, format) from GENQ_LOG_LEVEL and GENQ_LOG_FORMAT, the service's defaults."""
    env = os.environ if env is None else env
    return env.get("GENQ_LOG_LEVEL") or "info", env.get("GENQ_LOG_FORMAT") or "text"


def configure(level: str = "info", format: str = "text") -> None:
    """Replaces the root logger's handlers with one on stderr writing `format` from `level` up
    (valid values: see `problem`)."""
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if format.lower() == "json" else logging.Formatter(TEXT_FORMAT)
    )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
