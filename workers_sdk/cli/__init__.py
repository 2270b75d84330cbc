"""The `genq` command line (`[project.scripts]` in pyproject.toml runs `main`).

The operators' commands live here, in the SDK, so that `pip install genq` alone has every one:
they are gRPC clients of the service and hold no database credentials. Each topic module holds
its commands and their table (gates, tasks, resources, history, reconcile); command.py what
they share, values.py how arguments are read, render.py how answers are printed, program.py the
parser and `main`. The service's own commands (serve, migrate, token) are in service/cli.py.
"""

from workers_sdk.cli.program import main

__all__ = ["main"]
