"""Security (issue 10, GUIDE X5/X6): TLS and mutual TLS, tokens, roles per RPC, tool scopes,
revocation across replicas, the guarded HTTP port, the loopback-only default, and the audit log.

Certificates are made here with the openssl CLI; tokens with the code `genq token create` runs
(service/tokens.py), and once through the CLI itself. Every service is a real `genq serve`.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from google.protobuf import message_factory
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from psycopg.rows import dict_row

from generation.task.v1 import options_pb2, task_pb2, task_pb2_grpc
from service import tokens
from service.api.rpcs import SERVICE
from service.settings import Settings
from tests.certificates import Certs, channel_credentials, make_certs, tls_env
from tests.conftest import ROOT, Databases, ServiceProcess, free_port, url_for, wait_for
from workers_sdk import Credentials, GatewayClient, GenqClient, TaskContext, WorkerFleet

ROLES = ["gateway", "worker", "reconciler", "operator", "viewer"]
ROLE_OF = {
    options_pb2.ROLE_GATEWAY: "gateway",
    options_pb2.ROLE_WORKER: "worker",
    options_pb2.ROLE_RECONCILER: "reconciler",
    options_pb2.ROLE_VIEWER: "viewer",
}
REFUSALS = {
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.INTERNAL,
}


# -- certificates -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


# -- services and tokens ------------------------------------------------------------------------


@dataclass
class Secured:
    service: ServiceProcess
    url: str
    http_port: int

    def token(
        self, *roles: str, tools: tuple[str, ...] = (), note: str = "", expires: int | None = None
    ) -> str:
        return tokens.create(self.url, list(roles), list(tools), expires, note)


@pytest.fixture(scope="module")
def secured(databases: Databases, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """GENQ_AUTH=required, plaintext (loopback): the rules themselves."""
    url = url_for(databases.create("auth"))
    http_port = free_port()
    service = ServiceProcess(
        url,
        tmp_path_factory.mktemp("auth") / "serve.log",
        GENQ_AUTH="required",
        GENQ_HTTP_PORT=str(http_port),
    )
    yield Secured(service, url, http_port)
    service.stop()


def bearer(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


def call(channel: grpc.Channel, method: str, request: Any, token: str | None) -> Any:
    """One RPC by name; a streaming one is read to its end."""
    descriptor = SERVICE.methods_by_name[method]
    response_class = message_factory.GetMessageClass(descriptor.output_type)
    path = f"/{SERVICE.full_name}/{method}"
    metadata = bearer(token) if token else ()
    if descriptor.server_streaming:
        stream = channel.unary_stream(
            path,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_class.FromString,
        )
        return list(stream(request, metadata=metadata, timeout=5))
    unary = channel.unary_unary(
        path,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=response_class.FromString,
    )
    return unary(request, metadata=metadata, timeout=10)


def code_of(channel: grpc.Channel, method: str, request: Any, token: str | None) -> grpc.StatusCode:
    try:
        call(channel, method, request, token)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def empty_request(method: str) -> Any:
    return message_factory.GetMessageClass(SERVICE.methods_by_name[method].input_type)()


def allowed_roles(method: str) -> set[str]:
    options = SERVICE.methods_by_name[method].GetOptions()
    return {ROLE_OF[role] for role in options.Extensions[options_pb2.roles]} | {"operator"}


# -- identity and roles -------------------------------------------------------------------------


def test_every_rpc_needs_a_token_but_health(secured: Secured) -> None:
    channel = secured.service.channel
    for method in SERVICE.methods:
        request = empty_request(method.name)
        assert code_of(channel, method.name, request, None) == grpc.StatusCode.UNAUTHENTICATED
        for bad in ("nonsense", f"genq_{uuid.uuid4().hex}_guess", "genq_zz_x"):
            assert code_of(channel, method.name, request, bad) == grpc.StatusCode.UNAUTHENTICATED
    # A right id with a wrong secret is refused too.
    token_id = secured.token("operator").split("_")[1]
    assert (
        code_of(channel, "GetStatus", task_pb2.GetStatusRequest(), f"genq_{token_id}_wrong")
        == grpc.StatusCode.UNAUTHENTICATED
    )
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    # Reflection serves every method's SQL: a token first.
    assert list_services(channel, None) == grpc.StatusCode.UNAUTHENTICATED
    assert list_services(channel, "genq_x_y") == grpc.StatusCode.UNAUTHENTICATED
    assert list_services(channel, secured.token("viewer")) == grpc.StatusCode.OK


def list_services(channel: grpc.Channel, token: str | None) -> grpc.StatusCode:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    try:
        answers = list(
            stub.ServerReflectionInfo(
                iter([request]), metadata=bearer(token) if token else (), timeout=5
            )
        )
    except grpc.RpcError as error:
        return error.code()
    names = {s.name for answer in answers for s in answer.list_services_response.service}
    assert SERVICE.full_name in names
    return grpc.StatusCode.OK


def test_role_matrix_over_every_rpc(secured: Secured) -> None:
    """Each role, each RPC of the descriptor: allowed means never refused for who calls (nor
    INTERNAL); not allowed means PERMISSION_DENIED."""
    channel = secured.service.channel
    by_role = {role: secured.token(role, note=f"matrix {role}") for role in ROLES}
    seen = []
    for method in SERVICE.methods:
        allowed = allowed_roles(method.name)
        for role in ROLES:
            code = code_of(channel, method.name, empty_request(method.name), by_role[role])
            if role in allowed:
                assert code not in REFUSALS, (method.name, role, code)
            else:
                assert code == grpc.StatusCode.PERMISSION_DENIED, (method.name, role, code)
            seen.append((method.name, role))
    assert len(seen) == len(SERVICE.methods) * len(ROLES)


def test_the_refusal_names_the_rule(secured: Secured) -> None:
    viewer = secured.token("viewer")
    with pytest.raises(grpc.RpcError) as refused:
        call(secured.service.channel, "UpdateSettings", task_pb2.UpdateSettingsRequest(), viewer)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "UpdateSettings needs the role operator" in refused.value.details()


def test_expired_token_is_refused(secured: Secured) -> None:
    token = secured.token("viewer", expires=2)
    channel = secured.service.channel
    assert code_of(channel, "GetStatus", task_pb2.GetStatusRequest(), token) == grpc.StatusCode.OK
    wait_for(
        lambda: (
            code_of(channel, "GetStatus", task_pb2.GetStatusRequest(), token)
            == grpc.StatusCode.UNAUTHENTICATED
        ),
        timeout=20,
        what="the expired token refused",
    )


# -- tool scopes and viewers --------------------------------------------------------------------


@dataclass
class TwoTools:
    a: str
    b: str
    name_a: str
    name_b: str


@pytest.fixture(scope="module")
def two_tools(secured: Secured) -> TwoTools:
    operator = secured.token("operator")
    stub = task_pb2_grpc.GenerationDataServiceStub(secured.service.channel)
    names = [f"scoped-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    ids = [
        stub.UpsertTool(task_pb2.UpsertToolRequest(name=name), metadata=bearer(operator)).tool.id
        for name in names
    ]
    return TwoTools(ids[0], ids[1], names[0], names[1])


def _queue(secured: Secured, tool_id: str, token: str, prompt: str) -> str:
    stub = task_pb2_grpc.GenerationDataServiceStub(secured.service.channel)
    data = Struct()
    data.update({"prompt": prompt})
    task = stub.QueueTask(
        task_pb2.QueueTaskRequest(tool_id=tool_id, input=data), metadata=bearer(token)
    )
    return str(task.task.id)


def test_a_worker_of_tool_a_is_denied_tool_b(secured: Secured, two_tools: TwoTools) -> None:
    channel = secured.service.channel
    operator = secured.token("operator")
    worker_a = secured.token("worker", tools=(two_tools.name_a,), note="worker of A")
    denied = grpc.StatusCode.PERMISSION_DENIED
    _queue(secured, two_tools.b, operator, "secret prompt of B")
    # B's claims: neither one by one nor in batches, so B's input never reaches it.
    for method, request in [
        ("ClaimNextTask", task_pb2.ClaimNextTaskRequest(tool_id=two_tools.b)),
        ("ClaimTasks", task_pb2.ClaimTasksRequest(tool_id=two_tools.b, limit=5)),
        ("UpsertTool", task_pb2.UpsertToolRequest(name=two_tools.name_b)),
        ("GetTool", task_pb2.GetToolRequest(tool_id=two_tools.b)),
    ]:
        assert code_of(channel, method, request, worker_a) == denied, method
    # B's task, held by someone else: no report, heartbeat, event or release reaches it.
    claimed = call(
        channel, "ClaimNextTask", task_pb2.ClaimNextTaskRequest(tool_id=two_tools.b), operator
    )
    task_b, lease = claimed.task.id, claimed.lease_token
    assert claimed.task.input["prompt"] == "secret prompt of B"
    item = {"task_id": task_b, "lease_token": lease}
    for method, request in [
        ("CompleteTask", task_pb2.CompleteTaskRequest(**item)),
        ("FailTask", task_pb2.FailTaskRequest(**item, failure=task_pb2.FAILURE_KIND_RETRYABLE)),
        ("HeartbeatTask", task_pb2.HeartbeatTaskRequest(**item)),
        ("ReleaseTask", task_pb2.ReleaseTaskRequest(**item)),
        (
            "PublishTaskEvent",
            task_pb2.PublishTaskEventRequest(**item, kind=task_pb2.TASK_EVENT_KIND_PROGRESS),
        ),
        (
            "CompleteTasks",
            task_pb2.CompleteTasksRequest(tasks=[task_pb2.CompleteTaskRequest(**item)]),
        ),
        (
            "HeartbeatTasks",
            task_pb2.HeartbeatTasksRequest(tasks=[task_pb2.HeartbeatTaskRequest(**item)]),
        ),
        ("FailTasks", task_pb2.FailTasksRequest(tasks=[task_pb2.FailTaskRequest(**item)])),
    ]:
        assert code_of(channel, method, request, worker_a) == denied, method
    # Its own tool works, and a batch mixing in B's task is refused as a whole.
    task_a = _queue(secured, two_tools.a, operator, "prompt of A")
    mine = call(
        channel, "ClaimNextTask", task_pb2.ClaimNextTaskRequest(tool_id=two_tools.a), worker_a
    )
    assert mine.task.id == task_a and mine.task.input["prompt"] == "prompt of A"
    mixed = task_pb2.HeartbeatTasksRequest(
        tasks=[
            task_pb2.HeartbeatTaskRequest(task_id=task_a, lease_token=mine.lease_token),
            task_pb2.HeartbeatTaskRequest(**item),
        ]
    )
    assert code_of(channel, "HeartbeatTasks", mixed, worker_a) == denied
    done = call(
        channel,
        "CompleteTask",
        task_pb2.CompleteTaskRequest(task_id=task_a, lease_token=mine.lease_token),
        worker_a,
    )
    assert done.task.status == task_pb2.TASK_STATUS_COMPLETED
    # B's task is untouched: still held under the operator's lease.
    assert call(
        channel, "GetTask", task_pb2.GetTaskRequest(task_id=task_b), operator
    ).task.status == (task_pb2.TASK_STATUS_PROCESSING)


def test_a_gateway_of_tool_a_reads_only_a(secured: Secured, two_tools: TwoTools) -> None:
    channel = secured.service.channel
    operator = secured.token("operator")
    gateway_a = secured.token("gateway", tools=(two_tools.name_a,))
    denied = grpc.StatusCode.PERMISSION_DENIED
    task_b = _queue(secured, two_tools.b, operator, "B's")
    assert code_of(channel, "GetTask", task_pb2.GetTaskRequest(task_id=task_b), gateway_a) == denied
    for spelled in (task_b, task_b.upper()):  # the database takes an id in any case
        cancel = task_pb2.CancelTaskRequest(task_id=spelled)
        assert code_of(channel, "CancelTask", cancel, gateway_a) == denied, spelled
    shouting = task_pb2.QueueTaskRequest(tool_id=two_tools.b.upper())
    assert code_of(channel, "QueueTask", shouting, gateway_a) == denied
    assert (
        code_of(
            channel, "WatchTaskEvents", task_pb2.WatchTaskEventsRequest(task_id=task_b), gateway_a
        )
        == denied
    )
    # Every tool's tasks at once: refused; its own tool's: served.
    assert code_of(channel, "ListTasks", task_pb2.ListTasksRequest(), gateway_a) == denied
    assert (
        code_of(channel, "QueueTask", task_pb2.QueueTaskRequest(tool_id=two_tools.b), gateway_a)
        == denied
    )
    task_a = _queue(secured, two_tools.a, gateway_a, "A's")
    listed = call(channel, "ListTasks", task_pb2.ListTasksRequest(tool_id=two_tools.a), gateway_a)
    assert task_a in {task.id for task in listed.tasks}
    # An id that names no task is NOT_FOUND, as for anyone: nothing of another tool is shown.
    unknown = task_pb2.GetTaskRequest(task_id=str(uuid.uuid4()))
    assert code_of(channel, "GetTask", unknown, gateway_a) == grpc.StatusCode.NOT_FOUND


def test_a_viewer_never_sees_inputs_or_outputs(secured: Secured, two_tools: TwoTools) -> None:
    channel = secured.service.channel
    operator = secured.token("operator")
    task = _queue(secured, two_tools.a, operator, "private prompt")
    request = task_pb2.ListTasksRequest(tool_id=two_tools.a)
    as_viewer = {
        t.id: t for t in call(channel, "ListTasks", request, secured.token("viewer")).tasks
    }
    as_gateway = {
        t.id: t for t in call(channel, "ListTasks", request, secured.token("gateway")).tasks
    }
    assert as_viewer[task].status == task_pb2.TASK_STATUS_QUEUED
    assert not as_viewer[task].HasField("input") and not as_viewer[task].HasField("output")
    assert as_gateway[task].input["prompt"] == "private prompt"
    # A token with the viewer role and one that may read tasks gets them whole.
    both = secured.token("viewer", "gateway")
    assert {t.id: t for t in call(channel, "ListTasks", request, both).tasks}[task].input["prompt"]


# -- revocation across replicas -----------------------------------------------------------------


TOKEN_CACHE = {"GENQ_TOKEN_CACHE_SECONDS": "1"}
"""Replicas that trust a looked-up token 1 s, so that a revocation is seen without the wait."""


def test_revocation_reaches_every_replica_within_30_s(secured: Secured, tmp_path: Path) -> None:
    """Two replicas on one database; the token is revoked with the CLI while both have it
    cached; both refuse it within 30 s (here within their 1 s cache; the default cache, 15 s,
    keeps the promise too)."""
    assert Settings().token_cache_seconds <= 30
    with ExitStack() as replicas_running:
        replicas = []
        for name in ("first", "second"):
            log = tmp_path / f"{name}.log"
            replica = ServiceProcess(secured.url, log, GENQ_AUTH="required", **TOKEN_CACHE)
            replicas_running.callback(replica.stop)
            replicas.append(replica.channel)
        created = run_cli(
            ["token", "create", "--role", "viewer", "--note", "to revoke"], secured.url
        )
        token = created.stdout.strip().splitlines()[-1].split()[-1]
        status = task_pb2.GetStatusRequest()
        assert all(code_of(c, "GetStatus", status, token) == grpc.StatusCode.OK for c in replicas)
        revoked_at = time.monotonic()
        assert run_cli(["token", "revoke", token.split("_")[1]], secured.url).returncode == 0

        def refused_everywhere() -> bool:
            return all(
                code_of(channel, "GetStatus", status, token) == grpc.StatusCode.UNAUTHENTICATED
                for channel in replicas
            )

        wait_for(
            refused_everywhere,
            timeout=30 - (time.monotonic() - revoked_at),
            what="the revoked token refused by both replicas",
        )
        listed = run_cli(["token", "list"], secured.url).stdout
        assert token.split("_")[1] not in listed  # the list shows ids as UUIDs
        assert str(uuid.UUID(token.split("_")[1])) in listed
        secret = token.split("_", 2)[2]  # a urlsafe secret may itself hold "_"
        assert secret not in listed


def run_cli(
    args: list[str], database_url: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, **env}
    environment.pop("DATABASE_URL", None)
    if database_url:
        environment["DATABASE_URL"] = database_url
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
        cwd=ROOT,
    )


def test_token_commands_check_their_usage(secured: Secured) -> None:
    assert run_cli(["token", "create"], secured.url).returncode == 2
    assert run_cli(["token", "create", "--role", "boss"], secured.url).returncode == 2
    assert run_cli(["token", "revoke"], secured.url).returncode == 2
    missing = run_cli(["token", "revoke", str(uuid.uuid4())], secured.url)
    assert missing.returncode == 1 and "no token" in missing.stderr


# -- audit --------------------------------------------------------------------------------------


def test_audited_changes_are_recorded_in_their_transaction(
    secured: Secured, two_tools: TwoTools
) -> None:
    channel = secured.service.channel
    operator = secured.token("operator", note="alice")
    token_id = uuid.UUID(operator.split("_")[1])
    call(
        channel,
        "ConfigureTool",
        task_pb2.ConfigureToolRequest(tool_id=two_tools.a, paused=False),
        operator,
    )
    task = _queue(secured, two_tools.a, operator, "to cancel")
    call(channel, "CancelTask", task_pb2.CancelTaskRequest(task_id=task), operator)
    # Refused by the database: no change, and no audit row either.
    bad = task_pb2.UpdateSettingsRequest(timezone="Not/A_Zone")
    assert code_of(channel, "UpdateSettings", bad, operator) == grpc.StatusCode.INVALID_ARGUMENT
    with psycopg.connect(secured.url, row_factory=dict_row) as db:
        rows = db.execute(
            "SELECT actor, action, detail FROM generation.audit WHERE actor LIKE %s ORDER BY id",
            [f"token:{token_id}%"],
        ).fetchall()
    assert [row["action"] for row in rows] == ["ConfigureTool", "CancelTask"]
    assert rows[0]["actor"] == f"token:{token_id} (alice)"
    assert rows[0]["detail"] == {"tool_id": two_tools.a, "paused": False}
    assert rows[1]["detail"] == {"task_id": task}
    # Reads are not audited; `genq audit` lists the changes over gRPC, token commands included.
    listed = run_cli(
        ["audit", "--target", secured.service.address, "--format", "json"],
        GENQ_TOKEN=secured.token("viewer"),
    )
    assert listed.returncode == 0, listed.stderr
    entries = json.loads(listed.stdout)["entries"]
    actions = [entry["action"] for entry in entries]
    assert "CancelTask" in actions and "token create" in actions
    assert any(entry["actor"].startswith("cli:") for entry in entries)
    text = run_cli(
        ["audit", "--target", secured.service.address], GENQ_TOKEN=secured.token("viewer")
    )
    assert f"token:{token_id} (alice)" in text.stdout


# -- the HTTP port ------------------------------------------------------------------------------


def http_get(
    port: int,
    path: str,
    headers: dict[str, str] | None = None,
    *,
    method: str = "GET",
    body: bytes | None = None,
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, str], bytes]:
    connection = (
        http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
        if context
        else http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    )
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_the_page_and_metrics_need_a_token(secured: Secured) -> None:
    port = secured.http_port
    viewer, worker = secured.token("viewer"), secured.token("worker")
    for path in ("/status.json", "/metrics"):
        status, headers, _ = http_get(port, path)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        assert http_get(port, path, {"Authorization": f"Bearer {worker}"})[0] == 403
        assert http_get(port, path, {"Authorization": "Bearer genq_x_y"})[0] == 401
        assert http_get(port, path, {"Authorization": f"Bearer {viewer}"})[0] == 200
    assert http_get(port, "/healthz")[:1] == (200,)
    # A person gets a form; the token goes in the POST body, comes back as a strict cookie.
    status, _, page = http_get(port, "/")
    assert status == 401 and b'<form method="post" action="/login">' in page
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert http_get(port, "/login", form, method="POST", body=b"token=genq_bad")[0] == 401
    status, headers, _ = http_get(
        port, "/login", form, method="POST", body=f"token={viewer}".encode()
    )
    assert status == 303 and headers["Location"] == "/"
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Secure" not in cookie
    assert viewer not in headers["Location"]
    status, _, page = http_get(port, "/", {"Cookie": cookie.split(";")[0]})
    assert status == 200 and b'id="audit"' in page
    # A gateway reads the status but not the audit log (ListAuditEntries): nor on the page.
    gateway = {"Authorization": f"Bearer {secured.token('gateway')}"}
    status, _, page = http_get(port, "/", gateway)
    assert status == 200 and b'id="audit"' not in page
    # A login posted from another site is refused.
    foreign = {**form, "Origin": "https://evil.example"}
    assert (
        http_get(port, "/login", foreign, method="POST", body=f"token={viewer}".encode())[0] == 403
    )
    assert viewer not in secured.service.log_path.read_text()


def test_the_http_port_checks_the_host_header(secured: Secured) -> None:
    viewer = {"Authorization": f"Bearer {secured.token('viewer')}"}
    assert http_get(secured.http_port, "/status.json", {**viewer, "Host": "localhost:1"})[0] == 200
    assert http_get(secured.http_port, "/status.json", {**viewer, "Host": "evil.example"})[0] == 421
    assert http_get(secured.http_port, "/healthz", {"Host": "10.1.2.3:8080"})[0] == 200


# -- TLS and mutual TLS -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mutual(
    databases: Databases, certs: Certs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Secured]:
    """TLS with client certificates and tokens required: the whole deployment."""
    url = url_for(databases.create("mtls"))
    http_port = free_port()
    service = ServiceProcess(
        url,
        tmp_path_factory.mktemp("mtls") / "serve.log",
        channel_credentials(certs),
        GENQ_AUTH="required",
        GENQ_HTTP_PORT=str(http_port),
        **tls_env(certs, mutual=True),
    )
    yield Secured(service, url, http_port)
    service.stop()


def _health(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_plaintext_and_certificate_less_clients_are_refused(mutual: Secured, certs: Certs) -> None:
    address = mutual.service.address
    with grpc.insecure_channel(address) as plaintext:
        assert _health(plaintext) == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(address, channel_credentials(certs, client=False)) as anonymous:
        assert _health(anonymous) == grpc.StatusCode.UNAVAILABLE
    stranger = grpc.ssl_channel_credentials(
        certs.ca.read_bytes(), certs.stranger_key.read_bytes(), certs.stranger_cert.read_bytes()
    )
    with grpc.secure_channel(address, stranger) as channel:
        assert _health(channel) == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(address, channel_credentials(certs)) as channel:
        assert _health(channel) == grpc.StatusCode.OK
    # The HTTP port: no TLS, or TLS without a client certificate, gets no answer.
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        http_get(mutual.http_port, "/healthz")
    no_cert = ssl.create_default_context(cafile=str(certs.ca))
    with pytest.raises((ssl.SSLError, ConnectionError)):
        http_get(mutual.http_port, "/healthz", context=no_cert)
    with_cert = ssl.create_default_context(cafile=str(certs.ca))
    with_cert.load_cert_chain(str(certs.client_cert), str(certs.client_key))
    assert http_get(mutual.http_port, "/healthz", context=with_cert)[0] == 200
    login = http_get(
        mutual.http_port,
        "/login",
        {"Content-Type": "application/x-www-form-urlencoded"},
        method="POST",
        body=f"token={mutual.token('viewer')}".encode(),
        context=with_cert,
    )
    assert login[0] == 303 and "; Secure" in login[1]["Set-Cookie"]


def test_a_tls_port_without_client_ca_takes_any_tls_client(
    databases: Databases, certs: Certs, tmp_path: Path
) -> None:
    service = ServiceProcess(
        url_for(databases.create("tls")),
        tmp_path / "serve.log",
        channel_credentials(certs, client=False),
        **tls_env(certs, mutual=False),
    )
    try:
        with grpc.insecure_channel(service.address) as plaintext:
            assert _health(plaintext) == grpc.StatusCode.UNAVAILABLE
        assert _health(service.channel) == grpc.StatusCode.OK
        # No auth required: a call without a token is anonymous and may do anything.
        stub = task_pb2_grpc.GenerationDataServiceStub(service.channel)
        assert stub.GetStatus(task_pb2.GetStatusRequest(), timeout=5).status.settings
    finally:
        service.stop()


def test_sdk_cli_and_reconciler_end_to_end(mutual: Secured, certs: Certs) -> None:
    """A worker, a gateway and the reconciler over TLS + mTLS, each with a token of its own role."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    files = {
        "ca_file": str(certs.ca),
        "client_cert_file": str(certs.client_cert),
        "client_key_file": str(certs.client_key),
    }
    operator = mutual.token("operator")
    env = {
        "GENQ_TLS_CA_FILE": files["ca_file"],
        "GENQ_TLS_CLIENT_CERT_FILE": files["client_cert_file"],
        "GENQ_TLS_CLIENT_KEY_FILE": files["client_key_file"],
    }
    target = f"localhost:{mutual.service.port}"
    # The CLI: the operator sets the cap (an audited change), by arguments and by environment.
    cap = run_cli(
        [
            "cap",
            "100",
            "--target",
            target,
            "--token",
            operator,
            "--tls-ca-file",
            files["ca_file"],
            "--tls-client-cert-file",
            files["client_cert_file"],
            "--tls-client-key-file",
            files["client_key_file"],
        ]
    )
    assert cap.returncode == 0, cap.stderr
    status = run_cli(["status", "--target", target], GENQ_TOKEN=mutual.token("viewer"), **env)
    assert status.returncode == 0, status.stderr
    refused = run_cli(["cap", "5", "--target", target], GENQ_TOKEN=mutual.token("viewer"), **env)
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr

    async def scenario() -> str:
        gateway_credentials = Credentials(token=mutual.token("gateway", tools=(name,)), **files)
        fleet = WorkerFleet(
            target,
            poll_interval=0.2,
            credentials=Credentials(token=mutual.token("worker", tools=(name,)), **files),
        )

        async def handle(task: task_pb2.Task, ctx: TaskContext) -> dict[str, Any]:
            await ctx.progress(0.5, "half")
            return {"echo": ctx.input["prompt"]}

        async with GenqClient(target, credentials=gateway_credentials) as client:
            gateway = GatewayClient(client)
            tool = await gateway.upsert_tool(name)
            fleet.register(name, handle)
            running = asyncio.ensure_future(fleet.run(handle_signals=False))
            try:
                task = await gateway.enqueue(
                    tool.id, {"prompt": "over mTLS"}, reserved_token_amount=5
                )
                kinds = [event.kind async for event in gateway.follow(task.id)]
                assert kinds[-1] == task_pb2.TASK_EVENT_KIND_COMPLETED
                done = await client.call("GetTask", task_pb2.GetTaskRequest(task_id=task.id))
                assert done.task.output["echo"] == "over mTLS"
                return str(task.id)
            finally:
                fleet.stop()
                await running

    task_id = asyncio.run(scenario())
    reconcile = run_cli(
        ["reconcile", "--once", "--target", target], GENQ_TOKEN=mutual.token("reconciler"), **env
    )
    assert reconcile.returncode == 0, reconcile.stderr
    with psycopg.connect(mutual.url) as db:
        settled = db.execute(
            "SELECT count(*) FROM generation.settlements WHERE task_id = %s", [task_id]
        ).fetchone()
    assert settled == (1,)


