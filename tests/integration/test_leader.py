"""Maintenance once: the rescuer, expiry and purge run on one leader among all processes and
replicas (the `generation.leader` lease); another takes over when it stops, dies or freezes."""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from generation.task.v1 import task_pb2
from service.leader.expiry import EXPIRE_SQL
from service.leader.rescue import RESCUE_SQL
from tests.conftest import Databases, ServiceProcess, url_for, wait_for

TTL, RENEW = 2.0, 0.5
# Short leases so takeovers take seconds; the rescue sweep every 0.2 s (conftest's default).
LEASE = {"GENQ_LEADER_TTL_SECONDS": str(TTL), "GENQ_LEADER_RENEW_SECONDS": str(RENEW)}
LEADS = re.compile(r"leader: this process \(([0-9a-f-]{36})\) now runs the maintenance sweeps")
SLACK = 3.0


class Replicas:
    """Replicas of one service (one process each) on a database of their own."""

    def __init__(self, databases: Databases, tmp_path: Path) -> None:
        self.url = url_for(databases.create(f"leader_{uuid.uuid4().hex[:6]}"))
        self.tmp_path = tmp_path
        self.all: list[ServiceProcess] = []
        self.db = psycopg.connect(self.url, autocommit=True, row_factory=dict_row)

    def start(self) -> ServiceProcess:
        log = self.tmp_path / f"replica{len(self.all)}.log"
        replica = ServiceProcess(self.url, log, GENQ_PROCESSES="1", REDIS_ADDR="", **LEASE)
        self.all.append(replica)
        return replica

    def holder(self) -> str | None:
        row = self.db.execute(
            "SELECT holder::text AS holder FROM generation.leader "
            "WHERE name = 'maintenance' AND expires_at > now()"
        ).fetchone()
        return row["holder"] if row else None

    def leader(self, among: list[ServiceProcess] | None = None) -> ServiceProcess:
        """The replica whose last leadership log line names the holder of the row."""
        candidates = self.all if among is None else among

        def find() -> ServiceProcess | None:
            holder = self.holder()
            found = [r for r in candidates if holder and holder in leads(r)]
            return found[0] if len(found) == 1 else None

        found: ServiceProcess = wait_for(find, TTL + RENEW + SLACK, "a leader among the replicas")
        return found

    def lapsed_task(self, via: ServiceProcess) -> str:
        """A task claimed and confirmed, whose lease then lapsed (moved into the past)."""
        name = f"leader-{uuid.uuid4().hex[:8]}"
        tool = via.stub.UpsertTool(task_pb2.UpsertToolRequest(name=name)).tool.id
        task = via.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool)).task.id
        claimed = via.stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=tool))
        assert claimed.task.id == task
        self.db.execute(
            "UPDATE generation.tasks SET claim_expires_at = now() - interval '1 second' "
            "WHERE id = %s",
            [task],
        )
        return str(task)

    def status(self, task_id: str) -> Any:
        row = self.db.execute(
            "SELECT status::text AS status FROM generation.tasks WHERE id = %s", [task_id]
        ).fetchone()
        return row["status"] if row else None

    def close(self) -> None:
        for replica in self.all:
            if replica.process.poll() is None:
                os.kill(replica.process.pid, signal.SIGCONT)
            replica.stop()
        self.db.close()


def leads(replica: ServiceProcess) -> list[str]:
    """The holder ids a replica logged taking the lead as."""
    return LEADS.findall(replica.log_path.read_text())


def rescues(replica: ServiceProcess) -> int:
    return len(re.findall(r"rescued \d+ tasks whose lease lapsed", replica.log_path.read_text()))


@pytest.fixture
def replicas(databases: Databases, tmp_path: Path) -> Iterator[Replicas]:
    started = Replicas(databases, tmp_path)
    try:
        yield started
    finally:
        started.close()


def test_one_leader_among_replicas_runs_the_sweeps(replicas: Replicas) -> None:
    started = [replicas.start() for _ in range(3)]
    leader = replicas.leader()
    assert sum(len(leads(r)) for r in started) == 1, "more than one replica took the lead"
    (row,) = replicas.db.execute("SELECT * FROM generation.leader").fetchall()
    assert row["name"] == "maintenance"

    # A lapsed lease, claimed through a follower, is rescued by the leader alone.
    follower = next(r for r in started if r is not leader)
    tasks = [replicas.lapsed_task(follower) for _ in range(2)]
    wait_for(
        lambda: all(replicas.status(task) == "queued" for task in tasks),
        what="the leader to rescue the lapsed leases",
    )
    wait_for(lambda: rescues(leader) >= 1, what="the leader to log its rescue")
    assert [rescues(r) for r in started if r is not leader] == [0, 0]
    # Renewed, not retaken: still one holder, the same one, a few renewals later.
    deadline = time.monotonic() + 3 * RENEW
    while time.monotonic() < deadline:
        assert replicas.leader() is leader
        time.sleep(RENEW / 2)
    assert sum(len(leads(r)) for r in started) == 1


