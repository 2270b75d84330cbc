"""The watchdog meets the deliberate waits (GUIDE §3, seed A's reaper vs seed B's waits): a task
held on purpose is never "abandoned", and its clock starts only when it could have run.

A database and a service of their own: the tests change the switch and the cap. Time moves by
writing timestamps in SQL, never by sleeping.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import psycopg
import pytest
from google.protobuf import duration_pb2
from psycopg.rows import dict_row

from generation.task.v1 import task_pb2, task_pb2_grpc
from service.leader.overrides import OVERRIDES_GONE_SQL
from tests.conftest import UNLIMITED, Databases, ServiceProcess, forget_waits, url_for
from tests.integration.test_server import genq
from workers_sdk.errors import Reason, from_rpc_error

Stub = task_pb2_grpc.GenerationDataServiceStub
Db = psycopg.Connection[dict[str, Any]]
HOUR = 3600


@pytest.fixture(scope="module")
def watch_url(databases: Databases) -> str:
    return url_for(databases.create("watchdog"))


@pytest.fixture(scope="module")
def watch_service(
    watch_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    # The lease rescuer sweeps once at start only: a dead zombie is what it leaves behind.
    process = ServiceProcess(
        watch_url,
        tmp_path_factory.mktemp("watchdog") / "serve.log",
        GENQ_RESCUE_INTERVAL_SECONDS="3600",
    )
    yield process
    process.stop()


@pytest.fixture
def wdb(watch_url: str) -> Iterator[Db]:
    with psycopg.connect(watch_url, autocommit=True, row_factory=dict_row) as connection:
        connection.execute(
            "UPDATE generation.settings SET enabled = true, daily_cap_nanos = %s", [UNLIMITED]
        )
        connection.execute("DELETE FROM generation.replica_overrides")
        yield connection


@pytest.fixture
def wstub(watch_service: ServiceProcess, wdb: Db) -> Stub:
    return watch_service.stub


@pytest.fixture
def wtool(wstub: Stub) -> str:
    return str(wstub.UpsertTool(task_pb2.UpsertToolRequest(name=uuid.uuid4().hex)).tool.id)


def waiting_an_hour(db: Db, stub: Stub, tool_id: str, **fields: Any) -> str:
    """A task queued (and due) an hour ago that nobody claimed, by any rule of the old watchdog
    long abandoned."""
    task = stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id, **fields)).task
    db.execute(
        "UPDATE generation.tasks SET created_at = now() - interval '1 hour', "
        "queued_at = now() - interval '1 hour', "
        "run_at = LEAST(run_at, now() - interval '1 hour') WHERE id = %s",
        [task.id],
    )
    return str(task.id)


def stale(stub: Stub, task_id: str) -> int | None:
    listed = stub.ListStaleTasks(task_pb2.ListStaleTasksRequest(limit=10_000)).tasks
    return next((s.reason for s in listed if s.task.id == task_id), None)


def force_fail(stub: Stub, task_id: str) -> Reason | None:
    try:
        stub.FailTask(task_pb2.FailTaskRequest(task_id=task_id, error="reaped"))
    except grpc.RpcError as error:
        return from_rpc_error(error).reason
    return None


def no_cap(db: Db, stub: Stub, tool_id: str) -> Callable[[], object]:
    stub.UpdateSettings(task_pb2.UpdateSettingsRequest(clear=["daily_cap_nanos"]))
    return lambda: stub.UpdateSettings(task_pb2.UpdateSettingsRequest(daily_cap_nanos=UNLIMITED))


def cap_reached(db: Db, stub: Stub, tool_id: str) -> Callable[[], object]:
    stub.ConfigureTool(
        task_pb2.ConfigureToolRequest(tool_id=tool_id, cost_estimate_nanos=10, daily_cap_nanos=5)
    )
    return lambda: stub.ConfigureTool(
        task_pb2.ConfigureToolRequest(tool_id=tool_id, clear=["daily_cap_nanos"])
    )


def switch_off(db: Db, stub: Stub, tool_id: str) -> Callable[[], object]:
    stub.UpdateSettings(task_pb2.UpdateSettingsRequest(enabled=False))
    return lambda: stub.UpdateSettings(task_pb2.UpdateSettingsRequest(enabled=True))


def switch_off_by_a_replica(db: Db, stub: Stub, tool_id: str) -> Callable[[], object]:
    """Another replica runs with GENQ_DISABLED=true (its row, as its housekeeping writes it)."""
    replica = uuid.uuid4()
    db.execute(
        "INSERT INTO generation.replica_overrides (replica_id, disabled) VALUES (%s, true)",
        [replica],
    )
    return lambda: db.execute(
        "DELETE FROM generation.replica_overrides WHERE replica_id = %s", [replica]
    )


def paused(db: Db, stub: Stub, tool_id: str) -> Callable[[], object]:
    stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, paused=True))
    return lambda: stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, paused=False))


def group_held(db: Db, stub: Stub, tool_id: str) -> Callable[[], object]:
    db.execute(
        "INSERT INTO generation.holds (account_group, held_until) "
        "SELECT name, now() + interval '1 hour' FROM generation.tools WHERE id = %s",
        [tool_id],
    )
    return lambda: db.execute(
        "UPDATE generation.holds SET held_until = now() - interval '2 hours' "
        "WHERE account_group = (SELECT name FROM generation.tools WHERE id = %s)",
        [tool_id],
    )


def key_cooling(db: Db, stub: Stub, tool_id: str) -> Callable[[], object]:
    db.execute(
        "INSERT INTO generation.cooldowns (resource_key, cooling_until) "
        "SELECT name, now() + interval '1 hour' FROM generation.tools WHERE id = %s",
        [tool_id],
    )
    return lambda: db.execute(
        "UPDATE generation.cooldowns SET cooling_until = now() - interval '2 hours' "
        "WHERE resource_key = (SELECT name FROM generation.tools WHERE id = %s)",
        [tool_id],
    )


def busy(db: Db, stub: Stub, tool_id: str) -> Callable[[], object]:
    """The tool at its max_in_flight: its worker's lanes are full, so it asks for nothing until
    the run ends (a run with a live lease, started before the task waited)."""
    stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, max_in_flight=1))
    running = db.execute(
        "INSERT INTO generation.tasks (tool_id, status, lease_token, claim_expires_at, queued_at) "
        "VALUES (%s, 'processing', gen_random_uuid(), now() + interval '1 hour', "
        "now() - interval '2 hours') RETURNING id",
        [tool_id],
    ).fetchone()
    assert running is not None
    return lambda: db.execute("DELETE FROM generation.tasks WHERE id = %s", [running["id"]])


def a_dearer_task_ahead_short_of_todays_room(
    db: Db, stub: Stub, tool_id: str
) -> Callable[[], object]:
    """The tool's cap has 40 left today and the task ahead in claim order is estimated at 50:
    the claim stops there, so the task behind it (estimated at 0, which fits) waits on the cap
    too, and is not called abandoned and reaped."""
    stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, daily_cap_nanos=100))
    db.execute(
        "UPDATE generation.tools AS t SET spent_nanos = 60, "
        "spent_day = (now() AT TIME ZONE s.timezone)::date FROM generation.settings AS s "
        "WHERE t.id = %s",
        [tool_id],
    )
    ahead = waiting_an_hour(db, stub, tool_id, priority=100, cost_estimate_nanos=50)
    return lambda: stub.CancelTask(task_pb2.CancelTaskRequest(task_id=ahead))


WAITS = [
    no_cap,
    cap_reached,
    a_dearer_task_ahead_short_of_todays_room,
    switch_off,
    switch_off_by_a_replica,
    paused,
    group_held,
    key_cooling,
    busy,
]


@pytest.mark.parametrize("hold", WAITS, ids=[w.__name__ for w in WAITS])
def test_a_deliberate_wait_is_never_abandoned(
    wdb: Db, wstub: Stub, wtool: str, hold: Callable[[Db, Stub, str], Callable[[], object]]
) -> None:
    task = waiting_an_hour(wdb, wstub, wtool)
    lift = hold(wdb, wstub, wtool)
    forget_waits(wdb, wtool)  # as if the wait had started long ago and no worker were left

    assert stale(wstub, task) is None
    assert force_fail(wstub, task) is Reason.TASK_NOT_STALE
    assert status(wdb, task) == "queued"

    lift()
    forget_waits(wdb, wtool)  # ... and ended long ago, with still no worker asking
    assert stale(wstub, task) == task_pb2.STALE_REASON_ABANDONED
    assert force_fail(wstub, task) is None
    assert status(wdb, task) == "failed"


def key_at_its_limit(own: bool) -> Callable[[Db, Stub, str], Callable[[], object]]:
    """A key limited to one run at a time, and that run another tool's, with a live lease: the
    task's own key (OWN_KEY), or the tool's (its name)."""

    def hold(db: Db, stub: Stub, tool_id: str) -> Callable[[], object]:
        key = OWN_KEY.format(tool=tool_id) if own else tool_name(db, tool_id)
        db.execute(
            "INSERT INTO generation.resource_limits (resource_key, max_in_flight) VALUES (%s, 1)",
            [key],
        )
        # The run: a task of another tool processing under the key (a run counts while its
        # task is processing), ended two hours ago when the hold is lifted.
        run = db.execute(
            "INSERT INTO generation.tasks (tool_id, status, resource_key, lease_token, "
            "claim_expires_at, started_at) VALUES (gen_random_uuid(), 'processing', %s, "
            "gen_random_uuid(), now() + interval '1 hour', now()) RETURNING id",
            [key],
        ).fetchone()
        assert run is not None
        return lambda: db.execute(
            "UPDATE generation.tasks SET status = 'completed', lease_token = NULL, "
            "claim_expires_at = NULL, completed_at = now() - interval '2 hours' WHERE id = %s",
            [run["id"]],
        )

    hold.__name__ = "its_own_key_at_its_limit" if own else "the_tools_key_at_its_limit"
    return hold


def key_rate_limited(own: bool) -> Callable[[Db, Stub, str], Callable[[], object]]:
    """A key limited to one run an hour, and that run started a minute ago (by another tool):
    the task's own key (OWN_KEY), or the tool's (its name)."""

    def hold(db: Db, stub: Stub, tool_id: str) -> Callable[[], object]:
        key = OWN_KEY.format(tool=tool_id) if own else tool_name(db, tool_id)
        stub.SetRateLimit(
            task_pb2.SetRateLimitRequest(
                resource_key=key, max_calls=1, window=duration_pb2.Duration(seconds=HOUR)
            )
        )
        db.execute(
            "INSERT INTO generation.rate_slices (resource_key, slice_end, calls, units) "
            "VALUES (%s, now() - interval '1 minute', 1, 0)",
            [key],
        )
        # Lifted: the run started long enough ago for its slot to have freed an hour ago.
        return lambda: db.execute(
            "UPDATE generation.rate_slices SET slice_end = now() - interval '3 hours' "
            "WHERE resource_key = %s",
            [key],
        )

    hold.__name__ = "its_own_key_rate_limited" if own else "the_tools_key_rate_limited"
    return hold


def tool_name(db: Db, tool_id: str) -> str:
    found = db.execute("SELECT name FROM generation.tools WHERE id = %s", [tool_id]).fetchone()
    assert found is not None
    return str(found["name"])


OWN_KEY = "own-{tool}"
"""The resource key and account group of the task in the test below."""
TOOL_WAITS = [
    key_cooling,
    group_held,
    key_at_its_limit(own=False),
    key_at_its_limit(own=True),
    key_rate_limited(own=False),
    key_rate_limited(own=True),
]


@pytest.mark.parametrize("hold", TOOL_WAITS, ids=[w.__name__ for w in TOOL_WAITS])
def test_a_task_with_its_own_key_and_group_waits_as_the_claim_makes_it_wait(
    wdb: Db, wstub: Stub, wtool: str, hold: Callable[[Db, Stub, str], Callable[[], object]]
) -> None:
    """The claim holds every task of a tool back while the tool's own key cools, its own group
    is held or its own key is at its limit, and a task's own key at its limit holds that task:
    the watchdog counts each as a wait, as it counts a cooldown of the task's own key, and
    does not call such a task abandoned."""
    own = OWN_KEY.format(tool=wtool)
    task = waiting_an_hour(wdb, wstub, wtool, resource_key=own, account_group=own)
    lift = hold(wdb, wstub, wtool)
    forget_waits(wdb, wtool)

    assert stale(wstub, task) is None
    assert force_fail(wstub, task) is Reason.TASK_NOT_STALE
    assert status(wdb, task) == "queued"

    lift()
    forget_waits(wdb, wtool)
    assert stale(wstub, task) == task_pb2.STALE_REASON_ABANDONED


def released_hold(db: Db, stub: Stub, tool_id: str) -> None:
    group_held(db, stub, tool_id)
    stub.ReleaseHold(task_pb2.ReleaseHoldRequest(account_group=tool_name(db, tool_id)))


def released_cooldown(db: Db, stub: Stub, tool_id: str) -> None:
    key_cooling(db, stub, tool_id)
    stub.ReleaseCooldown(task_pb2.ReleaseCooldownRequest(resource_key=tool_name(db, tool_id)))


RELEASES = [released_hold, released_cooldown]


@pytest.mark.parametrize("release", RELEASES, ids=[r.__name__ for r in RELEASES])
def test_a_wait_an_operator_ends_restarts_the_clock_as_one_that_runs_out(
    wdb: Db, wstub: Stub, wtool: str, release: Callable[[Db, Stub, str], None]
) -> None:
    """ReleaseHold deleted the hold and ReleaseCooldown cleared the cooldown, leaving the clock
    nothing to count from: a task that had waited on them was abandoned the moment an operator
    let it run (a review found it). Now the wait ends at the release, as if it had run out."""
    task = waiting_an_hour(wdb, wstub, wtool)
    release(wdb, wstub, wtool)
    forget_waits(wdb, wtool)
    assert stale(wstub, task) is None
    assert force_fail(wstub, task) is Reason.TASK_NOT_STALE


def estimate_lowered_under_the_cap(db: Db, stub: Stub, tool_id: str) -> None:
    cap_reached(db, stub, tool_id)  # an estimate of 10 against a cap of 5
    forget_waits(db, tool_id)
    stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, cost_estimate_nanos=1))


def moved_off_a_cooling_key(db: Db, stub: Stub, tool_id: str) -> None:
    key_cooling(db, stub, tool_id)  # the tool's own key, its name
    forget_waits(db, tool_id)
    stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=tool_id, resource_key="cool-key"))


CHANGES = [estimate_lowered_under_the_cap, moved_off_a_cooling_key]


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__ for c in CHANGES])
def test_a_tool_change_that_lets_its_tasks_run_restarts_the_clock(
    wdb: Db, wstub: Stub, wtool: str, change: Callable[[Db, Stub, str], None]
) -> None:
    """A change of the tool that ends a wait (an estimate that now fits the cap, a key that is
    not cooling) counts as a change of its gates, as a pause or a cap does: the task gets its
    max age from then, not called abandoned the moment it could run (a review found it)."""
    task = waiting_an_hour(wdb, wstub, wtool)
    change(wdb, wstub, wtool)
    wdb.execute("DELETE FROM generation.tool_polls WHERE tool_id = %s", [wtool])
    assert stale(wstub, task) is None
    assert force_fail(wstub, task) is Reason.TASK_NOT_STALE


def test_a_tool_change_that_changes_nothing_leaves_the_clock_alone(
    wdb: Db, wstub: Stub, wtool: str
) -> None:
    """Clearing a setting the tool does not have, or setting one to its value, holds nothing
    back and lets nothing run: an abandoned task stays found. Before, every clear restarted
    the clock, so a script sending it again kept the tool's tasks from ever being found."""
    task = waiting_an_hour(wdb, wstub, wtool)
    forget_waits(wdb, wtool)
    wstub.ConfigureTool(
        task_pb2.ConfigureToolRequest(
            tool_id=wtool,
            clear=["resource_key", "account_group", "daily_cap_nanos", "max_in_flight"],
            paused=False,
            cost_estimate_nanos=0,
        )
    )
    assert stale(wstub, task) == task_pb2.STALE_REASON_ABANDONED


