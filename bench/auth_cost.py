"""What security costs on the single-task path: ClaimNextTask + CompleteTask over gRPC, one task
per call, with and without a token, and with TLS, in one run on one database.

    .venv/bin/python -m bench.auth_cost --clients 8 --seconds 10

Phases, each against a service of its own (`python -m service serve`, bench/claim_complete.py's
Service) on the same reloaded backlog (bench/claim_complete.py's load_queue):

1. plain: no TLS, no token (GENQ_AUTH=optional, the anonymous caller).
2. token: GENQ_AUTH=required, a worker token for every tool: the token is checked on each call
   (a cached lookup and a SHA-256).
3. scoped: the same with a token naming the bench's tools: each CompleteTask also resolves its
   task's tool (one primary-key query), each claim its tool's name (cached).
4. tls+scoped: phase 3 over TLS (certificates made here with openssl).
5. mtls+scoped: phase 4 with client certificates required.

K asyncio loops in one client process; tasks/s counts pairs completed in the measured window
after a warm-up. Prints each phase's figures and its ratio to the first.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.claim_complete import (
    TOOL_IDS,
    Rpcs,
    Service,
    Tally,
    Window,
    bench_database,
    complete_request,
    load_queue,
    percentile,
    server_settings,
    tally_pair,
)
from generation.task.v1 import task_pb2
from service import tokens


@dataclass(frozen=True)
class Phase:
    name: str
    env: dict[str, str]
    token: str | None
    credentials: grpc.ChannelCredentials | None


def make_certs(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, with openssl."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *curve, "-days", "1", "-subj", "/CN=bench-ca", "-keyout", "ca.key",
            "-out", "ca.pem")  # fmt: skip
    for name, extensions in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (directory / f"{name}.ext").write_text(extensions)
        openssl("req", "-new", *curve, "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                "-out", f"{name}.csr")  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext",
                "-out", f"{name}.pem")  # fmt: skip
    return {name: directory / name for name in ("ca.pem", "server.pem", "server.key",
                                                 "client.pem", "client.key")}  # fmt: skip


def wait_serving(service: Service, credentials: grpc.ChannelCredentials | None) -> None:
    deadline = time.monotonic() + 60
    with _channel(service.address, credentials) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            if service.process.poll() is not None:
                raise SystemExit(f"genq serve exited:\n{service.log_path.read_text()[-3000:]}")
            try:
                answer = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"genq serve not SERVING after 60 s ({service.log_path})")
            time.sleep(0.05)


def _channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    return (
        grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    )


async def loop(
    rpcs: Rpcs, metadata: tuple[tuple[str, str], ...], rng: random.Random, window: Window
) -> Tally:
    tally = Tally()
    claims = [task_pb2.ClaimNextTaskRequest(tool_id=str(tool_id)) for tool_id in TOOL_IDS]
    template = complete_request(0)
    await asyncio.sleep(max(0.0, window.begin - time.monotonic()))
    while (start := time.monotonic()) < window.end:
        try:
            claim = await rpcs.claim(rng.choice(claims), metadata=metadata)
            if not claim.lease_token:
                tally.empty_claims += 1
                continue
            claimed = time.monotonic()
            request = task_pb2.CompleteTaskRequest()
            request.CopyFrom(template)
            request.task_id, request.lease_token = claim.task.id, claim.lease_token
            await rpcs.complete(request, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            tally.errors[f"{error.code().name}: {error.details()}"] += 1
            continue
        tally_pair(tally, window, start, claimed, time.monotonic())
    return tally


async def measure(address: str, phase: Phase, args: argparse.Namespace) -> Tally:
    channel = (
        grpc.aio.secure_channel(address, phase.credentials)
        if phase.credentials
        else grpc.aio.insecure_channel(address)
    )
    async with channel:
        await asyncio.wait_for(channel.channel_ready(), 10)
        rpcs = Rpcs(channel)
        metadata = (("authorization", f"Bearer {phase.token}"),) if phase.token else ()
        begin = time.monotonic() + 0.2
        window = Window(begin, begin + args.warmup, begin + args.warmup + args.seconds)
        tallies = await asyncio.gather(
            *(
                loop(rpcs, metadata, random.Random(args.seed + n), window)
                for n in range(args.clients)
            )
        )
    total = Tally()
    for tally in tallies:
        total.merge(tally)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=8, help="concurrent client loops (8)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds (10)")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first (2)")
    parser.add_argument("--tasks", type=int, default=60_000, help="backlog per phase (60000)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    with bench_database() as url, tempfile.TemporaryDirectory() as scratch:
        files = make_certs(Path(scratch))
        tls = {
            "GENQ_TLS_CERT_FILE": str(files["server.pem"]),
            "GENQ_TLS_KEY_FILE": str(files["server.key"]),
        }
        server_only = grpc.ssl_channel_credentials(files["ca.pem"].read_bytes())
        mutual = grpc.ssl_channel_credentials(
            files["ca.pem"].read_bytes(),
            files["client.key"].read_bytes(),
            files["client.pem"].read_bytes(),
        )
        names = [f"bench-tool-{n}" for n in range(1, len(TOOL_IDS) + 1)]
        every = tokens.create(url, ["worker"], [], None, "bench")
        scoped = tokens.create(url, ["worker"], names, None, "bench scoped")
        required = {"GENQ_AUTH": "required"}
        phases = [
            Phase("plain", {}, None, None),
            Phase("token", required, every, None),
            Phase("scoped", required, scoped, None),
            Phase("tls+scoped", {**required, **tls}, scoped, server_only),
            Phase(
                "mtls+scoped",
                {**required, **tls, "GENQ_TLS_CLIENT_CA_FILE": str(files["ca.pem"])},
                scoped,
                mutual,
            ),
        ]
        print(f"postgres: {server_settings(url)}")
        print(f"{args.clients} client loops, {args.seconds:g} s measured per phase")
        first = None
        for phase in phases:
            load_queue(url, args.tasks)
            service = Service(url, phase.env)
            try:
                wait_serving(service, phase.credentials)
                tally = asyncio.run(measure(service.address, phase, args))
            finally:
                service.stop()
            rate = len(tally.pairs) / args.seconds
            first = first or rate
            print(
                f"{phase.name:<12} {rate:>8,.0f} tasks/s  {rate / first:.2f}x plain  "
                f"pair p50 {percentile(tally.pairs, 0.5) * 1000:.2f} ms  "
                f"p99 {percentile(tally.pairs, 0.99) * 1000:.2f} ms"
            )
            if tally.empty_claims:
                print(f"{'':<12} WARNING: {tally.empty_claims} empty claims: raise --tasks")
            for error, count in tally.errors.most_common(3):
                print(f"{'':<12} ERROR x{count}: {error}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