def test_a_leader_that_stops_cleanly_hands_over_at_the_next_try(replicas: Replicas) -> None:
    started = [replicas.start() for _ in range(2)]
    leader = replicas.leader()
    stopped_at = time.monotonic()
    assert leader.stop() == 0
    assert "gave the lease up" in leader.log_path.read_text()
    rest = [r for r in started if r is not leader]
    successor = replicas.leader(rest)
    took = time.monotonic() - stopped_at
    print(f"\nclean stop: the lead moved in {took:.2f} s")
    assert took < RENEW + SLACK  # at the next try, not after the TTL
    task = replicas.lapsed_task(successor)
    wait_for(lambda: replicas.status(task) == "queued", what="the successor to rescue")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_another_replica_takes_over_from_a_dead_or_frozen_leader(
    replicas: Replicas, how: signal.Signals
) -> None:
    started = [replicas.start() for _ in range(3)]
    leader = replicas.leader()
    held_by = replicas.holder()
    os.kill(leader.process.pid, how)
    lost_at = time.monotonic()
    rest = [r for r in started if r is not leader]
    successor = replicas.leader(rest)
    took = time.monotonic() - lost_at
    print(f"\n{how.name}: another replica leads after {took:.2f} s (TTL {TTL}, renew {RENEW})")
    assert replicas.holder() != held_by
    assert took <= TTL + RENEW + SLACK
    assert sum(len(leads(r)) for r in rest) == 1

    task = replicas.lapsed_task(successor)
    wait_for(lambda: replicas.status(task) == "queued", what="the successor to rescue")

    if how == signal.SIGSTOP:
        # Thawed, the old leader finds its lease gone and does not take it back.
        os.kill(leader.process.pid, signal.SIGCONT)
        wait_for(
            lambda: "no longer the leader" in leader.log_path.read_text(),
            what="the thawed leader to step down",
        )
        assert replicas.leader() is successor
        before = rescues(leader)
        task = replicas.lapsed_task(successor)
        wait_for(lambda: replicas.status(task) == "queued", what="the successor to rescue")
        assert rescues(leader) == before


@pytest.mark.parametrize("sweep", ["rescue", "expiry"])
def test_a_sweep_runs_only_under_a_lease_its_sender_holds(databases: Databases, sweep: str) -> None:
    """A leader cut off from the database can send a sweep just before its lease ends; when the
    link heals, the database runs it only if that lease still holds on its own clock (found in
    review: a thawed leader rescued 200 tasks after another had taken over)."""
    url = url_for(databases.create(f"fence_{uuid.uuid4().hex[:6]}"))
    holder = uuid.uuid4()
    params = {"batch": 1000, "disabled": False, "leader": "maintenance", "holder": holder}
    statement = RESCUE_SQL if sweep == "rescue" else EXPIRE_SQL
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as db:
        tool = db.execute("INSERT INTO generation.tools (name) VALUES ('t') RETURNING id")
        tool_id = tool.fetchone()["id"]  # type: ignore[index]
        if sweep == "rescue":  # a lease that lapsed
            db.execute(
                "INSERT INTO generation.tasks (tool_id, status, lease_token, claim_expires_at) "
                "VALUES (%s, 'processing', gen_random_uuid(), now() - interval '1 minute')",
                [tool_id],
            )
        else:  # a task past its expiry
            db.execute(
                "INSERT INTO generation.tasks (tool_id, expires_at) "
                "VALUES (%s, now() - interval '1 minute')",
                [tool_id],
            )
        leases = [
            (
                "another's",
                "INSERT INTO generation.leader (name, holder, expires_at) "
                "VALUES ('maintenance', gen_random_uuid(), now() + interval '1 minute')",
            ),
            (
                "its own, lapsed",
                "UPDATE generation.leader SET holder = %(holder)s, "
                "expires_at = now() - interval '1 second'",
            ),
        ]
        for lease, change in leases:
            db.execute(change, {"holder": holder})
            assert db.execute(statement, params).fetchall() == [], lease
        db.execute("UPDATE generation.leader SET expires_at = now() + interval '1 minute'")
        assert len(db.execute(statement, params).fetchall()) == 1, "its own lease, running"