def test_a_replica_that_held_the_switch_off_and_stopped_restarts_the_clock(
    wdb: Db, wstub: Stub, wtool: str
) -> None:
    """A replica run with GENQ_DISABLED holds every task back; when it stops cleanly it deletes
    its row, and the watchdog once had nothing left to count from: the tasks were abandoned the
    moment it went (a review found it). Its stop now counts as a change of the gates."""
    task = waiting_an_hour(wdb, wstub, wtool)
    replica = uuid.uuid4()
    wdb.execute(
        "INSERT INTO generation.replica_overrides (replica_id, disabled) VALUES (%s, true)",
        [replica],
    )
    forget_waits(wdb, wtool)
    wdb.execute(OVERRIDES_GONE_SQL, {"replica": replica})
    assert stale(wstub, task) is None
    assert force_fail(wstub, task) is Reason.TASK_NOT_STALE


@pytest.mark.parametrize("gone", [True, False], ids=["gone", "alive"])
def test_a_replica_overriding_the_cap_is_a_wait_until_shortly_after_it_is_gone(
    wdb: Db, wstub: Stub, wtool: str, gone: bool
) -> None:
    """A replica run with GENQ_DAILY_CAP_NANOS=0 holds every task back. Once it has not been
    seen for the 30 s its override still counts, the task has its max age from then, as after
    a GENQ_DISABLED replica (not abandoned at once). A live one
    whose cap leaves room holds nothing back, and the watchdog still finds the task."""
    task = waiting_an_hour(wdb, wstub, wtool)
    replica = uuid.uuid4()
    wdb.execute(
        "INSERT INTO generation.replica_overrides (replica_id, disabled, daily_cap_nanos, seen_at) "
        "VALUES (%s, false, %s, now() - make_interval(secs => %s))",
        [replica, 0 if gone else UNLIMITED, 31 if gone else 0],
    )
    try:
        forget_waits(wdb, wtool)
        if gone:
            assert stale(wstub, task) is None
            assert force_fail(wstub, task) is Reason.TASK_NOT_STALE
        else:
            assert stale(wstub, task) == task_pb2.STALE_REASON_ABANDONED
    finally:  # its sighting would hold every later test's tasks for the max age
        wdb.execute("DELETE FROM generation.replica_overrides WHERE replica_id = %s", [replica])


