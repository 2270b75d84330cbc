"""`python -m workers_sdk.cli`: the `genq` program, as the entry point runs it."""

import sys

from workers_sdk.cli import main

sys.exit(main())
