"""What the operators' commands share: the options every client command takes, and the calls
most of them make (one RPC, the answer printed, a tool found by id or name).

A command is a `Command` (workers_sdk/commands.py) in some topic module's COMMANDS table;
`workers_sdk/cli/program.py` builds the parser from the tables.
"""

from __future__ import annotations

import argparse
import os
import uuid
from typing import Any, NamedTuple

from generation.task.v1 import task_pb2 as pb
from workers_sdk.cli import render
from workers_sdk.client import DEFAULT_TARGET, Credentials
from workers_sdk.commands import CommandError, arg
from workers_sdk.errors import GenqError, Reason

TOOL_ID = "a tool id or name"

CONNECTION = [
    arg("--token TOKEN", "the caller's token (default: GENQ_TOKEN; prefer it: argv is visible)"),
    arg("--tls-ca-file PEM", "TLS: the CA of the service's certificate (GENQ_TLS_CA_FILE)"),
    arg("--tls-client-cert-file PEM", "mutual TLS: this client's (GENQ_TLS_CLIENT_CERT_FILE)"),
    arg("--tls-client-key-file PEM", "its key (GENQ_TLS_CLIENT_KEY_FILE)"),
]
"""How every client command reaches a secured service."""


def target(args: argparse.Namespace) -> str:
    return str(args.target or os.environ.get("GENQ_ADDR") or DEFAULT_TARGET)


def credentials(args: argparse.Namespace) -> Credentials:
    return Credentials.from_env(
        token=args.token,
        ca_file=args.tls_ca_file,
        client_cert_file=args.tls_client_cert_file,
        client_key_file=args.tls_client_key_file,
    )


async def call(args: argparse.Namespace, method: str, request: Any) -> Any:
    """One RPC on the command's channel; a refusal raises GenqError (exit 1 in `main`)."""
    return await args.client.call(method, request)


def answer(args: argparse.Namespace, message: Any, text: str) -> None:
    """The answer: the proto message as JSON with --format json, else the text."""
    print(render.as_json(message) if args.format == "json" else text, flush=True)


class ToolRef(NamedTuple):
    id: str
    name: str


async def find_tool(args: argparse.Namespace, tool: str, *, create: bool = False) -> ToolRef:
    """A tool by id, or by a name looked up in GetStatus (created with UpsertTool if `create`)."""
    try:
        uuid.UUID(tool)
    except ValueError:
        pass
    else:
        try:
            found = (await call(args, "GetTool", pb.GetToolRequest(tool_id=tool))).tool
            return ToolRef(str(found.id), str(found.name))
        except GenqError as error:  # an unknown id may still be some tool's name
            if error.reason is not Reason.TOOL_NOT_FOUND:
                raise
    for tool_id, name in (await tool_names(args)).items():
        if name == tool:
            return ToolRef(tool_id, name)
    if create:
        made = (await call(args, "UpsertTool", pb.UpsertToolRequest(name=tool))).tool
        return ToolRef(str(made.id), str(made.name))
    hint = " (enqueue --create-tool creates it)" if args.command == "enqueue" else ""
    raise CommandError(f"no tool with the id or name {tool!r}{hint}")


async def tool_names(args: argparse.Namespace) -> dict[str, str]:
    """Every tool's name by its id, in one GetStatus call."""
    status = (await call(args, "GetStatus", pb.GetStatusRequest())).status
    return {str(t.tool_id): str(t.name) for t in status.tools}
