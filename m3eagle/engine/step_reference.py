"""The step's bookkeeping in plain PyTorch: the overlap scheduler's input correction, the sampled rows'
positions and the commit of a step's outputs into the slot buffers the next step reads. The reference the
Triton kernels of step_kernels.py equal bit for bit (int64 arithmetic), and the CPU path. Every function is
device arithmetic only: no host sync, so a step that calls them is CUDA-graph capturable."""

from __future__ import annotations

import torch

from m3eagle.kernels.attention.metadata import slots_for_positions


def overlap_ids_kv(input_ids: torch.Tensor, kv_lens: torch.Tensor, row_slot: torch.Tensor,
                   row_first: torch.Tensor, row_gather: torch.Tensor, row_num_drafts: torch.Tensor,
                   row_correct: torch.Tensor, row_chained: torch.Tensor, slot_tokens: torch.Tensor,
                   slot_num_new: torch.Tensor, slot_dev: torch.Tensor, slot_drafts: torch.Tensor, k: int,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's input ids and true KV lengths from what the previous steps left on the device.

    input_ids [T] (host-packed; gathered positions hold placeholders), kv_lens [B] (host-optimistic, or
    exact on a chained row), per row: row_slot, row_first (first flat token), row_gather / row_correct /
    row_chained (bool), row_num_drafts; the slot buffers [S+1, K+1] tokens, [S+1] num_new / dev,
    [S+1, max(K, 1)] drafts.
    A gather row's first token is its slot's last emitted token and its next num_drafts tokens are the
    slot's drafts. A correct row's kv_len moves by the slot's dev: the tokens the steps still in flight
    when the host planned this one emitted minus what the host assumed (every draft accepted) -- one step
    under overlap, the whole previous launch of a multi-step iteration. A chained row (a later sub-step of
    a multi-step iteration: commit_outputs advanced its kv_len exactly) takes no correction.
    -> (ids [T], kv_lens [B])."""
    t = input_ids.shape[0]
    ids = torch.cat([input_ids, input_ids.new_zeros(1)])  # [T+1], index T is a dump slot
    last = slot_tokens[row_slot].gather(1, (slot_num_new[row_slot] - 1).clamp(min=0)[:, None])[:, 0]
    dump = torch.full_like(row_first, t)
    ids.index_put_((torch.where(row_gather, row_first, dump),), last)
    for j in range(k):
        ok = row_gather & (j < row_num_drafts)
        ids.index_put_((torch.where(ok, row_first + 1 + j, dump),), slot_drafts[row_slot, j])
    corr = torch.where(row_correct & ~row_chained, slot_dev[row_slot], 0)
    return ids[:t], kv_lens + corr


def sample_positions(row_first: torch.Tensor, row_qlen: torch.Tensor, row_num_drafts: torch.Tensor,
                     positions: torch.Tensor, ids: torch.Tensor, k: int,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where a step samples: each row's last num_drafts + 1 tokens (padded to K + 1 by repeating its last).

    Per row: row_first, row_qlen, row_num_drafts [B]; positions, ids [T]. -> (sample_idx [B, K+1] flat
    token indices, their positions [B, K+1], the row's drafts as input ids [B, K], 0 past num_drafts)."""
    j = torch.arange(k + 1, device=ids.device)
    row_last = row_first + row_qlen - 1
    sample_idx = torch.minimum((row_last - row_num_drafts)[:, None] + j, row_last[:, None])
    d_idx = torch.minimum(row_first[:, None] + j[1:], row_last[:, None])
    drafts_in = torch.where(j[:k] < row_num_drafts[:, None], ids[d_idx], 0)
    return sample_idx, positions[sample_idx], drafts_in


def commit_outputs(new_tokens: torch.Tensor, num_new: torch.Tensor, row_samples: torch.Tensor,
                   row_slot: torch.Tensor, dump_slot: int, row_num_drafts: torch.Tensor, row_first: torch.Tensor,
                   row_qlen: torch.Tensor, row_next_token: torch.Tensor, ids: torch.Tensor,
                   positions: torch.Tensor, slot_tokens: torch.Tensor, slot_num_new: torch.Tensor,
                   slot_dev: torch.Tensor, k: int, draft: bool, chain: tuple | None = None,
                   pages: tuple[torch.Tensor, int] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                              torch.Tensor | None, torch.Tensor | None]:
    """After verification: what the next step and the drafter read.

    new_tokens [B, K+1], num_new [B] (verify's); per row row_samples (bool), row_slot, row_num_drafts,
    row_first, row_qlen, row_next_token; ids, positions [T]; the slot buffers, written in place: a sampling
    row's slot gets its tokens, its count and its deviation from the host's assumption (num_new -
    (num_drafts + 1)), added to the slot's running deviation on a chained row, replacing it otherwise (the
    host planned this row knowing everything before the steps in flight); other rows write the dump slot.
    `chain` = (row_chained [B] bool, kv_lens [B] the step's corrected lengths, kv_out [B], chained_out [B]):
    the step's own input buffer views, advanced in place for a replay of the same inputs (a multi-step
    iteration's next sub-step): a sampling row's kv_len moves to exactly kv_len + num_new (its next row
    starts at its last emitted token) and it is marked chained. Without `chain` no row counts as chained.
    With `draft`, also the drafter's inputs: each row's last accepted token (last_idx [B]), the input ids
    shifted by one with the bonus token (or the row's next known token) after it (shifted [T]), and at
    [K+1, B] = position of the last accepted token + j; with `pages` = (page_table [B, W], page_size) also
    the cache slots of those positions (at_slots [K+1, B], attention.metadata.slots_for_positions: what the
    draft steps' metadata would derive from their lengths).
    -> (num_new [B], 0 for rows that do not sample; s [B] the slots written; last_idx; shifted; at; at_slots)."""
    num_new = torch.where(row_samples, num_new, 0)
    s = torch.where(row_samples, row_slot, dump_slot)
    dev = num_new - (row_num_drafts + 1)
    if chain is not None:
        row_chained, kv_lens, kv_out, chained_out = chain
        dev = dev + torch.where(row_chained, slot_dev[row_slot], 0)
    slot_tokens.index_copy_(0, s, new_tokens)
    slot_num_new.index_copy_(0, s, num_new)
    slot_dev.index_copy_(0, s, dev)
    if chain is not None:
        kv_out.copy_(torch.where(row_samples, kv_lens + num_new, kv_out))
        chained_out.copy_(chained_out | row_samples)
    if not draft:
        return num_new, s, None, None, None, None
    accepted = (num_new - 1).clamp(min=0)  # [B] index of the last emitted token in new_tokens
    last_idx = row_first + row_qlen - 1 - row_num_drafts + accepted
    bonus = new_tokens.gather(1, accepted[:, None])[:, 0]
    shifted = torch.cat([ids[1:], ids.new_zeros(1)])
    shifted.index_put_((last_idx,), torch.where(row_samples, bonus, row_next_token))
    at = positions[last_idx][None, :] + torch.arange(k + 1, device=ids.device)[:, None]  # [K+1, B]
    at_slots = None
    if pages is not None:
        rows = torch.arange(at.shape[1], device=at.device).expand_as(at)
        at_slots = slots_for_positions(pages[0], rows, at, pages[1])
    return num_new, s, last_idx, shifted, at, at_slots
