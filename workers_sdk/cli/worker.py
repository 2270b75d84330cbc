"""`genq worker MODULE:ATTR`: runs the WorkerFleet a worker author's module builds, as its own
process: the signals, the logs and the exit code are the command's, the tools and handlers the
module's.

ATTR is a WorkerFleet, or a function called with no arguments that returns one (it may be
`async def`); a function is called inside the command's event loop, after the options are in the
environment, so it may read them and make a client of its own. The options --target, --token and
--tls-* are written to the environment (GENQ_ADDR, GENQ_TOKEN, GENQ_TLS_*) before MODULE is
imported: a fleet made from a target (`WorkerFleet(os.environ.get("GENQ_ADDR", ...))`) finds its
token and TLS there, as every client does. --concurrency N hosts every tool the module registers
N at a time, whatever its `register`/`tool` call says.

SIGTERM and SIGINT drain (WorkerFleet.run's own handlers): no new claims, the tasks in flight
finish within the fleet's drain_timeout or are handed back (ReleaseTask, no attempt used); then
the command exits 0.

--until-empty stops once nothing is due and says why, from the service's own answer: a claim
that brings nothing carries an `idle_reason` (IdleReason in task.proto). Once every hosted tool's
latest claim came back empty, each claim asked while the fleet had nothing in flight, and nothing
is in flight still, the fleet drains and the command exits with `exit_code` of the reasons:
3 if any tool is disabled or paused, else 4 if any is capped, else 0 (empty, or a deliberate
wait: not due yet, cooling, held, busy, and any reason this SDK does not know). A claim the
service refuses (a token that may not claim the tool, say) ends the run with 1; an unreachable
service is waited for, as the fleet always does.

The fleet reports no idle reasons of its own, so the command reads them from the answers of its
client's claims (`watch_claims` wraps that client's `call`); and a registered tool's concurrency
cannot be changed, so --concurrency wraps `WorkerFleet.register` while the module loads
(`every_lane`). A public `WorkerFleet(on_idle=...)` callback and a `set_concurrency` method would
replace both. Docs: "Running workers: genq worker" in docs/OPERATIONS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import inspect
import logging
import operator
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from generation.task.v1 import task_pb2 as pb
from workers_sdk import logs
from workers_sdk.cli.command import CONNECTION
from workers_sdk.client import GenqClient
from workers_sdk.commands import (
    CAPPED,
    DISABLED,
    DONE,
    ERROR,
    Command,
    CommandError,
    UsageError,
    arg,
    flag,
)
from workers_sdk.errors import GenqError
from workers_sdk.fleet import Handler, WorkerFleet

log = logging.getLogger("workers_sdk.cli.worker")

CLAIMS = ("ClaimTasks", "ClaimNextTask")
"""The calls whose answers say why nothing was claimed."""

REFUSALS = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
"""A claim failing with one of these fails the same way again: with --until-empty the run
ends (exit 1) instead of trying forever, as the fleet otherwise does."""

IDLE_EXIT: dict[str, int] = {
    "IDLE_REASON_EMPTY": DONE,
    "IDLE_REASON_WAITING": DONE,
    "IDLE_REASON_COOLING": DONE,
    "IDLE_REASON_HELD": DONE,
    "IDLE_REASON_BUSY": DONE,
    "IDLE_REASON_RATE_LIMITED": DONE,
    "IDLE_REASON_DISABLED": DISABLED,
    "IDLE_REASON_PAUSED": DISABLED,
    "IDLE_REASON_CAPPED": CAPPED,
}
"""--until-empty: the exit code each idle reason asks for; the waits (rate_limited too) end the
run as "waiting", 0."""

PRECEDENCE = (DISABLED, CAPPED, DONE)
"""When the tools idle for different reasons, the first of these any of them asks for."""

WORDS = {DONE: "empty or waiting", DISABLED: "disabled", CAPPED: "capped"}

HEALTH_TOUCH_SECONDS = 10.0
"""How often --health-file is touched while the fleet works."""


def reason_name(reason: int) -> str:
    """IDLE_REASON_PAUSED for 5; "" for a number this SDK does not know."""
    try:
        return pb.IdleReason.Name(reason)  # type: ignore[arg-type]
    except ValueError:
        return ""


def reason_word(reason: int) -> str:
    """ "paused" for IDLE_REASON_PAUSED; "idle reason N" for a number this SDK does not know."""
    name = reason_name(reason)
    return name.removeprefix("IDLE_REASON_").lower() if name else f"idle reason {reason}"


def exit_code(reasons: dict[str, int]) -> int:
    """The exit code for the idle reasons of the tools (name -> IdleReason)."""
    asked = {IDLE_EXIT.get(reason_name(reason), DONE) for reason in reasons.values()}
    return next((code for code in PRECEDENCE if code in asked), DONE)


# -- loading MODULE:ATTR ------------------------------------------------------------------------


def load(spec: str) -> Any:
    """The object MODULE:ATTR names (ATTR may be dotted). The current directory is searched
    first, as `python -m` does, so `genq worker examples.worker:make_fleet` runs from a checkout."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise UsageError(f"{spec!r}: give MODULE:ATTR, e.g. examples.worker:make_fleet")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise CommandError(f"cannot import {module_name!r} ({spec}): {error}") from None
    except Exception as error:
        log.error("importing %s raised", module_name, exc_info=True)
        raise CommandError(
            f"importing {module_name!r} ({spec}) raised {type(error).__name__}: {error}"
        ) from None
    try:
        return operator.attrgetter(attribute)(module)
    except AttributeError:
        raise CommandError(f"module {module_name!r} has no attribute {attribute!r}") from None


