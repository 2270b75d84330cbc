"""What `genq serve` writes to its log: a handful of lines at start, GENQ_LOG_LEVEL and
GENQ_LOG_FORMAT=json, the embedded Postgres and alembic held back unless they fail, and a port
in use as one line before any slow work."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from service import logs
from service.settings import Settings
from tests.conftest import Databases, ServiceProcess, url_for, wait_for

JSON_KEYS = {"time", "level", "logger", "message"}
LEADING = "now runs the maintenance sweeps"
"""The leader's line: the last of a start."""


def serve(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`genq serve` run to its end, as conftest's ServiceProcess starts it, embedded Postgres in
    tmp_path/data unless DATABASE_URL is given."""
    environment = {
        **os.environ,
        "GENQ_HOST": "127.0.0.1",
        "GENQ_PROCESSES": "1",
        "GENQ_DATA_DIR": str(tmp_path / "data"),
        **env,
    }
    if "DATABASE_URL" not in env:
        environment.pop("DATABASE_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "service", "serve"],
        env=environment,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("setting", ["GENQ_PORT", "GENQ_HTTP_PORT"])
def test_a_port_in_use_is_one_line_before_the_embedded_postgres(
    setting: str, tmp_path: Path
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        other = "GENQ_HTTP_PORT" if setting == "GENQ_PORT" else "GENQ_PORT"
        result = serve(tmp_path, **{setting: str(port), other: "0"})
    assert result.returncode != 0
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"{setting}: cannot listen on 127.0.0.1:{port}"), line
    assert "in use" in line and "Traceback" not in result.stderr
    assert not (tmp_path / "data").exists(), "checked before the embedded Postgres started"


def test_a_bad_log_setting_is_one_line(tmp_path: Path) -> None:
    result = serve(tmp_path, GENQ_LOG_LEVEL="loud", GENQ_PORT="0", GENQ_HTTP_PORT="0")
    assert result.returncode != 0
    assert result.stderr.splitlines() == [
        "GENQ_LOG_LEVEL='loud': must be one of debug, info, warning, error"
    ]
    assert not (tmp_path / "data").exists()


def test_the_start_is_a_handful_of_lines(tmp_path: Path) -> None:
    """A first start: initdb, every migration, the ports; about 94 lines before."""
    service = ServiceProcess(None, tmp_path / "serve.log", GENQ_DATA_DIR=str(tmp_path))
    try:
        wait_for(lambda: LEADING in service.log_path.read_text(), what="the leader's line")
        lines = service.log_path.read_text().splitlines()
    finally:
        assert service.stop() == 0
    text = "\n".join(lines)
    assert len(lines) <= 12, text
    for chatter in ("initdb", "You can now start", "alembic", "Running upgrade", "Warning"):
        assert chatter not in text, text
    assert "database schema at revision" in text
    # The fresh database has no cap: said at start, with the command that sets one.
    assert "no daily spend cap is set, so nothing will run" in text and "genq cap" in text
    stopped = service.log_path.read_text().splitlines()[len(lines) :]
    assert not [line for line in stopped if "embedded_postgres" in line], stopped


def test_json_lines_and_the_level(databases: Databases, tmp_path: Path) -> None:
    url = url_for(databases.create("logs_json"))
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("UPDATE generation.settings SET daily_cap_nanos = NULL")
    service = ServiceProcess(
        url, tmp_path / "serve.log", GENQ_LOG_FORMAT="json", GENQ_LOG_LEVEL="warning"
    )
    try:
        wait_for(
            lambda: "no daily spend cap" in service.log_path.read_text(), what="the cap warning"
        )
    finally:
        assert service.stop() == 0
    lines = service.log_path.read_text().splitlines()
    # service/cli.py prints the port on stdout for scripts: not a log line.
    entries = [json.loads(line) for line in lines if not line.startswith("genq serving gRPC")]
    for entry in entries:
        assert set(entry) >= JSON_KEYS, entry
        assert entry["level"] in ("WARNING", "ERROR", "CRITICAL"), entry
    (warning,) = [e for e in entries if "no daily spend cap" in e["message"]]
    assert warning["logger"] == "service.leader" and "`genq cap" in warning["message"]


def test_the_json_formatter_carries_the_exception() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.getLogger("genq.test").makeRecord(
            "genq.test", logging.ERROR, __file__, 1, "failed: %s", ("x",), sys.exc_info()
        )
    entry: dict[str, Any] = json.loads(logs.JsonFormatter().format(record))
    assert entry["level"] == "ERROR" and entry["logger"] == "genq.test"
    assert entry["message"] == "failed: x"
    assert "Traceback" in entry["exception"] and "ValueError: boom" in entry["exception"]
    assert entry["time"].endswith("+00:00")


def test_held_back_drops_chatter_and_shows_it_on_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    chatty = logging.getLogger("genq.test.library")
    caplog.set_level(logging.INFO)
    with logs.held_back("the library", "genq.test.library"):
        chatty.info("you can now start the server using...")
    assert not caplog.records
    with logs.held_back("the library", "genq.test.library"):
        chatty.warning("the data directory is not empty")
    (warned,) = caplog.records  # a warning is never held back, even when all goes well
    assert (warned.levelno, warned.getMessage()) == (
        logging.WARNING,
        "the data directory is not empty",
    )
    caplog.clear()
    with pytest.raises(RuntimeError), logs.held_back("the library", "genq.test.library"):
        chatty.info("step one")
        chatty.warning("it broke")
        raise RuntimeError
    warning, record = caplog.records
    assert (warning.levelno, warning.getMessage()) == (logging.WARNING, "it broke")
    assert record.levelno == logging.ERROR
    assert "the library failed" in record.getMessage()
    assert "step one" in record.getMessage()
    assert chatty.propagate and not chatty.handlers, "the logger is given back as it was"


def test_log_settings_are_checked() -> None:
    assert logs.problem(Settings()) is None
    assert logs.problem(Settings(log_level="DEBUG", log_format="JSON")) is None
    assert "GENQ_LOG_FORMAT" in str(logs.problem(Settings(log_format="xml")))
