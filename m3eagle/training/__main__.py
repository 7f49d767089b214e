"""`python -m m3eagle.training CMD ...`: the training commands without the `m3eagle` entry point."""

from m3eagle.training.cli import main

main()
