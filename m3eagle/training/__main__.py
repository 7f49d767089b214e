"""`python -m m3eagle.training CMD ...`: the training commands without the `m3eagle` entry point."""

from .cli import main

main()
