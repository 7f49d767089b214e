"""Attention backends behind one small interface, and a registry to pick one.

`reference` is plain PyTorch (the oracle, and the CPU path). `triton` holds the fused kernels for CUDA;
tests hold it equal to `reference`. The model calls `backend.get()`, so switching is one call."""

from __future__ import annotations

from typing import Protocol

import torch

from . import reference
from .metadata import AttnMetadata


class AttentionBackend(Protocol):
    name: str

    def attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMetadata,
                  scale: float) -> torch.Tensor: ...

    def sparse_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         meta: AttnMetadata, scale: float, iq: torch.Tensor, ik_pool: torch.Tensor,
                         block_size: int, topk: int, local_blocks: int) -> torch.Tensor: ...


class ReferenceBackend:
    name = "reference"

    def attention(self, q, k_pool, v_pool, meta, scale):
        return reference.paged_attention(q, k_pool, v_pool, meta, scale)

    def sparse_attention(self, q, k_pool, v_pool, meta, scale, iq, ik_pool, block_size, topk, local_blocks):
        return reference.paged_attention(q, k_pool, v_pool, meta, scale, iq, ik_pool, block_size, topk,
                                         local_blocks)


_REGISTRY: dict[str, type] = {"reference": ReferenceBackend}
_current: AttentionBackend = ReferenceBackend()


def register(name: str, cls: type) -> None:
    _REGISTRY[name] = cls


def names() -> list[str]:
    return sorted(_REGISTRY)


def set_backend(name: str) -> AttentionBackend:
    global _current
    if name not in _REGISTRY:
        if name == "triton":
            from . import triton_backend  # noqa: F401  (registers itself)
        if name not in _REGISTRY:
            raise ValueError(f"attention_backend={name!r} is unknown; choose one of {names()}")
    _current = _REGISTRY[name]()
    return _current


def get() -> AttentionBackend:
    return _current