def test_a_task_due_later_is_not_abandoned_until_it_could_have_run(
    wdb: Db, wstub: Stub, wtool: str, watch_service: ServiceProcess
) -> None:
    """Seen: a job due in 1 h reaped 15 min after enqueue by `genq reconcile`."""
    task = wstub.QueueTask(
        task_pb2.QueueTaskRequest(tool_id=wtool, run_after={"seconds": now_seconds(wdb) + HOUR})
    ).task
    wdb.execute(
        "UPDATE generation.tasks SET created_at = now() - interval '20 minutes', "
        "queued_at = now() - interval '20 minutes' WHERE id = %s",
        [task.id],
    )
    forget_waits(wdb, wtool)
    reconcile = genq("reconcile", "--once", "--target", watch_service.address)
    assert reconcile.returncode == 0, reconcile.stderr
    assert status(wdb, task.id) == "queued"

    wdb.execute(
        "UPDATE generation.tasks SET run_at = now() - interval '901 seconds' WHERE id = %s",
        [task.id],
    )
    assert stale(wstub, task.id) == task_pb2.STALE_REASON_ABANDONED


def test_a_worker_asking_for_the_tools_work_keeps_its_backlog_alive(
    wdb: Db, wstub: Stub, wtool: str
) -> None:
    """A long backlog behind busy workers is waiting its turn, not abandoned."""
    task = waiting_an_hour(wdb, wstub, wtool)
    forget_waits(wdb, wtool)
    assert stale(wstub, task) == task_pb2.STALE_REASON_ABANDONED
    busy = waiting_an_hour(wdb, wstub, wtool, priority=100)  # what the worker gets next
    claimed = wstub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=wtool))
    assert claimed.task.id == busy
    assert stale(wstub, task) is None


