"""docker-compose.yml and the Dockerfile agree with the code.

No docker runs here, so the stack is checked by construction: every command is one the image can
run, every variable is one the code reads, ports, URLs and addresses point where the code and the
other services expect, and the data plane's health check answers a live `genq serve`.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from service.cli import parser
from service.settings import Settings, env_names
from tests.certificates import channel_credentials, make_certs
from tests.conftest import ROOT, Databases, ServiceProcess, free_port, url_for

COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
APP_SERVICES = ["certs", "genq", "tokens", "worker", "reconciler", "setup"]
"""The services that run the project's own image."""
ONE_SHOTS = ["certs", "tokens"]
"""Provisioning scripts (`sh -ec SCRIPT`) that run once before the clients start."""
CLIENTS = ["worker", "reconciler", "setup"]
"""The services that reach the data plane over gRPC (and hold no database credentials)."""
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(Settings)}


def environment(service: str) -> dict[str, str]:
    env = SERVICES[service].get("environment", {})
    assert isinstance(env, dict), f"{service}: write environment as a mapping"
    return {name: str(value) for name, value in env.items()}


def command(service: str) -> list[str]:
    cmd = SERVICES[service]["command"]
    assert isinstance(cmd, list), f"{service}: write the command in exec form (a list)"
    return [str(part) for part in cmd]


def reader_source(service: str) -> str:
    """The source of the program a service runs: the script, or the `genq` CLI, and the SDK
    client both use (it reads the token and TLS variables)."""
    cmd = command(service)
    client = (ROOT / "workers_sdk" / "client.py").read_text()
    if cmd[0] == "genq":
        return (ROOT / "service" / "cli.py").read_text() + client
    assert cmd[0] == "python", cmd
    return (ROOT / cmd[1]).read_text() + client


def script_commands(service: str) -> list[list[str]]:
    """The `genq` command lines a one-shot's script runs (a shell function's arguments added)."""
    cmd = command(service)
    assert cmd[:2] == ["sh", "-ec"], f"{service}: a one-shot runs `sh -ec SCRIPT`"
    lines = [shlex.split(line) for line in cmd[2].splitlines() if line.strip()]
    calls = [words[1:] for words in lines if words[0] == "provision"]
    return [["genq", "token", "create", *call[1:]] for call in calls] or [
        words for words in lines if words[0] == "genq"
    ]


def volume_targets(service: str) -> dict[str, str]:
    """Mount point -> named volume."""
    mounts = (str(mount).split(":") for mount in SERVICES[service].get("volumes", []))
    return {parts[1]: parts[0] for parts in mounts}


def container_ports(service: str) -> dict[int, int]:
    """Published ports, container port -> host port."""
    published = {}
    for mapping in SERVICES[service].get("ports", []):
        host, container = str(mapping).rsplit(":", 1)
        published[int(container)] = int(host.rsplit(":", 1)[-1])
    return published


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)s", duration)
    assert match, f"write durations in whole seconds, e.g. 15s, not {duration!r}"
    return float(match.group(1))


def test_the_services_and_their_images() -> None:
    assert set(SERVICES) == {"postgres", "redis", *APP_SERVICES}
    assert SERVICES["postgres"]["image"] == "postgres:15"
    assert SERVICES["redis"]["image"] == "redis:7"
    images = {(SERVICES[s]["image"], SERVICES[s]["build"]) for s in APP_SERVICES}
    assert images == {("genq:local", ".")}, "one image, built from the Dockerfile, for all"


