"""The KV pools of every layer as one device table (base addresses, row lengths and strides), built once with
the runner, so a single kernel launch can copy a slot in all of them (the draft tree's accepted-path
compaction, tree_kernels.py). Its own module: the kernels and the op selection (tree_ops.py) both read it."""

from __future__ import annotations

import torch


class PoolTable:
    """The KV pools a compaction copies ([S, ...] each: K, V, index-K of every layer) and, when every pool's row
    is contiguous, a device table of their base addresses, row lengths and row strides in WORD-byte words for
    the fused copy (made once, with the runner: a captured step reads it)."""

    def __init__(self, pools: list[torch.Tensor]) -> None:
        self.pools = pools
        self.ptrs = tuple(p.data_ptr() for p in pools)
        self.words_ok = bool(pools) and all(p[0].is_contiguous() and p.device == pools[0].device for p in pools)
        if not self.words_ok:
            return
        row = [p[0].numel() * p.element_size() for p in pools]  # bytes
        step = [p.stride(0) * p.element_size() for p in pools]  # bytes
        sizes = row + step + list(self.ptrs)
        self.word = 4 if all(x % 4 == 0 for x in sizes) else 2 if all(x % 2 == 0 for x in sizes) else 1
        dev = pools[0].device
        self.addrs = torch.tensor(self.ptrs, dtype=torch.int64, device=dev)  # [P]
        self.words = torch.tensor([x // self.word for x in row], dtype=torch.int64, device=dev)  # [P]
        self.strides = torch.tensor([x // self.word for x in step], dtype=torch.int64, device=dev)  # [P]
        self.max_words = max(row) // self.word

    def current(self) -> bool:
        """The device table describes the pools as they are now (host ints only)."""
        return self.words_ok and tuple(p.data_ptr() for p in self.pools) == self.ptrs