def test_a_poll_counts_for_the_seconds_a_claim_may_leave_unnoted(
    wdb: Db, wstub: Stub, wtool: str
) -> None:
    """A claim notes its tool's poll at most every 5 s, so under a short queued_max_age a tool
    whose worker keeps asking must not look unattended between two notes."""
    task = waiting_an_hour(wdb, wstub, wtool)
    forget_waits(wdb, wtool)
    wdb.execute(
        "INSERT INTO generation.tool_polls (tool_id, polled_at) "
        "VALUES (%s, now() - interval '6 seconds')",
        [wtool],
    )
    wstub.UpdateSettings(task_pb2.UpdateSettingsRequest(queued_max_age_seconds=3))
    try:
        assert stale(wstub, task) is None, "asked 6 s ago: maybe 1 s ago, unnoted"
        wdb.execute(
            "UPDATE generation.tool_polls SET polled_at = now() - interval '9 seconds' "
            "WHERE tool_id = %s",
            [wtool],
        )
        assert stale(wstub, task) == task_pb2.STALE_REASON_ABANDONED
    finally:
        wstub.UpdateSettings(task_pb2.UpdateSettingsRequest(queued_max_age_seconds=900))


def test_the_clock_restarts_when_a_wait_ends(wdb: Db, wstub: Stub, wtool: str) -> None:
    task = waiting_an_hour(wdb, wstub, wtool)
    paused(wdb, wstub, wtool)
    forget_waits(wdb, wtool)
    wstub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=wtool, paused=False))
    assert stale(wstub, task) is None, "just resumed: workers get queued_max_age to come"


