"""`python -m m3eagle ...` runs the CLI."""

import sys

from .entrypoints.cli import main

sys.exit(main())
