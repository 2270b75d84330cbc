"""The contract (GUIDE A1): each RPC carries its SQL, stubs match the proto, buf lint is clean."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

from generation.task.v1 import task_pb2
from service.api.rpcs import BINDINGS, SERVICE, STATEMENTS
from service.settings import Settings
from tests.conftest import ROOT

BUF = Path(sys.executable).parent / "buf"  # buf-bin, a dev dependency


def test_every_rpc_has_sql_and_a_binding() -> None:
    names = {method.name for method in SERVICE.methods}
    unary = {method.name for method in SERVICE.methods if not method.server_streaming}
    assert names == set(STATEMENTS)
    assert unary == set(BINDINGS)


def test_a_queue_task_binds_every_parameter_of_its_statement() -> None:
    """A QueueTask that sets nothing but its tool still names every column its statement reads
    (the bind leaves the unset ones out of a batch item, never out of the single RPC)."""
    request = task_pb2.QueueTaskRequest(tool_id=str(uuid.uuid4()))
    params = BINDINGS["QueueTask"].bind(request, Settings.from_env({}))
    assert set(re.findall(r"%\((\w+)\)s", STATEMENTS["QueueTask"])) <= set(params)


def test_task_status_mirrors_the_postgres_enum(db) -> None:  # type: ignore[no-untyped-def]
    labels = [
        r["label"]
        for r in db.execute(
            "SELECT unnest(enum_range(NULL::generation.task_status))::text AS label"
        ).fetchall()
    ]
    proto = [
        value.name.removeprefix("TASK_STATUS_").lower()
        for value in task_pb2.TaskStatus.DESCRIPTOR.values
        if value.number != 0
    ]
    assert proto == labels
    assert task_pb2.TaskStatus.Value("TASK_STATUS_UNSPECIFIED") == 0


def test_generated_stubs_match_the_proto() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "build.py"), "check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_lint_standard_is_clean() -> None:
    assert BUF.exists(), "buf is not installed: run `make install` (buf-bin, a dev dependency)"
    result = subprocess.run(
        [str(BUF), "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
