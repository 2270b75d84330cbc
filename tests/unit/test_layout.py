"""The import graph of the project's own modules: no circle, the service never imports the
operators' CLI (workers_sdk/cli/), and the SDK never imports the service.

Read from the source (ast), so an import inside a function counts as much as one at the top: a
circle closed at run time is still a circle. The SDK reaches the service's commands through an
entry point (workers_sdk/commands.py COMMAND_GROUP), which is no import.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

SCANNED = ("service", "workers_sdk")
PROJECT = ("service", "workers_sdk", "generation")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in SCANNED
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(name: str, path: Path) -> set[str]:
    """The project modules `name` imports anywhere in its source: `from package import module`
    names the module, `from module import thing` the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if is_module(submodule) else base)
    return {target for target in found if target.partition(".")[0] in PROJECT}


def graph() -> dict[str, set[str]]:
    return {name: imports(name, path) - {name} for name, path in modules().items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_graph_is_read() -> None:
    edges = graph()
    assert "service.api.server" in edges["service.cli"]
    assert "workers_sdk.commands" in edges["service.cli"]
    assert "workers_sdk.money" in edges["service.page.app"]
    assert "workers_sdk.cli.program" in edges["workers_sdk.cli"]


def test_no_import_circle_among_the_project_modules() -> None:
    assert cycles(graph()) == []


def test_the_service_imports_nothing_from_the_operators_cli() -> None:
    wrong = {
        (name, target)
        for name, targets in graph().items()
        if name.partition(".")[0] == "service"
        for target in targets
        if target == "workers_sdk.cli" or target.startswith("workers_sdk.cli.")
    }
    assert not wrong


def test_the_sdk_imports_nothing_from_the_service() -> None:
    wrong = {
        (name, target)
        for name, targets in graph().items()
        if name.partition(".")[0] == "workers_sdk"
        for target in targets
        if target.partition(".")[0] == "service"
    }
    assert not wrong


def test_a_circle_is_found() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