def test_a_requeued_task_whose_workers_vanished_is_found(wdb: Db, wstub: Stub, wtool: str) -> None:
    """Ran once, failed retryably, requeued: it is not `never started`, yet it is abandoned."""
    waiting_an_hour(wdb, wstub, wtool)
    claimed = wstub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=wtool))
    wstub.FailTask(
        task_pb2.FailTaskRequest(
            task_id=claimed.task.id, lease_token=claimed.lease_token, increment_retry=True
        )
    )
    wdb.execute(
        "UPDATE generation.tasks SET queued_at = now() - interval '1 hour', "
        "run_at = now() - interval '1 hour' WHERE id = %s",
        [claimed.task.id],
    )
    forget_waits(wdb, wtool)
    assert stale(wstub, claimed.task.id) == task_pb2.STALE_REASON_ABANDONED


def test_what_stale_means_is_a_stored_setting(wdb: Db, wstub: Stub, wtool: str) -> None:
    task = waiting_an_hour(wdb, wstub, wtool)
    forget_waits(wdb, wtool, seconds=3 * HOUR)
    settings = wstub.UpdateSettings(
        task_pb2.UpdateSettingsRequest(queued_max_age_seconds=2 * HOUR)
    ).settings
    try:
        assert settings.queued_max_age_seconds == 2 * HOUR
        assert stale(wstub, task) is None, "an hour is young under a two-hour threshold"
        assert force_fail(wstub, task) is Reason.TASK_NOT_STALE
    finally:
        wstub.UpdateSettings(task_pb2.UpdateSettingsRequest(queued_max_age_seconds=900))


