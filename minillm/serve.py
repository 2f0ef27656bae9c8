"""`python -m minillm.serve`: the OpenAI-compatible HTTP server (lesson 13), built in `minillm.serving`."""

import sys

from .serving.server import main

if __name__ == "__main__":
    sys.exit(main())