# -- the safe default ---------------------------------------------------------------------------


def test_loopback_only_by_default(databases: Databases, tmp_path: Path) -> None:
    assert Settings().host == "127.0.0.1" and Settings.from_env({}).host == "127.0.0.1"
    url = url_for(databases.create("insecure"))
    with pytest.raises(AssertionError, match="GENQ_ALLOW_INSECURE=true"):
        ServiceProcess(url, tmp_path / "refused.log", GENQ_HOST="0.0.0.0")
    loopback = ServiceProcess(url, tmp_path / "loopback.log")
    try:
        wait_for(
            lambda: "listening on loopback (127.0.0.1) only" in loopback.log_path.read_text(),
            what="the loopback notice",
        )
    finally:
        loopback.stop()
    insecure = ServiceProcess(
        url, tmp_path / "insecure.log", GENQ_HOST="0.0.0.0", GENQ_ALLOW_INSECURE="true"
    )
    try:
        wait_for(
            lambda: (
                "WARNING" in insecure.log_path.read_text()
                and "INSECURE" in insecure.log_path.read_text()
            ),
            what="the warning",
        )
    finally:
        insecure.stop()
    guarded = ServiceProcess(
        url,
        tmp_path / "guarded.log",
        GENQ_HOST="0.0.0.0",
        GENQ_AUTH="required",
        GENQ_REFLECTION="false",
    )
    try:
        token = tokens.create(url, ["operator"], [], None, "")
        assert list_services(guarded.channel, token) == grpc.StatusCode.UNIMPLEMENTED
        assert "INSECURE" not in guarded.log_path.read_text()
    finally:
        guarded.stop()