@pytest.mark.parametrize(
    ("confirmed", "max_retries", "ends"),
    [(False, 1, "queued"), (True, 2, "queued"), (True, 1, "failed")],
    ids=["unconfirmed", "confirmed-retries-left", "confirmed-last-run"],
)
def test_a_lease_nobody_handed_back_is_a_dead_zombie_the_reaper_ends_as_its_lapse_decides(
    wdb: Db, wstub: Stub, wtool: str, confirmed: bool, max_retries: int, ends: str
) -> None:
    """The rescuer is not running (here: it sweeps once an hour). Past the grace the watchdog
    lists the lease; the reaper ends the run as the rescuer would have: a claim that never
    reached a worker or a run with retries left goes back to the queue; only a last run fails."""
    task = waiting_an_hour(wdb, wstub, wtool, max_retries=max_retries)
    claimed = wstub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=wtool))
    assert claimed.task.id == task
    if confirmed:
        wstub.HeartbeatTask(
            task_pb2.HeartbeatTaskRequest(task_id=task, lease_token=claimed.lease_token)
        )
    lapsed(wdb, task, 110)
    assert stale(wstub, task) is None, "within the 120 s grace"
    assert force_fail(wstub, task) is Reason.TASK_NOT_STALE
    lapsed(wdb, task, 121)
    assert stale(wstub, task) == task_pb2.STALE_REASON_DEAD_ZOMBIE
    assert force_fail(wstub, task) is None
    assert status(wdb, task) == ends
    attempt = wdb.execute(
        "SELECT outcome::text FROM generation.attempts WHERE task_id = %s", [task]
    ).fetchone()
    assert attempt == {"outcome": "abandoned" if confirmed else "unconfirmed"}
    stored = wdb.execute(
        "SELECT retry_count FROM generation.tasks WHERE id = %s", [task]
    ).fetchone()
    assert stored == {"retry_count": int(confirmed)}


