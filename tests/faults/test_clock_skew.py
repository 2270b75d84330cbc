"""Fault 10: the service host's clock is wrong (libfaketime, hours ahead or behind). Every time
comparison that decides ownership runs in SQL on the database's clock, so nothing changes:
leases last their length, the rescuer takes no live lease, expiry and the watchdog keep their
times. libfaketime is Debian's `faketime` package (.ci/run installs it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from google.protobuf import duration_pb2
from psycopg.rows import dict_row

from generation.task.v1 import task_pb2
from tests.conftest import Databases, ServiceProcess, url_for, wait_for
from tests.integration.test_semantics import Db, claim, confirm, queue, row

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")


@pytest.fixture(scope="module", params=["+3h", "-3h"])
def skewed(
    request: pytest.FixtureRequest, databases: Databases, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServiceProcess, str]]:
    if not LIBFAKETIME.exists():
        pytest.fail("libfaketime is not installed: .ci/run installs it (apt-get install faketime)")
    url = url_for(databases.create(f"skew{'ahead' if request.param[0] == '+' else 'behind'}"))
    service = ServiceProcess(
        url,
        tmp_path_factory.mktemp("skew") / "serve.log",
        LD_PRELOAD=str(LIBFAKETIME),
        FAKETIME=request.param,
        FAKETIME_DONT_FAKE_MONOTONIC="1",  # timers and deadlines run; only the wall clock lies
        GENQ_RESCUE_INTERVAL_SECONDS="0.2",
    )
    yield service, url
    service.stop()


def test_a_wrong_host_clock_changes_no_decision(skewed: tuple[ServiceProcess, str]) -> None:
    service, url = skewed
    stub = service.stub
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as db:
        tool_id = str(stub.UpsertTool(task_pb2.UpsertToolRequest(name="skew")).tool.id)
        soon_expiring = queue(stub, tool_id, ttl=duration_pb2.Duration(seconds=3600), priority=-1)
        task = queue(stub, tool_id)
        claimed = claim(stub, tool_id)
        assert claimed.task.id == task.id
        confirm(stub, claimed)
        lease_left(db, task.id, 100, 121)

        # Sentinels the sweeps must end, lapsed and expired on the database's clock: once both
        # are ended, a rescue and an expiry sweep ran after the setup. A host-clock decision
        # would have lapsed the live lease or expired the live task in those sweeps.
        other = str(stub.UpsertTool(task_pb2.UpsertToolRequest(name="sentinels")).tool.id)
        lapsed = queue(stub, other)
        confirm(stub, claim(stub, other))
        expired = queue(stub, other)
        db.execute(
            "UPDATE generation.tasks SET claim_expires_at = now() - interval '1 second' "
            "WHERE id = %s",
            [lapsed.id],
        )
        db.execute(
            "UPDATE generation.tasks SET expires_at = now() - interval '1 second' WHERE id = %s",
            [expired.id],
        )
        wait_for(lambda: row(db, lapsed.id)["status"] == "queued", what="a rescue sweep")
        wait_for(lambda: row(db, expired.id)["status"] == "expired", what="an expiry sweep")
        assert row(db, task.id)["status"] == "processing"
        assert row(db, soon_expiring.id)["status"] == "queued"
        stale = stub.ListStaleTasks(task_pb2.ListStaleTasksRequest(limit=10_000)).tasks
        assert [s.task.id for s in stale if s.task.tool_id == tool_id] == []

        done = stub.CompleteTask(
            task_pb2.CompleteTaskRequest(task_id=task.id, lease_token=claimed.lease_token)
        ).task
        assert done.status == task_pb2.TASK_STATUS_COMPLETED


def lease_left(db: Db, task_id: str, low: float, high: float) -> None:
    found = db.execute(
        "SELECT extract(epoch FROM claim_expires_at - now()) AS left "
        "FROM generation.tasks WHERE id = %s",
        [task_id],
    ).fetchone()
    assert found is not None and low < float(found["left"]) < high, found
