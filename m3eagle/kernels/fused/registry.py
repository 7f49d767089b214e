"""The fused-ops backends by name: lazy factories, so nothing imports triton until its backend is built, and no
module global remembers a choice (each engine builds its own object)."""

from __future__ import annotations

from collections.abc import Callable

from m3eagle.kernels.fused.backend import FusedOps, ReferenceFused


def _triton() -> FusedOps:
    from m3eagle.kernels.fused.triton_backend import TritonFused  # imports triton; only when asked for

    return TritonFused()


def _batch_invariant() -> FusedOps:
    from m3eagle.kernels.batch_invariant.fused import BatchInvariantFused  # imports triton

    return BatchInvariantFused()


# Lazy factories: nothing here imports triton, and no module global remembers a choice.
_FACTORIES: dict[str, Callable[[], FusedOps]] = {"reference": ReferenceFused, "triton": _triton,
                                                 "batch_invariant": _batch_invariant}


def register(name: str, factory: Callable[[], FusedOps]) -> None:
    _FACTORIES[name] = factory


def names() -> list[str]:
    return sorted(_FACTORIES)


def create(name: str) -> FusedOps:
    if name not in _FACTORIES:
        raise ValueError(f"fused_backend={name!r} is unknown; choose one of {names()} or 'auto'")
    return _FACTORIES[name]()
