"""History-dependent logits processing: repetition / presence / frequency penalties and min_tokens.

These change the target distribution with the request's tokens so far, so speculation stays exact only if
verify position j is penalised with the history *up to and including the drafts before j* (the history it
would have had without speculation, had those drafts been sampled). The draft head's proposals ignore the
penalties: rejection sampling against the penalised target p (and greedy's argmax of the penalised logits)
is what keeps the output exact.

State lives on the device, one row per request slot (`PenaltyState`, [S+1, V] each), and is updated inside
the step from StepInput tensors alone -- no host sync, and any rank that receives the same StepInput keeps
the same state:
- a row that starts its request's history (first chunk at position 0) resets the slot; its stop mask comes
  from the step's flat stop-id list, its prompt mask from another slot (`src_slot`: a sample of n that
  shares its prompt's pages with its parent copies the parent's prompt mask) or empty;
- host-known tokens of prompt chunks (the prompt, and the outputs again after a preemption) are recorded by
  position: below `prompt_len` into the prompt mask, from there on into the output counts;
- tokens a step emits (new_tokens[:num_new]) are added to the output counts. A gathered input token (the
  last emitted one) is never counted again, and drafts count only inside the step that verifies them.

Steps in which no row has penalties skip all of this (the slots of such requests are never read).

Semantics (as transformers and vLLM): repetition_penalty r on tokens of prompt or output: logit > 0 becomes
logit / r, logit <= 0 becomes logit * r; then logit -= frequency * count + presence * (count > 0), counts
over output tokens only (OpenAI). min_tokens: while fewer than min_tokens tokens are out, EOS (unless
ignore_eos) and stop_token_ids get -inf, as transformers' MinNewTokensLengthLogitsProcessor / vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PenaltyTensors:
    """Per-row penalty parameters of one step ([B] each unless noted), built by the input builder."""

    presence: torch.Tensor  # fp32
    frequency: torch.Tensor  # fp32
    repetition: torch.Tensor  # fp32
    min_tokens: torch.Tensor  # int64
    prompt_len: torch.Tensor  # int64: positions below it are prompt tokens
    ignore_eos: torch.Tensor  # bool
    reset: torch.Tensor  # bool: the row starts its request's history (first chunk from position 0)
    src_slot: torch.Tensor  # int64: slot whose prompt mask a resetting row copies (the dump slot: none)
    stop_ids: torch.Tensor  # [M] int64: stop_token_ids of the resetting rows, flattened
    stop_rows: torch.Tensor  # [M] int64: the row of each


def penalize(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, presence: torch.Tensor,
             frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """logits [N, V] fp32, counts [N, V] (output-token counts), in_prompt [N, V] bool, params [N] -> [N, V].
    Neutral parameters (0, 0, 1) leave the logits bit-for-bit unchanged (x / 1, x * 1 and x - 0 are exact)."""
    r = repetition[:, None]
    seen = in_prompt | (counts > 0)
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    c = counts.to(logits.dtype)
    return logits - frequency[:, None] * c - presence[:, None] * (c > 0).to(logits.dtype)


def penalize_reference(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float = 0.0,
                       frequency: float = 0.0, repetition: float = 1.0, min_tokens: int = 0,
                       stop_ids: tuple[int, ...] = ()) -> torch.Tensor:
    """The plain definition on one position: logits [V] given the prompt and the output so far -> [V]."""
    out = logits.clone().float()
    if len(output) < min_tokens:
        for t in stop_ids:
            out[t] = float("-inf")
    for t in set(prompt) | set(output):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(output):
        out[t] -= frequency * output.count(t) + presence
    return out


class PenaltyState:
    """Per-slot token history on the device: output counts, prompt mask and min_tokens stop mask."""

    def __init__(self, num_slots: int, vocab: int, eos_ids: list[int], dump_slot: int, device: torch.device):
        self.vocab, self.dump_slot = vocab, dump_slot
        self.counts = torch.zeros(num_slots, vocab, dtype=torch.int32, device=device)  # [S+1, V]
        self.in_prompt = torch.zeros(num_slots, vocab, dtype=torch.bool, device=device)  # [S+1, V]
        self.stop_mask = torch.zeros(num_slots, vocab, dtype=torch.bool, device=device)  # [S+1, V]
        self.eos_mask = torch.zeros(vocab, dtype=torch.bool, device=device)  # [V]
        self._true = torch.ones((), dtype=torch.bool, device=device)
        self.eos_mask[[t for t in eos_ids if 0 <= t < vocab]] = True

    def record_inputs(self, pt: PenaltyTensors, row_slot: torch.Tensor, row_gather: torch.Tensor,
                      ids: torch.Tensor, tok_row: torch.Tensor, positions: torch.Tensor) -> None:
        """Reset the slots of rows that start a history, then record the step's host-known input tokens
        (ids [T], tok_row [T], positions [T]) as prompt or output tokens by position."""
        v, dump = self.vocab, self.dump_slot
        rs = torch.where(pt.reset, row_slot, dump)  # [B]
        has_src = pt.reset & (pt.src_slot != dump)
        copied = self.in_prompt[pt.src_slot] & has_src[:, None]  # [B, V], read before any write
        self.counts.index_fill_(0, rs, 0)
        self.stop_mask.index_fill_(0, rs, False)
        self.in_prompt.index_copy_(0, rs, copied)
        # index_put_ with a device value: `mask[idx] = True` would copy a host scalar (not capturable)
        self.stop_mask.index_put_((row_slot[pt.stop_rows], pt.stop_ids), self._true)
        # Tokens of gathered rows (the last emitted token + drafts) are not history to record here.
        host = ~row_gather[tok_row]  # [T]
        slot = row_slot[tok_row]
        is_prompt = host & (positions < pt.prompt_len[tok_row])
        is_out = host & ~is_prompt
        flat = slot * v + ids  # [T]
        # Unselected tokens go to the dump slot's entry 0: every write below is unconditional.
        self.in_prompt.view(-1).index_fill_(0, torch.where(is_prompt, flat, dump * v), True)
        self.counts.view(-1).index_add_(0, torch.where(is_out, flat, dump * v), is_out.to(torch.int32))

    def apply(self, logits: torch.Tensor, pt: PenaltyTensors, row_slot: torch.Tensor, drafts: torch.Tensor,
              num_drafts: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """logits [B, K+1, V] of the sampled positions, drafts [B, K], positions [B, K+1] (of the query that
        predicts each token) -> penalised logits [B, K+1, V]. Position j sees the drafts d_1..d_j as output."""
        b, kp1, v = logits.shape
        k = kp1 - 1
        counts = self.counts[row_slot]  # [B, V]
        if k:
            valid = (torch.arange(k, device=logits.device)[None, :] < num_drafts[:, None]).to(torch.int32)
            inc = torch.zeros(b, kp1, v, dtype=torch.int32, device=logits.device)
            inc[:, 1:].scatter_(-1, drafts[..., None], valid[..., None])  # d_j counts from position j on
            counts = counts[:, None] + inc.cumsum(1, dtype=torch.int32)  # [B, K+1, V]
        else:
            counts = counts[:, None]
        stop = self.stop_mask[row_slot] | (self.eos_mask[None] & ~pt.ignore_eos[:, None])  # [B, V]
        n_out = positions + 1 - pt.prompt_len[:, None]  # [B, K+1] output tokens before the one sampled here
        hold = stop[:, None] & (n_out < pt.min_tokens[:, None])[..., None]  # [B, K+1, V]
        logits = logits.masked_fill(hold, float("-inf"))
        rep = lambda x: x.repeat_interleave(kp1, 0)  # noqa: E731 -- per-row parameters to per-position rows
        out = penalize(logits.reshape(b * kp1, v), counts.expand(b, kp1, v).reshape(b * kp1, v),
                       self.in_prompt[row_slot].repeat_interleave(kp1, 0), rep(pt.presence), rep(pt.frequency),
                       rep(pt.repetition))
        return out.view(b, kp1, v)

    def record_outputs(self, new_tokens: torch.Tensor, num_new: torch.Tensor, write_slot: torch.Tensor) -> None:
        """Count the emitted tokens new_tokens[b, :num_new[b]] ([B, K+1], [B]) in slot write_slot[b] (the
        dump slot for rows that did not sample)."""
        v = self.vocab
        j = torch.arange(new_tokens.shape[1], device=new_tokens.device)
        keep = j[None, :] < num_new[:, None]  # [B, K+1]
        flat = torch.where(keep, write_slot[:, None] * v + new_tokens, self.dump_slot * v)
        self.counts.view(-1).index_add_(0, flat.reshape(-1), keep.reshape(-1).to(torch.int32))
