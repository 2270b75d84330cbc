"""The `genq` command line (`[project.scripts]` in pyproject.toml runs `main`).

The operators' commands live here, in the SDK, so that `pip install genq` alone has every one:
they are gRPC clients of the service and hold no database credentials. Each topic module holds
its commands and their table (gates, tasks, resources, history, reconcile); command.py what
they share, values.py how arguments are read, render.py how answers are printed, program.py the
parser and `main`. What any command is (workers_sdk/commands.py) is outside this package: the
service's own commands (serve, migrate, token, in service/cli.py) are written with it too, and
the program finds them through an entry point.
"""

from workers_sdk.cli.program import main

__all__ = ["main"]
