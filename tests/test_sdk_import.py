"""The SDK is what worker and gateway hosts install: it must not pull in a database driver, the
migration tooling, Redis or the OpenTelemetry SDK (only the API). Checked in a fresh interpreter,
since this test process has imported all of them already."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

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
