"""Spies for the kernel tests: which kernel variants ran (`spy_launches`), or how often a host function ran
(`count_calls`), so a test of a fast path fails when the path it means to exercise never ran."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any


def spy_launches(monkeypatch, module: ModuleType, name: str,
                 record: Callable[[Any, dict], Any] = lambda grid, kw: kw) -> list:
    """Replace the jit kernel `module.name` for this test: each launch appends record(grid, its keyword
    arguments) -- the constexprs and launch options -- to the returned list, then runs the real kernel."""
    seen: list = []
    kernel = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(record(grid, kwargs))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, name, Spy())
    return seen


def count_calls(monkeypatch, module: ModuleType, name: str) -> list:
    """Replace the function `module.name` for this test with a wrapper that appends its arguments to the returned
    list (so len() is the call count), then calls the real function."""
    seen: list = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen
