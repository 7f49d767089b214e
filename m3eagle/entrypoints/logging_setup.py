"""The `m3eagle` logger's one handler: set up once, on import of the package, with its level from the
environment (M3EAGLE_LOGGING_LEVEL, default INFO); the CLI's `--log-level` overrides it.

The handler sits on the `m3eagle` logger (not the root), and the logger does not propagate, so an
application's own logging setup neither duplicates nor silences these lines. Calling `init_logging()`
again (a re-import, a test) never adds a second handler.
"""

from __future__ import annotations

import logging
import os
import sys

ENV_LEVEL = "M3EAGLE_LOGGING_LEVEL"
LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

logger = logging.getLogger("m3eagle")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at emit time (pytest and callers may swap it after import)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def parse_level(name: str) -> int:
    """'info' / 'INFO' / '20' -> logging.INFO; anything else is a ValueError naming the choices."""
    text = name.strip().upper()
    if text.isdigit():
        return int(text)
    if text not in LEVELS:
        raise ValueError(f"log level {name!r}: choose one of {', '.join(LEVELS)}")
    return getattr(logging, text)


def init_logging() -> logging.Logger:
    """Attach the handler once and take the level from M3EAGLE_LOGGING_LEVEL."""
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    env = os.environ.get(ENV_LEVEL)
    try:
        logger.setLevel(parse_level(env) if env else logging.INFO)
    except ValueError as e:
        logger.setLevel(logging.INFO)
        logger.warning("%s: %s; using INFO", ENV_LEVEL, e)
    return logger


def set_level(name: str | int) -> None:
    """Set the `m3eagle` logger's level (the CLI's --log-level)."""
    logger.setLevel(name if isinstance(name, int) else parse_level(name))
