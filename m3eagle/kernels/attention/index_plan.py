"""The lightning indexer's launch plan, from host ints only (graph-safe): splits, list capacity and blocks per
iteration of `triton_kernels.select_blocks`, and the split-merge variants an engine can launch.

The merge kernel's BLOCK_C / BLOCK_K constexprs follow a step's split count, so an eager step (a prompt
chunk above the prefill graphs' cap) with an unusual row count or context can pick a variant no earlier step
compiled; `merge_classes` lists every one reachable up to a KV bound, for the warm-up to compile them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton


def pow2(n: int, floor: int = 1) -> int:
    """The next power of two >= n (and >= floor)."""
    return max(floor, triton.next_power_of_2(max(1, n)))


# The merge holds every split's list of one (token, index head) in one program's registers.
MAX_MERGE_CANDIDATES = 4096


@dataclass(frozen=True)
class IndexPlan:
    """Launch shape of one indexer call, from host ints only (graph-safe)."""

    splits: int  # programs per (row, query tile); > 1: lists + merge
    cap: int  # entries a program's list keeps (k when unsplit)
    block_k: int  # the list's width: cap rounded up to a power of two
    span: int  # most blocks one program of any row scans: max(min_bps, cdiv(NB, splits)) (NB when unsplit)
    blocks_per_iter: int  # index-K blocks scored per loop iteration

    @property
    def direct(self) -> bool:
        """Every program's blocks fit its list, so each takes its own slot (no insertion). A row's split
        holds max(cdiv(row_blocks, splits), min_bps) <= span blocks (row_blocks <= NB)."""
        return self.span <= self.cap


def index_plan(num_blocks: int, k: int, block_size: int, num_splits: int = 1, min_blocks_per_split: int = 1,
               keys_per_iter: int = 128, span_bound: bool = True) -> IndexPlan:
    """Splits, list capacity and blocks per iteration of `select_blocks` for NB = num_blocks, top-k."""
    min_bps = max(1, min_blocks_per_split)
    splits = max(1, min(num_splits, -(-num_blocks // min_bps)))
    cap = k
    if splits > 1:
        # a split holds at most cdiv(NB, splits) blocks, so its list needs no more room than that
        cap = min(k, max(min_bps, -(-num_blocks // splits)))
        splits = max(1, min(splits, MAX_MERGE_CANDIDATES // pow2(cap)))
        cap = min(k, max(min_bps, -(-num_blocks // splits)))
    span = max(min_bps, -(-num_blocks // splits))
    # Score ~keys_per_iter keys per iteration (several small blocks at once, max-pooled by a reshape), at
    # least 16 (the smallest tl.dot), at most 8 blocks (each is offered to the list on its own) and no
    # more than a program scans (the rest would be masked work).
    block_bs = pow2(block_size)
    # span_bound False (the batch-invariant mode): the score tile never follows the step's KV bound.
    per_iter = max(pow2(-(-16 // block_bs)), min(8, max(1, keys_per_iter // block_bs),
                                                  pow2(span) if span_bound else 8))
    return IndexPlan(splits, cap, pow2(cap), span, per_iter)


def merge_classes(max_blocks: int, k: int, block_size: int, min_blocks_per_split: int, max_splits: int,
                  keys_per_iter: int = 128) -> list[tuple[int, int]]:
    """Every (pow2(splits), block_k) that `index_plan` gives a split launch for some NB in (k, max_blocks] and
    some asked-for splits in [2, max_splits]: the merge variants of an engine with that KV bound. For asked-for
    splits s in (P/2, P], cdiv(NB, s) spans at most a factor of two, so block_k = pow2(cap) takes at most its
    values at the two ends, and the plan's class is monotone in s: each power-of-two run's ends are tried (the
    test holds this equal to trying every value)."""
    out: set[tuple[int, int]] = set()
    min_bps = max(1, min_blocks_per_split)
    for nb in range(k + 1, max_blocks + 1):
        most = min(max_splits, -(-nb // min_bps))
        ends = {2, most}
        p = 2
        while p <= most:
            ends.update((p, p + 1, p // 2 + 1))
            p *= 2
        for s in ends:
            if 2 <= s <= most:
                plan = index_plan(nb, k, block_size, s, min_bps, keys_per_iter)
                if plan.splits > 1:
                    out.add((pow2(plan.splits), plan.block_k))
    return sorted(out)
