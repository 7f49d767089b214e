"""Progress bars: tqdm when it is installed, a plain periodic print otherwise.

tqdm is not a hard dependency of m3eagle; the training commands must still run (and say where they are)
without it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class _Plain:
    """The subset of tqdm's interface the training loops use."""

    def __init__(self, iterable: Iterable | None = None, total: int | None = None, desc: str = "",
                 unit: str = "it", initial: int = 0, **_: Any):
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n, self._last, self._post = initial, 0.0, ""

    def __iter__(self) -> Iterator:
        for x in self.iterable or ():
            yield x
            self.update(1)
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last > 10.0:
            self._last = now
            tot = f"/{self.total}" if self.total else ""
            print(f"{self.desc}: {self.n}{tot} {self.unit} {self._post}", file=sys.stderr, flush=True)

    def set_postfix_str(self, s: str) -> None:
        self._post = s

    def close(self) -> None:
        print(f"{self.desc}: done, {self.n} {self.unit} {self._post}", file=sys.stderr, flush=True)


def progress(iterable: Iterable[T] | None = None, **kw: Any) -> Any:
    """tqdm(iterable, **kw) if available, else a plain printer with the same small interface."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Plain(iterable, **kw)
    kw.setdefault("mininterval", 2.0)
    kw.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kw)
