"""Plain PyTorch attention: the oracle every fast path is held equal to.

One extend path serves prompt chunks, decode rows and spec-verify rows: each query token attends to
keys 0..its own position (token-causal). On MiniMax Sparse Attention layers the lightning indexer first
picks, per query token and per index head (one per KV group), the key blocks it may see:

    score[t, h, j] = <iq[t, h], ik[j]>          (fp32, j <= pos[t], else -inf)
    block[t, h, n] = max_{j in block n} score    (max-pool over index_block_size keys)
    block[t, h, pos[t] // bs - l] = +inf         (the query's own `index_local_blocks` blocks always win)
    sel[t, h]      = top-k blocks, -1 for slots that only found -inf

and attention then sees only the tokens of the selected blocks (still token-causal). With
topk * block_size >= context this equals dense attention.

Ties are broken toward the lower block id: the top-k is a stable descending sort by (score desc, block id
asc). `torch.topk` leaves ties unspecified (CPU and CUDA pick differently), and a selection that depends on
the device cannot be an oracle. Attention depends only on the selected set, so `sel` lists it in ascending
block id, -1 padding last: a canonical form the fast paths reproduce exactly, and one that a token whose
every visible block fits in the top-k (blocks 0..own, whatever the scores) can write without scoring.

Memory: `paged_attention` works through the padded queries in chunks, so its [B, H, queries, L]
temporaries (scores, masks, attention weights) stay near `QUERY_CHUNK_ELEMS` elements whatever the
context (a chunked prefill at 8k+ context fits on a CPU); the math per query is unchanged (queries are
independent). What remains O(L) per row is the gathered K/V/index-K, [B, L, ...].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from m3eagle.kernels.attention.metadata import AttnMetadata, row_key_slots

# Elements of one [B, H, queries, L] temporary that `paged_attention` allows itself per query chunk
# (256 MB in fp32). Steps under the bound run in one chunk, exactly as an unchunked oracle would.
QUERY_CHUNK_ELEMS = 1 << 26


def pad_queries(x: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
    """[T, ...] flat tokens -> [B, Qmax, ...] padded rows."""
    return x[meta.q_index]


def padded_positions(meta: AttnMetadata) -> torch.Tensor:
    # Padding queries get position 0: they see key 0 only, stay finite, and are never read back.
    return torch.where(meta.q_valid, meta.positions[meta.q_index], 0)  # [B, Qmax]


def select_blocks(iq: torch.Tensor, ik: torch.Tensor, pos: torch.Tensor, block_size: int, topk: int,
                  local_blocks: int) -> torch.Tensor:
    """Lightning-indexer block selection on padded rows.

    iq [B, Qmax, Hi, Di], ik [B, L, Di], pos [B, Qmax] -> sel [B, Hi, Qmax, k] int64, -1 padded,
    where k = min(topk, ceil(L / block_size)): the k best blocks by (score desc, block id asc), listed
    in ascending block id, -1 (a slot that only found -inf) last."""
    b, lq, hi, _ = iq.shape
    length = ik.shape[1]
    nb = -(-length // block_size)
    scores = torch.einsum("bqhd,bkd->bhqk", iq.float(), ik.float())  # [B, Hi, Qmax, L]
    keys = torch.arange(length, device=iq.device)
    future = keys[None, None, None, :] > pos[:, None, :, None]
    scores = scores.masked_fill(future, float("-inf"))
    pad = nb * block_size - length
    if pad:
        scores = F.pad(scores, (0, pad), value=float("-inf"))
    block_scores = scores.view(b, hi, lq, nb, block_size).amax(-1)  # [B, Hi, Qmax, nb]
    if local_blocks > 0:
        own = torch.div(pos, block_size, rounding_mode="floor")  # [B, Qmax]
        local = (own[..., None] - torch.arange(local_blocks, device=iq.device)).clamp(min=0)
        local = local[:, None].expand(-1, hi, -1, -1)  # [B, Hi, Qmax, local]
        block_scores = block_scores.scatter(-1, local, float("inf"))
    k = min(topk, nb)
    # A stable sort keeps equal scores in block order: ties go to the lower block id.
    top_scores, top_idx = block_scores.sort(dim=-1, descending=True, stable=True)
    top_scores, top_idx = top_scores[..., :k], top_idx[..., :k]
    chosen = top_idx.masked_fill(top_scores == float("-inf"), nb)  # nb: "none", sorts last
    chosen = chosen.sort(dim=-1).values
    return chosen.masked_fill(chosen == nb, -1)


def block_keep_mask(sel: torch.Tensor, length: int, block_size: int, num_heads: int) -> torch.Tensor:
    """sel [B, Hi, Qmax, k] -> keep [B, Hq, Qmax, L] bool (each index head covers Hq / Hi heads)."""
    b, hi, lq, _ = sel.shape
    nb = -(-length // block_size)
    safe = sel.masked_fill(sel < 0, nb)  # -1 lands in a throwaway column
    keep = torch.zeros(b, hi, lq, nb + 1, dtype=torch.bool, device=sel.device)
    keep.scatter_(-1, safe, True)
    keep = keep[..., :nb].repeat_interleave(block_size, dim=-1)[..., :length]
    return keep.repeat_interleave(num_heads // hi, dim=1)


def attend(qp: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, scale: float,
           keep: torch.Tensor | None = None) -> torch.Tensor:
    """Token-causal attention on padded rows.

    qp [B, Qmax, Hq, D], k/v [B, L, Hkv, D], pos [B, Qmax], keep [B, Hq, Qmax, L] or None
    -> [B, Qmax, Hq, D]."""
    length = k.shape[1]
    keys = torch.arange(length, device=qp.device)
    mask = (keys[None, None, :] <= pos[:, :, None])[:, None]  # [B, 1, Qmax, L]
    if keep is not None:
        mask = mask & keep
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale,
        enable_gqa=qp.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: AttnMetadata,
                    scale: float, iq: torch.Tensor | None = None, ik_pool: torch.Tensor | None = None,
                    block_size: int = 0, topk: int = 0, local_blocks: int = 0) -> torch.Tensor:
    """q [T, Hq, D] over paged K/V [S, Hkv, D] -> [T, Hq, D]. With iq [T, Hi, Di] and ik_pool [S, Di]
    the layer is sparse. The current step's K/V must already be written at meta.slot_mapping. Row b's key
    position j is read from the page table, with the metadata's tail override (`row_key_slots`)."""
    slots = row_key_slots(meta, meta.max_kv)  # [B, L]
    k, v = k_pool[slots], v_pool[slots]  # [B, L, Hkv, D]
    ik = ik_pool[slots] if iq is not None else None  # [B, L, Di]
    pos = padded_positions(meta)  # [B, Qmax]
    qp = pad_queries(q, meta)  # [B, Qmax, Hq, D]
    iqp = pad_queries(iq, meta) if iq is not None else None  # [B, Qmax, Hi, Di]
    chunk = max(1, QUERY_CHUNK_ELEMS // max(1, meta.num_rows * q.shape[1] * meta.max_kv))
    outs = []
    for c0 in range(0, meta.max_q, chunk):
        c = slice(c0, c0 + chunk)
        keep = None
        if iqp is not None:
            sel = select_blocks(iqp[:, c], ik, pos[:, c], block_size, topk, local_blocks)  # [B, Hi, C, k]
            keep = block_keep_mask(sel, meta.max_kv, block_size, q.shape[1])  # [B, Hq, C, L]
        outs.append(attend(qp[:, c], k, v, pos[:, c], scale, keep))  # [B, C, Hq, D]
    out = torch.cat(outs, 1) if len(outs) > 1 else outs[0]  # [B, Qmax, Hq, D]
    return out[meta.tok_row, meta.tok_col]