def lapsed(db: Db, task_id: str, seconds: int) -> None:
    db.execute(
        "UPDATE generation.tasks SET claim_expires_at = now() - make_interval(secs => %s) "
        "WHERE id = %s",
        [seconds, task_id],
    )


def status(db: Db, task_id: str) -> str:
    found = db.execute("SELECT status::text FROM generation.tasks WHERE id = %s", [task_id])
    row = found.fetchone()
    assert row is not None
    return str(row["status"])


def now_seconds(db: Db) -> int:
    found = db.execute("SELECT extract(epoch FROM now())::bigint AS t").fetchone()
    assert found is not None
    return int(found["t"])


def test_the_watchdogs_reads_do_not_judge_a_drained_backlog_row_by_row(
    databases: Databases,
) -> None:
    """A long backlog that a worker is draining (its tool polled just now) cannot be abandoned:
    GetStatus's stale count and ListStaleTasks ask stale_reason_v1 about none of its tasks
    (generation.unattended_tools_v1), so a status read stays cheap whatever the backlog. The
    same tasks of a tool nobody polls are judged, and found stale."""
    from service.api.rpcs import BINDINGS, STATEMENTS
    from service.settings import Settings

    url = url_for(databases.create("stale_reads"))
    settings = Settings.from_env({"DATABASE_URL": url})
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as db:
        attended, unattended = (
            db.execute(
                "INSERT INTO generation.tools (name, gates_changed_at) "
                "VALUES (%s, now() - interval '1 day') RETURNING id",
                [name],
            ).fetchone()["id"]  # type: ignore[index]
            for name in ("drained", "forgotten")
        )
        db.execute("UPDATE generation.settings SET gates_changed_at = now() - interval '1 day'")
        for tool, count in ((attended, 500), (unattended, 3)):
            db.execute(
                "INSERT INTO generation.tasks (tool_id, queued_at, run_at) "
                "SELECT %s, now() - interval '1 hour', now() - interval '1 hour' "
                "FROM generate_series(1, %s)",
                [tool, count],
            )
        db.execute("INSERT INTO generation.tool_polls VALUES (%s, now())", [attended])
        with db.transaction():
            db.execute("SET LOCAL jit = off")  # as in the service's sessions
            db.execute("SET LOCAL track_functions = 'all'")
            status = db.execute(
                STATEMENTS["GetStatus"],
                BINDINGS["GetStatus"].bind(task_pb2.GetStatusRequest(), settings),
            ).fetchone()
            listed = db.execute(
                STATEMENTS["ListStaleTasks"],
                BINDINGS["ListStaleTasks"].bind(task_pb2.ListStaleTasksRequest(), settings),
            ).fetchall()
            judged = db.execute(
                "SELECT COALESCE(sum(calls), 0) AS n FROM pg_stat_xact_user_functions "
                "WHERE funcname = 'stale_reason_v1'"
            ).fetchone()
    assert status is not None and status["status"]["stale_tasks"] == 3
    assert {row["tool_id"] for row in listed} == {unattended} and len(listed) == 3
    assert judged == {"n": 6}, "only the unattended tool's tasks were judged, once per read"
