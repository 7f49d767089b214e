"""The `triton` attention backend: paged extend attention and MiniMax Sparse Attention from Triton kernels.

Same interface and results as `backend.ReferenceBackend` (the tests hold them equal); the kernels live in
`triton_kernels.py`. This file only decides launch shapes -- in particular how many split pieces a step
needs to fill the GPU -- from host ints of the metadata (num_rows, max_q, max_kv, num_tokens), which a
captured CUDA graph fixes. No blocking CPU operation in this path.

One sparse layer on this backend, per step:

    indexer   _indexer_kernel (+ _index_merge_kernel when split)   iq, index-K  -> sel [T, Hi, k]
    attention _sparse_attn_kernel (+ _combine_kernel when split)   q, K/V, sel  -> out [T, Hq, D]
              or, for prompt steps, sparse_prefill._sparse_prefill_kernel (+ _combine_kernel)
"""

from __future__ import annotations

import functools

import torch

from m3eagle.kernels.attention import index_plan, sparse_prefill, triton_kernels
from m3eagle.kernels.attention.metadata import AttnMetadata


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # CPU / interpreter: small, so tests of a few rows still take the split path


class TritonBackend:
    """Paged attention from Triton kernels.

    Split policy: a launch whose grid has fewer than `waves * SMs` programs (typically small-batch decode)
    is split until it reaches that count: the dense kernel cuts every row's keys into pieces of at least
    `min_keys_per_split` keys (at most `max_splits`), the sparse kernel cuts each token's selected blocks,
    and the indexer cuts each row's index-K into runs of at least `min_index_keys_per_split` keys (at most
    `max_index_splits`). The split count comes from max_kv; each row's real length, read on the device,
    decides what each piece holds.

    Sparse layers whose every block fits in the top-k (ceil(max_kv / block) <= topk) select every visible
    block whatever the scores, which is dense attention exactly: they run the dense kernel and skip the
    indexer. A graph captured with max_kv = max_model_len never takes that shortcut.

    Sparse attention of decode and verify steps runs per query token: each token gathers its own selected
    blocks. Steps whose widest row has at least `sparse_prefill_min_q` query tokens (prompt chunks;
    `sparse_prefill.PREFILL_MIN_Q` = 16 is the intended threshold; None, the default: never, until
    `benchmarks/attention_kernels.py --prefill-only` has timed it against the per-token kernel on a GPU) run
    `sparse_prefill`'s tiled kernel instead: BLOCK_T consecutive tokens of a row per program
    walk the union of their selections, loading each selected block once for the tile and filling the MMA
    with BLOCK_T times more rows. The choice is `sparse_prefill.use_prefill_kernel`, a function of host
    metadata only (draft-tree steps, which carry a tail override, stay per token).

    With `sparse_tile_min_q` set (it takes precedence), such steps run the dense kernel over query tiles with
    the selection as a per-key-tile block mask instead, visiting every key tile of the context. On random data
    (benchmarks/attention_kernels.py) it lost ~1.4x to the per-token kernel, so it is off."""

    name = "triton"

    def __init__(self, waves: int = 2, min_keys_per_split: int | None = None, max_splits: int = 64,
                 block_n: int | None = None, sparse_tile_min_q: int | None = None,
                 sparse_prefill_min_q: int | None = None,
                 min_index_keys_per_split: int | None = None, max_index_splits: int = 512,
                 index_num_warps: int | None = None, index_keys_per_iter: int = 256,
                 index_merge_warps: int | None = None) -> None:
        # None = the measured policy (a sweep of the decode kernels on an H200 at the bench geometries' head shapes):
        # decode / verify steps of <= 8 rows are latency-bound, one program walking a row's keys serially,
        # so they take 32-key tiles and splits of >= 64 keys (m3-mini b1, 137 keys: 9.6 -> 5.9 us; 4k keys:
        # 10.6 -> 9.1 us); wider steps keep 64-key tiles and 128-key splits. The indexer splits at two
        # blocks (m3-mini 4k keys: 17.8 -> 12.8 us; embedded 19.2 -> 7.4 us) with 2 warps on small
        # (block x index dim < 8K) tiles.
        self.waves = waves
        self.min_keys_per_split = min_keys_per_split
        self.max_splits = max_splits
        self.block_n = block_n  # keys per tile of the dense kernel; None = by step shape
        self.sparse_tile_min_q = sparse_tile_min_q
        self.sparse_prefill_min_q = sparse_prefill_min_q
        self.min_index_keys_per_split = min_index_keys_per_split
        self.max_index_splits = max_index_splits
        self.index_num_warps = index_num_warps
        # Index-K keys the indexer scores per loop iteration (whole blocks, at most 8, never more than a
        # split scans): more loads in flight per program. 256 (two m3 blocks) measured best of 128 / 256 /
        # 512 on the H200 (`benchmarks/msa_step.py` sweep, m3-mini): 8x4 verify steps at 64k / 128k 64.6 ->
        # 58.7 / 113.5 -> 102.7 us per layer, batch 1 within 1 us (22.9 -> 22.1 us at 128k); 512 loses.
        self.index_keys_per_iter = index_keys_per_iter
        # Warps of the split merge (None: 4, or 8 past 1,024 candidates). At batch 1 it is one program per
        # index head running k serial max-reductions over the candidates: cross-warp reductions are its cost.
        self.index_merge_warps = index_merge_warps

    def _block_n(self, meta: AttnMetadata) -> int:
        # Measured on an H200 (D=64): 128-key tiles win for decode / verify (few query rows per tile, so
        # the load is the cost), 64-key tiles for prompt chunks (big M, registers are the cost).
        if self.block_n is not None:
            return self.block_n
        return (32 if meta.num_rows <= 8 else 64) if meta.max_q <= 16 else 64

    def _min_keys(self, meta: AttnMetadata) -> int:
        if self.min_keys_per_split is not None:
            return self.min_keys_per_split
        return 64 if meta.max_q <= 16 and meta.num_rows <= 8 else 128

    def _splits(self, programs: int, keys: int, device: torch.device, min_keys: int, most: int) -> int:
        want = -(-self.waves * _num_sms(device) // max(1, programs))
        fit = max(1, keys // max(1, min_keys))
        return max(1, min(want, fit, most))

    def attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMetadata,
                  scale: float) -> torch.Tensor:
        """q [T, Hq, D] over paged K/V [S, Hkv, D] -> [T, Hq, D] in q's dtype."""
        programs = triton_kernels.dense_programs(meta, q.shape[1], k_pool.shape[1], q.shape[2])
        splits = self._splits(programs, meta.max_kv, q.device, self._min_keys(meta), self.max_splits)
        return triton_kernels.dense_attention(q, k_pool, v_pool, meta, scale, num_splits=splits,
                                              block_n=self._block_n(meta))

    def select_blocks(self, iq: torch.Tensor, ik_pool: torch.Tensor, meta: AttnMetadata, block_size: int,
                      topk: int, local_blocks: int) -> torch.Tensor:
        """The lightning indexer alone: iq [T, Hi, Di], ik_pool [S, Di] -> sel [T, Hi, min(topk, NB)] int64,
        equal to `reference.select_blocks` (the same blocks, listed in ascending id)."""
        min_blocks = self._min_index_blocks(block_size)
        warps = self.index_num_warps or (4 if block_size * iq.shape[-1] >= 8192 else 2)
        programs = triton_kernels.index_programs(meta, iq.shape[1])
        splits = self._splits(programs, -(-meta.max_kv // block_size), iq.device, min_blocks,
                              self.max_index_splits)
        return triton_kernels.select_blocks(iq, ik_pool, meta, block_size, topk, local_blocks, num_splits=splits,
                                            min_blocks_per_split=min_blocks, keys_per_iter=self.index_keys_per_iter,
                                            num_warps=warps, merge_num_warps=self.index_merge_warps)

    def _min_index_blocks(self, block_size: int) -> int:
        keys = self.min_index_keys_per_split
        return max(1, keys // block_size) if keys is not None else 2

    def warm_index_merges(self, num_index_heads: int, block_size: int, topk: int, local_blocks: int, max_kv: int,
                          device: torch.device) -> int:
        """Compile every split-merge variant `select_blocks` can launch for contexts up to max_kv keys (before
        serving: a merge variant otherwise compiles in the first step that needs it); returns how many."""
        min_blocks = self._min_index_blocks(block_size)
        classes = index_plan.merge_classes(-(-max_kv // block_size), topk, block_size, min_blocks,
                                           self.max_index_splits, self.index_keys_per_iter)
        triton_kernels.warm_index_merge(num_index_heads, topk, block_size, min_blocks, local_blocks, classes, device,
                                        merge_num_warps=self.index_merge_warps)
        return len(classes)

    def sparse_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         meta: AttnMetadata, scale: float, iq: torch.Tensor, ik_pool: torch.Tensor,
                         block_size: int, topk: int, local_blocks: int) -> torch.Tensor:
        """As `attention`, but each token sees only the key blocks its indexer head selects.
        iq [T, Hi, Di], ik_pool [S, Di]."""
        num_blocks = -(-meta.max_kv // block_size)
        if num_blocks <= topk:
            # Every block that holds a visible key is selected (its score is finite), the others hold
            # none: exactly dense attention, with no indexer to run.
            return self.attention(q, k_pool, v_pool, meta, scale)
        sel = self.select_blocks(iq, ik_pool, meta, block_size, topk, local_blocks)  # [T, Hi, k]
        return self.attend_selected(q, k_pool, v_pool, meta, scale, sel, block_size)

    def attend_selected(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMetadata,
                        scale: float, sel: torch.Tensor, block_size: int) -> torch.Tensor:
        """The attention half of a sparse layer: q [T, Hq, D] over the blocks sel [T, Hi, k] (-1 = none)."""
        if self.sparse_tile_min_q is not None and meta.max_q >= self.sparse_tile_min_q:
            keep = triton_kernels.selection_mask(sel, -(-meta.max_kv // block_size))  # [T, Hi, NB]
            programs = triton_kernels.dense_programs(meta, q.shape[1], k_pool.shape[1], q.shape[2])
            splits = self._splits(programs, meta.max_kv, q.device, self._min_keys(meta), self.max_splits)
            return triton_kernels.dense_attention(q, k_pool, v_pool, meta, scale, num_splits=splits,
                                                  block_n=self._block_n(meta), keep=keep, keep_block=block_size)
        num_sel = sel.shape[-1]
        if sparse_prefill.use_prefill_kernel(meta, self.sparse_prefill_min_q):
            # Splits cut each tile's visible blocks: as many as keep ~min_keys of its selection per split.
            programs = sparse_prefill.prefill_programs(meta, q.shape[1], k_pool.shape[1], sel.shape[1], q.shape[2],
                                                       block_size)
            splits = self._splits(programs, num_sel * block_size, q.device, self.min_keys_per_split or 128,
                                  self.max_splits)
            return sparse_prefill.sparse_prefill_attention(q, k_pool, v_pool, meta, scale, sel, block_size,
                                                           num_splits=splits)
        programs = triton_kernels.sparse_programs(meta, q.shape[1], k_pool.shape[1], sel.shape[1])
        splits = self._splits(programs, num_sel * block_size, q.device, self.min_keys_per_split or 128,
                              self.max_splits)
        return triton_kernels.sparse_attention(q, k_pool, v_pool, meta, scale, sel, block_size,
                                               num_splits=min(splits, num_sel))
