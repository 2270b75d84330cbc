"""The status page's actions and its task page, as a person uses them: the real service under
GENQ_AUTH=required, real headless Chromium driven through the DevTools protocol (it logs in,
presses the page's buttons, answers its confirmation pages), and the database read back: every
action changed what its RPC changes and left the RPC's audit row; a viewer has no button, and a
POST without the form's CSRF token changes nothing.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import psycopg
import pytest
from google.protobuf.struct_pb2 import Struct

from generation.task.v1 import task_pb2
from service import tokens
from service.page.actions import form_token
from tests.conftest import Databases, ServiceProcess, end_process, free_port, url_for, wait_for
from tests.integration.test_status_page import CHROMIUM_FLAGS, Dom, chromium

NANOS = 1_000_000_000
PAINT, WRITE = "paint", "write"
COOLING_KEY = "acme/image-model"
HELD_GROUP = "acme-account"
SECRET_A, SECRET_B = "prompt-secret-a", "prompt-secret-b"


# --- the browser ----------------------------------------------------------------------------------


class Browser:
    """Headless Chromium, one tab, driven over the DevTools protocol: what a person does (open a
    URL, type, press a button) and what they see (the DOM). Each step waits for the next page
    to have loaded, with a deadline."""

    def __init__(self, profile: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.process = subprocess.Popen(
            [
                chromium(),
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = profile / "DevToolsActivePort"

        def port() -> int | None:
            if self.process.poll() is not None:
                raise AssertionError("chromium exited")
            lines = port_file.read_text().split() if port_file.exists() else []
            return int(lines[0]) if len(lines) >= 2 else None

        self.port = wait_for(port, timeout=60, what="chromium's DevTools port")
        self.sent = 0
        self.loop.run_until_complete(self._connect())

    async def _connect(self) -> None:
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{self.port}/json/list") as answer:
            targets = await answer.json()
        tab = next(target for target in targets if target["type"] == "page")
        self.socket = await self.session.ws_connect(tab["webSocketDebuggerUrl"], max_msg_size=0)

    async def _send(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.sent += 1
        number = self.sent
        await self.socket.send_json({"id": number, "method": method, "params": params})
        while True:
            message = await self.socket.receive_json(timeout=30)
            if message.get("id") == number:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                result: dict[str, Any] = message["result"]
                return result

    def evaluate(self, expression: str) -> Any:
        result = self.loop.run_until_complete(
            self._send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def _mark(self) -> None:
        """Marks the page shown now: the next one has no mark."""
        self.evaluate("window.genqOldPage = true")

    def _next_page(self) -> None:
        def loaded() -> bool:
            try:
                return bool(
                    self.evaluate(
                        "document.readyState === 'complete' && window.genqOldPage === undefined"
                    )
                )
            except AssertionError:  # the old page's context went away mid-evaluation
                return False

        wait_for(loaded, timeout=30, what="the next page to load")

    def open(self, url: str) -> None:
        self._mark()
        self.loop.run_until_complete(self._send("Page.navigate", {"url": url}))
        self._next_page()

    def click(self, expression: str) -> None:
        """Clicks the element `expression` finds, then waits for the page it leads to."""
        self._mark()
        self.evaluate(f"({expression}).click()")
        self._next_page()

    def fill(self, selector: str, value: str) -> None:
        self.evaluate(f"document.querySelector({json.dumps(selector)}).value = {json.dumps(value)}")

    def html(self) -> str:
        return str(self.evaluate("document.documentElement.outerHTML"))

    def location(self) -> str:
        return str(self.evaluate("location.pathname"))

    def log_in(self, base: str, token: str) -> None:
        self.open(f"{base}/")
        assert 'action="/login"' in self.html()
        self.fill('input[name="token"]', token)
        self.click("document.querySelector('#login button')")
        assert 'id="tools"' in self.html(), self.html()[:2000]

    def close(self) -> None:
        async def close() -> None:
            await self.socket.close()
            await self.session.close()

        self.loop.run_until_complete(close())
        self.loop.close()
        end_process(self.process)


def button(action: str, field: str = "", value: str = "") -> str:
    """The submit button of the form posting to /actions/<action> (whose `field` is `value`)."""
    form = f'form[action="/actions/{action}"]'
    if not field:
        return f"document.querySelector({json.dumps(form + ' button')})"
    hidden = f'{form} input[name="{field}"][value="{value}"]'
    return f"document.querySelector({json.dumps(hidden)}).form.querySelector('button')"


CONFIRM = "document.getElementById('confirm-yes')"


# --- the service ----------------------------------------------------------------------------------


@dataclass
class Served:
    service: ServiceProcess
    url: str
    base: str
    operator: str
    viewer: str
    gateway: str
    tools: dict[str, str]
    queued: str
    """A task of WRITE, queued (cancelled by a test)."""
    failed: str
    """A task of WRITE that ran once, published progress and failed (retried by a test)."""

    def metadata(self) -> tuple[tuple[str, str]]:
        return (("authorization", f"Bearer {self.operator}"),)

    def sql(self, statement: str, params: Any = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url, autocommit=True) as db:
            return db.execute(statement, params).fetchall()

    def audit(self) -> list[tuple[str, str, dict[str, Any]]]:
        rows = self.sql("SELECT action, actor, detail FROM generation.audit ORDER BY id")
        return [(action, actor, detail) for action, actor, detail in rows]

    def audited(self, action: str) -> list[dict[str, Any]]:
        """The details of `action`'s audit rows written by the operator's token."""
        return [
            detail
            for name, actor, detail in self.audit()
            if name == action and actor.startswith("token:") and "(page operator)" in actor
        ]


@pytest.fixture(scope="module")
def served(databases: Databases, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    url = url_for(databases.create("page_actions"))
    http_port = free_port()
    service = ServiceProcess(
        url,
        tmp_path_factory.mktemp("page_actions") / "serve.log",
        GENQ_AUTH="required",
        GENQ_HTTP_PORT=str(http_port),
    )
    try:
        operator = tokens.create(url, ["operator"], [], None, "page operator")
        auth = (("authorization", f"Bearer {operator}"),)
        stub = service.stub
        stub.UpdateSettings(
            task_pb2.UpdateSettingsRequest(currency="EUR", daily_cap_nanos=5 * NANOS),
            metadata=auth,
        )
        tools = {
            name: stub.UpsertTool(task_pb2.UpsertToolRequest(name=name), metadata=auth).tool.id
            for name in (PAINT, WRITE)
        }
        failed = stub.QueueTask(
            task_pb2.QueueTaskRequest(tool_id=tools[WRITE], input=_struct(SECRET_B)),
            metadata=auth,
        ).task.id
        claim = stub.ClaimNextTask(
            task_pb2.ClaimNextTaskRequest(tool_id=tools[WRITE]), metadata=auth
        )
        assert claim.task.id == failed
        stub.PublishTaskEvent(
            task_pb2.PublishTaskEventRequest(
                task_id=failed,
                lease_token=claim.lease_token,
                kind=task_pb2.TASK_EVENT_KIND_PROGRESS,
                data=_struct("halfway", key="note"),
            ),
            metadata=auth,
        )
        stub.FailTask(
            task_pb2.FailTaskRequest(
                task_id=failed,
                lease_token=claim.lease_token,
                error="provider said no",
                failure=task_pb2.FAILURE_KIND_PERMANENT,
                reported_usage=task_pb2.ReportedUsage(cost_nanos=NANOS // 20),
            ),
            metadata=auth,
        )
        queued = stub.QueueTask(
            task_pb2.QueueTaskRequest(tool_id=tools[WRITE], input=_struct(SECRET_A)),
            metadata=auth,
        ).task.id
        with psycopg.connect(url, autocommit=True) as db:
            db.execute(
                "INSERT INTO generation.cooldowns (resource_key, consecutive_failures, "
                "cooling_until) VALUES (%s, 0, now() + interval '10 minutes')",
                [COOLING_KEY],
            )
            db.execute(
                "INSERT INTO generation.holds (account_group, held_until, reason) "
                "VALUES (%s, now() + interval '1 hour', 'out of credit')",
                [HELD_GROUP],
            )
        yield Served(
            service,
            url,
            f"http://127.0.0.1:{http_port}",
            operator,
            tokens.create(url, ["viewer"], [], None, "page viewer"),
            tokens.create(url, ["gateway"], [], None, "page gateway"),
            tools,
            queued,
            failed,
        )
    finally:
        service.stop()


def _struct(value: str, key: str = "prompt") -> Struct:
    struct = Struct()
    struct.update({key: value})
    return struct


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    opened = Browser(tmp_path / f"chromium-{uuid.uuid4().hex[:8]}")
    try:
        yield opened
    finally:
        opened.close()


def post(
    served: Served, path: str, fields: dict[str, str], headers: dict[str, str]
) -> tuple[int, str]:
    port = int(served.base.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(
            "POST",
            path,
            body=urlencode(fields),
            headers={"Content-Type": "application/x-www-form-urlencoded", **headers},
        )
        answer = connection.getresponse()
        return answer.status, answer.read().decode()
    finally:
        connection.close()


def log_in(served: Served, token: str) -> tuple[str, str]:
    """(the cookies, the CSRF token of the page) of a session logged in with `token`."""
    port = int(served.base.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(
            "POST",
            "/login",
            body=urlencode({"token": token}),
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        login = connection.getresponse()
        login.read()
        cookie = login.getheader("Set-Cookie", "").split(";")[0]
        connection.request("GET", "/", headers={"Cookie": cookie})
        page = connection.getresponse()
        html = page.read().decode()
        session = page.getheader("Set-Cookie", "").split(";")[0]
    finally:
        connection.close()
    assert cookie.startswith("genq_token=") and session.startswith("genq_session=")
    csrf = html.split('name="csrf" value="')[1].split('"')[0] if 'name="csrf"' in html else ""
    return f"{cookie}; {session}", csrf


# --- the tests ------------------------------------------------------------------------------------


def test_an_operator_pauses_a_tool_and_releases_a_cooldown(
    served: Served, browser: Browser
) -> None:
    browser.log_in(served.base, served.operator)
    assert COOLING_KEY in Dom(browser.html()).section("cooling")

    browser.click(button("pause", "tool_id", served.tools[PAINT]))
    assert browser.location() == "/"  # POST-redirect-GET
    assert served.sql("SELECT paused FROM generation.tools WHERE name = %s", [PAINT]) == [(True,)]
    assert served.audited("ConfigureTool")[-1] == {"tool_id": served.tools[PAINT], "paused": True}
    # The page now offers to resume it.
    assert button("resume", "tool_id", served.tools[PAINT]) and browser.evaluate(
        f"!!{button('resume', 'tool_id', served.tools[PAINT])}"
    )

    browser.click(button("release-cooldown", "resource_key", COOLING_KEY))
    assert browser.location() == "/"
    assert served.sql(
        "SELECT cooling_until <= now() FROM generation.cooldowns WHERE resource_key = %s",
        [COOLING_KEY],
    ) == [(True,)]
    assert served.audited("ReleaseCooldown") == [{"resource_key": COOLING_KEY}]
    assert "no resource key is cooling" in Dom(browser.html()).section("cooling")

    browser.click(button("resume", "tool_id", served.tools[PAINT]))
    assert served.sql("SELECT paused FROM generation.tools WHERE name = %s", [PAINT]) == [(False,)]
    assert served.audited("ConfigureTool")[-1] == {
        "tool_id": served.tools[PAINT],
        "paused": False,
    }


def test_the_switch_the_cap_and_a_hold_from_the_page(served: Served, browser: Browser) -> None:
    browser.log_in(served.base, served.operator)

    # Switching off asks first; "go back" would change nothing.
    browser.click(button("switch"))
    assert browser.location() == "/actions/switch"
    assert "Switch the queue off?" in Dom(browser.html()).section("confirm")
    assert served.sql("SELECT enabled FROM generation.settings") == [(True,)]
    browser.click(CONFIRM)
    assert browser.location() == "/"
    assert served.sql("SELECT enabled FROM generation.settings") == [(False,)]
    assert "disabled" in Dom(browser.html()).section("switch")
    browser.click(button("switch"))  # on again: no question
    assert served.sql("SELECT enabled FROM generation.settings") == [(True,)]
    assert [d for d in served.audited("UpdateSettings") if "enabled" in d] == [
        {"enabled": False},
        {"enabled": True},
    ]

    # The cap has a page of its own (the status page reloads itself, and would lose the amount).
    browser.click("document.getElementById('change-cap')")
    assert browser.location() == "/cap" and "5.00 EUR" in Dom(browser.html()).section("cap-page")
    browser.fill('#cap-form input[name="amount"]', "12.5")
    browser.click("document.querySelector('#cap-form button')")
    assert "Set the daily cap to 12.50 EUR?" in Dom(browser.html()).section("confirm")
    browser.click(CONFIRM)
    assert served.sql("SELECT daily_cap_nanos FROM generation.settings") == [(12_500_000_000,)]
    assert {"daily_cap_nanos": "12500000000"} in served.audited("UpdateSettings")
    assert "12.50 EUR" in Dom(browser.html()).section("cap")

    # An amount that is not one is refused, and changes nothing.
    browser.open(f"{served.base}/cap")
    browser.fill('#cap-form input[name="amount"]', "ten")
    browser.click("document.querySelector('#cap-form button')")
    assert "not an amount" in Dom(browser.html()).section("message")
    assert served.sql("SELECT daily_cap_nanos FROM generation.settings") == [(12_500_000_000,)]

    browser.open(f"{served.base}/")
    browser.click(button("release-hold", "account_group", HELD_GROUP))
    assert served.sql(
        "SELECT held_until <= now() FROM generation.holds WHERE account_group = %s", [HELD_GROUP]
    ) == [(True,)]
    assert served.audited("ReleaseHold") == [{"account_group": HELD_GROUP}]


def test_a_viewer_sees_no_button_and_a_forged_post_changes_nothing(
    served: Served, browser: Browser
) -> None:
    browser.log_in(served.base, served.viewer)
    html = browser.html()
    assert "/actions/" not in html and 'name="csrf"' not in html and "/cap" not in html
    browser.open(f"{served.base}/cap")
    assert "setting the cap needs operator" in Dom(browser.html()).section("message")
    browser.open(f"{served.base}/tasks/{served.failed}")
    assert "/actions/" not in browser.html()

    def state() -> list[tuple[Any, ...]]:
        return [
            *served.sql("SELECT enabled, daily_cap_nanos FROM generation.settings"),
            *served.sql("SELECT name, paused FROM generation.tools ORDER BY name"),
            *served.sql("SELECT count(*) FROM generation.audit"),
        ]

    before = state()
    operator_cookies, csrf = log_in(served, served.operator)
    assert csrf
    forged = {"enabled": "off", "confirm": "yes"}
    # The operator's own browser, made to post by another site: no CSRF token, a wrong one,
    # the right one from another site's page, no session at all.
    assert post(served, "/actions/switch", forged, {"Cookie": operator_cookies})[0] == 403
    assert (
        post(served, "/actions/switch", {**forged, "csrf": "0" * 64}, {"Cookie": operator_cookies})[
            0
        ]
        == 403
    )
    foreign = {"Cookie": operator_cookies, "Origin": "https://evil.example"}
    assert post(served, "/actions/switch", {**forged, "csrf": csrf}, foreign)[0] == 403
    cross = {"Cookie": operator_cookies, "Sec-Fetch-Site": "cross-site"}
    assert post(served, "/actions/switch", {**forged, "csrf": csrf}, cross)[0] == 403
    token_only = {"Cookie": operator_cookies.split(";")[0]}
    assert post(served, "/actions/switch", {**forged, "csrf": csrf}, token_only)[0] == 403
    # A viewer with a valid form token of their own: refused by the RPC's roles.
    viewer_cookies, _ = log_in(served, served.viewer)
    viewer_csrf = _csrf_of(served, viewer_cookies)
    status, body = post(
        served,
        "/actions/pause",
        {"tool_id": served.tools[WRITE], "csrf": viewer_csrf},
        {"Cookie": viewer_cookies},
    )
    assert status == 403 and "needs the role operator" in body
    # No login at all: the login form, nothing else.
    assert post(served, "/actions/switch", forged, {})[0] == 401
    assert state() == before
    # The same form with its token does change it (so the refusals above were the checks').
    status, _ = post(
        served,
        "/actions/pause",
        {"tool_id": served.tools[WRITE], "csrf": csrf},
        {"Cookie": operator_cookies},
    )
    assert status == 303
    served.service.stub.ConfigureTool(
        task_pb2.ConfigureToolRequest(tool_id=served.tools[WRITE], paused=False),
        metadata=served.metadata(),
    )


def _csrf_of(served: Served, cookies: str) -> str:
    port = int(served.base.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", f"/tasks/{served.queued}", headers={"Cookie": cookies})
        html = connection.getresponse().read().decode()
    finally:
        connection.close()
    # A viewer's pages carry no form; the token is the session's, as an operator's would be.
    assert "/actions/" not in html
    # The token the page would derive for this session (a viewer's pages carry no form).
    session = cookies.split("genq_session=")[1]
    return form_token(session, cookies.split(";")[0].removeprefix("genq_token="))


def test_cancel_and_retry_from_the_task_page(served: Served, browser: Browser) -> None:
    browser.log_in(served.base, served.operator)

    browser.open(f"{served.base}/tasks/{served.queued}")
    assert "queued" in Dom(browser.html()).section("task-status")
    browser.click(button("cancel", "task_id", served.queued))
    assert f"Cancel task {served.queued}?" in Dom(browser.html()).section("confirm")
    browser.click(CONFIRM)
    assert browser.location() == f"/tasks/{served.queued}"
    assert "cancelled" in Dom(browser.html()).section("task-status")
    assert served.sql(
        "SELECT status::text FROM generation.tasks WHERE id = %s", [served.queued]
    ) == [("cancelled",)]
    assert served.audited("CancelTask") == [{"task_id": served.queued}]

    browser.open(f"{served.base}/tasks/{served.failed}")
    browser.click(button("retry", "task_id", served.failed))
    assert "Retry task" in Dom(browser.html()).section("confirm")
    browser.click(CONFIRM)
    assert browser.location() == f"/tasks/{served.failed}"
    assert served.sql(
        "SELECT status::text FROM generation.tasks WHERE id = %s", [served.failed]
    ) == [("queued",)]
    (retried,) = served.audited("RetryTask")
    assert retried["task_id"] == served.failed and retried["retry_key"]
    dom = Dom(browser.html())
    assert "queued" in dom.section("task-status")
    assert "requeued" in dom.section("events")


def test_the_task_page_shows_attempts_events_and_why_it_waits(
    served: Served, browser: Browser
) -> None:
    stub, auth = served.service.stub, served.metadata()
    waiting = stub.QueueTask(
        task_pb2.QueueTaskRequest(tool_id=served.tools[PAINT], input=_struct("paint me")),
        metadata=auth,
    ).task.id
    stub.ConfigureTool(
        task_pb2.ConfigureToolRequest(tool_id=served.tools[PAINT], paused=True), metadata=auth
    )
    try:
        browser.log_in(served.base, served.operator)
        browser.open(f"{served.base}/tasks/{served.failed}")
        dom = Dom(browser.html())
        attempts = dom.section("attempts")
        assert "1" in attempts and "failed" in attempts and "0.05 EUR" in attempts
        assert dom.section("task-cost") == "0.05 EUR (1 attempt)"
        events = dom.section("events")
        # In order: the claim's start, the progress, the failure.
        assert events.index("progress") < events.index("failed")
        assert "halfway" in events
        assert SECRET_B in dom.section("input")

        browser.open(f"{served.base}/tasks/{waiting}")
        dom = Dom(browser.html())
        assert "their tool is paused" in dom.section("wait")
        assert "not run yet" in dom.section("attempts")

        browser.open(f"{served.base}/tasks/{uuid.uuid4()}")
        assert "task not found" in Dom(browser.html()).section("message")
    finally:
        stub.ConfigureTool(
            task_pb2.ConfigureToolRequest(tool_id=served.tools[PAINT], paused=False),
            metadata=auth,
        )


def test_a_viewer_reads_a_task_without_its_input(served: Served, browser: Browser) -> None:
    browser.log_in(served.base, served.viewer)
    browser.open(f"{served.base}/tasks/{served.failed}")
    html = browser.html()
    dom = Dom(html)
    assert "hidden" in dom.section("input") and "hidden" in dom.section("output")
    assert SECRET_B not in html and "halfway" not in html  # nor the events' data
    assert "0.05 EUR" in dom.section("attempts") and "progress" in dom.section("events")
    # A gateway (which may call GetTask) reads it, and may cancel and retry, but not pause.
    bearer = {"Authorization": f"Bearer {served.gateway}"}
    task_page = get(served, f"/tasks/{served.failed}", bearer)
    assert SECRET_B in task_page
    assert 'action="/actions/retry"' in task_page or 'action="/actions/cancel"' in task_page
    assert "/actions/pause" not in get(served, "/", bearer)


def get(served: Served, path: str, headers: dict[str, str]) -> str:
    port = int(served.base.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path, headers=headers)
        answer = connection.getresponse()
        assert answer.status == 200, answer.status
        return answer.read().decode()
    finally:
        connection.close()
