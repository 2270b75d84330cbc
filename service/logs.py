"""The service's log lines: their level and format (GENQ_LOG_LEVEL, GENQ_LOG_FORMAT), and the
libraries `genq serve` drives at start, held back unless they fail.

The embedded Postgres (initdb, pg_ctl) and alembic log every step at INFO: about 70 lines at
each start, one of them initdb's "you can now start the database server using…", which reads
like an instruction to the operator. `held_back` keeps those records while the work runs and
drops them when it succeeds; when it fails, they are logged in one ERROR record, so the failure
still shows what led to it. GENQ_LOG_LEVEL=debug lets them through as they come.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from service.settings import Settings

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# With GENQ_PROCESSES above 1, a child's lines say which process wrote them (genq-N).
CHILD_TEXT_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"

# The loggers docs/OPERATIONS.md names for alerts: one per package, whichever module logs.
SERVER_LOGGER = "service.api"
"""A service process's life: listening, `database DOWN`, children exiting, stopped
(service/api/server.py)."""
LEADER_LOGGER = "service.leader"
"""The leader's work: the election, the sweeps, the overrides, why tasks wait
(service/leader/)."""


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message; `process` in a
    child service process; `exception` (the traceback's text) when the record carries one."""

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


def problem(settings: Settings) -> str | None:
    """What is wrong with the log settings, or None."""
    if settings.log_level.lower() not in LEVELS:
        return f"GENQ_LOG_LEVEL={settings.log_level!r}: must be one of {', '.join(LEVELS)}"
    if settings.log_format.lower() not in FORMATS:
        return f"GENQ_LOG_FORMAT={settings.log_format!r}: must be one of {', '.join(FORMATS)}"
    return None


def configure(settings: Settings, *, child: bool = False) -> None:
    """Replaces the root logger's handlers with one on stderr, as the settings say (valid ones:
    see `problem`)."""
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter()
        if settings.log_format.lower() == "json"
        else logging.Formatter(CHILD_TEXT_FORMAT if child else TEXT_FORMAT)
    )
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler], force=True)


class _Keep(logging.Handler):
    """Keeps the chatter; a warning or worse is never held back (a start that works may still
    have something to say that an operator must read)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            logging.getLogger().handle(record)
        else:
            self.records.append(record)


@contextmanager
def held_back(what: str, *loggers: str) -> Iterator[None]:
    """Holds back the records below WARNING of `loggers` (and their children) while the block
    runs: dropped if it succeeds, logged as one ERROR record (on the first logger) if it raises.
    At debug level nothing is held back."""
    if logging.getLogger().getEffectiveLevel() <= logging.DEBUG:
        yield
        return
    keep = _Keep()
    saved = []
    for name in loggers:
        logger = logging.getLogger(name)
        saved.append((logger, logger.handlers, logger.propagate, logger.level))
        logger.handlers, logger.propagate = [keep], False
        logger.setLevel(logging.INFO)  # what they say at INFO is what explains a failure
    try:
        yield
    except BaseException:
        _restore(saved)
        told = "\n".join(f"  {record.name}: {record.getMessage()}" for record in keep.records)
        logging.getLogger(loggers[0]).error(
            "%s failed; what it said:\n%s", what, told or "  (nothing)"
        )
        raise
    _restore(saved)


def _restore(saved: list[tuple[logging.Logger, list[logging.Handler], bool, int]]) -> None:
    for logger, handlers, propagate, level in saved:
        logger.handlers, logger.propagate = handlers, propagate
        logger.setLevel(level)
