"""MiniMax-M3 text backbone: dense layers then MoE, full attention then MiniMax Sparse Attention.

The module holds weights only. `forward` is a pure function of (tokens, positions, metadata, caches):
the engine owns the KV pools and passes them in, and its ops (`meta.ops`: attention, MoE and the fused
elementwise ops) run the paged path. `forward_seq` (training, the oracle) runs the plain reference math.
Parameter names follow transformers' `MiniMaxM3VLForCausalLM` with the `model.` prefix dropped, so its
`save_pretrained` output maps 1:1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from m3eagle.config import M3Config
from m3eagle.distributed.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from m3eagle.distributed.parallel_state import SINGLE, TPGroup
from m3eagle.kernels.attention import reference
from m3eagle.kernels.attention.metadata import AttnMetadata
from m3eagle.kernels.fused.reference import apply_rope, rope_cos_sin
from m3eagle.kernels.ops import REFERENCE
from m3eagle.models.layers import GemmaRMSNorm, PackedLinears, SparseMoE, SwigluOaiMLP

Delta = tuple[torch.Tensor, torch.Tensor | None, float]
"""A sub-layer's output not yet added to the residual stream: (x, x2, scale) stands for x * scale + x2 (the
MoE's routed experts, shared expert and routed_scaling_factor; (x, None, 1.0) for a plain output). The paged
path hands it to the next norm, whose fused kernel adds it in with the unfused model's roundings, so the
residual adds cost no launches of their own."""


@dataclass
class LayerCache:
    """One attention layer's pools, all indexed by the same cache slots."""

    k: torch.Tensor  # [S, Hkv, D]
    v: torch.Tensor  # [S, Hkv, D]
    idx_k: torch.Tensor | None = None  # [S, Di] on sparse layers