async def build(found: Any, spec: str) -> WorkerFleet:
    """The fleet: `found` itself, or what calling it (and awaiting that, if it must) returns."""
    if isinstance(found, WorkerFleet):
        return found
    if not callable(found):
        raise CommandError(
            f"{spec} is a {type(found).__name__}: give a WorkerFleet or a function returning one"
        )
    try:
        made = found()
        if inspect.isawaitable(made):
            made = await made
    except Exception as error:
        log.error("%s() raised", spec, exc_info=True)
        raise CommandError(f"{spec}() raised {type(error).__name__}: {error}") from None
    if not isinstance(made, WorkerFleet):
        raise CommandError(f"{spec}() returned a {type(made).__name__}, not a WorkerFleet")
    return made


@contextlib.contextmanager
def every_lane(concurrency: int | None) -> Iterator[None]:
    """While the module loads and its factory runs: every tool registered on any WorkerFleet
    runs `concurrency` tasks at a time, whatever `register` (or `tool`) was told. WorkerFleet has
    no way to change a registered tool's concurrency, so the command decides it as the tools are
    registered."""
    if concurrency is None:
        yield
        return
    original = WorkerFleet.register

    def register(self: WorkerFleet, name: str, handler: Handler, **_: Any) -> None:
        log.info("tool %s: concurrency %d (--concurrency)", name, concurrency)
        original(self, name, handler, concurrency=concurrency)

    WorkerFleet.register = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        WorkerFleet.register = original  # type: ignore[method-assign]


# -- what the claims answered -------------------------------------------------------------------


