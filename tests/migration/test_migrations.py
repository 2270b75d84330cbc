"""Migrating as deployments do: from an installed wheel (which carries the baseline's schema.sql),
by several replicas at once, and never down without being told how far (GUIDE fault 21)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psycopg
from alembic.script import ScriptDirectory
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service import migrations
from tests.conftest import ROOT, Databases, ServiceProcess, free_port, url_for, wait_for
from workers_sdk.commands import USAGE


def head() -> str:
    found = ScriptDirectory(str(migrations.script_location())).get_current_head()
    assert found is not None
    return found


def versions(url: str) -> list[str]:
    with psycopg.connect(url) as connection:
        if connection.execute("SELECT to_regclass('public.alembic_version')").fetchone() == (None,):
            return []
        rows = connection.execute("SELECT version_num FROM alembic_version").fetchall()
    return [row[0] for row in rows]


def has_tasks_table(url: str) -> bool:
    with psycopg.connect(url) as connection:
        found = connection.execute("SELECT to_regclass('generation.tasks') IS NOT NULL").fetchone()
    return found == (True,)


def run(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def source_copy(destination: Path) -> Path:
    """What the wheel is built from, per pyproject.toml: so the build neither writes into the
    checkout (build/, *.egg-info) nor sees anything the packaging does not name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = project["tool"]["setuptools"]
    folders = {
        setuptools.get("package-dir", {}).get(package, package)
        for package in setuptools["packages"]
        if "." not in package
    }
    destination.mkdir()
    for name in ("pyproject.toml", project["project"]["readme"]):
        shutil.copy(ROOT / name, destination / name)
    for folder in folders:
        shutil.copytree(
            ROOT / folder, destination / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    return destination


def test_an_installed_wheel_migrates_and_serves_from_anywhere(
    databases: Databases, tmp_path: Path
) -> None:
    source = source_copy(tmp_path / "source")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    offline = ["--no-deps", "--no-index", "--no-build-isolation"]
    built = run([*pip, "wheel", *offline, "-w", str(tmp_path / "dist"), str(source)], tmp_path)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("genq-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    assert not {name for name in names if name.startswith("alembic/")}, "shadows the library"
    assert not {name for name in names if "__pycache__" in name}
    assert {"genq_migrations/env.py", "genq_migrations/script.py.mako"} <= names
    revisions = {
        f"genq_migrations/versions/{p.name}" for p in (ROOT / "alembic/versions").glob("*.py")
    }
    assert revisions and revisions <= names
    assert "generation/task/v1/schema.sql" in names, "the baseline runs it"

    target = tmp_path / "site"
    installed = run([*pip, "install", *offline, "--target", str(target), str(wheel)], tmp_path)
    assert installed.returncode == 0, installed.stderr

    outside = tmp_path / "elsewhere"  # no alembic.ini, no alembic/, no checkout
    outside.mkdir()
    where = run(
        [
            sys.executable,
            "-c",
            "from importlib.resources import files; from service import migrations; "
            "print(migrations.__file__); print(migrations.script_location()); "
            "print(files('generation.task.v1').joinpath('schema.sql'))",
        ],
        outside,
        PYTHONPATH=str(target),
    )
    assert where.returncode == 0, where.stderr
    module, scripts, schema = where.stdout.split()
    assert Path(module).is_relative_to(target)
    assert Path(scripts) == target / "genq_migrations"
    assert Path(schema) == target / "generation" / "task" / "v1" / "schema.sql"

    url = url_for(databases.create("from_wheel", template=None))
    migrated = run(
        [str(target / "bin" / "genq"), "migrate"], outside, PYTHONPATH=str(target), DATABASE_URL=url
    )
    assert migrated.returncode == 0, migrated.stderr
    assert versions(url) == [head()]
    assert has_tasks_table(url)

    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as output:
        serve = subprocess.Popen(
            [str(target / "bin" / "genq"), "serve"],
            cwd=outside,
            env={
                **os.environ,
                "PYTHONPATH": str(target),
                "DATABASE_URL": url,
                "GENQ_HOST": "127.0.0.1",
                "GENQ_PORT": str(port),
                "GENQ_HTTP_PORT": "0",
            },
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)

    def serving() -> bool:
        if serve.poll() is not None:
            raise AssertionError(f"genq serve exited: {log.read_text()[-3000:]}")
        try:
            answer = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    try:
        wait_for(serving, timeout=60, what="genq serve from the installed wheel")
    finally:
        channel.close()
        serve.terminate()
        serve.wait(30)


def test_three_replicas_on_an_empty_database_all_serve(
    databases: Databases, tmp_path: Path
) -> None:
    url = url_for(databases.create("replicas", template=None))
    assert versions(url) == []

    def start(number: int) -> ServiceProcess:
        return ServiceProcess(url, tmp_path / f"serve-{number}.log")

    with ThreadPoolExecutor(max_workers=3) as pool:  # three `genq serve` at once
        futures = [pool.submit(start, number) for number in range(3)]
    replicas = [future.result() for future in futures if future.exception() is None]
    try:
        for future in futures:
            future.result()  # a replica that did not come up fails the test with its log
        assert all(replica.serving() for replica in replicas)
        assert versions(url) == [head()]
        with psycopg.connect(url) as connection:
            # Advisory locks belong to one database; nobody holds this one's any more.
            held = connection.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid::bigint = %s"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                [migrations.LOCK_KEY],
            ).fetchone()
        assert held == (0,)
    finally:
        for replica in replicas:
            replica.stop()


def test_downgrade_needs_an_explicit_revision(databases: Databases, tmp_path: Path) -> None:
    url = url_for(databases.create("no_default_downgrade"))  # a copy of the migrated template
    before = versions(url)
    assert before == [head()]

    refused = run(
        [sys.executable, "-m", "service", "migrate", "--downgrade"], ROOT, DATABASE_URL=url
    )
    assert refused.returncode == USAGE
    assert "--downgrade" in refused.stderr and "REVISION" in refused.stderr
    assert versions(url) == before
    assert has_tasks_table(url)

    explicit = run(
        [sys.executable, "-m", "service", "migrate", "--downgrade", "base"], ROOT, DATABASE_URL=url
    )
    assert explicit.returncode == 0, explicit.stderr
    assert versions(url) == []
    assert not has_tasks_table(url)