def test_health_checks() -> None:
    postgres = SERVICES["postgres"]
    check = " ".join(postgres["healthcheck"]["test"])
    user, db = postgres["environment"]["POSTGRES_USER"], postgres["environment"]["POSTGRES_DB"]
    assert "pg_isready" in check
    assert f"-U {user}" in check and f"-d {db}" in check
    # The image's first start initialises the database on a socket-only server: check over TCP.
    assert "-h 127.0.0.1" in check
    assert SERVICES["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    genq = SERVICES["genq"]["healthcheck"]["test"]
    assert genq[:3] == ["CMD", "python", "-c"]
    assert "grpc_health" in genq[3] and "SERVING" in genq[3]


def test_start_order_waits_for_health() -> None:
    healthy = {"condition": "service_healthy"}
    done = {"condition": "service_completed_successfully"}
    expected = {
        "genq": {"postgres": healthy, "redis": healthy, "certs": done},
        "tokens": {"genq": healthy},  # migrated: the tokens table exists
        "worker": {"genq": healthy, "tokens": done},
        "reconciler": {"genq": healthy, "tokens": done},
        "setup": {"genq": healthy, "tokens": done},
    }
    for service, depends_on in expected.items():
        assert SERVICES[service]["depends_on"] == depends_on, service
    for service, spec in SERVICES.items():
        for dependency, condition in spec.get("depends_on", {}).items():
            if condition == healthy:
                assert "healthcheck" in SERVICES[dependency], f"{service} waits on {dependency}"
            else:
                assert condition == done and SERVICES[dependency]["restart"] == "no", service


def test_every_command_is_one_the_image_runs() -> None:
    for service in ONE_SHOTS:
        for line in script_commands(service):
            try:
                parser().parse_args(line[1:])
            except SystemExit:
                pytest.fail(f"{service}: `{shlex.join(line)}` is not a genq command line")
    for service in set(APP_SERVICES) - set(ONE_SHOTS):
        cmd = command(service)
        if cmd[0] == "genq":
            try:
                args = parser().parse_args(cmd[1:])
            except SystemExit:
                pytest.fail(f"{service}: `{shlex.join(cmd)}` is not a genq command line")
            assert args.command == cmd[1]
        else:
            assert cmd[0] == "python" and len(cmd) == 2, f"{service}: {cmd}"
            assert (ROOT / cmd[1]).is_file(), f"{service}: no {cmd[1]}"
    assert command("genq") == ["genq", "serve"]  # migrates, then serves
    assert command("worker") == ["python", "examples/worker.py"]
    assert command("reconciler") == ["genq", "reconcile"]
    assert command("setup")[:2] == ["genq", "cap"]


def test_setup_runs_once() -> None:
    # Unquoted, YAML reads `no` as false, which compose rejects.
    for service in ["setup", *ONE_SHOTS]:
        assert SERVICES[service]["restart"] == "no", service


def test_the_stack_runs_with_tls_and_tokens() -> None:
    """Every port speaks TLS, every call needs a token, each client has a token of its own role
    from the tokens one-shot, and the certificate covers the name clients dial."""
    genq = environment("genq")
    assert genq["GENQ_AUTH"] == "required"
    assert genq["GENQ_HOST"] == "0.0.0.0"  # reachable from the other containers: auth is on
    certs_dir = volume_targets("genq")
    chain, key = genq["GENQ_TLS_CERT_FILE"], genq["GENQ_TLS_KEY_FILE"]
    assert Path(chain).parent.as_posix() in certs_dir and Path(key).parent == Path(chain).parent
    script = command("certs")[2]
    assert f"> {Path(chain).name}" in script and f"-keyout {Path(key).name}" in script
    assert "DNS:genq" in script  # the name in GENQ_ADDR / --target
    made = {line[line.index("--note") + 1]: line for line in script_commands("tokens")}
    roles = {
        "worker": "worker",
        "reconciler": "reconciler",
        "setup": "operator",
    }
    for client in CLIENTS:
        env = environment(client)
        token_file = env["GENQ_TOKEN_FILE"]
        assert volume_targets(client)[str(Path(token_file).parent)] == "secrets"
        assert volume_targets("tokens")[str(Path(token_file).parent)] == "secrets"
        note = f"compose-{client}" if client != "setup" else "compose-setup"
        assert f"/secrets/{Path(token_file).name} " in command("tokens")[2].replace(
            f"provision {token_file} ", f"{token_file} "
        )
        line = made[note]
        assert line[line.index("--role") + 1] == roles[client], client
        ca = env["GENQ_TLS_CA_FILE"]
        assert volume_targets(client)[str(Path(ca).parent)] == "certs"
        assert f"-out {Path(ca).name}" in script
    worker_line = made["compose-worker"]
    assert worker_line[worker_line.index("--tool") + 1] == environment("worker")["GENQ_TOOL"]
    assert set(COMPOSE["volumes"]) >= {"certs", "secrets"}


def test_the_data_plane_sets_only_variables_its_settings_read() -> None:
    read = {name for setting in fields(Settings) for name in env_names(setting.name)}
    unread = set(environment("genq")) - read
    assert not unread, f"genq serve does not read {sorted(unread)} (service/settings.py)"


@pytest.mark.parametrize("service", CLIENTS)
def test_clients_set_only_variables_their_code_reads(service: str) -> None:
    source = reader_source(service)
    for name in environment(service):
        assert f'"{name}"' in source, f"{service}: {name} is not read by {command(service)}"
    assert "DATABASE_URL" not in environment(service), "only the data plane holds credentials"


def test_ports_are_the_settings_defaults() -> None:
    env = environment("genq")
    assert "http_port" in DEFAULTS, "Settings has no http_port: nothing reads GENQ_HTTP_PORT"
    grpc_port, http_port = DEFAULTS["port"], DEFAULTS["http_port"]
    assert int(env[env_names("port")[0]]) == grpc_port
    assert int(env[env_names("http_port")[0]]) == http_port
    assert container_ports("genq") == {grpc_port: grpc_port, http_port: http_port}


@pytest.mark.parametrize("service", CLIENTS)
def test_clients_address_the_data_plane(service: str) -> None:
    cmd = command(service)
    address = (
        cmd[cmd.index("--target") + 1] if "--target" in cmd else environment(service)["GENQ_ADDR"]
    )
    assert address == f"genq:{DEFAULTS['port']}"


def test_database_url_points_at_the_postgres_service() -> None:
    postgres = SERVICES["postgres"]["environment"]
    url = urlsplit(environment("genq")["DATABASE_URL"])
    assert url.scheme == "postgresql"
    assert url.hostname == "postgres" and url.port in (None, 5432)
    assert url.username == postgres["POSTGRES_USER"]
    assert url.password == postgres["POSTGRES_PASSWORD"]
    assert url.path == "/" + postgres["POSTGRES_DB"]


def test_redis_addr_points_at_the_redis_service() -> None:
    url = urlsplit(environment("genq")["REDIS_ADDR"])
    assert (url.scheme, url.hostname, url.port, url.path) == ("redis", "redis", 6379, "/0")


def test_postgres_keeps_its_data_in_a_named_volume() -> None:
    volume, target = SERVICES["postgres"]["volumes"][0].split(":")
    assert target == "/var/lib/postgresql/data"
    assert volume in COMPOSE["volumes"]


def test_stop_grace_outlasts_the_programs_own() -> None:
    assert seconds(SERVICES["genq"]["stop_grace_period"]) > DEFAULTS["shutdown_grace_seconds"]
    drain = re.search(r'"GENQ_DRAIN_TIMEOUT", "([\d.]+)"', reader_source("worker"))
    assert drain, "examples/worker.py no longer reads GENQ_DRAIN_TIMEOUT as expected"
    assert seconds(SERVICES["worker"]["stop_grace_period"]) > float(drain.group(1))


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (word.upper(), rest.strip())
        for word, _, rest in (line.partition(" ") for line in lines if line and line[0] != "#")
    ]


