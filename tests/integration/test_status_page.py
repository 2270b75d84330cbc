"""The status page (GUIDE B9) as a person sees it: the real service, real headless Chromium.

The state is set up first through gRPC (and SQL only for what no RPC makes at once: a cooling key,
a held group, tasks old enough to be stale); then Chromium renders the page, its DOM is read back
and a screenshot is kept in artifacts/status-page.png. Chromium must be installed (.ci/run does).
"""

from __future__ import annotations

import copy
import http.client
import json
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo

import psycopg
import pytest
from google.protobuf import duration_pb2, json_format

from generation.task.v1 import task_pb2
from tests.conftest import ROOT, Databases, ServiceProcess, free_port, url_for, wait_for
from tests.faults.test_clock_skew import LIBFAKETIME
from tests.tcp_proxy import TcpProxy

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
NANOS = 1_000_000_000
PAUSED_TOOL = "render-cats"
SILENT_TOOL = "write-poems"
COOLING_KEY = "acme/<b>bold</b>-model"  # markup in a name must show as text
HELD_GROUP = "acme-account"
ZONE = "Europe/Berlin"  # the page shows times on the settings' clock
MOVED = {"completed": 30, "failed": 45}  # one run of each ended this many minutes ago


@dataclass
class Page:
    service: ServiceProcess
    base: str
    database_url: str


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail(
            "chromium is not installed: .ci/run installs it "
            "(apt-get install -y chromium, Debian's package); the status page tests need it",
            pytrace=False,
        )
    return path


def browse(tmp_path: Path, *arguments: str) -> str:
    profile = tmp_path / f"chromium-{uuid.uuid4().hex[:8]}"
    result = subprocess.run(
        [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *arguments],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def page(databases: Databases, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Page]:
    """A service of its own (the kill switch goes off here), in the state the page must show."""
    database_url = url_for(databases.create("status_page"))
    http_port = free_port()
    service = ServiceProcess(
        database_url,
        tmp_path_factory.mktemp("status_page") / "serve.log",
        GENQ_HTTP_PORT=str(http_port),
    )
    try:
        set_up(service, database_url)
        yield Page(service, f"http://127.0.0.1:{http_port}", database_url)
    finally:
        service.stop()


def set_up(service: ServiceProcess, database_url: str) -> None:
    stub = service.stub
    stub.UpdateSettings(
        task_pb2.UpdateSettingsRequest(currency="EUR", daily_cap_nanos=5 * NANOS, timezone=ZONE)
    )
    cats = stub.UpsertTool(task_pb2.UpsertToolRequest(name=PAUSED_TOOL)).tool.id
    stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=cats, cost_estimate_nanos=NANOS // 10))
    for _ in range(7):
        stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=cats))
    # Five runs end (3 completed at 0.25 EUR, 2 failed at 0.05 EUR): the chart has bars and
    # today's spend is 0.85 EUR. A sixth runs on, reserving its 0.10 EUR estimate.
    for index in range(6):
        claim = stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=cats))
        assert claim.task.id, claim
        if index < 3:
            stub.CompleteTask(
                task_pb2.CompleteTaskRequest(
                    task_id=claim.task.id,
                    lease_token=claim.lease_token,
                    reported_usage=task_pb2.ReportedUsage(cost_nanos=NANOS // 4),
                )
            )
        elif index < 5:
            stub.FailTask(
                task_pb2.FailTaskRequest(
                    task_id=claim.task.id,
                    lease_token=claim.lease_token,
                    error="provider said no",
                    failure=task_pb2.FAILURE_KIND_PERMANENT,
                    reported_usage=task_pb2.ReportedUsage(cost_nanos=NANOS // 20),
                )
            )
    stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=cats, paused=True))

    poems = stub.UpsertTool(task_pb2.UpsertToolRequest(name=SILENT_TOOL)).tool.id
    for _ in range(2):  # never claimable: stale even while the switch is off
        stub.QueueTask(
            task_pb2.QueueTaskRequest(tool_id=poems, max_retries=0, source="status-page-test")
        )
    stub.UpdateSettings(task_pb2.UpdateSettingsRequest(enabled=False))

    with psycopg.connect(database_url, autocommit=True) as db:
        for outcome, minutes in MOVED.items():
            db.execute(
                "UPDATE generation.attempts SET ended_at = ended_at - make_interval(mins => %s) "
                "WHERE (task_id, attempt) IN ("
                "  SELECT task_id, attempt FROM generation.attempts WHERE outcome = %s LIMIT 1)",
                [minutes, outcome],
            )
        # Queued 20 minutes ago, and no worker seen (600 s).
        db.execute(
            "UPDATE generation.tasks SET created_at = now() - interval '20 minutes', "
            "queued_at = now() - interval '20 minutes' "
            "WHERE tool_id = %s",
            [poems],
        )
        # As a cooldown starts: its count of failures in a row begins again at 0.
        db.execute(
            "INSERT INTO generation.cooldowns (resource_key, consecutive_failures, cooling_until) "
            "VALUES (%s, 0, now() + interval '10 minutes')",
            [COOLING_KEY],
        )
        db.execute(
            "INSERT INTO generation.holds (account_group, held_until, reason) "
            "VALUES (%s, now() + interval '1 hour', 'out of credit')",
            [HELD_GROUP],
        )


