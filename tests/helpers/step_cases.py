"""A random mixed step for the step-input ops (overlap correction, positions and slots): shared by the CPU
test under the Triton interpreter (test_fused_ops.py) and the GPU test (test_cuda_graphs.py), which must not
import each other (one sets TRITON_INTERPRET for its whole process)."""

from __future__ import annotations

import torch

from m3eagle.kernels.attention.metadata import build_metadata


def step_case(seed: int, k: int, page_size: int, n_slots: int = 6, device: torch.device | str = "cpu"):
    """A mixed step: verify rows (gather, 1 + num_drafts tokens, some corrected, some chained -- a later
    sub-step, whose correction is off), prompt chunks and a padding row (dump slot), random slot buffers
    (deviations of either sign), a page table narrower than some rows' lengths (clamped lookups)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi, *shape: torch.randint(lo, hi, shape, generator=g)  # noqa: E731
    rows = []  # (q_len, gather, num_drafts, correct, slot, chained)
    for i in range(5):
        nd = int(r(0, k + 1))
        rows.append((1 + nd, True, nd, i == 0 or bool(r(0, 2)), i, i == 4 or (i > 0 and bool(r(0, 2)))))
    rows += [(int(r(1, 9)), False, 0, False, 5, False), (3, False, 0, False, 2, False)]
    rows.append((k + 1, False, k, False, n_slots, False))  # padding row: the dump slot
    q_lens = [q for q, *_ in rows]
    kv = torch.tensor([q + int(r(0, 40)) for q in q_lens])
    width = 6
    meta = build_metadata(q_lens, kv, r(1, 50, len(rows), width), page_size, torch.device(device), int(kv.max()))
    t = sum(q_lens)
    first = torch.tensor([0] + q_lens[:-1]).cumsum(0)
    flags = lambda j: torch.tensor([row[j] for row in rows])  # noqa: E731
    dev = r(-3 * (k + 1), 3, n_slots + 1)
    dev[0] = -1  # row 0 is corrected and not chained: it moves
    inputs = (r(3, 500, t), flags(4), first, flags(1), flags(2), flags(3), flags(5),
              r(0, 500, n_slots + 1, k + 1), r(1, k + 2, n_slots + 1), dev,
              r(0, 500, n_slots + 1, max(k, 1)), k)
    dev = torch.device(device)
    return meta, tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in inputs)


def sample_case(seed: int, k: int, device: torch.device | str = "cpu"):
    """Rows of a mixed step for sample_positions: verify rows (1 + num_drafts tokens), prompt chunks (no
    drafts), one-token rows; (row_first, row_qlen, row_num_drafts, positions, ids, k)."""
    g = torch.Generator().manual_seed(seed)
    q, nd = [], []
    for _ in range(37):
        kind = int(torch.randint(0, 3, (1,), generator=g))
        d = int(torch.randint(0, k + 1, (1,), generator=g)) if kind == 0 else 0
        q.append(1 + d if kind == 0 else int(torch.randint(1, 20, (1,), generator=g)) if kind == 1 else 1)
        nd.append(d)
    t = sum(q)
    first = torch.tensor([0] + q[:-1]).cumsum(0)
    dev = torch.device(device)
    return (first.to(dev), torch.tensor(q, device=dev), torch.tensor(nd, device=dev),
            torch.randint(0, 10_000, (t,), generator=g).to(dev), torch.randint(3, 500, (t,), generator=g).to(dev), k)


def commit_case(seed: int, k: int, draft: bool, device: torch.device | str = "cpu", n_slots: int = 40):
    """Verify outputs of a mixed step for commit_outputs: rows that sample (verify rows with 0..K drafts,
    num_new in 1..num_drafts + 1, one per slot) and prompt chunks that do not (their slot is the dump row).
    -> (args for commit_outputs, tok_row [T])."""
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi, *shape: torch.randint(lo, hi, shape, generator=g)  # noqa: E731
    q, nd, samples = [], [], []
    for _ in range(29):
        if bool(r(0, 3)):
            d = int(r(0, k + 1))
            q.append(1 + d), nd.append(d), samples.append(True)
        else:
            q.append(int(r(1, 12))), nd.append(0), samples.append(False)
    b, t = len(q), sum(q)
    dev = torch.device(device)
    first = torch.tensor([0] + q[:-1]).cumsum(0)
    num_new = torch.tensor([int(r(1, d + 2)) for d in nd])
    slots = torch.randperm(n_slots, generator=g)[:b]
    tok_row = torch.repeat_interleave(torch.arange(b), torch.tensor(q))
    args = (r(3, 500, b, k + 1), num_new, torch.tensor(samples), slots, n_slots, torch.tensor(nd), first,
            torch.tensor(q), r(3, 500, b), r(3, 500, t), r(0, 10_000, t), r(0, 500, n_slots + 1, k + 1),
            r(1, 5, n_slots + 1), r(-5, 3, n_slots + 1), k, draft)
    return tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in args), tok_row.to(dev)


def chain_case(seed: int, b: int, device: torch.device | str = "cpu"):
    """commit_outputs' `chain` for b rows, as the engine passes it: (row_chained, the step's corrected
    kv_lens, the kv_len input view, row_chained again) -- some rows chained, every kv_len distinct."""
    g = torch.Generator().manual_seed(seed + 100)
    chained = torch.randint(0, 2, (b,), generator=g).bool()
    kv = torch.randperm(10 * b, generator=g)[:b] + 4
    kv_in = kv - torch.randint(0, 4, (b,), generator=g)  # the host's lengths before the correction
    dev = torch.device(device)
    chained, kv, kv_in = chained.to(dev), kv.to(dev), kv_in.to(dev)
    return chained, kv, kv_in, chained
