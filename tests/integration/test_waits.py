"""Nothing runs until a cap is set, and the service and the gateway example say so: why queued
tasks wait (the switch, no cap or a spent one, a pause), which tools, and the command that
frees them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from google.protobuf import json_format

from generation.task.v1 import task_pb2
from service.leader.waits import WAITS_CHECK_SECONDS, Wait, Waits, start_warnings, waits
from service.settings import Settings
from tests.conftest import ROOT, Databases, ServiceProcess, url_for, wait_for
from tests.integration.test_metrics import RecordingDatabase

UNIT = 10**9


def status(tools: list[dict[str, Any]], **settings: Any) -> task_pb2.Status:
    given = {"enabled": True, "currency": "EUR", "timezone": "UTC", **settings}
    return json_format.ParseDict({"settings": given, "tools": tools}, task_pb2.Status())


def tool(name: str, queued: int = 1, **fields: Any) -> dict[str, Any]:
    return {"tool_id": str(uuid.uuid4()), "name": name, "queued": queued, **fields}


def said(found: list[Wait]) -> dict[str, tuple[list[str], int]]:
    return {wait.reason: (wait.tools, wait.tasks) for wait in found}


def test_no_cap_holds_every_tool_with_queued_work() -> None:
    found = waits(status([tool("image-gen", 3), tool("video", 2), tool("idle", 0)]))
    assert said(found) == {"no_cap": (["image-gen", "video"], 5)}
    assert str(found[0]) == (
        "5 queued tasks (tools image-gen, video) wait: no daily spend cap is set; "
        "`genq cap N` sets one (N currency units a day, e.g. `genq cap 10`)"
    )


def test_each_tool_waits_on_the_first_gate_the_claim_checks() -> None:
    capped = {"daily_cap_nanos": str(10 * UNIT)}
    tools = [
        tool("paused", paused=True),
        tool("spent", daily_cap_nanos=str(UNIT), spent_today_nanos=str(UNIT)),
        tool("free"),
    ]
    found = said(waits(status(tools, **capped)))
    assert found == {"paused": (["paused"], 1), "tool_cap_spent": (["spent"], 1)}
    # The switch comes first: every tool waits on it, paused or not.
    assert said(waits(status(tools, enabled=False, **capped))) == {
        "disabled": (["paused", "spent", "free"], 3)
    }
    # Today's spend and reservations at the cap hold the tools that are not paused.
    full = {**capped, "spent_today_nanos": str(6 * UNIT), "reserved_nanos": str(4 * UNIT)}
    assert said(waits(status(tools, **full))) == {
        "paused": (["paused"], 1),
        "cap_spent": (["spent", "free"], 2),
    }


def test_each_wait_names_its_command() -> None:
    tools = [tool("a b", paused=True), tool("c", paused=True)]
    (paused,) = waits(status(tools, daily_cap_nanos="1"))
    assert paused.fix == "`genq resume 'a b'`; `genq resume c`"
    (off,) = waits(status([tool("c")], enabled=False))
    assert "`genq resume` turns it on" in str(off)
    (forced,) = waits(status([tool("c")], disabled_by_environment=True))
    assert "GENQ_DISABLED" in str(forced)
    (zero,) = waits(status([tool("c")], daily_cap_nanos="0"))
    assert zero.reason == "zero_cap" and "`genq cap N`" in str(zero)
    spent = status(
        [tool("c")], daily_cap_nanos=str(2 * UNIT), spent_today_nanos=str(2 * UNIT), timezone="UTC"
    )
    (full,) = waits(spent)
    assert "(2.00 EUR) reached the daily cap" in str(full) and "above 2.00" in str(full)
    (own,) = waits(
        status(
            [tool("c", daily_cap_nanos=str(UNIT), reserved_nanos=str(UNIT))],
            daily_cap_nanos=str(5 * UNIT),
        )
    )
    assert "`genq cap N --tool c` (now 1.00 EUR)" in str(own)
    # An override replaces the stored cap, as in the claim.
    (overridden,) = waits(status([tool("c")], daily_cap_nanos=str(UNIT), cap_override_nanos="0"))
    assert "GENQ_DAILY_CAP_NANOS=0" in str(overridden)


def test_a_task_estimated_above_the_cap_in_force_is_named_with_its_fix() -> None:
    capped = {"daily_cap_nanos": str(10 * UNIT)}
    tools = [
        tool("big", queued=1_000, largest_queued_estimate_nanos=str(12 * UNIT)),
        tool("own", daily_cap_nanos=str(UNIT), largest_queued_estimate_nanos=str(2 * UNIT)),
        tool("fits", largest_queued_estimate_nanos=str(10 * UNIT)),
    ]
    found = waits(status(tools, **capped))
    assert said(found) == {"over_cap": (["big", "own"], 2)}, "one task each, not the 1,000"
    assert str(found[0]).startswith("2 queued tasks (tools big, own) wait: each is estimated")
    assert found[0].fix == (
        "`genq cap N` with N at least 12.00, or cancel that task; "
        "`genq cap N --tool own` with N at least 2.00, or cancel that task"
    )
    # Both caps below it: both named. An override in force: the replica that sets it.
    both = tool("both", daily_cap_nanos=str(UNIT), largest_queued_estimate_nanos=str(11 * UNIT))
    (wait,) = waits(status([both], **capped))
    assert wait.fix.startswith("`genq cap N --tool both` and `genq cap N` with N at least 11.00")
    (wait,) = waits(
        status(
            [tool("big", largest_queued_estimate_nanos=str(2 * UNIT))],
            daily_cap_nanos=str(10 * UNIT),
            cap_override_nanos=str(UNIT),
        )
    )
    assert wait.fix.startswith("GENQ_DAILY_CAP_NANOS raised on the replica that sets it")


def test_start_warnings() -> None:
    assert start_warnings(status([], daily_cap_nanos=str(UNIT)).settings) == []
    (cap,) = start_warnings(status([]).settings)
    assert cap.startswith("no daily spend cap is set, so nothing will run: `genq cap N`")
    off = start_warnings(status([], enabled=False).settings)
    assert len(off) == 2 and off[0].startswith("the kill switch is off, so nothing will run")


def test_each_reason_is_said_once_a_minute_and_again_when_it_comes_back(uncapped: str) -> None:
    with psycopg.connect(uncapped, autocommit=True) as db:
        db.execute("INSERT INTO generation.tools (name) VALUES ('image-gen')")
        db.execute(
            "INSERT INTO generation.tasks (tool_id) "
            "SELECT id FROM generation.tools WHERE name = 'image-gen'"
        )

        async def scenario() -> None:
            database = RecordingDatabase(uncapped)
            await database.open()
            try:
                watcher = Waits(database, Settings(), check_seconds=0)
                assert [w.reason for w in await watcher.check()] == ["no_cap"]
                assert await watcher.check() == [], "said within the minute: not again"
                db.execute("UPDATE generation.tools SET paused = true")
                db.execute("UPDATE generation.settings SET daily_cap_nanos = 1")
                assert [w.reason for w in await watcher.check()] == ["paused"], "new: at once"
                db.execute("UPDATE generation.tools SET paused = false")
                db.execute("UPDATE generation.settings SET daily_cap_nanos = NULL")
                assert [w.reason for w in await watcher.check()] == ["no_cap"], "it came back"
                reads = len(database.statements)
                assert reads == 4
                pacing = Waits(database, Settings())
                await pacing.check()
                await pacing.check()
                assert len(database.statements) == reads + 1, "one read per check interval"
            finally:
                await database.close()

        asyncio.run(scenario())


@pytest.fixture
def uncapped(databases: Databases) -> str:
    url = url_for(databases.create(f"waits_{uuid.uuid4().hex[:6]}"))
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("UPDATE generation.settings SET daily_cap_nanos = NULL")
    return url


def test_the_leader_logs_why_tasks_wait(uncapped: str, tmp_path: Path) -> None:
    service = ServiceProcess(uncapped, tmp_path / "serve.log")
    try:
        name = f"tool-{uuid.uuid4().hex[:8]}"
        tool_id = service.stub.UpsertTool(task_pb2.UpsertToolRequest(name=name)).tool.id
        service.stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id))
        expected = f"1 queued task (tool {name}) wait: no daily spend cap is set; `genq cap N`"
        wait_for(
            lambda: expected in service.log_path.read_text(),
            timeout=3 * WAITS_CHECK_SECONDS,
            what="the leader's warning",
        )
    finally:
        service.stop()


def test_the_gateway_example_says_why_its_task_waits(uncapped: str, tmp_path: Path) -> None:
    service = ServiceProcess(uncapped, tmp_path / "serve.log")
    output = tmp_path / "gateway.out"
    with open(output, "wb") as out:
        gateway = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "gateway.py"), "a lighthouse"],
            env={**os.environ, "GENQ_ADDR": service.address},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(
                lambda: "still queued: no daily cap set: run `genq cap 10`" in output.read_text(),
                timeout=30,
                what="the gateway to say why",
            )
            service.stub.UpdateSettings(task_pb2.UpdateSettingsRequest(daily_cap_nanos=UNIT))
            # No worker runs here: that is what it says next.
            wait_for(
                lambda: "no worker has taken it yet" in output.read_text(),
                timeout=30,
                what="the next reason",
            )
        finally:
            gateway.kill()
            gateway.wait()
            service.stop()
