"""`python -m minillm.bench SUITE`: the benchmark runner (`minillm.bench.cli`)."""

import sys

from .cli import main

sys.exit(main())
