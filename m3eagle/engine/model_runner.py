"""ModelRunner.execute(step) -> StepOutput: target forward, verification and drafting in one call.

The runner owns the device state: KV pools (target layers, index-K, draft layer) and per-request slot
buffers holding each request's latest sampled tokens and drafts. Continuing rows read their input ids
from those buffers, so the host never needs them -- which is what lets the overlap scheduler launch
step N+1 before it has seen step N's tokens.

NOTE: no blocking CPU operation in `execute` (no .item(), .tolist(), .cpu(), nonzero or boolean-mask
indexing). The only device->host traffic is StepOutput.copy_to_host(), non-blocking, with an event.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.metadata import AttnMetadata
from ..models.minimax_m3 import LayerCache, MiniMaxM3
from ..sampling.sampler import SALT_DRAFT, SamplingTensors, probs_from_logits, sample_from_probs
from ..sampling.verify import verify
from .input_builder import StepInput


@dataclass
class StepOutput:
    new_tokens: torch.Tensor  # [B, K+1] emitted tokens; the first num_new[b] are valid
    num_new: torch.Tensor  # [B] 0 for rows that did not sample
    draft_tokens: torch.Tensor  # [B, K] proposals for the next step
    logprobs: torch.Tensor | None  # [B, K+1]
    host: dict | None = None
    event: torch.cuda.Event | None = None

    def copy_to_host(self, bufs: dict[str, torch.Tensor]) -> None:
        """Start the non-blocking device->host copy into preallocated (pinned on CUDA) buffers;
        `wait()` before use. Only the first B rows of each buffer are written."""
        pin = self.new_tokens.is_cuda
        self.host = {}
        for name in ("new_tokens", "num_new", "logprobs"):
            t = getattr(self, name)
            if t is None:
                continue
            buf = bufs[name][: t.shape[0]]
            buf.copy_(t, non_blocking=pin)
            self.host[name] = buf
        if pin:
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> dict:
        if self.event is not None:
            self.event.synchronize()
        return self.host


class ModelRunner:
    def __init__(self, target: MiniMaxM3, draft, num_draft_tokens: int, num_pages: int, page_size: int,
                 max_num_seqs: int, dtype: torch.dtype, device: torch.device, max_num_tokens: int = 512,
                 max_rows: int | None = None):
        self.target, self.draft = target, draft
        self.k = num_draft_tokens if draft is not None else 0
        self.page_size, self.device, self.dtype = page_size, device, dtype
        slots = num_pages * page_size
        self.caches: list[LayerCache] = target.new_caches(slots, dtype, device)
        self.draft_cache: LayerCache | None = draft.new_cache(slots, dtype, device) if draft is not None else None
        # Slot buffers have S + 1 rows: row S is a dump row that rows which must not write (prompt
        # chunks that did not sample) are pointed at, so every write is one unconditional index_copy_.
        n, k1 = max_num_seqs + 1, self.k + 1
        self.slot_tokens = torch.zeros(n, k1, dtype=torch.int64, device=device)  # [S+1, K+1]
        self.slot_num_new = torch.ones(n, dtype=torch.int64, device=device)  # [S+1]
        self.slot_expected = torch.ones(n, dtype=torch.int64, device=device)  # [S+1]
        self.slot_drafts = torch.zeros(n, max(self.k, 1), dtype=torch.int64, device=device)  # [S+1, K]
        self.dump_slot = max_num_seqs
        cfg = target.cfg
        self.aux_ids: tuple[int, ...] = tuple(draft.cfg.aux_layer_ids) if draft is not None else ()
        self.aux_width = len(self.aux_ids) * cfg.hidden_size
        # Everything a step writes besides the model's own intermediates is allocated here, once: the
        # aux-hidden buffer, the draft probabilities of sampled rows, and the pinned host outputs (two
        # sets, alternated per step, since under overlap the host reads step N while N+1 copies).
        self.aux_buf = (torch.zeros(max_num_tokens, self.aux_width, dtype=dtype, device=device)
                        if self.k else None)  # [T_max, 3H]
        self.slot_draft_probs = (torch.zeros(n, self.k, cfg.vocab_size, device=device)
                                 if self.k else None)  # [S+1, K, V] fp32
        rows = max_rows or max_num_seqs
        pin = device.type == "cuda"
        self.host_bufs = [{"new_tokens": torch.zeros(rows, k1, dtype=torch.int64, pin_memory=pin),
                           "num_new": torch.zeros(rows, dtype=torch.int64, pin_memory=pin),
                           "logprobs": torch.zeros(rows, k1, dtype=torch.float32, pin_memory=pin)} for _ in range(2)]
        self._host_parity = 0

    def to_host(self, out: StepOutput) -> StepOutput:
        """Launch the step's device->host copy (after execute, or after a graph replay)."""
        out.copy_to_host(self.host_bufs[self._host_parity])
        self._host_parity ^= 1
        return out

    # ---- overlap correction ---------------------------------------------------------------------
    def _apply_overlap_correction(self, inp: StepInput) -> tuple[torch.Tensor, AttnMetadata]:
        """Fill gathered input ids from the slot buffers and correct optimistic KV lengths.

        kv_len += num_new_prev - (k_prev + 1) on rows whose previous sampling step was still in flight
        when the host planned this one; the metadata hook then re-derives positions and slots."""
        ids = torch.cat([inp.input_ids, inp.input_ids.new_zeros(1)])  # [T+1], index T is a dump slot
        t = inp.input_ids.shape[0]
        slot = inp.row_slot
        last = self.slot_tokens[slot].gather(1, (self.slot_num_new[slot] - 1).clamp(min=0)[:, None])[:, 0]
        dump = torch.full_like(inp.row_first, t)
        ids.index_put_((torch.where(inp.row_gather, inp.row_first, dump),), last)
        for j in range(self.k):
            ok = inp.row_gather & (j < inp.row_num_drafts)
            ids.index_put_((torch.where(ok, inp.row_first + 1 + j, dump),), self.slot_drafts[slot, j])
        corr = torch.where(inp.row_correct, self.slot_num_new[slot] - self.slot_expected[slot], 0)
        return ids[:t], inp.meta.with_lengths(inp.meta.kv_lens + corr)

    # ---- the step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, inp: StepInput) -> StepOutput:
        k = self.k
        ids, meta = self._apply_overlap_correction(inp)
        aux = self.aux_buf[: inp.num_tokens] if self.aux_buf is not None else None  # [T, 3H]
        hidden = self.target(ids, meta.positions, meta, self.caches, self.aux_ids, aux)  # [T, H]

        # Sampled positions: the last (num_drafts + 1) tokens of each row.
        j = torch.arange(k + 1, device=self.device)
        row_last = inp.row_first + inp.row_qlen - 1
        base = row_last - inp.row_num_drafts
        sample_idx = torch.minimum(base[:, None] + j, row_last[:, None])  # [B, K+1]
        logits = self.target.compute_logits(hidden[sample_idx.reshape(-1)]).view(inp.num_rows, k + 1, -1)
        positions = meta.positions[sample_idx]  # [B, K+1]
        if k:
            d_idx = torch.minimum(inp.row_first[:, None] + 1 + j[:k], row_last[:, None])
            drafts_in = torch.where(j[:k] < inp.row_num_drafts[:, None], ids[d_idx], 0)  # [B, K]
        else:
            drafts_in = ids.new_zeros(inp.num_rows, 0)
        # Draft probabilities exist for rows whose drafts were sampled; greedy rows never read them.
        q_probs = self.slot_draft_probs[inp.row_slot] if inp.any_random and self.slot_draft_probs is not None else None
        new_tokens, num_new = verify(logits, drafts_in, inp.row_num_drafts, inp.sampling, positions, q_probs,
                                     inp.any_random)
        num_new = torch.where(inp.row_samples, num_new, 0)
        logprobs = None
        if inp.want_logprobs:
            logprobs = torch.log_softmax(logits, -1).gather(-1, new_tokens[..., None])[..., 0]

        # Remember each sampling row's outputs for the next step (gathered on device).
        keep = inp.row_samples
        s = torch.where(keep, inp.row_slot, self.dump_slot)
        self.slot_tokens.index_copy_(0, s, new_tokens)
        self.slot_num_new.index_copy_(0, s, num_new)
        self.slot_expected.index_copy_(0, s, inp.row_num_drafts + 1)

        drafts = ids.new_zeros(inp.num_rows, k)
        if self.draft is not None and k:
            drafts = self._draft(inp, ids, meta, aux, new_tokens, num_new, s)
        return StepOutput(new_tokens, num_new, drafts, logprobs)

    # ---- drafting -------------------------------------------------------------------------------
    def _draft(self, inp: StepInput, ids: torch.Tensor, meta: AttnMetadata, aux: torch.Tensor,
               new_tokens: torch.Tensor, num_new: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """Draft step 0 over every target token (inputs shifted by one), then K-1 one-token steps."""
        k, b = self.k, inp.num_rows
        st: SamplingTensors = inp.sampling
        # Index of the last accepted token of each row; its successor is the bonus token.
        last_idx = inp.row_first + inp.row_qlen - 1 - inp.row_num_drafts + (num_new - 1).clamp(min=0)
        bonus = new_tokens.gather(1, (num_new - 1).clamp(min=0)[:, None])[:, 0]
        shifted = torch.cat([ids[1:], ids.new_zeros(1)])
        shifted.index_put_((last_idx,), torch.where(inp.row_samples, bonus, inp.row_next_token))
        h_out, h_next = self.draft(shifted, meta.positions, aux, meta, self.draft_cache, True)
        h_out, h_next = h_out[last_idx], h_next[last_idx]  # [B, H]
        pos = meta.positions[last_idx]  # position of the last accepted token
        rows = torch.arange(b, device=self.device)
        dmeta = AttnMetadata(num_rows=b, max_q=1, max_kv=inp.meta.max_kv + k, page_size=self.page_size,
                             q_lens=torch.ones_like(rows), kv_lens=pos + 1, page_table=meta.page_table,
                             tok_row=rows, tok_col=torch.zeros_like(rows), q_index=rows[:, None],
                             q_valid=torch.ones(b, 1, dtype=torch.bool, device=self.device),
                             positions=pos, slot_mapping=pos, ops=meta.ops)
        out_tokens, out_probs = [], []
        for step in range(k):
            logits = self.draft.compute_logits(h_out)  # [B, Vd]
            tok, probs = self._draft_sample(logits, st, pos + step, inp.any_random)
            out_tokens.append(tok)
            out_probs.append(probs)
            if step == k - 1:
                break
            p = pos + step + 1
            sm = dmeta.with_lengths(p + 1)
            h_out, h_next = self.draft(tok, sm.positions, h_next, sm, self.draft_cache, False)
        drafts = torch.stack(out_tokens, 1)  # [B, K]
        self.slot_drafts.index_copy_(0, s, drafts)
        if inp.any_random:
            self.slot_draft_probs.index_copy_(0, s, torch.stack(out_probs, 1))
        return drafts

    def _draft_sample(self, logits: torch.Tensor, st: SamplingTensors, pos: torch.Tensor, random: bool,
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy rows take the draft argmax; sampled rows draw from the draft's processed
        distribution (same temperature / top-k / top-p as the target) mapped to target ids."""
        greedy = self.draft.draft_to_target(logits.argmax(-1))
        if not random:
            return greedy, None
        q = self.draft.draft_probs_to_target(probs_from_logits(logits, st))  # [B, V]
        drawn = sample_from_probs(q, st.seed, pos, SALT_DRAFT)
        return torch.where(st.greedy, greedy, drawn), q