class Indexer(nn.Module):
    """Lightning indexer. Tensor parallel: its query heads follow the KV-head grouping (split, or the one
    head this rank's query heads read); the single index-K head is replicated, as is its pool."""

    def __init__(self, cfg: M3Config, tp: TPGroup = SINGLE):
        super().__init__()
        self.cfg = cfg
        h0, self.n_heads = tp.head_shard(cfg.index_n_heads, "index_n_heads")
        di = cfg.index_head_dim
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, cfg.index_n_heads * di, ((h0 * di, self.n_heads * di),))
        self.k_proj = ColumnParallelLinear(cfg.hidden_size, cfg.index_head_dim)  # replicated (no shards)
        self.q_norm = GemmaRMSNorm(cfg.index_head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.index_head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> iq [T, Hi, Di], ik [T, Di]."""
        t = x.shape[0]
        r = self.cfg.index_rope_dim
        iq = self.q_norm(self.q_proj(x).view(t, self.n_heads, self.cfg.index_head_dim))
        ik = self.k_norm(self.k_proj(x).view(t, 1, self.cfg.index_head_dim))
        return apply_rope(iq, cos[:, :r], sin[:, :r]), apply_rope(ik, cos[:, :r], sin[:, :r])[:, 0]

    def paged_inputs(self, q_raw: torch.Tensor, k_raw: torch.Tensor, pool: torch.Tensor) -> tuple:
        """The indexer's part of `FusedOps.qkv_index_rope_store` on the projections q_proj(x) [T, Hi * Di],
        k_proj(x) [T, Di] (the attention layer runs them in its packed GEMM): (iq [T, Hi, Di], ik [T, 1, Di],
        q/k norm weights, index_rope_dim, the index-K pool [S, Di]). Same math as `forward`; ik goes to the
        pool at the step's slots."""
        t, c = q_raw.shape[0], self.cfg
        return (q_raw.view(t, self.n_heads, c.index_head_dim), k_raw.view(t, 1, c.index_head_dim),
                self.q_norm.weight, self.k_norm.weight, c.index_rope_dim, pool)


class Attention(nn.Module):
    """Tensor parallel: this rank's query heads (q_proj rows), the KV heads they read (split, or replicated
    when num_key_value_heads < N), and o_proj's matching columns (row parallel, then all-reduce). `n_q` /
    `n_kv` are the local head counts; with one rank they are the config's."""

    def __init__(self, cfg: M3Config, layer: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        q0, self.n_q = tp.split(cfg.num_attention_heads, "num_attention_heads")
        k0, self.n_kv = tp.head_shard(cfg.num_key_value_heads, "num_key_value_heads")
        self.q_proj = ColumnParallelLinear(h, cfg.num_attention_heads * d, ((q0 * d, self.n_q * d),))
        self.k_proj = ColumnParallelLinear(h, cfg.num_key_value_heads * d, ((k0 * d, self.n_kv * d),))
        self.v_proj = ColumnParallelLinear(h, cfg.num_key_value_heads * d, ((k0 * d, self.n_kv * d),))
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, h, tp, what="num_attention_heads * head_dim")
        self.q_norm = GemmaRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, cfg.rms_norm_eps)
        self.indexer = Indexer(cfg, tp) if cfg.is_sparse(layer) else None
        self.scale = d ** -0.5
        # q, k, v and the indexer's q, k all read x: one GEMM on the paged path once packed (the engine
        # packs after loading; see PackedLinears).
        idx = [self.indexer.q_proj, self.indexer.k_proj] if self.indexer is not None else []
        self.proj = PackedLinears([self.q_proj, self.k_proj, self.v_proj, *idx])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                cache: LayerCache) -> torch.Tensor:
        t, c = x.shape[0], self.cfg
        ops = meta.ops or REFERENCE
        # q/k norm + RoPE, and this step's K/V into the pools at meta.slot_mapping: one fused op (with the
        # indexer's q/k and index-K on sparse layers).
        pq, pk, pv, *pidx = self.proj(x, ops.fused)  # [T, Hq * D], [T, Hkv * D] x 2, (+ [T, Hi * Di], [T, Di])
        qkv = (pq.view(t, self.n_q, c.head_dim), pk.view(t, self.n_kv, c.head_dim), pv.view(t, self.n_kv, c.head_dim),
               self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin, cache.k, cache.v, meta.slot_mapping)
        attn = ops.attention
        if self.indexer is None:
            q = ops.fused.qkv_rope_store(*qkv)
            o = attn.attention(q, cache.k, cache.v, meta, self.scale)
        else:
            # the index norms share the layer's eps (both are the config's rms_norm_eps)
            q, iq = ops.fused.qkv_index_rope_store(*qkv, *self.indexer.paged_inputs(*pidx, cache.idx_k))
            o = attn.sparse_attention(q, cache.k, cache.v, meta, self.scale, iq, cache.idx_k,
                                      c.index_block_size, c.index_topk_blocks, c.index_local_blocks)
        return self.o_proj(o.reshape(t, -1), ops.fused)

    def forward_seq(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Contiguous (training / oracle) path: x [B, S, H], cos/sin [S, R] -> [B, S, H]. Same math as
        the paged path with no cache: row b's keys are its own tokens 0..S-1."""
        b, s, c = x.shape[0], x.shape[1], self.cfg
        flat = x.reshape(b * s, -1)
        cos_f, sin_f = cos.repeat(b, 1), sin.repeat(b, 1)
        q = apply_rope(self.q_norm(self.q_proj(flat).view(b * s, self.n_q, c.head_dim)), cos_f, sin_f)
        k = apply_rope(self.k_norm(self.k_proj(flat).view(b * s, self.n_kv, c.head_dim)), cos_f, sin_f)
        v = self.v_proj(flat).view(b, s, self.n_kv, c.head_dim)
        pos = torch.arange(s, device=x.device).expand(b, s)
        keep = None
        if self.indexer is not None:
            iq, ik = self.indexer(flat, cos_f, sin_f)
            sel = reference.select_blocks(iq.view(b, s, self.indexer.n_heads, -1), ik.view(b, s, -1), pos,
                                          c.index_block_size, c.index_topk_blocks, c.index_local_blocks)
            keep = reference.block_keep_mask(sel, s, c.index_block_size, self.n_q)
        o = reference.attend(q.view(b, s, self.n_q, c.head_dim),
                             k.view(b, s, self.n_kv, c.head_dim), v, pos, self.scale, keep)
        return self.o_proj(o.reshape(b, s, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: M3Config, layer: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.self_attn = Attention(cfg, layer, tp)
        if cfg.is_moe(layer):
            self.mlp: nn.Module = SparseMoE(cfg.hidden_size, cfg.intermediate_size, cfg.shared_intermediate_size,
                                            cfg.num_local_experts, cfg.num_experts_per_tok,
                                            cfg.routed_scaling_factor, cfg.swiglu_alpha, cfg.swiglu_limit, tp)
        else:
            self.mlp = SwigluOaiMLP(cfg.hidden_size, cfg.dense_intermediate_size, cfg.swiglu_alpha,
                                    cfg.swiglu_limit, tp, what="dense_intermediate_size")
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, residual: torch.Tensor | None, delta: Delta, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttnMetadata, cache: LayerCache, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, Delta]:
        """Paged path. The stream entering the layer is residual + delta (residual None: delta alone); so is
        the one it returns -- the MLP's output is left for the next norm to add (vLLM's fused_add_rms_norm).
        `rows` [T]: the stream is rows `rows` of delta (the first layer's embedding lookup, in its norm)."""
        ops = meta.ops or REFERENCE
        f, ln1, ln2 = ops.fused, self.input_layernorm, self.post_attention_layernorm
        h, residual = f.add_rms_norm(delta[0], residual, ln1.weight, ln1.eps, delta[1], delta[2], rows=rows)
        a = self.self_attn(h, cos, sin, meta, cache)
        h, residual = f.add_rms_norm(a, residual, ln2.weight, ln2.eps)
        if isinstance(self.mlp, SparseMoE):
            routed, shared, scale = self.mlp.forward_parts(h, ops)
            if self.tp.size > 1:  # partial sums over the ranks: one all-reduce for the two
                both = routed if shared is None else torch.add(shared, routed, alpha=scale)
                return residual, (self.tp.all_reduce(both), None, 1.0)
            return residual, (routed, shared, scale)
        return residual, (self.mlp(h, f), None, 1.0)

    def forward_seq(self, x, cos, sin):
        x = x + self.self_attn.forward_seq(self.input_layernorm(x), cos, sin)
        b, s, h = x.shape
        hn = self.post_attention_layernorm(x).reshape(b * s, h)
        # the contiguous (training / oracle) path always runs the dense, differentiable reference MoE
        out = self.mlp(hn, REFERENCE.moe) if isinstance(self.mlp, SparseMoE) else self.mlp(hn)
        return x + out.view(b, s, h)


class MiniMaxM3(nn.Module):
    """forward(input_ids [T], positions [T], meta, caches) -> hidden [T, H] (after the final norm).

    aux_layer_ids: capture the residual stream after L layers (L in 1..N) into `aux_out`
    [T, len(ids) * H], a preallocated buffer, in the order given -- the Eagle3 convention.

    `tp`: the tensor-parallel group this rank's shard belongs to (m3eagle.distributed); the hidden states
    and the logits are whole on every rank, the weights and KV pools only this rank's part."""

    def __init__(self, cfg: M3Config, tp: TPGroup = SINGLE):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers)])
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata,
                caches: list[LayerCache], aux_layer_ids: tuple[int, ...] = (),
                aux_out: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> the final norm's hidden states [T, H], or with `rows` [R] only those
        tokens' ([R, H]: the rows the step samples, gathered inside the final norm's launch). K/V of every
        token are written to `caches`; `aux_out` [>= T, n_aux * H] receives the aux layers' streams."""
        f = (meta.ops or REFERENCE).fused
        emb = self.embed_tokens
        if emb.tp.size == 1 and emb.max_norm is None and not (aux_out is not None and 0 in aux_layer_ids):
            x, first = emb.weight, input_ids  # the lookup rides in the first layer's input norm (its rows)
        else:  # a vocab-parallel table needs its all-reduce; aux id 0 reads the embeddings themselves
            x, first = emb(input_ids), None  # [T, H]
        cos, sin = f.rope_cos_sin(positions, self.cfg.rotary_dim, self.cfg.rope_theta, x.dtype,
                                  self.cfg.rope_scaling)  # [T, R] each, shared by every layer
        h, t = self.cfg.hidden_size, input_ids.shape[0]
        residual, delta = None, (x, None, 1.0)  # the stream is residual + delta (see Delta)
        for i in range(len(self.layers) + 1):
            if i:
                residual, delta = self.layers[i - 1](residual, delta, cos, sin, meta, caches[i - 1],
                                                     first if i == 1 else None)
            cols = [j for j, lid in enumerate(aux_layer_ids) if lid == i] if aux_out is not None else []
            if cols:  # ids may repeat (e.g. N=4 -> (2, 2, 1)): sum the stream once, into the first column
                dst = [aux_out[:t, j * h:(j + 1) * h] for j in cols]
                x = f.add_residual(delta[0], residual, delta[1], delta[2],
                                   out=dst[0] if dst[0].dtype == x.dtype else None)
                for d in dst:
                    if d is not x:
                        d.copy_(x)
                residual, delta = None, (x, None, 1.0)
        return f.add_rms_norm(delta[0], residual, self.norm.weight, self.norm.eps, delta[1], delta[2], rows=rows)[0]

    def forward_seq(self, input_ids: torch.Tensor, aux_layer_ids: tuple[int, ...] = (),
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Training / oracle path without a cache: input_ids [B, S] -> (hidden [B, S, H] after the
        final norm, aux [B, S, len(ids) * H] or None). Differentiable."""
        x = self.embed_tokens(input_ids)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = rope_cos_sin(pos, self.cfg.rotary_dim, self.cfg.rope_theta, x.dtype, self.cfg.rope_scaling)
        aux = [x] if 0 in aux_layer_ids else []
        for i, layer in enumerate(self.layers):
            x = layer.forward_seq(x, cos, sin)
            if (i + 1) in aux_layer_ids:
                aux.append(x)
        order = sorted(set(aux_layer_ids))
        aux_t = torch.cat([aux[order.index(i)] for i in aux_layer_ids], -1) if aux_layer_ids else None
        return self.norm(x), aux_t

    def compute_logits(self, hidden: torch.Tensor, fused: Any = None, fp32: bool = True) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in fp32 (fp32=False: the weights' dtype, for an argmax that needs no
        copy). `fused`: the engine's fused ops (their decode GEMV)."""
        logits = self.lm_head(hidden, fused)
        return logits.float() if fp32 else logits

    def greedy_ids(self, hidden: torch.Tensor, fused: Any) -> torch.Tensor:
        """hidden [N, H] -> [N] argmax of compute_logits(hidden, fused, fp32=False): one launch where the fused
        ops pick the argmax in the lm_head GEMV (`FusedOps.linear_argmax`); a vocab-parallel head gathers
        its logits first."""
        if self.lm_head.tp.size > 1:
            return fused.argmax(self.compute_logits(hidden, fused, fp32=False))
        return fused.linear_argmax(hidden, self.lm_head.weight)

    def new_caches(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> list[LayerCache]:
        c = self.cfg
        out = []
        for i, layer in enumerate(self.layers):
            shape = (num_slots, layer.self_attn.n_kv, c.head_dim)  # this rank's KV heads only
            idx = (torch.zeros(num_slots, c.index_head_dim, dtype=dtype, device=device)
                   if c.is_sparse(i) else None)
            out.append(LayerCache(torch.zeros(shape, dtype=dtype, device=device),
                                  torch.zeros(shape, dtype=dtype, device=device), idx))
        return out
