"""`python -m m3eagle ...` runs the CLI."""

import sys

from m3eagle.entrypoints.cli import main

if __name__ == "__main__":  # a tensor-parallel worker (spawned) imports this module too: it must not run the CLI
    sys.exit(main())
