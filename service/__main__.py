"""`python -m service`: the `genq` program, as its console script runs it (every command, the
operators' and the service's). Loaded through the installed entry point, not imported: the
program lives in the SDK (workers_sdk/cli/), which adds the service's commands, never the other
way round."""

import sys
from importlib.metadata import entry_points

(genq,) = entry_points(group="console_scripts", name="genq")
sys.exit(genq.load()())
