"""The plain PyTorch elementwise ops of the models: RMSNorm, RoPE, SwiGLU-OAI, SiLU-mul and the router.

This is the math itself, not a copy of it: `models.layers` builds its modules from these functions
(GemmaRMSNorm, LlamaRMSNorm, SwigluOaiMLP, SiluMLP, Router), so the training path, the `forward_seq`
oracle, the reference fused backend and transformers' parity all run exactly this code. The Triton kernels
in `triton_fused.py` are held to it (tests/test_fused_ops.py).

Every op computes in the order the models always have and rounds where they round: an op on bf16
tensors rounds its result to bf16 before the next op reads it. The kernels replay those roundings, which
is what lets them match bit for bit where no reduction is involved.

Nothing here imports the models (models.layers imports this module).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# ---- RMSNorm ------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool = True) -> torch.Tensor:
    """x [..., N] -> [..., N]. The mean square and the normalisation are fp32.

    gemma=True (the target): scale by (1 + w) in fp32, then cast to x.dtype (the checkpoint stores w,
    zero-initialised). gemma=False (Llama-style Eagle3 heads): cast to x.dtype first, then scale by w --
    in the promoted dtype of (w, x), as torch promotes `w * y`."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (xf * (1.0 + w.float())).type_as(x)
    return w * xf.to(x.dtype)