def dockerignored(path: str) -> bool:
    """Whether .dockerignore leaves `path` (or a folder holding it) out of the build context."""
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()]
    parts = Path(path).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in (p for p in patterns if p and not p.startswith("#")):
        negated = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        if any(fnmatch.fnmatchcase(c, pattern) for c in candidates):
            ignored = not negated
    return ignored


def test_the_image_installs_the_service_and_holds_what_the_commands_run() -> None:
    instructions = dockerfile()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    runs = [shlex.split(args) for word, args in instructions if word == "RUN"]
    assert any(run[:3] == ["pip", "install", ".[service]"] for run in runs)
    (workdir,) = [args for word, args in instructions if word == "WORKDIR"]
    assert ("COPY", f". {workdir}") in instructions or ("COPY", ". .") in instructions
    env = dict(
        pair.split("=", 1)
        for word, args in instructions
        if word == "ENV"
        for pair in shlex.split(args)
    )
    # A plain install: the wheel carries the migrations, so nothing may lean on the copy in
    # WORKDIR (tests/test_migrations.py runs `genq migrate` from such an install).
    assert "PYTHONPATH" not in env

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    folders = setuptools["package-dir"]
    packages = {
        "/".join([folders.get(top, top), *rest])
        for top, *rest in (package.split(".") for package in setuptools["packages"])
    }
    needed = [
        "pyproject.toml",
        project["project"]["readme"],
        *sorted(packages),
        "alembic/env.py",
        "alembic/versions",
        *(command(s)[1] for s in APP_SERVICES if command(s)[0] == "python"),
    ]
    for path in needed:
        assert (ROOT / path).exists(), path
        assert not dockerignored(path), f".dockerignore leaves out {path}"
    for path in (".git", ".venv", "service/__pycache__"):
        assert dockerignored(path), f".dockerignore should leave out {path}"


def health_check(port: int, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs genq's compose health check here, with the interpreter of the tests."""
    test = SERVICES["genq"]["healthcheck"]["test"]
    return subprocess.run(
        [sys.executable, *test[2:]],
        env={"GENQ_PORT": str(port), **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_health_check_passes_on_a_serving_data_plane(service: ServiceProcess) -> None:
    result = health_check(service.port)
    assert result.returncode == 0, result.stderr


def test_the_health_check_fails_without_a_data_plane() -> None:
    assert health_check(free_port()).returncode != 0


def test_the_health_check_passes_on_a_tls_data_plane(databases: Databases, tmp_path: Path) -> None:
    """As in the stack: the certificate file is the chain, ending with the CA it trusts."""
    certs = make_certs(tmp_path)
    chain = tmp_path / "chain.pem"
    chain.write_bytes(certs.server_cert.read_bytes() + certs.ca.read_bytes())
    env = {"GENQ_TLS_CERT_FILE": str(chain), "GENQ_TLS_KEY_FILE": str(certs.server_key)}
    service = ServiceProcess(
        url_for(databases.create("compose_tls")),
        tmp_path / "serve.log",
        channel_credentials(certs, client=False),
        GENQ_AUTH="required",
        **env,
    )
    try:
        result = health_check(service.port, GENQ_TLS_CERT_FILE=str(chain))
        assert result.returncode == 0, result.stderr
        assert health_check(service.port).returncode != 0  # plaintext: refused
    finally:
        service.stop()
