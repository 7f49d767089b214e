"""The `triton` attention backend: paged extend attention and MiniMax Sparse Attention from Triton kernels.

Same interface and results as `backend.ReferenceBackend` (the tests hold them equal); the kernels live in
`triton_kernels.py`. This file only decides launch shapes -- in particular how many split-KV pieces a step
needs to fill the GPU -- from host ints of the metadata. No blocking CPU operation in this path.
"""

from __future__ import annotations

import functools

import torch

from . import triton_kernels
from .metadata import AttnMetadata


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # CPU / interpreter: small, so tests of a few rows still take the split path


class TritonBackend:
    """Paged attention from Triton kernels.

    Split-KV policy: a step whose grid has fewer than `waves * SMs` programs (typically small-batch
    decode) cuts every row's keys (dense) or its selected blocks (sparse) into pieces of at least
    `min_keys_per_split` keys, enough pieces to reach that program count, at most `max_splits`.

    Sparse layers run per query token: each token gathers its own selected blocks. With
    `sparse_tile_min_q` set, steps whose widest row has at least that many tokens (prompt chunks) run the
    dense kernel over query tiles with the selection as a block mask instead, reading the union of a
    tile's selections once rather than each token's selection separately. That wins only when nearby
    tokens select overlapping blocks; on random data (benchmarks/attention_kernels.py) it loses ~1.4x, so
    it is off until measured on real activations."""

    name = "triton"

    def __init__(self, waves: int = 2, min_keys_per_split: int = 128, max_splits: int = 64,
                 block_n: int | None = None, sparse_tile_min_q: int | None = None) -> None:
        self.waves = waves
        self.min_keys_per_split = min_keys_per_split
        self.max_splits = max_splits
        self.block_n = block_n  # keys per tile of the dense kernel; None = by step shape
        self.sparse_tile_min_q = sparse_tile_min_q

    def _block_n(self, meta: AttnMetadata) -> int:
        # Measured on an H200 (D=64): 128-key tiles win for decode / verify (few query rows per tile, so
        # the load is the cost), 64-key tiles for prompt chunks (big M, registers are the cost).
        if self.block_n is not None:
            return self.block_n
        return 128 if meta.max_q <= 16 else 64

    def _splits(self, programs: int, keys: int, device: torch.device) -> int:
        want = -(-self.waves * _num_sms(device) // max(1, programs))
        most = max(1, keys // max(1, self.min_keys_per_split))
        return max(1, min(want, most, self.max_splits))

    def attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMetadata,
                  scale: float) -> torch.Tensor:
        """q [T, Hq, D] over paged K/V [S, Hkv, D] -> [T, Hq, D] in q's dtype."""
        programs = triton_kernels.dense_programs(meta, q.shape[1], k_pool.shape[1])
        splits = self._splits(programs, meta.max_kv, q.device)
        return triton_kernels.dense_attention(q, k_pool, v_pool, meta, scale, num_splits=splits,
                                              block_n=self._block_n(meta))

    def sparse_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         meta: AttnMetadata, scale: float, iq: torch.Tensor, ik_pool: torch.Tensor,
                         block_size: int, topk: int, local_blocks: int) -> torch.Tensor:
        """As `attention`, but each token sees only the key blocks its indexer head selects.
        iq [T, Hi, Di], ik_pool [S, Di]."""
        sel = triton_kernels.select_blocks(iq, ik_pool, meta, block_size, topk, local_blocks)  # [T, Hi, k]
        if self.sparse_tile_min_q is not None and meta.max_q >= self.sparse_tile_min_q:
            keep = triton_kernels.selection_mask(sel, -(-meta.max_kv // block_size))  # [T, Hi, NB]
            programs = triton_kernels.dense_programs(meta, q.shape[1], k_pool.shape[1])
            splits = self._splits(programs, meta.max_kv, q.device)
            return triton_kernels.dense_attention(q, k_pool, v_pool, meta, scale, num_splits=splits,
                                                  block_n=self._block_n(meta), keep=keep, keep_block=block_size)
        programs = triton_kernels.sparse_programs(meta, q.shape[1], k_pool.shape[1], iq.shape[1])
        num_sel = sel.shape[-1]
        splits = self._splits(programs, num_sel * block_size, q.device)
        return triton_kernels.sparse_attention(q, k_pool, v_pool, meta, scale, sel, block_size,
                                               num_splits=min(splits, num_sel))