class Dom(HTMLParser):
    """The text of each element with an id (what a person reads there), and the tags seen."""

    def __init__(self, markup: str) -> None:
        super().__init__(convert_charrefs=True)
        self.text: dict[str, str] = {}
        self.tags: list[tuple[str, dict[str, str]]] = []
        self._open: list[tuple[str, str | None]] = []
        self.all: list[str] = []
        self.feed(markup)

    VOID = frozenset({"meta", "link", "br", "img", "input", "hr", "line", "rect", "path"})

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {name: value or "" for name, value in attrs}
        self.tags.append((tag, attributes))
        self.handle_data(" ")  # cells and blocks read as separate words
        if tag in self.VOID:
            return
        self._open.append((tag, attributes.get("id")))
        if attributes.get("id"):
            self.text[attributes["id"]] = ""

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {name: value or "" for name, value in attrs}))

    def handle_endtag(self, tag: str) -> None:
        self.handle_data(" ")
        if tag in self.VOID:
            return
        while self._open:
            opened, _ = self._open.pop()
            if opened == tag:
                break

    def handle_data(self, data: str) -> None:
        self.all.append(data)
        for _, element in self._open:
            if element:
                self.text[element] += data

    def text_of_all(self) -> str:
        """Every text of the markup fed, in order (the Dom of a fragment)."""
        return " ".join(self.all)

    def section(self, element: str) -> str:
        assert element in self.text, f"no element #{element} on the page"
        return " ".join(self.text[element].split())

    def count(self, tag: str, css_class: str) -> int:
        return sum(
            1 for name, attrs in self.tags if name == tag and css_class in attrs.get("class", "")
        )


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def getheader(self, name: str) -> str:
        value = self.headers[name]
        assert value is not None, f"no {name} header"
        return value


def request(page: Page, method: str, path: str, body: bytes | None = None) -> Reply:
    return fetch(page.base, method, path, body)


def fetch(base: str, method: str, path: str, body: bytes | None = None) -> Reply:
    connection = http.client.HTTPConnection("127.0.0.1", int(base.rsplit(":", 1)[1]), 10)
    try:
        connection.request(method, path, body=body)
        response = connection.getresponse()
        return Reply(response.status, response.headers, response.read())
    finally:
        connection.close()


