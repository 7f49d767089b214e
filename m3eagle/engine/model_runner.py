"""ModelRunner.execute(step) -> StepOutput: target forward, verification and drafting in one call.

The runner owns the device state: KV pools (target layers, index-K, draft layer) and per-request slot
buffers holding each request's latest sampled tokens and drafts. Continuing rows read their input ids
from those buffers, so the host never needs them -- which is what lets the overlap scheduler launch
step N+1 before it has seen step N's tokens.

NOTE: no blocking CPU operation in `execute` (no .item(), .tolist(), .cpu(), nonzero or boolean-mask
indexing). The only device->host traffic is StepOutput.copy_to_host(), non-blocking, with an event. A
constrained step's grammar masks are one more static input (StepInput.verify_mask); only the opt-in
structured_draft_masks option (and a draft tree's grammar) reads device values back inside the step, through
the GrammarStep in StepInput.grammar, and runs eagerly for that reason.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from m3eagle.engine import step_ops
from m3eagle.engine.input_builder import StepInput
from m3eagle.engine.step_ops import StepOps
from m3eagle.kernels.attention.metadata import AttnMetadata
from m3eagle.kernels.ops import REFERENCE
from m3eagle.models.minimax_m3 import LayerCache, MiniMaxM3
from m3eagle.sampling.params import MAX_LOGPROBS
from m3eagle.sampling.penalties import PenaltyState
from m3eagle.sampling.sampler import SALT_DRAFT, SALT_SAMPLE, SamplingTensors, probs_from_logits, sample_from_probs
from m3eagle.sampling.structured import apply_bitmask
from m3eagle.sampling.verify import verify


@dataclass
class TokenLogprobs:
    """Logprobs of N tokens (one per sampled position, or per prompt token) and their top candidates."""

    logprob: torch.Tensor  # [..., ] fp32 logprob of the token
    rank: torch.Tensor  # [..., ] int64, 1 = the most likely
    top_logprobs: torch.Tensor  # [..., MAX_LOGPROBS] fp32, descending
    top_ids: torch.Tensor  # [..., MAX_LOGPROBS] int64


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, n_top: int) -> TokenLogprobs:
    """logits [..., V], tokens [...] -> the tokens' log_softmax, their rank (vLLM's: 1 + the number of
    strictly more likely tokens) and the n_top best candidates."""
    lsm = torch.log_softmax(logits.float(), -1)
    lp = lsm.gather(-1, tokens[..., None])  # [..., 1]
    rank = (lsm > lp).sum(-1) + 1
    top_lp, top_ids = lsm.topk(n_top, -1)
    return TokenLogprobs(lp[..., 0], rank, top_lp, top_ids)


@dataclass
class StepOutput:
    new_tokens: torch.Tensor  # [B, K+1] emitted tokens; the first num_new[b] are valid
    num_new: torch.Tensor  # [B] 0 for rows that did not sample
    draft_tokens: torch.Tensor  # [B, K] proposals for the next step
    logprobs: TokenLogprobs | None  # of new_tokens: [B, K+1] (+ [B, K+1, MAX_LOGPROBS] candidates)
    prompt_logprobs: TokenLogprobs | None = None  # of each input token's successor: [T] (+ [T, MAX_LOGPROBS])
    host: dict | None = None
    event: torch.cuda.Event | None = None

    def fresh(self) -> StepOutput:
        """The same device tensors without host state (a replayed graph's static outputs, per step)."""
        return StepOutput(self.new_tokens, self.num_new, self.draft_tokens, self.logprobs, self.prompt_logprobs)

    def copy_to_host(self, bufs: dict[str, torch.Tensor], drafts: bool = False) -> None:
        """Start the non-blocking device->host copy into preallocated (pinned on CUDA) buffers;
        `wait()` before use. Only the first B rows of each buffer are written. Prompt logprobs (prompt
        steps only, any number of tokens) go to pinned buffers allocated here. `drafts`: also draft_tokens."""
        pin = self.new_tokens.is_cuda
        self.host = {}
        named = {"new_tokens": self.new_tokens, "num_new": self.num_new}
        if drafts:
            named["draft_tokens"] = self.draft_tokens
        if self.logprobs is not None:
            named.update({f"lp_{f.name}": getattr(self.logprobs, f.name) for f in fields(TokenLogprobs)})
        for name, t in named.items():
            buf = bufs[name][: t.shape[0]]
            buf.copy_(t, non_blocking=pin)
            self.host[name] = buf
        if self.prompt_logprobs is not None:
            for f in fields(TokenLogprobs):
                t = getattr(self.prompt_logprobs, f.name)
                self.host[f"plp_{f.name}"] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(
                    t, non_blocking=pin)
        if pin:
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> dict:
        if self.event is not None:
            self.event.synchronize()
        return self.host


@dataclass
class Forward:
    """What a step's target forward hands its finish (ModelRunner.forward -> finish): device tensors, which a
    replayed forward graph leaves at fixed addresses for the finish graph to read."""

    ids: torch.Tensor  # [T] input ids, gathered from the slot buffers where rows continue
    meta: AttnMetadata  # the corrected lengths, positions and cache slots
    aux: torch.Tensor | None  # [T, 3H] the draft head's aux hidden states (None without a head)
    positions: torch.Tensor  # [B, K+1] position of each sampled row
    drafts_in: torch.Tensor  # [B, K] the drafts each row verifies
    sampled: torch.Tensor  # [B * (K+1), H] hidden states of the sampled rows
    prompt_logprobs: TokenLogprobs | None  # prompt steps that want them: [T] (+ [T, MAX_LOGPROBS])


def _fused(meta: AttnMetadata):
    """The step's fused ops (kernels/fused/backend.py): the engine's, or the plain torch reference without any."""
    return meta.ops.fused if meta.ops is not None else REFERENCE.fused


class ModelRunner:
    def __init__(self, target: MiniMaxM3, draft, num_draft_tokens: int, num_pages: int, page_size: int,
                 max_num_seqs: int, dtype: torch.dtype, device: torch.device, max_num_tokens: int = 512,
                 max_rows: int | None = None, host_sets: int = 2, coupled: bool = False):
        self.target, self.draft = target, draft
        # The deterministic mode's coupled verification (sampling/verify.py): each emitted token is the target's
        # own draw at its position, and drafts are drawn with that draw's key, so sampled output does not depend
        # on the drafts, the batch or recomputes.
        self.coupled = coupled
        self.draft_salt = SALT_SAMPLE if coupled else SALT_DRAFT
        self._book: dict[str, StepOps] = {}  # step bookkeeping ops by fused-backend name (_step_ops)
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
        # [S+1] tokens emitted minus tokens the host assumed (every draft accepted), summed over a slot's
        # steps since the host last planned it: what a planned row in flight corrects its kv_len by
        self.slot_dev = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_drafts = torch.zeros(n, max(self.k, 1), dtype=torch.int64, device=device)  # [S+1, K]
        self.dump_slot = max_num_seqs
        cfg = target.cfg
        # Token history for penalties / min_tokens ([S+1, V] x 3): used only by steps with such rows.
        self.penalty = PenaltyState(n, cfg.vocab_size, list(cfg.eos_token_ids), self.dump_slot, device)
        self.n_top = min(MAX_LOGPROBS, cfg.vocab_size)
        self.aux_ids: tuple[int, ...] = tuple(draft.cfg.aux_layer_ids) if draft is not None else ()
        self.aux_width = len(self.aux_ids) * cfg.hidden_size
        # Everything a step writes besides the model's own intermediates is allocated here, once: the
        # aux-hidden buffer, the draft probabilities of sampled rows, and the pinned host outputs (host_sets
        # sets, used in turn: under overlap the host reads one iteration's outputs while the next copies, and
        # a multi-step iteration of N sub-steps copies N, so the engine asks for 2N).
        self.aux_buf = (torch.zeros(max_num_tokens, self.aux_width, dtype=dtype, device=device)
                        if self.k else None)  # [T_max, 3H]
        self.slot_draft_probs = (torch.zeros(n, self.k, cfg.vocab_size, device=device)
                                 if self.k else None)  # [S+1, K, V] fp32
        rows = max_rows or max_num_seqs
        pin = device.type == "cuda"
        nt = self.n_top
        self.host_bufs = [{"new_tokens": torch.zeros(rows, k1, dtype=torch.int64, pin_memory=pin),
                           "num_new": torch.zeros(rows, dtype=torch.int64, pin_memory=pin),
                           "draft_tokens": torch.zeros(rows, self.k, dtype=torch.int64, pin_memory=pin),
                           "lp_logprob": torch.zeros(rows, k1, dtype=torch.float32, pin_memory=pin),
                           "lp_rank": torch.zeros(rows, k1, dtype=torch.int64, pin_memory=pin),
                           "lp_top_logprobs": torch.zeros(rows, k1, nt, dtype=torch.float32, pin_memory=pin),
                           "lp_top_ids": torch.zeros(rows, k1, nt, dtype=torch.int64, pin_memory=pin)}
                          for _ in range(host_sets)]
        self._host_parity = 0
        # Constant index tensors, made once: inside a captured step each fresh arange / ones would be one
        # more kernel per replay. Rows take views of the first B entries.
        self.row_ids = torch.arange(rows, device=device)  # [R]
        self.row_ones = torch.ones(rows, dtype=torch.int64, device=device)  # [R]
        self.row_zeros = torch.zeros(rows, dtype=torch.int64, device=device)  # [R]
        self.row_true = torch.ones(rows, 1, dtype=torch.bool, device=device)  # [R, 1]

    def _step_ops(self, meta: AttnMetadata) -> StepOps:
        """The step's bookkeeping ops (step_ops.py): the implementation named like the step's fused backend, one
        object per name for this runner (they are stateless)."""
        name = _fused(meta).name
        ops = self._book.get(name)
        if ops is None:
            ops = self._book[name] = step_ops.create(name)
        return ops

    def step_width(self, inp: StepInput) -> int:
        """The drafts per row the step computes with (host int): K, fixed per engine (a draft tree's runner
        reads the step's verify width). A graph bakes it in, so its capture and its replays must agree."""
        return self.k

    def to_host(self, out: StepOutput, drafts: bool = False) -> StepOutput:
        """Launch the step's device->host copy (after execute, or after a graph replay); `drafts`: the drafts too
        (a constrained step's: the next step's verify masks walk them)."""
        out.copy_to_host(self.host_bufs[self._host_parity], drafts)
        self._host_parity = (self._host_parity + 1) % len(self.host_bufs)
        return out

    # ---- overlap correction ---------------------------------------------------------------------
    def _apply_overlap_correction(self, inp: StepInput) -> tuple[torch.Tensor, AttnMetadata]:
        """Fill gathered input ids from the slot buffers and correct optimistic KV lengths.

        kv_len += slot_dev (emitted - assumed over the steps in flight when the host planned this one) on
        rows whose sampling steps were still in flight then; chained rows (later sub-steps of a multi-step
        iteration) already hold exact lengths. The metadata hook then re-derives positions and slots."""
        meta = inp.meta
        return self._step_ops(meta).overlap_inputs(inp.input_ids, meta, inp.row_slot, inp.row_first, inp.row_gather,
                                    inp.row_num_drafts, inp.row_correct, inp.row_chained, self.slot_tokens,
                                    self.slot_num_new, self.slot_dev, self.slot_drafts, self.k)

    # ---- the step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, inp: StepInput) -> StepOutput:
        return self.finish(inp, self.forward(inp))

    @torch.inference_mode()
    def forward(self, inp: StepInput) -> Forward:
        """The step's first half: the overlap correction and the target forward up to the sampled rows' hidden
        states. It reads no mask, so a constrained step launches it before the host has built its masks
        (LLMEngine._step); `finish` does the rest."""
        k = self.k
        ids, meta = self._apply_overlap_correction(inp)
        pen = inp.penalties
        if pen is not None:  # history first: a prompt chunk's tokens precede the position it samples
            self.penalty.record_inputs(pen, inp.row_slot, inp.row_gather, ids, meta.tok_row, meta.positions)
        aux = self.aux_buf[: inp.num_tokens] if self.aux_buf is not None else None  # [T, 3H]
        # Sampled positions: the last (num_drafts + 1) tokens of each row; the drafts they verify.
        sample_idx, positions, drafts_in = self._step_ops(meta).sample_positions(
            inp.row_first, inp.row_qlen, inp.row_num_drafts, meta.positions, ids, k)  # [B, K+1] x 2, [B, K]
        # The final norm computes only the sampled rows (the gather rides in its launch), unless prompt
        # logprobs read every token's hidden state.
        every = inp.want_prompt_logprobs
        hidden = self.target(ids, meta.positions, meta, self.caches, self.aux_ids, aux,
                             rows=None if every else sample_idx.reshape(-1))  # [T, H] or [B * (K+1), H]
        prompt_lps = self._prompt_logprobs(inp, ids, hidden) if every else None
        sampled = hidden[sample_idx.reshape(-1)] if every else hidden  # [B * (K+1), H]
        return Forward(ids, meta, aux, positions, drafts_in, sampled, prompt_lps)

    @torch.inference_mode()
    def finish(self, inp: StepInput, fw: Forward) -> StepOutput:
        """The step's second half: logits of the sampled rows, penalties, the grammar's masks (inp.verify_mask,
        uploaded by now), verification, the commit of each row's outputs and the K draft steps."""
        k = self.k
        # Constrained rows: inp.verify_mask masks the target (a static input, like the step's other tensors). A
        # GrammarStep here (structured_step.py) is the structured_draft_masks option's: it masks the draft head
        # too, reading device values back as it drafts, so such a step runs eagerly.
        grammar = inp.grammar
        ids, meta, aux, positions, drafts_in, sampled = fw.ids, fw.meta, fw.aux, fw.positions, fw.drafts_in, fw.sampled
        pen = inp.penalties
        fused, book = _fused(meta), self._step_ops(meta)
        # fp32 logits only where something reads more than their argmax (an fp32 copy of bf16 logits changes
        # no argmax); these flags are part of a graph's key.
        fp32 = inp.any_random or pen is not None or inp.want_logprobs or inp.masked
        # Without drafts every greedy row emits exactly its argmax: no acceptance launch to count that.
        accept = book.greedy_accept if k else (lambda tok, _d, _n: self.row_ones[: tok.shape[0]])
        if not fp32:  # all greedy, nothing else reads the logits: verify's greedy path, the argmax in lm_head's launch
            greedy = self.target.greedy_ids(sampled, fused).view(inp.num_rows, k + 1)  # [B, K+1]
            new_tokens, num_new = greedy, accept(greedy, drafts_in, inp.row_num_drafts)
            logits = None
        else:
            logits = self.target.compute_logits(sampled, fused, fp32).view(inp.num_rows, k + 1, -1)
            if pen is not None:  # the target distribution of position j given the history and drafts d_1..d_j
                logits = self.penalty.apply(logits, pen, inp.row_slot, drafts_in, inp.row_num_drafts, positions)
            # Draft probabilities exist for rows whose drafts were sampled; greedy rows never read them.
            q_probs = (self.slot_draft_probs[inp.row_slot] if inp.any_random and self.slot_draft_probs is not None
                       else None)
            # The grammar's mask of each verify position (the state after the drafts before it); logprobs stay
            # those of the unmasked distribution, as vLLM's do. A draft the grammar refuses has p = 0 there, so it
            # is rejected whatever proposed it.
            scored = apply_bitmask(logits, inp.verify_mask) if inp.masked else logits
            new_tokens, num_new = verify(scored, drafts_in, inp.row_num_drafts, inp.sampling, positions, q_probs,
                                         inp.any_random, accept, fused.argmax, self.coupled)
        # Logprobs of the (penalised) target distribution, before temperature / top-k / top-p / min-p.
        logprobs = token_logprobs(logits, new_tokens, self.n_top) if inp.want_logprobs else None

        # Remember each sampling row's outputs for the next step (gathered on device), and the drafter's
        # inputs: the last accepted token of each row, the ids shifted by one with the bonus token after it.
        # The step's own kv_len / chained inputs advance in place, so replaying these inputs runs the next
        # sub-step of a multi-step iteration (a host-built step overwrites them).
        drafting = self.draft is not None and k > 0
        num_new, s, last_idx, shifted, at, at_slots = book.commit_outputs(
            new_tokens, num_new, inp.row_samples, inp.row_slot, self.dump_slot, inp.row_num_drafts, inp.row_first,
            inp.row_qlen, inp.row_next_token, ids, meta.positions, self.slot_tokens, self.slot_num_new,
            self.slot_dev, k, drafting, tok_row=meta.tok_row,
            chain=(inp.row_chained, meta.kv_lens, inp.meta.kv_lens, inp.row_chained),
            pages=(meta.page_table, self.page_size) if drafting else None)
        if pen is not None:
            self.penalty.record_outputs(new_tokens, num_new, s)

        if grammar is not None:  # what the draft masks start from: this step's emitted tokens
            grammar.emitted = (new_tokens, num_new)
        drafts = (self._draft(inp, meta, aux, s, last_idx, shifted, at, at_slots) if drafting
                  else ids.new_zeros(inp.num_rows, k))
        if grammar is not None:
            grammar.finish(drafts if drafting else None)
        return StepOutput(new_tokens, num_new, drafts, logprobs, fw.prompt_logprobs)

    def _prompt_logprobs(self, inp: StepInput, ids: torch.Tensor, hidden: torch.Tensor) -> TokenLogprobs:
        """Logprobs of every input token's successor under the raw target logits ([T] and [T, n_top]): within
        a row the next input id, after a chunk's last token the row's next known token. The host keeps the
        entries that fall on prompt tokens (prompt steps are eager, so T may vary)."""
        nxt = torch.cat([ids[1:], ids[:1]])  # [T]
        nxt[inp.row_first + inp.row_qlen - 1] = inp.row_next_token
        return token_logprobs(self.target.compute_logits(hidden), nxt, self.n_top)

    # ---- drafting -------------------------------------------------------------------------------
    def _draft(self, inp: StepInput, meta: AttnMetadata, aux: torch.Tensor, s: torch.Tensor, last_idx: torch.Tensor,
               shifted: torch.Tensor, at: torch.Tensor, at_slots: torch.Tensor) -> torch.Tensor:
        """Draft step 0 over every target token (inputs shifted by one, the bonus token after each row's last
        accepted one), then K-1 one-token steps. last_idx [B], shifted [T], at [K+1, B] (position of the
        last accepted token + j) and at_slots [K+1, B] (their cache slots): commit_outputs'. Constrained rows draft
        like the others; under structured_draft_masks (a GrammarStep in inp.grammar) each depth is masked with its
        draft_mask."""
        k, b = self.k, inp.num_rows
        st: SamplingTensors = inp.sampling
        h_out, h_next = self.draft(shifted, meta.positions, aux, meta, self.draft_cache, True, rows=last_idx)  # [B, H]
        pos = at[0]  # position of the last accepted token
        rows = self.row_ids[:b]
        dmeta = AttnMetadata(num_rows=b, max_q=1, max_kv=inp.meta.max_kv + k, page_size=self.page_size,
                             q_lens=self.row_ones[:b], kv_lens=at[1], page_table=meta.page_table,
                             tok_row=rows, tok_col=self.row_zeros[:b], q_index=rows[:, None],
                             q_valid=self.row_true[:b], positions=pos, slot_mapping=pos, ops=meta.ops)
        drafts = torch.empty(k, b, dtype=torch.int64, device=at.device).t()  # [B, K]; column j contiguous
        out_probs = []
        grammar = inp.grammar
        for step in range(k):
            if grammar is not None:  # drafts stay inside the grammar: masked over the target vocabulary
                mask = grammar.draft_mask(step, drafts)  # [B, W] (reads back tokens: a host sync)
                logits = self.draft.compute_logits(h_out, _fused(meta))  # [B, Vd] fp32
                tok, probs = self._draft_constrained(logits, mask, st, at[step], inp.any_random, drafts, step)
            elif inp.any_random:
                logits = self.draft.compute_logits(h_out, _fused(meta))  # [B, Vd] fp32
                tok, probs = self._draft_sample(logits, st, at[step], _fused(meta), drafts, step)
            else:  # draft_to_target(argmax), into column `step` and the slot buffer's rows s, with the lm_head
                tok, probs = self.draft.greedy_ids(h_out, _fused(meta), drafts[:, step], (self.slot_drafts, s, step)), None
            out_probs.append(probs)
            if step == k - 1:
                break
            # the drafted token sits at pos + step + 1: dmeta.with_lengths(at[step + 2]), derived by commit
            sm = replace(dmeta, kv_lens=at[step + 2], positions=at[step + 1], slot_mapping=at_slots[step + 1])
            h_out, h_next = self.draft(tok, sm.positions, h_next, sm, self.draft_cache, False)
        if inp.any_random or grammar is not None:
            self.slot_drafts.index_copy_(0, s, drafts)
        if inp.any_random:
            self.slot_draft_probs.index_copy_(0, s, torch.stack(out_probs, 1))
        return drafts

    def _draft_constrained(self, logits: torch.Tensor, mask: torch.Tensor, st: SamplingTensors, pos: torch.Tensor,
                           any_random: bool, drafts: torch.Tensor, step: int,
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft step of a constrained step: the head's logits [B, Vd] placed at their target ids (-inf off the
        draft vocabulary, so the mask is applied after the d2t mapping), masked by the grammar (int32 [B, W]);
        a row whose allowed tokens all lie outside the draft vocabulary drafts unmasked (its draft is then
        rejected by the masked target). Greedy rows take the argmax; sampled rows draw from the processed
        masked distribution, which is also the q that verification divides by. -> (tokens [B] into
        drafts[:, step], q [B, V] or None)."""
        b, vd = logits.shape
        target_ids = torch.arange(vd, device=logits.device) + self.draft.d2t
        full = logits.new_full((b, self.target.cfg.vocab_size), float("-inf")).index_copy_(1, target_ids, logits)
        masked = apply_bitmask(full, mask)  # [B, V]
        masked = torch.where(torch.isinf(masked).all(-1, keepdim=True), full, masked)
        greedy = masked.argmax(-1)
        if not any_random:
            return drafts[:, step].copy_(greedy), None
        q = probs_from_logits(masked, st)  # [B, V]
        drawn = sample_from_probs(q, st.seed, pos, self.draft_salt)
        return drafts[:, step].copy_(torch.where(st.greedy, greedy, drawn)), q

    def _draft_sample(self, logits: torch.Tensor, st: SamplingTensors, pos: torch.Tensor, fused: Any,
                      drafts: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sampled step (some row has temperature > 0): greedy rows take the draft argmax, sampled rows draw
        from the draft's processed distribution (same temperature / top-k / top-p as the target) mapped to
        target ids; the tokens go to drafts[:, step] (`_draft` copies the [B, K] drafts to the slot buffer at
        the end). An all-greedy step takes `Eagle3Head.greedy_ids` instead."""
        greedy = fused.argmax(logits, self.draft.d2t)
        q = self.draft.draft_probs_to_target(probs_from_logits(logits, st))  # [B, V]
        drawn = sample_from_probs(q, st.seed, pos, self.draft_salt)
        return drafts[:, step].copy_(torch.where(st.greedy, greedy, drawn)), q

