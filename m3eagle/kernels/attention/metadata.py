"""Per-step attention metadata, and the one function that derives its device values.

Everything whose *size* the host knows (rows, tokens per row, padded widths) is decided on the host;
every *value* that depends on how many drafts the previous step accepted (positions, KV lengths, cache
slots) is computed on the device by `derive_positions_and_slots`. The input builder calls it for a
fresh step, and the overlap correction hook calls it again after fixing `kv_lens` -- one function, so the
two cannot drift.

Row layout of one step (row b owns the flat tokens cu_q[b] .. cu_q[b+1]):

    # [0, kv_len - q_len)        cached prefix: valid K/V from earlier steps
    # [kv_len - q_len, kv_len)   this step's tokens: written before attention reads them
    # [kv_len, held pages)       reserved for drafts / the step in flight; contents undefined
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

# Page 0 of every pool is a trash page that no request owns: table entries past a row's held pages
# point at it, so an optimistic length that runs past the last held page writes and reads garbage
# there instead of another request's slots.
TRASH_PAGE = 0


@dataclass
class AttnMetadata:
    # host-known shapes
    num_rows: int  # B
    max_q: int  # Qmax: the widest row of this step
    max_kv: int  # L: an upper bound of every row's kv_len (host-optimistic)
    page_size: int
    # device tensors
    q_lens: torch.Tensor  # [B] int64 tokens per row this step
    kv_lens: torch.Tensor  # [B] int64 tokens in KV after this step (true, corrected on device)
    page_table: torch.Tensor  # [B, P] int64 page ids, TRASH_PAGE past the held pages
    tok_row: torch.Tensor  # [T] int64 row of each flat token
    tok_col: torch.Tensor  # [T] int64 index of each flat token inside its row
    q_index: torch.Tensor  # [B, Qmax] int64 flat index of each padded query (0 for padding)
    q_valid: torch.Tensor  # [B, Qmax] bool
    positions: torch.Tensor  # [T] int64 derived
    slot_mapping: torch.Tensor  # [T] int64 derived
    # the engine's fast paths (m3eagle.kernels.ops.Ops) that the models run this step with; None = reference
    ops: Any = None
    # A short override of the page table, read by every backend: row b's key positions p >= tail_start[b]
    # live at slot tail_slots[b, p - tail_start[b]] (a draft-tree node row's ancestors at their depth
    # positions, a frontier node's scratch slots). tail_start [B] int64, tail_slots [B, W] int64; a row
    # reads no position past tail_start + W - 1 (its kv_len stops there), and tail_start >= max_kv leaves
    # the row on its page table.
    tail_start: torch.Tensor | None = None
    tail_slots: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.tok_row.shape[0]

    def with_lengths(self, kv_lens: torch.Tensor) -> AttnMetadata:
        """The overlap hook: re-derive positions and slots from corrected KV lengths.

        Idempotent: it depends only on `kv_lens`, never on the previous derived values."""
        pos, slots = derive_positions_and_slots(kv_lens, self.q_lens, self.tok_row, self.tok_col, self.page_table,
                                                self.page_size)
        return replace(self, kv_lens=kv_lens, positions=pos, slot_mapping=slots)


def slots_for_positions(page_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                        page_size: int) -> torch.Tensor:
    """Cache slot of (row, position) pairs; lookups past the table width clamp to its last column,
    which holds TRASH_PAGE whenever the row does not own that many pages."""
    page_col = torch.div(positions, page_size, rounding_mode="floor").clamp(0, page_table.shape[1] - 1)
    page = page_table[rows, page_col]
    return page * page_size + positions % page_size


def derive_positions_and_slots(kv_lens: torch.Tensor, q_lens: torch.Tensor, tok_row: torch.Tensor,
                               tok_col: torch.Tensor, page_table: torch.Tensor, page_size: int,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] and slot_mapping [T] from per-row lengths. Pure device arithmetic, no sync."""
    start = kv_lens - q_lens  # [B] first position of this step's tokens
    positions = start[tok_row] + tok_col  # [T]
    return positions, slots_for_positions(page_table, tok_row, positions, page_size)


def gather_slots(meta: AttnMetadata, length: int) -> torch.Tensor:
    """[B, L] cache slots of key positions 0..L-1 of every row (trash beyond held pages)."""
    pos = torch.arange(length, device=meta.page_table.device)
    rows = torch.arange(meta.num_rows, device=pos.device)
    return slots_for_positions(meta.page_table, rows[:, None], pos[None, :], meta.page_size)


def row_key_slots(meta: AttnMetadata, length: int) -> torch.Tensor:
    """[B, L] cache slots of every row's key positions 0..L-1: the page table's, with the tail override
    (`tail_start` / `tail_slots`) applied."""
    slots = gather_slots(meta, length)
    if meta.tail_start is None:
        return slots
    pos = torch.arange(length, device=slots.device)
    rel = pos[None, :] - meta.tail_start[:, None]  # [B, L]
    tail = meta.tail_slots.gather(1, rel.clamp(0, meta.tail_slots.shape[1] - 1))
    return torch.where(rel >= 0, tail, slots)


def build_metadata(q_lens: list[int], kv_lens: torch.Tensor, page_table: torch.Tensor, page_size: int,
                   device: torch.device, max_kv: int) -> AttnMetadata:
    """Host shapes + device values for one step. `kv_lens` may already live on the device."""
    b = len(q_lens)
    max_q = max(q_lens) if q_lens else 1
    tok_row_l, tok_col_l, q_index_l, q_valid_l = [], [], [], []
    t = 0
    for r, n in enumerate(q_lens):
        tok_row_l += [r] * n
        tok_col_l += list(range(n))
        q_index_l.append([t + i for i in range(n)] + [0] * (max_q - n))
        q_valid_l.append([True] * n + [False] * (max_q - n))
        t += n

    def dev(x, dtype=torch.int64):
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    q_lens_t = dev(q_lens)
    tok_row, tok_col = dev(tok_row_l), dev(tok_col_l)
    kv_lens = kv_lens.to(device, non_blocking=True)
    page_table = page_table.to(device, non_blocking=True)
    pos, slots = derive_positions_and_slots(kv_lens, q_lens_t, tok_row, tok_col, page_table, page_size)
    return AttnMetadata(num_rows=b, max_q=max_q, max_kv=max_kv, page_size=page_size, q_lens=q_lens_t,
                        kv_lens=kv_lens, page_table=page_table, tok_row=tok_row, tok_col=tok_col,
                        q_index=dev(q_index_l).view(b, max_q), q_valid=dev(q_valid_l, torch.bool).view(b, max_q),
                        positions=pos, slot_mapping=slots)
