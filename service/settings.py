"""The service's settings, read once from the environment. Every field says its default."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

_ENV_NAMES = {
    "database_url": ["DATABASE_URL"],
    "redis_url": ["REDIS_ADDR", "REDIS_URL"],
    "environment": ["ENVIRONMENT"],
}


@dataclass(frozen=True)
class Settings:
    database_url: str | None = None
    """DATABASE_URL. Unset: `genq serve` starts an embedded Postgres in `data_dir`."""

    data_dir: Path = Path(".genq")
    """GENQ_DATA_DIR (.genq): where the embedded Postgres keeps its data."""

    host: str = "127.0.0.1"
    """GENQ_HOST (127.0.0.1): the address both ports bind. Loopback only by default; another
    address needs auth (GENQ_AUTH=required or GENQ_TLS_CLIENT_CA_FILE), or GENQ_ALLOW_INSECURE."""

    port: int = 50051
    """GENQ_PORT (50051): gRPC port; 0 picks a free one (printed at start)."""

    http_port: int = 8080
    """GENQ_HTTP_PORT (8080): the status page and /metrics; 0 picks a free one"""

    pool_min_size: int = 2
    """GENQ_POOL_MIN_SIZE (2): connections kept open."""

    pool_max_size: int = 10
    """GENQ_POOL_MAX_SIZE (10): most connections at once; more callers wait."""

    pool_timeout_seconds: float = 5.0
    """GENQ_POOL_TIMEOUT_SECONDS (5): longest wait for a connection before UNAVAILABLE."""

    statement_timeout_ms: int = 10_000
    """GENQ_STATEMENT_TIMEOUT_MS (10000): Postgres statement_timeout of every session."""

    statement_margin_seconds: float = 2.0
    """GENQ_STATEMENT_MARGIN_SECONDS (2): a database call without a deadline is given up
    client-side (UNAVAILABLE) after GENQ_POOL_TIMEOUT_SECONDS + GENQ_STATEMENT_TIMEOUT_MS + this;
    a call with a deadline at its deadline, if sooner."""

    ping_timeout_seconds: float = 1.5
    """GENQ_PING_TIMEOUT_SECONDS (1.5): the health check's SELECT 1, sent through the pool every
    second, must answer within this, else gRPC health is NOT_SERVING."""

    connect_timeout_seconds: int = 3
    """GENQ_CONNECT_TIMEOUT_SECONDS (3): libpq connect_timeout of each new connection (at least
    2), unless DATABASE_URL sets one."""

    tcp_keepalive_seconds: int = 10
    """GENQ_TCP_KEEPALIVE_SECONDS (10): a quiet TCP connection to Postgres is probed after this
    long, then every third of it, three times, and dropped if none is answered (libpq keepalives,
    unless DATABASE_URL sets them)."""

    tcp_user_timeout_ms: int = 10_000
    """GENQ_TCP_USER_TIMEOUT_MS (10000): a TCP connection to Postgres whose sent data stays
    unacknowledged this long is dropped (libpq tcp_user_timeout, unless DATABASE_URL sets it)."""

    lease_seconds: int = 120
    """GENQ_LEASE_SECONDS (120): lease length set by a claim and by each heartbeat."""

    min_lease_seconds: int = 10
    """GENQ_MIN_LEASE_SECONDS (10): the shortest `lease_seconds` ConfigureTool takes for a tool.
    A shorter lease cannot outlive one slow heartbeat (the SDK beats every third of it)."""

    rescue_interval_seconds: float = 1.0
    """GENQ_RESCUE_INTERVAL_SECONDS (1): how often the maintenance leader hands lapsed leases back
    to the queue and expires tasks past their TTL."""

    processes: int = os.cpu_count() or 1
    """GENQ_PROCESSES (the number of CPUs, os.cpu_count()): service processes `genq serve` runs,
    all on GENQ_PORT (SO_REUSEPORT), each with its own pool; 1 runs the service in one process."""

    leader_ttl_seconds: float = 10.0
    """GENQ_LEADER_TTL_SECONDS (10): the maintenance leader's lease (generation.leader); a leader
    that dies or freezes is replaced at most this plus GENQ_LEADER_RENEW_SECONDS later."""

    leader_renew_seconds: float = 3.0
    """GENQ_LEADER_RENEW_SECONDS (3): how often the leader renews its lease, and every other
    process tries to take it."""

    max_input_bytes: int = 1_048_576
    """GENQ_MAX_INPUT_BYTES (1 MiB): largest `input` or `output` accepted, serialized."""

    max_message_bytes: int = 4_194_304
    """GENQ_MAX_MESSAGE_BYTES (4 MiB): gRPC receive limit for one request."""

    shutdown_grace_seconds: float = 10.0
    """GENQ_SHUTDOWN_GRACE_SECONDS (10): on SIGTERM, time given to calls in flight."""

    max_claim_wait_seconds: float = 30.0
    """GENQ_MAX_CLAIM_WAIT_SECONDS (30): longest `wait` a ClaimNextTask may ask for."""

    recheck_seconds: float = 1.0
    """GENQ_RECHECK_SECONDS (1): a parked claim or event watch re-reads the database at least
    this often, so a lost wake (another replica without Redis, a dropped message) costs at most
    this much."""

    redis_url: str | None = None
    """REDIS_ADDR (alias REDIS_URL), e.g. redis://host:6379/0, the DB index in the path. Unset:
    wakes stay within this process and events only in Postgres."""

    disabled: bool = False
    """GENQ_DISABLED (false): the kill switch's override. True stops every claim whatever the
    database says; the stored switch cannot turn it back on."""

    daily_cap_nanos: int | None = field(default=None, metadata={"parse": int})
    """GENQ_DAILY_CAP_NANOS (unset): replaces the stored global daily cap while set."""

    environment: str = "dev"
    """ENVIRONMENT (dev): namespace of the Redis keys, `{env}:common:task:wake` and
    `{env}:common:task:{id}:events`; every service and worker of a deployment must agree."""

    tls_cert_file: str | None = None
    """GENQ_TLS_CERT_FILE (unset): PEM certificate chain; with GENQ_TLS_KEY_FILE, both ports
    speak TLS only (plaintext is refused). Read at start: a new certificate needs a restart."""

    tls_key_file: str | None = None
    """GENQ_TLS_KEY_FILE (unset): the PEM private key of GENQ_TLS_CERT_FILE."""

    tls_client_ca_file: str | None = None
    """GENQ_TLS_CLIENT_CA_FILE (unset): mutual TLS; every client of either port must present a
    certificate signed by one of these PEM CA certificates. Needs GENQ_TLS_CERT_FILE."""

    token_cache_seconds: float = 15.0
    """GENQ_TOKEN_CACHE_SECONDS (15): how long a process trusts a token it looked up without
    asking the database again, so a revocation (or an expiry) reaches every replica within this
    long; `genq token revoke` promises 30 s."""

    auth: str = "optional"
    """GENQ_AUTH (optional): `required` makes a valid token (`authorization: Bearer`) mandatory
    on every RPC but gRPC health, and on the HTTP port but /healthz. `optional`: a call without
    a token acts with every role, as before tokens existed; a token sent is still checked."""

    allow_insecure: bool = False
    """GENQ_ALLOW_INSECURE (false): lets GENQ_HOST be a non-loopback address without auth (a
    warning at every start). Without it such a start is refused."""

    reflection: bool = True
    """GENQ_REFLECTION (true): gRPC server reflection (what `grpcurl list` uses). It serves
    every method's SQL: turn it off where callers should not read it."""

    log_level: str = "info"
    """GENQ_LOG_LEVEL (info): debug, info, warning or error. Below debug, what the embedded Postgres
    and alembic print is held back, and logged at ERROR only if they fail."""

    log_format: str = "text"
    """GENQ_LOG_FORMAT (text): `json` writes one JSON object a line, for a log collector: time,
    level, logger, message, and exception when there is one."""

    http_hosts: str = ""
    """GENQ_HTTP_HOSTS (unset): comma-separated names the HTTP port answers as (its Host header,
    port aside), beside localhost, 127.0.0.1, ::1 and GENQ_HOST; others get 421 (DNS rebinding).
    /healthz answers any Host."""

    @property
    def auth_required(self) -> bool:
        return self.auth == "required"

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        values: dict[str, object] = {}
        for setting in fields(cls):
            names = env_names(setting.name)
            name = next((n for n in names if env.get(n)), names[0])
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            default = getattr(cls, setting.name)
            try:
                if "parse" in setting.metadata:
                    values[setting.name] = setting.metadata["parse"](raw)
                elif isinstance(default, bool):
                    values[setting.name] = raw.lower() in {"1", "true", "yes", "on"}
                elif isinstance(default, int):
                    values[setting.name] = int(raw)
                elif isinstance(default, float):
                    values[setting.name] = float(raw)
                elif isinstance(default, Path):
                    values[setting.name] = Path(raw)
                else:
                    values[setting.name] = raw
            except ValueError as exc:
                raise SystemExit(f"{name}={raw!r} is not a valid {type(default).__name__}") from exc
        return cls(**values)  # type: ignore[arg-type]


def env_names(field_name: str) -> list[str]:
    """The environment variables a setting is read from, preferred first."""
    return _ENV_NAMES.get(field_name, [f"GENQ_{field_name.upper()}"])