def add_residual(x: torch.Tensor, residual: torch.Tensor | None, x2: torch.Tensor | None = None,
                 x_scale: float = 1.0) -> torch.Tensor:
    """The residual stream after a layer's update: residual + (x * x_scale + x2), each step in x.dtype as the
    unfused model computes `residual + (routed * routed_scaling_factor + shared)`. Terms that are absent
    (residual None, x2 None, x_scale 1) are skipped, not added as zeros, so no extra rounding happens."""
    d = x * x_scale if x_scale != 1.0 else x
    if x2 is not None:
        d = d + x2
    return d if residual is None else residual + d


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float,
                 x2: torch.Tensor | None = None, x_scale: float = 1.0, gemma: bool = True,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(r), r) with r = add_residual(x, residual, x2, x_scale): the residual add of the previous
    sub-layer and the next norm in one op (vLLM's fused_add_rms_norm). r is returned as the new residual."""
    r = add_residual(x, residual, x2, x_scale)
    return rms_norm(r, w, eps, gemma), r


# ---- RoPE ---------------------------------------------------------------------------------------------


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial NeoX RoPE over the first cos.shape[-1] channels. x [T, H, D], cos/sin [T, R]."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = r // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def qk_norm_rope(x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """Per-head Gemma RMSNorm (skipped when w is None), then partial NeoX RoPE: x [T, H, D], w [D],
    cos/sin [T, R] with R <= D -> [T, H, D] in x.dtype."""
    return apply_rope(rms_norm(x, w, eps) if w is not None else x, cos, sin)


def qkv_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, q_w: torch.Tensor | None,
                   k_w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   k_pool: torch.Tensor, v_pool: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """An attention layer's inputs after its projections: q [T, Hq, D] -> qk_norm_rope(q) (returned), k
    [T, Hk, D] -> qk_norm_rope(k) written to k_pool at `slots` [T] ([S, Hk, D], or [S, D] for the
    indexer's one-head pool), v [T, Hk, D] written to v_pool as is (both absent for the indexer)."""
    q = qk_norm_rope(q, q_w, eps, cos, sin)
    k = qk_norm_rope(k, k_w, eps, cos, sin)
    k_pool.index_copy_(0, slots, k.reshape(k.shape[0], *k_pool.shape[1:]).to(k_pool.dtype))
    if v is not None:
        v_pool.index_copy_(0, slots, v.reshape(v.shape[0], *v_pool.shape[1:]).to(v_pool.dtype))
    return q


def qkv_index_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_w: torch.Tensor | None,
                         k_w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                         k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, iq: torch.Tensor,
                         ik: torch.Tensor, iq_w: torch.Tensor, ik_w: torch.Tensor, index_rope_dim: int,
                         ik_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse layer's attention and indexer inputs: `qkv_rope_store` of q/k/v, then of the indexer's
    iq [T, Hi, Di] / ik [T, 1, Di] (same eps, RoPE on the first index_rope_dim columns of cos/sin, ik to
    the [S, Di] index-K pool) -> (q, iq). A fast path may run both in one launch."""
    q = qkv_rope_store(q, k, v, q_w, k_w, eps, cos, sin, k_pool, v_pool, slots)
    r = index_rope_dim
    return q, qkv_rope_store(iq, ik, None, iq_w, ik_w, eps, cos[:, :r], sin[:, :r], ik_pool, None, slots)


# ---- MLP activations ----------------------------------------------------------------------------------


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """(up + 1) * gate * sigmoid(alpha * gate); gate clamped above only, up on both sides.
    gate_up [..., 2I] holds gate then up (not interleaved)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The Llama MLP's activation: silu(gate) * up, gate/up [T, I] -> [T, I]."""
    return F.silu(gate) * up


# ---- router -------------------------------------------------------------------------------------------


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The router GEMM in the router weight's dtype (fp32 in the checkpoint): x [T, H] -> logits [T, E] fp32."""
    return F.linear(x.to(weight.dtype), weight).float()


def route(logits: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sigmoid router after its GEMM: logits [T, E] (fp32) -> (weights [T, k] fp32, experts [T, k] int64).

    Selection ranks sigmoid(logits) + bias; the weights are the plain sigmoid scores of the chosen experts,
    renormalised. Experts come in selection order: highest biased score first, and among equal scores the
    lowest expert id first. NOTE: that tie rule is spelled out (a stable sort) rather than left to
    torch.topk: CUDA's topk takes the lowest ids among ties too, but CPU's takes whichever its partial sort
    leaves (all-equal scores over 4 experts pick {2, 3}), so the reference would depend on the device."""
    scores = torch.sigmoid(logits.float())  # [T, E]
    biased = scores + bias.float()
    idx = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :k]
    w = scores.gather(1, idx)
    return w / w.sum(-1, keepdim=True), idx


def route_tokens(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole router: x [T, H] -> (weights [T, k] fp32, experts [T, k] int64)."""
    return route(router_logits(x, weight), bias, k)


# ---- step inputs (the engine's overlap correction) -----------------------------------------------------


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
        from m3eagle.kernels.attention.metadata import slots_for_positions  # attention imports this package

        rows = torch.arange(at.shape[1], device=at.device).expand_as(at)
        at_slots = slots_for_positions(pages[0], rows, at, pages[1])
    return num_new, s, last_idx, shifted, at, at_slots


def argmax(x: torch.Tensor, offsets: torch.Tensor | None = None, out: torch.Tensor | None = None,
           scatter: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """x [N, V] -> [N] int64: torch.argmax of each row (the first maximum; NaN counts as the largest), plus
    offsets[i] at the chosen i when `offsets` [V] int64 is given (Eagle3's draft -> target id map).
    `out` [N] (any stride) receives the result; `scatter` = (buf [S, C], rows [N], col) also writes
    buf[rows[n], col] (a draft step's token into its request's slot row)."""
    i = x.argmax(-1)
    i = i if offsets is None else i + offsets[i]
    if out is not None:
        i = out.copy_(i)
    if scatter is not None:
        buf, rows, col = scatter
        buf[rows, col] = i
    return i


def greedy_accept(greedy_tok: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Greedy verification after the argmax: greedy_tok [B, K+1] (argmax of each scored position), drafts
    [B, K], num_drafts [B] -> num_new [B] = 1 + the number of leading drafts equal to the argmax before
    them (sampling/verify.py's greedy path)."""
    k = drafts.shape[1]
    in_row = torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]  # [B, K]
    match = (drafts == greedy_tok[:, :k]) & in_row
    return match.long().cumprod(-1).sum(-1) + 1
