"""The plain PyTorch elementwise ops of the models: RMSNorm, RoPE (tables and rotation), SwiGLU-OAI,
SiLU-mul, the router and argmax.

This is the math itself, not a copy of it: `models.layers` builds its modules from these functions
(GemmaRMSNorm, LlamaRMSNorm, SwigluOaiMLP, SiluMLP, Router), so the training path, the `forward_seq`
oracle, the reference fused backend and transformers' parity all run exactly this code. The Triton kernels
(norm.py, rope.py, activation.py, argmax.py, moe/router.py) are held to it (tests/kernels/).

Every op computes in the order the models always have and rounds where they round: an op on bf16
tensors rounds its result to bf16 before the next op reads it. The kernels replay those roundings, which
is what lets them match bit for bit where no reduction is involved.

Nothing here imports the models (models.layers imports this module).
"""

from __future__ import annotations

import math
from typing import Any

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


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any] | None = None,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] (fp32) and the cos/sin scale of one RoPE type, with
    transformers' formulas (modeling_rope_utils) so logits match it. `scaling` is `M3Config.rope_scaling`:
    None for plain RoPE, else rope_type linear / yarn / llama3 with every parameter resolved by the config."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "default":
        return inv_freq, 1.0
    factor = scaling["factor"]
    if kind == "linear":
        return inv_freq / factor, 1.0
    orig = scaling["original_max_position_embeddings"]
    if kind == "llama3":
        # wavelengths shorter than orig / high_freq_factor keep their frequency, longer than
        # orig / low_freq_factor are divided by factor, and the band between is interpolated.
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < orig / high) * ~(wavelen > orig / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        # Dimensions that rotate more than beta_fast times over the original context extrapolate (keep
        # their frequency), fewer than beta_slow interpolate (divided by factor), a linear ramp between.
        def correction_dim(rotations: float) -> float:
            return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
        if scaling["truncate"]:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
        if lo == hi:
            hi += 0.001  # as transformers: avoid a zero-width ramp
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device=device) - lo) / (hi - lo)).clamp(0, 1)
        extrapolate = 1 - ramp
        pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
        return inv_freq, scaling["attention_factor"]
    raise ValueError(f"rope_type={kind!r} is not implemented; choose default, linear, yarn or llama3")


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype,
                 scaling: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX RoPE tables: positions [...] -> cos, sin [..., rotary_dim], computed in fp32 (and scaled by
    yarn's attention factor, as transformers scales them)."""
    inv_freq, mscale = rope_inv_freq(rotary_dim, theta, scaling, positions.device)
    freqs = positions.float()[..., None] * inv_freq  # [..., rotary_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    if mscale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * mscale).to(dtype), (emb.sin() * mscale).to(dtype)


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
