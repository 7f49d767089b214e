"""MLP activations in one launch: MiniMax-M3's clamped SwiGLU (`swiglu_oai`) and SiLU-and-multiply. The `_f32`
helpers are also the decode GEMV's epilogues (gemv.py), so both round alike.

    _swiglu_kernel      swiglu_oai (clamps, sigmoid, muls)              7 -> 1 (-> 0 in the GEMV's epilogue)
    _silu_mul_kernel    silu(gate) * up                                 2 -> 1
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from m3eagle.kernels import pdl
from m3eagle.kernels.pdl import pdl_wait
from m3eagle.kernels.triton_utils import as_rows, exp_precise, launch_opts, precise, warps_for


@triton.jit
def _swiglu_kernel(gu_ptr, out_ptr, inter, stride_g, stride_o, alpha, limit,
                   PRECISE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[t, i] = (up + 1) * gate * sigmoid(alpha * gate), gate = gu[t, i], up = gu[t, I + i]; every
    intermediate rounded where reference.swiglu_oai's bf16 ops round."""
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < inter
    dt = gu_ptr.dtype.element_ty
    g = tl.load(gu_ptr + t * stride_g + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_g + inter + offs, mask=m, other=0.0).to(tl.float32)
    out = swiglu_oai_f32(g, u, alpha, limit, dt, PRECISE)
    tl.store(out_ptr + t * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def swiglu_oai_f32(g, u, alpha, limit, dt: tl.constexpr, PRECISE: tl.constexpr):
    """(up + 1) * gate * sigmoid(alpha * gate) of clamped values of dtype dt held in fp32, rounded where
    reference.swiglu_oai's ops on dt round (fp32 result; its store rounds it). Shared by `_swiglu_kernel`
    and the decode GEMV's activation epilogue (fused/gemv.py), both compiled without FMA contraction."""
    # clamp keeps NaN, as torch.clamp does (the enum is spelled inline: triton 3.6 cannot bind it to a name)
    g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL).to(dt).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                   propagate_nan=tl.PropagateNan.ALL).to(dt).to(tl.float32)
    ga = (g * alpha).to(dt).to(tl.float32)
    sig = tl.math.div_rn(1.0, 1.0 + exp_precise(-ga, PRECISE)).to(dt).to(tl.float32)  # torch: 1 / (1 + exp(-x))
    return (u + 1.0).to(dt).to(tl.float32) * (g * sig).to(dt).to(tl.float32)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, inter, stride_g, stride_u, stride_o,
                     PRECISE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # programmatic dependent launch (m3eagle/kernels/pdl.py): before any memory access
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < inter
    dt = g_ptr.dtype.element_ty
    g = tl.load(g_ptr + t * stride_g + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t * stride_u + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, silu_mul_f32(g, u, dt, PRECISE).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def silu_mul_f32(g, u, dt: tl.constexpr, PRECISE: tl.constexpr):
    """silu(g) * u of values of dtype dt held in fp32, rounded where reference.silu_mul's ops on dt round (the
    product is returned in fp32; its store rounds it). Shared by `_silu_mul_kernel` and the decode GEMV's
    activation epilogue (fused/gemv.py), which compile it without FMA contraction: the same bits."""
    act = tl.math.div_rn(g, 1.0 + exp_precise(-g, PRECISE)).to(dt).to(tl.float32)  # torch's silu: x / (1 + exp(-x))
    return act * u


ACTS = {"silu": 1, "swiglu_oai": 2}  # the fused GEMMs' ACT constexpr by activation name (0: none)


@triton.jit
def act_of_sums(g, u, alpha, limit, dt: tl.constexpr, ACT: tl.constexpr, PRECISE: tl.constexpr):
    """A GEMM epilogue's activation of its fp32 gate / up sums (same shapes): each rounded to dt as the GEMM's own
    store rounds it, then ACT (1 silu, 2 swiglu-oai) as its own launch computes it (fp32 result; the store rounds).
    Shared by the tile store below and the decode GEMV's row store (fused/gemv.py)."""
    g = g.to(dt).to(tl.float32)
    u = u.to(dt).to(tl.float32)
    if ACT == 1:
        out = silu_mul_f32(g, u, dt, PRECISE)
    else:
        out = swiglu_oai_f32(g, u, alpha, limit, dt, PRECISE)
    return out


@triton.jit
def store_act_tile(Y, vals, offs_m, m_ok, pid_n, n_act, stride_ym, alpha, limit, ACT: tl.constexpr,
                   BLOCK_M: tl.constexpr, HALF: tl.constexpr, PRECISE: tl.constexpr):
    """A GEMM epilogue's activation store. vals [BM, 2 * HALF] fp32: interleaved (gate, up) sums of activation
    columns pid_n * HALF + i. Each is rounded to Y's dtype as the plain GEMM stores it, then the activation
    (ACT 1 silu, 2 swiglu-oai) is computed and stored as its own launch computes it. Shared by the
    batch-invariant GEMM's fold (batch_invariant/folds.py) and the W8A16 kernels (quant/w8a16.py)."""
    dt = Y.dtype.element_ty
    g, u = tl.split(tl.reshape(vals, [BLOCK_M, HALF, 2]))  # [BM, HALF] each
    out = act_of_sums(g, u, alpha, limit, dt, ACT, PRECISE)
    cols = pid_n * HALF + tl.arange(0, HALF)
    ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + cols[None, :]  # [BM, HALF]
    tl.store(ptrs, out.to(dt), mask=m_ok[:, None] & (cols < n_act)[None, :])


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up [..., 2I] (gate then up) -> [..., I], as reference.swiglu_oai."""
    gu = as_rows(gate_up)
    inter = gu.shape[1] // 2
    out = torch.empty(gu.shape[0], inter, dtype=gu.dtype, device=gu.device)
    if gu.shape[0] and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _swiglu_kernel[(gu.shape[0], triton.cdiv(inter, block))](
            gu, out, inter, gu.stride(0), out.stride(0), float(alpha), float(limit), PRECISE=precise(),
            BLOCK=block, num_warps=warps_for(block), **launch_opts(), **pdl.args(gu))
    return out.view(*gate_up.shape[:-1], inter)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] -> silu(gate) * up, as reference.silu_mul."""
    g, u = as_rows(gate), as_rows(up)
    inter = g.shape[1]
    out = torch.empty_like(g)
    if g.shape[0] and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(g.shape[0], triton.cdiv(inter, block))](
            g, u, out, inter, g.stride(0), u.stride(0), out.stride(0), PRECISE=precise(), BLOCK=block,
            num_warps=warps_for(block), **launch_opts(), **pdl.args(g))
    return out.view(gate.shape)


