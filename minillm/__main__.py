"""`python -m minillm`: the command-line interface (the same as `python -m minillm.infer`)."""

import sys

from .infer import main

sys.exit(main())
