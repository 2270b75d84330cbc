"""The service's log lines: their level and format (GENQ_LOG_LEVEL, GENQ_LOG_FORMAT), and the
libraries `genq serve` drives at start, held back unless they fail. The line format is the SDK's
(workers_sdk/logs.py), so `genq serve` and `genq worker` write the same lines.

The embedded Postgres (initdb, pg_ctl) and alembic log every step at INFO: about 70 lines at
each start, one of them initdb's "you can now start the database server using…", which reads
like an instruction to the operator. `held_back` keeps those records while the work runs and
drops them when it succeeds; when it fails, they are logged in one ERROR record, so the failure
still shows what led to it. GENQ_LOG_LEVEL=debug lets them through as they come.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from service.settings import Settings
from workers_sdk import logs
from workers_sdk.logs import TEXT_FORMAT, JsonFormatter

__all__ = ["JsonFormatter", "configure", "held_back", "problem"]

# With GENQ_PROCESSES above 1, a child's lines say which process wrote them (genq-N).
CHILD_TEXT_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"

# The loggers docs/OPERATIONS.md names for alerts: one per package, whichever module logs.
SERVER_LOGGER = "service.api"
"""A service process's life: listening, `database DOWN`, children exiting, stopped
(service/api/server.py)."""
LEADER_LOGGER = "service.leader"
"""The leader's work: the election, the sweeps, the overrides, why tasks wait
(service/leader/)."""


def problem(settings: Settings) -> str | None:
    """What is wrong with the log settings, or None."""
    return logs.problem(settings.log_level, settings.log_format)


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