def status_now(page: Page) -> dict[str, Any]:
    """GetStatus over gRPC as a dict, without the ages that move with the clock."""
    answer = page.service.stub.GetStatus(task_pb2.GetStatusRequest())
    return without_ages(
        json_format.MessageToDict(
            answer, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    )


def without_ages(document: dict[str, Any]) -> dict[str, Any]:
    """The document without what moves with the clock between two reads."""
    document = copy.deepcopy(document)
    document["status"].pop("as_of", None)
    for depth in document["status"].get("depths", []):
        depth.pop("oldest_age", None)
    return document


def test_the_page_shows_the_state_in_a_browser(page: Page, tmp_path: Path) -> None:
    dom_text = browse(tmp_path, "--dump-dom", f"{page.base}/")
    dom = Dom(dom_text)

    assert ("meta", {"http-equiv": "refresh", "content": "10"}) in dom.tags
    assert f"({ZONE})" in dom.section("header")
    assert "disabled" in dom.section("switch")
    warnings = dom.section("warnings")
    assert "Capped" not in warnings  # 0.95 EUR of 5.00 EUR
    # Every banner says the command that ends it.
    banners = dom_text.split('id="warnings"')[1].split("</ul>")[0]
    assert banners.count("<li") == banners.count("Fix: <code>") >= 5
    assert "Disabled: the kill switch is off; nothing runs. Fix: genq resume " in warnings
    assert f"Paused: tool {PAUSED_TOOL} has 1 queued" in warnings
    assert f"Fix: genq resume {PAUSED_TOOL} " in warnings
    assert f"Cooling: resource key {COOLING_KEY}" in warnings
    assert f"Fix: genq release-cooldown '{COOLING_KEY}' " in warnings
    assert f"Held: account group {HELD_GROUP} (out of credit)" in warnings
    assert f"Fix: genq release-hold {HELD_GROUP} " in warnings
    # The stale banner names the tasks (a few, and how many in all) and what fails them.
    stale = page.service.stub.ListStaleTasks(task_pb2.ListStaleTasksRequest()).tasks
    assert "Stale: 2 live task(s) can never finish on their own:" in warnings
    for item in stale:
        assert f"{item.task.id} (unclaimable, from status-page-test)" in warnings
    assert "Fix: genq reconcile --once fails them" in warnings

    assert "5.00 EUR" in dom.section("cap")
    assert "0.85 EUR" in dom.section("spend")
    assert "19.0% of the cap" in dom.section("spend")  # (0.85 + 0.10) / 5.00
    assert "0.10 EUR" in dom.section("reserved")
    assert "Stale tasks 2 cannot finish on their own" in dom.section("stale")

    assert PAUSED_TOOL in dom.section("paused")
    assert SILENT_TOOL not in dom.section("paused")
    # A cooling key's count began again with the cooldown: it says until when, not "0 in a row".
    cooling = dom.section("cooling")
    until = cooling_until(page)
    assert f"{COOLING_KEY} · cooling until {until:%H:%M:%S} (" in cooling
    assert "failures in a row" not in cooling and "failed since" not in cooling
    assert "<b>" not in dom_text.split('id="cooling"')[1].split("</section>")[0]
    assert HELD_GROUP in dom.section("holds") and "out of credit" in dom.section("holds")
    # The audit log's newest entries: set_up's changes, by an anonymous caller (no auth here).
    audit = dom.section("audit")
    assert "ConfigureTool by anonymous" in audit and "UpdateSettings by anonymous" in audit

    tools = dom.section("tools")
    assert f"{PAUSED_TOOL} paused 1 " in tools
    depths = dom.section("depths")
    assert f"{PAUSED_TOOL} processing 1" in depths
    assert f"{PAUSED_TOOL} queued 1" in depths
    assert f"{SILENT_TOOL} queued 2 20 min" in depths

    chart = dom.section("chart")
    assert "completed (3)" in chart and "failed, retried or lost (2)" in chart
    assert any(tag == "svg" and attrs.get("role") == "img" for tag, attrs in dom.tags)
    # One run of each kind moved back in time has a bar of its own, labelled with its minute.
    assert 2 <= dom.count("rect", "completed") <= 3
    assert dom.count("rect", "failed") == 2
    for outcome, minute in ended_minutes(page).items():
        label = f"{minute.astimezone(ZoneInfo(ZONE)):%H:%M}"
        done, failed = (1, 0) if outcome == "completed" else (0, 1)
        assert f"<title>{label}: {done} completed, {failed} failed</title>" in dom_text


def cooling_until(page: Page) -> datetime:
    """When COOLING_KEY cools until, on the page's clock."""
    with psycopg.connect(page.database_url) as db:
        found = db.execute(
            "SELECT cooling_until FROM generation.cooldowns WHERE resource_key = %s",
            [COOLING_KEY],
        ).fetchone()
    assert found is not None
    return found[0].astimezone(ZoneInfo(ZONE))


def ended_minutes(page: Page) -> dict[str, datetime]:
    """The minute each moved run ended in, by outcome."""
    with psycopg.connect(page.database_url) as db:
        rows = db.execute(
            "SELECT outcome::text, date_trunc('minute', ended_at) FROM generation.attempts "
            "WHERE ended_at < now() - interval '20 minutes'"
        ).fetchall()
    assert len(rows) == len(MOVED)
    return dict(rows)


def test_screenshot(page: Page, tmp_path: Path) -> None:
    shot = tmp_path / "status-page.png"
    browse(tmp_path, f"--screenshot={shot}", "--window-size=1280,1400", f"{page.base}/")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    artifacts = ROOT / "artifacts"
    artifacts.mkdir(exist_ok=True)
    shutil.copyfile(shot, artifacts / "status-page.png")


def test_status_json_is_the_get_status_answer(page: Page) -> None:
    response = request(page, "GET", "/status.json")
    assert response.status == 200
    assert response.getheader("Content-Type") == "application/json"
    document = json.loads(response.body)
    assert without_ages(document) == status_now(page)
    settings = document["status"]["settings"]
    # Every field, those at their proto3 default too: `enabled: false` is there to read.
    assert settings["currency"] == "EUR" and settings["enabled"] is False
    assert settings["disabled_by_environment"] is False
    for tool in document["status"]["tools"]:
        assert {"paused", "queued", "no_worker_seen", "reserved_nanos"} <= tool.keys()
    assert {depth["tool_name"] for depth in document["status"]["depths"]} == {
        PAUSED_TOOL,
        SILENT_TOOL,
    }
    assert all(depth["oldest_age"].endswith("s") for depth in document["status"]["depths"])


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
@pytest.mark.parametrize("path", ["/", "/status.json", "/metrics"])
def test_writes_are_refused_and_change_nothing(page: Page, method: str, path: str) -> None:
    before = status_now(page)
    response = request(page, method, path, body=b'{"enabled": true}')
    assert response.status == 405
    assert response.getheader("Allow") == "GET, HEAD"
    assert status_now(page) == before


def test_head_health_and_unknown_paths(page: Page) -> None:
    get, head = request(page, "GET", "/"), request(page, "HEAD", "/")
    assert get.status == head.status == 200
    assert get.getheader("Content-Type") == "text/html; charset=utf-8"
    assert "script-src" not in get.getheader("Content-Security-Policy")  # default-src 'none'
    assert head.body == b"" and int(head.getheader("Content-Length")) > 0

    health = request(page, "GET", "/healthz")
    assert (health.status, health.body) == (200, b"SERVING\n")
    assert request(page, "GET", "/nope").status == 404
    assert request(page, "GET", "/status.json?pretty=1").status == 200


def test_a_busy_http_port_stops_the_start(page: Page, tmp_path: Path) -> None:
    """Like the gRPC port: a port in use is a configuration error, said at once."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(AssertionError, match=r"GENQ_HTTP_PORT: cannot listen on 127\.0\.0\.1:"):
            ServiceProcess(page.database_url, tmp_path / "serve.log", GENQ_HTTP_PORT=str(port))


# -- waits on purpose, and tools held up --------------------------------------------------------

FRESH_PAUSED, FRESH, SILENT = "fresh-paused", "fresh", "long-silent"
BUSY, COOLING, HELD, RATED = "at-its-limit", "cooling-tool", "held-tool", "rate-limited"
OVER_CAP = "over-its-cap"


@pytest.fixture(scope="module")
def waits(databases: Databases, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Page]:
    """The switch on and a cap set: a tool that waits here does so for a reason of its own."""
    database_url = url_for(databases.create("status_waits"))
    http_port = free_port()
    service = ServiceProcess(
        database_url,
        tmp_path_factory.mktemp("status_waits") / "serve.log",
        GENQ_HTTP_PORT=str(http_port),
    )
    try:
        stub = service.stub
        ids = {
            name: stub.UpsertTool(task_pb2.UpsertToolRequest(name=name)).tool.id
            for name in (FRESH_PAUSED, FRESH, SILENT, BUSY, COOLING, HELD, OVER_CAP, RATED)
        }
        for tool_id in ids.values():
            for _ in range(2):
                stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=tool_id))
        stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=ids[FRESH_PAUSED], paused=True))
        stub.ConfigureTool(task_pb2.ConfigureToolRequest(tool_id=ids[BUSY], max_in_flight=1))
        stub.ConfigureTool(
            task_pb2.ConfigureToolRequest(tool_id=ids[OVER_CAP], daily_cap_nanos=100)
        )
        stub.QueueTask(task_pb2.QueueTaskRequest(tool_id=ids[OVER_CAP], cost_estimate_nanos=150))
        claimed = stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=ids[BUSY]))
        assert claimed.task.id, claimed
        stub.SetRateLimit(
            task_pb2.SetRateLimitRequest(
                resource_key=RATED, max_calls=1, window=duration_pb2.Duration(seconds=3600)
            )
        )
        claimed = stub.ClaimNextTask(task_pb2.ClaimNextTaskRequest(tool_id=ids[RATED]))
        assert claimed.task.id, claimed
        with psycopg.connect(database_url, autocommit=True) as db:
            # Every tool but the fresh ones has been there, queued and unclaimed, for 20 minutes.
            db.execute(
                "UPDATE generation.tools SET created_at = now() - interval '20 minutes', "
                "gates_changed_at = now() - interval '20 minutes' WHERE NOT name = ANY(%s)",
                [[FRESH_PAUSED, FRESH]],
            )
            db.execute(
                "UPDATE generation.settings SET gates_changed_at = now() - interval '20 minutes'"
            )
            db.execute(
                "INSERT INTO generation.cooldowns (resource_key, consecutive_failures, "
                "cooling_until) VALUES (%s, 0, now() + interval '10 minutes')",
                [COOLING],
            )
            db.execute(
                "INSERT INTO generation.holds (account_group, held_until, reason) "
                "VALUES (%s, now() + interval '1 hour', 'account error')",
                [HELD],
            )
        yield Page(service, f"http://127.0.0.1:{http_port}", database_url)
    finally:
        service.stop()


def tool_rows(dom_text: str) -> dict[str, str]:
    """Each tool's row of the tools table, as read."""
    table = dom_text.split('id="tools"')[1].split("</table>")[0]
    rows = [" ".join(Dom(row).text_of_all().split()) for row in table.split("<tr>")[2:]]
    return {row.split(" ")[0]: row for row in rows}


def test_a_silent_tool_is_flagged_with_its_fix(waits: Page, tmp_path: Path) -> None:
    dom_text = browse(tmp_path, "--dump-dom", f"{waits.base}/")
    warnings = Dom(dom_text).section("warnings")
    assert f"No worker: tool {SILENT} has 2 queued and no claim for 10 minutes" in warnings
    assert f"Fix: genq pause {SILENT} if its work is meant to wait" in warnings
    assert f"Paused: tool {FRESH_PAUSED} has 2 queued" in warnings
    assert "no worker seen" in tool_rows(dom_text)[SILENT]


def test_a_tool_waiting_on_purpose_or_new_is_not_flagged(waits: Page, tmp_path: Path) -> None:
    """Paused (and created a moment ago), or younger than the silence window: no "no worker"."""
    dom_text = browse(tmp_path, "--dump-dom", f"{waits.base}/")
    warnings = Dom(dom_text).section("warnings")
    rows = tool_rows(dom_text)
    for name in (FRESH_PAUSED, FRESH, BUSY, COOLING, HELD, RATED):
        assert f"No worker: tool {name} " not in warnings
        assert "no worker seen" not in rows[name], rows[name]


def test_held_cooling_and_busy_tools_are_badged(waits: Page, tmp_path: Path) -> None:
    rows = tool_rows(browse(tmp_path, "--dump-dom", f"{waits.base}/"))
    assert f"{COOLING} cooling " in rows[COOLING]
    assert f"{HELD} held " in rows[HELD]
    assert f"{BUSY} busy 1 of 1 running " in rows[BUSY]
    assert f"{FRESH} ok " in rows[FRESH]
    assert f"{OVER_CAP} a task over the cap " in rows[OVER_CAP]
    assert f"{RATED} rate limited " in rows[RATED]
    for name in (COOLING, HELD, BUSY, OVER_CAP, RATED):
        assert " ok " not in rows[name]


def test_a_rate_limit_shows_its_window_and_next_slot(waits: Page, tmp_path: Path) -> None:
    panel = Dom(browse(tmp_path, "--dump-dom", f"{waits.base}/")).section("rate-limits")
    assert f"{RATED} · 1/1 calls per 1 h · at its limit: next slot at " in " ".join(panel.split())


def test_healthz_answers_503_within_a_second_with_the_database_down(
    databases: Databases, tmp_path: Path
) -> None:
    """A probe with a 1 s timeout gets its answer, not a timeout of its own (the pool waits 5 s)."""
    target = urlsplit(url_for(databases.create("status_outage")))
    proxy = TcpProxy((target.hostname or "127.0.0.1", target.port or 5432))
    proxy.start()
    proxied = target._replace(netloc=f"{target.username}@127.0.0.1:{proxy.port}").geturl()
    base = f"http://127.0.0.1:{free_port()}"
    service = ServiceProcess(proxied, tmp_path / "serve.log", GENQ_HTTP_PORT=base.rsplit(":", 1)[1])
    try:
        assert fetch(base, "GET", "/healthz").status == 200
        proxy.cut()

        def answered_503_in_time() -> bool:
            started = time.monotonic()
            reply = fetch(base, "GET", "/healthz")
            took = time.monotonic() - started
            assert took < 1.0, f"/healthz took {took:.2f} s ({reply.status})"
            return reply.status == 503 and reply.body.startswith(b"NOT_SERVING")

        wait_for(answered_503_in_time, what="/healthz 503")
        for _ in range(3):  # and every time, not once
            assert answered_503_in_time()
        proxy.start()
        wait_for(lambda: fetch(base, "GET", "/healthz").status == 200, timeout=30, what="200")
    finally:
        service.stop()
        proxy.cut()


def test_the_chart_keeps_the_database_clock(page: Page, tmp_path: Path) -> None:
    """The service host's clock 3 h ahead: the bars stay on the minutes their runs ended."""
    if not LIBFAKETIME.exists():
        pytest.fail("libfaketime is not installed: .ci/run installs it (apt-get install faketime)")
    http_port = free_port()
    skewed = ServiceProcess(
        page.database_url,
        tmp_path / "serve.log",
        GENQ_HTTP_PORT=str(http_port),
        LD_PRELOAD=str(LIBFAKETIME),
        FAKETIME="+3h",
        FAKETIME_DONT_FAKE_MONOTONIC="1",
    )
    try:
        dom_text = browse(tmp_path, "--dump-dom", f"http://127.0.0.1:{http_port}/")
    finally:
        skewed.stop()
    assert "completed (3)" in Dom(dom_text).section("chart")
    for outcome, minute in ended_minutes(page).items():
        label = f"{minute.astimezone(ZoneInfo(ZONE)):%H:%M}"
        done, failed = (1, 0) if outcome == "completed" else (0, 1)
        assert f"<title>{label}: {done} completed, {failed} failed</title>" in dom_text
