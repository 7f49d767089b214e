"""The roofline: bytes a decode step must read, and the HBM bandwidth to read them with.

A decode step is memory-bound: its floor is (bytes read) / (copy bandwidth). The byte count is what an
ideal engine reads for one step at batch B and per-row context C, in the serving dtype:

    every non-expert weight once          attention q/k/v/o, norms, indexer, dense MLPs, shared experts,
                                          the fp32 router, the full lm_head; embedding rows only (T x H)
    the routed experts actually chosen    distinct experts over the step's T tokens, per MoE layer --
                                          counted from the router's choices in a measured step, or
                                          E * (1 - (1 - k/E)^T) expected for uniform routing
    full-attention KV                     B x C x Hkv x D x 2 (K and V)
    sparse-attention (MSA) KV             B x min(C, topk_blocks x block) x Hkv x D x 2 (selected blocks)
                                          + B x C x Di (the indexer scores every index key)

Writes (new K/V, activations) are left out: they are O(T x H) per layer. MBU = bytes / step time /
measured copy bandwidth; roofline tok/s = tokens per step / (bytes / bandwidth).

NOTE: today's MoE (`models.layers.Experts`) runs every expert on every token, so m3eagle really reads all
E experts per layer; the roofline counts the chosen ones, as an engine with a grouped MoE kernel would.
`weight_elements(cfg, experts=E)` gives the all-experts figure for comparison.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from m3eagle.config import M3Config
from m3eagle.models.eagle3 import Eagle3Config

GiB = 1 << 30


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts hit when each of `tokens` tokens picks k of E uniformly."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def moe_layers(cfg: M3Config) -> list[int]:
    return [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]


def weight_elements(cfg: M3Config, experts: float | Sequence[float] | None = None) -> dict[str, float]:
    """Weight elements by kind. experts: routed experts per MoE layer (one number or one per layer);
    None counts all E. 'router' is fp32 in every m3eagle model; the rest is in the serving dtype."""
    h, d, e = cfg.hidden_size, cfg.head_dim, cfg.num_local_experts
    moe = moe_layers(cfg)
    per_layer = _per_moe_layer(experts if experts is not None else e, len(moe))
    out = {"embedding": cfg.vocab_size * h, "attention": 0.0, "indexer": 0.0, "norms": float(h), "dense_mlp": 0.0,
           "router": 0.0, "shared_experts": 0.0, "routed_experts": 0.0,
           "lm_head": 0.0 if cfg.tie_word_embeddings else cfg.vocab_size * h}
    for i in range(cfg.num_hidden_layers):
        out["attention"] += (h * cfg.num_attention_heads * d * 2  # q_proj, o_proj
                             + h * cfg.num_key_value_heads * d * 2)  # k_proj, v_proj
        out["norms"] += 2 * h + 2 * d  # input / post-attention layernorms, q_norm, k_norm
        if cfg.is_sparse(i):
            di = cfg.index_head_dim
            out["indexer"] += h * cfg.index_n_heads * di + h * di
            out["norms"] += 2 * di
        if cfg.is_moe(i):
            out["router"] += e * h + e  # weight + score-correction bias
            out["shared_experts"] += 3 * h * cfg.shared_intermediate_size
            out["routed_experts"] += per_layer[moe.index(i)] * 3 * h * cfg.intermediate_size
        else:
            out["dense_mlp"] += 3 * h * cfg.dense_intermediate_size
    return out


def param_counts(cfg: M3Config) -> dict[str, int]:
    """Total and active (k experts per token) parameters of the target."""
    total = sum(weight_elements(cfg).values())
    active = sum(weight_elements(cfg, cfg.num_experts_per_tok).values())
    return {"params": int(total), "active_params": int(active)}


# The weights an MXFP8 model holds in FP8 (`models/quant.py`), and their bytes per element: one e4m3 byte plus
# one ue8m0 scale byte per 32.
QUANTIZED_KINDS = ("attention", "indexer", "dense_mlp", "shared_experts", "routed_experts")
MXFP8_BYTES = 1 + 1 / 32


def decode_step_bytes(cfg: M3Config, batch: int, context: float, dtype_bytes: int, tokens: int | None = None,
                      experts: float | Sequence[float] | None = None,
                      quant_bytes: float | None = None) -> dict[str, float]:
    """Bytes one target step reads (see the module docstring). batch rows, each attending over `context`
    tokens; `tokens` query tokens in all (batch for plain decode, batch x (K+1) for a verify step);
    experts: distinct routed experts per MoE layer (None: the uniform-routing expectation for `tokens`);
    quant_bytes: bytes per element of the QUANTIZED_KINDS (MXFP8_BYTES for an MXFP8 model; None: dtype_bytes)."""
    t = batch if tokens is None else tokens
    if experts is None:
        experts = expected_distinct_experts(cfg.num_local_experts, cfg.num_experts_per_tok, t)
    el = weight_elements(cfg, experts)
    qb = dtype_bytes if quant_bytes is None else quant_bytes
    out = {k: v * (4 if k == "router" else qb if k in QUANTIZED_KINDS else dtype_bytes) for k, v in el.items()}
    out["embedding"] = t * cfg.hidden_size * dtype_bytes  # rows gathered, not the table
    out["lm_head"] = cfg.vocab_size * cfg.hidden_size * dtype_bytes  # read in full, tied or not
    kv_row = cfg.num_key_value_heads * cfg.head_dim * 2 * dtype_bytes  # K and V of one token, one layer
    window = cfg.index_block_size * cfg.index_topk_blocks
    out["kv_cache"] = 0.0
    out["index_k_cache"] = 0.0
    for i in range(cfg.num_hidden_layers):
        if cfg.is_sparse(i):
            out["kv_cache"] += batch * min(context, window) * kv_row
            out["index_k_cache"] += batch * context * cfg.index_head_dim * dtype_bytes
        else:
            out["kv_cache"] += batch * context * kv_row
    out["total"] = sum(out.values())
    return out


def draft_step_bytes(cfg: Eagle3Config, batch: int, context: float, k: int, dtype_bytes: int) -> dict[str, float]:
    """Bytes the Eagle3 head reads in one spec step: fc once (step 0), then K passes over the layer, the
    draft lm_head and the draft KV (one draft step per drafted token). The embedding is the target's."""
    h, d = cfg.hidden_size, cfg.head_dim
    layer = (2 * h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d  # q/k/v read the 2H concat
             + cfg.num_attention_heads * d * h + 3 * h * cfg.intermediate_size + 4 * h)  # o_proj, MLP, norms
    out = {"fc": (cfg.aux_hidden_size * h + (cfg.aux_hidden_size if cfg.fc_norm else 0)) * dtype_bytes,
           "layer": k * layer * dtype_bytes,
           "lm_head": k * cfg.draft_vocab_size * h * dtype_bytes,
           "kv_cache": k * batch * context * cfg.num_key_value_heads * d * 2 * dtype_bytes}
    out["total"] = sum(out.values())
    return out


def _per_moe_layer(experts: float | Sequence[float], n: int) -> list[float]:
    if isinstance(experts, (int, float)):
        return [float(experts)] * n
    experts = [float(x) for x in experts]
    if len(experts) != n:
        raise ValueError(f"got expert counts for {len(experts)} MoE layers, the config has {n}")
    return experts


# ------------------------------------------------------------------------------------------------
# Bandwidth
# ------------------------------------------------------------------------------------------------


def measure_copy_bandwidth(device: torch.device, nbytes: int = 4 * GiB, iters: int = 10) -> dict[str, float]:
    """Device-to-device copy bandwidth in bytes/s, counting the read and the write (2 x nbytes per copy),
    as STREAM's copy does. On CUDA the buffer should be several GB so caches do not flatter it; on the
    CPU it is capped at 64 MiB (a host-memory figure, for completeness)."""
    if device.type != "cuda":
        nbytes = min(nbytes, 64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch, allocator
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        secs = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        secs = time.perf_counter() - t0
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"buffer_bytes": nbytes, "iters": iters, "bytes_per_s": 2 * nbytes * iters / secs}
