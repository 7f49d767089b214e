"""Attention backends behind one small interface, and a registry to pick one.

`reference` is plain PyTorch (the oracle, and the CPU path). `triton` holds the fused kernels for CUDA;
tests hold it equal to `reference`. `create(name)` builds a backend object; the engine owns it (see
`m3eagle/kernels/ops.py`), so two engines in one process never share a choice."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from m3eagle.kernels.attention import reference
from m3eagle.kernels.attention.metadata import AttnMetadata


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


def _triton() -> AttentionBackend:
    from m3eagle.kernels.attention.triton_backend import TritonBackend  # imports triton; only when asked for

    return TritonBackend()


def _triton_sparse_prefill() -> AttentionBackend:
    """`triton` with prompt rows of sparse layers on the tiled kernel (sparse_prefill.py): the tokens of a tile
    share each selected block's load, where the per-token kernel re-reads it per token (a suffix over a cached
    prefix, a long prompt). Not the default until a GPU benchmark has timed it."""
    from m3eagle.kernels.attention.sparse_prefill import PREFILL_MIN_Q  # imports triton; only when asked for
    from m3eagle.kernels.attention.triton_backend import TritonBackend

    return TritonBackend(sparse_prefill_min_q=PREFILL_MIN_Q)


def _batch_invariant() -> AttentionBackend:
    from m3eagle.kernels.batch_invariant.attention import BatchInvariantBackend  # imports triton

    return BatchInvariantBackend()


# Lazy factories: nothing here imports triton, and no module global remembers a choice. Each engine
# creates its own backend object and hands it to the models with the step's metadata (`meta.ops`).
_FACTORIES: dict[str, Callable[[], AttentionBackend]] = {"reference": ReferenceBackend, "triton": _triton,
                                                         "triton_sparse_prefill": _triton_sparse_prefill,
                                                         "batch_invariant": _batch_invariant}


def names() -> list[str]:
    return sorted(_FACTORIES)


def create(name: str) -> AttentionBackend:
    if name not in _FACTORIES:
        raise ValueError(f"attention_backend={name!r} is unknown; choose one of {names()} or 'auto'")
    return _FACTORIES[name]()
