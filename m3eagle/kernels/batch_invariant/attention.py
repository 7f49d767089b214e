"""Batch-invariant paged attention and MSA: a query token's output is the same bits whether it is a decode
row, a verify row or a token of any prompt chunk, alone or among other rows.

The `triton` backend (`attention/triton_backend.py`) sizes query tiles from the step's widest row, key tiles
and split-KV from the batch, and runs a sparse layer densely while every block fits in the top-k; each of
these changes a token's summation order with its neighbours. This backend runs the same kernels
(`attention/triton_kernels.py`) under one launch shape per head shape:

- dense: one program per (query tile, KV head) walks the key positions 0, BLOCK_N, 2 * BLOCK_N, ... of its
  row in order -- tiles aligned to absolute positions, no split-KV -- with the query tile sized as for a
  long prompt (`DenseConfig`). Key tiles past a token's position are fully masked, and a fully masked tile
  leaves the online softmax's state bit-unchanged (alpha = 2^0, p = 0), so how far a tile's loop runs does
  not matter;
- MSA indexer: fixed query and score tiles (`IndexConfig`); its split into per-split top-k lists stays, since
  selection on packed (score, id) keys is exact whatever the split;
- MSA attention: always the indexer and the per-token sparse kernel (never the dense shortcut), one split,
  and a fixed number of selected blocks per iteration (`SparseConfig`), visited in ascending block id.

Each config is a pure function of the head shape (head_dim, GQA group, block size): never of the rows, the
tokens or the KV bound of a step. `reference.paged_attention` stays the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3eagle.kernels.attention import triton_kernels
from m3eagle.kernels.attention.metadata import AttnMetadata
from m3eagle.kernels.attention.triton_backend import TritonBackend

# The query tile is sized as for a row of this many tokens (never the step's widest row): 64 query rows
# (tokens x heads) per program for head_dim <= 128, as `triton_kernels.dense_tile` gives a prompt chunk.
TILE_MAX_Q = 1 << 16


@dataclass(frozen=True)
class DenseConfig:
    block_n: int  # keys per tile, aligned to absolute key positions
    tile_max_q: int  # the row width the query tile is sized for


@dataclass(frozen=True)
class SparseConfig:
    sel_chunk: int  # selected blocks gathered per iteration


@dataclass(frozen=True)
class IndexConfig:
    tile_max_q: int
    keys_per_iter: int  # index-K keys scored per iteration


def _pow2(n: int) -> int:
    return 1 << max(0, (max(1, n) - 1).bit_length())


def dense_config(head_dim: int, group: int) -> DenseConfig:
    """64-key tiles (what prompt chunks already take); `dense_tile` narrows them for wide heads."""
    return DenseConfig(block_n=64, tile_max_q=TILE_MAX_Q)


def sparse_config(block_size: int) -> SparseConfig:
    """~128 keys per iteration and at least the 16 keys of the smallest tl.dot, from the block size alone."""
    block_bs = _pow2(block_size)
    return SparseConfig(sel_chunk=max(max(1, 128 // block_bs), _pow2(-(-16 // block_bs))))


def index_config(block_size: int, index_dim: int) -> IndexConfig:
    return IndexConfig(tile_max_q=TILE_MAX_Q, keys_per_iter=256)


class BatchInvariantBackend(TritonBackend):
    """`TritonBackend`'s kernels at fixed launch shapes. The indexer may still split its blocks over
    programs (exact selection); attention never splits its keys."""

    name = "batch_invariant"

    def attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMetadata,
                  scale: float) -> torch.Tensor:
        """q [T, Hq, D] over paged K/V [S, Hkv, D] -> [T, Hq, D]."""
        cfg = dense_config(q.shape[2], q.shape[1] // k_pool.shape[1])
        return triton_kernels.dense_attention(q, k_pool, v_pool, meta, scale, num_splits=1, block_n=cfg.block_n,
                                              tile_max_q=cfg.tile_max_q)

    def select_blocks(self, iq: torch.Tensor, ik_pool: torch.Tensor, meta: AttnMetadata, block_size: int,
                      topk: int, local_blocks: int) -> torch.Tensor:
        """iq [T, Hi, Di], ik_pool [S, Di] -> sel [T, Hi, min(topk, NB)]: `reference.select_blocks`'s blocks."""
        cfg = index_config(block_size, iq.shape[-1])
        min_blocks = 2
        warps = self.index_num_warps or (4 if block_size * iq.shape[-1] >= 8192 else 2)
        programs = triton_kernels.index_programs(meta, iq.shape[1])
        splits = self._splits(programs, -(-meta.max_kv // block_size), iq.device, min_blocks, self.max_index_splits)
        return triton_kernels.select_blocks(iq, ik_pool, meta, block_size, topk, local_blocks, num_splits=splits,
                                            min_blocks_per_split=min_blocks, keys_per_iter=cfg.keys_per_iter,
                                            num_warps=warps, merge_num_warps=self.index_merge_warps,
                                            tile_max_q=cfg.tile_max_q)

    def sparse_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         meta: AttnMetadata, scale: float, iq: torch.Tensor, ik_pool: torch.Tensor,
                         block_size: int, topk: int, local_blocks: int) -> torch.Tensor:
        """Always the per-token sparse walk: the dense shortcut's key tiles would sum a short context in another
        order than the same token's sparse walk once the context has grown. A step whose every row fits the
        top-k (ceil(max_kv / block) <= topk) selects every visible block whatever the scores, so it skips the
        indexer and walks blocks 0, 1, .. directly: the indexer's own list, the same visits and bits, one
        launch fewer per sparse layer."""
        num_blocks = -(-meta.max_kv // block_size)
        if num_blocks <= topk:
            return triton_kernels.sparse_attention(q, k_pool, v_pool, meta, scale, (iq.shape[1], num_blocks),
                                                   block_size, num_splits=1,
                                                   sel_chunk=sparse_config(block_size).sel_chunk)
        sel = self.select_blocks(iq, ik_pool, meta, block_size, topk, local_blocks)  # [T, Hi, k]
        return self.attend_selected(q, k_pool, v_pool, meta, scale, sel, block_size)

    def attend_selected(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMetadata,
                        scale: float, sel: torch.Tensor, block_size: int) -> torch.Tensor:
        """q [T, Hq, D] over the blocks sel [T, Hi, k] (-1 = none), one split, a fixed chunk of blocks."""
        return triton_kernels.sparse_attention(q, k_pool, v_pool, meta, scale, sel, block_size, num_splits=1,
                                               sel_chunk=sparse_config(block_size).sel_chunk)
