"""Triton compiles, observed: one process-wide post-compile hook tells registered listeners which kernel variant
was just built. After an engine's warm-up, a compile is first-use work in the middle of serving (a Triton
compile costs 0.1-2 s on the step that needs it), so the engine logs each one: that line names the variant
the warm-up should have run."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

Listener = Callable[[str], None]  # called with the variant's description: name[options](argument types)

_listeners: list[weakref.ref] = []
_installed = False


def _notify(variant: str) -> None:
    for ref in list(_listeners):
        listener = ref()
        if listener is None:  # its owner is gone
            _listeners.remove(ref)
        else:
            listener(variant)


def _install() -> bool:
    """Chain our hook after any hook already set (a profiler's, a test's); False where triton has no knobs."""
    global _installed
    if _installed:
        return True
    # imported here, not at the top: the engine imports this module, and the CPU tests set TRITON_INTERPRET
    # before the first `import triton` of their process (a test module importing m3eagle first must not import it)
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return False
    previous = runtime.jit_post_compile_hook

    def hook(**kwargs: Any) -> Any:
        out = previous(**kwargs) if previous is not None else None
        # triton's repr spans lines (one per argument): one line, so that a log line names the whole variant
        _notify(" ".join(str(kwargs.get("repr", kwargs.get("key", "?"))).split()))
        return out

    runtime.jit_post_compile_hook = hook
    _installed = True
    return True


def add_compile_listener(listener: Listener) -> Callable[[], None]:
    """Call `listener(variant)` after every Triton compile in this process until the returned function is
    called or the listener (a bound method's object) is collected. A no-op where triton has no post-compile
    hook."""
    if not _install():
        return lambda: None
    ref: weakref.ref = weakref.WeakMethod(listener) if hasattr(listener, "__self__") else weakref.ref(listener)
    _listeners.append(ref)

    def remove() -> None:
        if ref in _listeners:
            _listeners.remove(ref)

    return remove
