"""`python -m benchmarks.lab`: the lab's command (benchmarks/lab/cli.py)."""

import sys

from benchmarks.lab.cli import main

sys.exit(main())