@dataclass
class Idle:
    """What the fleet's claims answered, per tool id, for --until-empty."""

    fleet: WorkerFleet
    reasons: dict[str, int] = field(default_factory=dict)
    """Tool id -> the idle reason of its latest claim, if that claim brought nothing and was
    asked while the fleet had nothing in flight (else the tool is absent)."""
    refused: GenqError | None = None
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once every tool idles (see `reasons`) with nothing in flight, or a claim is refused."""

    def quiet(self) -> bool:
        return not any(self.fleet.in_flight.values())

    def answered(self, tool_id: str, reason: int | None, asked_quiet: bool) -> None:
        if reason is None or not asked_quiet:
            self.reasons.pop(tool_id, None)
            return
        self.reasons[tool_id] = reason
        tools = set(self.fleet.tool_ids.values())
        if tools and tools <= set(self.reasons) and self.quiet():
            self.settled.set()

    def refuse(self, error: GenqError) -> None:
        self.refused = error
        self.settled.set()

    def by_name(self) -> dict[str, int]:
        names = {tool_id: name for name, tool_id in self.fleet.tool_ids.items()}
        return {names.get(tool_id, tool_id): reason for tool_id, reason in self.reasons.items()}


def watch_claims(client: GenqClient, idle: Idle) -> None:
    """Has `idle` hear the answer of every claim `client` makes (a wrapper of `client.call` on
    this one client: the fleet's other calls pass through untouched)."""
    call: Callable[..., Awaitable[Any]] = client.call

    @functools.wraps(call)
    async def watched(method: str, request: Any, *, timeout: float | None = None) -> Any:
        if method not in CLAIMS:
            return await call(method, request, timeout=timeout)
        asked_quiet = idle.quiet()
        try:
            answer = await call(method, request, timeout=timeout)
        except GenqError as error:
            if error.code in REFUSALS:
                idle.refuse(error)
            raise
        claimed = bool(answer.tasks) if method == "ClaimTasks" else answer.HasField("task")
        idle.answered(request.tool_id, None if claimed else answer.idle_reason, asked_quiet)
        return answer

    client.call = watched  # type: ignore[method-assign]


async def client_of(fleet: WorkerFleet, running: asyncio.Task[None]) -> GenqClient | None:
    """The fleet's client: given to it, or made as `run` starts (before its first call); None if
    the run ended first."""
    while True:
        with contextlib.suppress(RuntimeError):
            return fleet.client
        if running.done():
            return None
        await asyncio.sleep(0)


# -- the command --------------------------------------------------------------------------------


def cmd_worker(args: argparse.Namespace) -> int:
    level, format = logs.from_env()
    if problem := logs.problem(level, format):
        raise UsageError(problem)
    logs.configure(level, format)
    if bool(args.tls_client_cert_file) != bool(args.tls_client_key_file):
        raise UsageError("--tls-client-cert-file and --tls-client-key-file go together")
    for option, variable in OPTION_VARIABLES.items():
        if (value := getattr(args, option)) is not None:
            os.environ[variable] = value
    return asyncio.run(work(args))


OPTION_VARIABLES = {
    "target": "GENQ_ADDR",
    "token": "GENQ_TOKEN",
    "tls_ca_file": "GENQ_TLS_CA_FILE",
    "tls_client_cert_file": "GENQ_TLS_CLIENT_CERT_FILE",
    "tls_client_key_file": "GENQ_TLS_CLIENT_KEY_FILE",
}
"""The connection options, and the variables they set for the module and its fleet."""


async def work(args: argparse.Namespace) -> int:
    with every_lane(args.concurrency):
        fleet = await build(load(args.fleet), args.fleet)
    idle = Idle(fleet)
    running = asyncio.create_task(fleet.run(), name="genq worker")
    helpers: list[asyncio.Task[Any]] = []
    if args.until_empty and (client := await client_of(fleet, running)) is not None:
        watch_claims(client, idle)
        helpers.append(asyncio.create_task(_stop_when_settled(fleet, idle)))
    health_file = args.health_file or os.environ.get("GENQ_HEALTH_FILE") or None
    if health_file:
        helpers.append(asyncio.create_task(_touch(fleet, running, Path(health_file))))
    try:
        await running
    except (ValueError, OSError) as error:  # the fleet's client: a bad certificate or key
        raise CommandError(str(error)) from None
    except RuntimeError as error:  # a fleet with no tools, or one that ran already
        raise CommandError(f"{args.fleet}: {error}") from None
    finally:
        for helper in helpers:
            helper.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
    if not args.until_empty:
        return DONE
    if idle.refused is not None:
        log.error("stopped: a claim was refused: %s", idle.refused)
        return ERROR
    if not idle.settled.is_set():
        log.info("stopped by a signal before the queue was empty")
        return DONE
    reasons = idle.by_name()
    code = exit_code(reasons)
    why = ", ".join(f"{name} {reason_word(reason)}" for name, reason in sorted(reasons.items()))
    why = why or "empty"  # the drain's last claims brought tasks, and they were worked
    log.info("stopped: nothing due (%s): %s, exit %d", why, WORDS[code], code)
    print(f"genq worker: nothing due ({why}): {WORDS[code]}", flush=True)
    return code


async def _stop_when_settled(fleet: WorkerFleet, idle: Idle) -> None:
    await idle.settled.wait()
    fleet.stop()  # the drain: a claim parked now is awaited, and what it brings is worked


async def _touch(fleet: WorkerFleet, running: asyncio.Task[None], path: Path) -> None:
    """Touches `path` every HEALTH_TOUCH_SECONDS from when the fleet's tools are registered (the
    service answered and took the token) until it stops; removes it then."""
    ready = asyncio.create_task(fleet.ready.wait())
    try:
        await asyncio.wait([running, ready], return_when=asyncio.FIRST_COMPLETED)
        while not running.done():
            await asyncio.to_thread(path.touch)
            await asyncio.wait([running], timeout=HEALTH_TOUCH_SECONDS)
    finally:
        ready.cancel()
        with contextlib.suppress(OSError):
            await asyncio.to_thread(path.unlink, missing_ok=True)


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


COMMANDS = [
    Command(
        "worker",
        cmd_worker,
        "run the WorkerFleet a module builds: MODULE:ATTR (drains on SIGTERM/SIGINT)",
        "Import MODULE and run the WorkerFleet its ATTR is, or that calling ATTR with no "
        "arguments returns (a factory; it may be async), until SIGTERM or SIGINT: then no new "
        "claims, and the tasks in flight get the fleet's drain_timeout to finish before they are "
        "handed back; exit 0. With --until-empty it stops once nothing is due and says why, from "
        "the service's idle reasons: exit 0 empty or waiting, 3 disabled (the kill switch, or a "
        "tool paused), 4 capped, 1 a claim refused. --target, --token and --tls-* are set in the "
        "environment (GENQ_ADDR, GENQ_TOKEN, GENQ_TLS_*) before MODULE is imported; logs follow "
        "GENQ_LOG_LEVEL and GENQ_LOG_FORMAT, as the service's. See docs/OPERATIONS.md, "
        '"Running workers: genq worker".',
        [
            arg("fleet MODULE:ATTR", "e.g. examples.worker:make_fleet"),
            arg(
                "--concurrency N",
                "run every tool N tasks at a time (default: as the module registers each)",
                type=positive,
            ),
            flag("--until-empty", "stop once nothing is due; the exit code says why"),
            arg(
                "--health-file PATH",
                "touched every 10 s while the fleet works (default: GENQ_HEALTH_FILE)",
            ),
            arg("--target HOST:PORT", "the service (sets GENQ_ADDR; default: localhost:50051)"),
            *CONNECTION,
        ],
        client=False,
    ),
]
