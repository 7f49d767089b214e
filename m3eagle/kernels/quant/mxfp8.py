"""FP8 weight formats in plain PyTorch: the reference every FP8 kernel and the checkpoint loader are held to.

MXFP8 (`quant_method: mxfp8`, `weight_block_size: [1, 32]`), as the MiniMax-M3 release stores it: a weight
w [N, K] is `q` [N, K] float8_e4m3fn and `scale` [N, K / 32] uint8, one ue8m0 byte per 1 x 32 block along K,
and w[n, k] = float(q[n, k]) * 2 ** (scale[n, k // 32] - 127). The checkpoint names the scale tensor
`weight_scale_inv` although it multiplies (transformers' FineGrainedFP8 dequantizes exactly so).
Block FP8 (`quant_method: fp8`, `weight_block_size: [bn, bk]`, DeepSeek / MiniMax-M2 style): `scale` [ceil(N / bn),
ceil(K / bk)] float32, w = q * scale over each [bn, bk] tile.

Quantizing picks each block's smallest power of two that maps its largest magnitude into e4m3's range (448), so
a block's largest value keeps the full 3-bit mantissa and nothing saturates.

`MxWeight` is how a quantized weight travels from a module to a kernel: the fp8 values and their scales as one
argument, so every op that takes a weight (F.linear's place, the fused GEMVs, the MoE experts) can tell an MXFP8
weight from a plain one and run the W8A16 kernel or dequantize.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MX_BLOCK = 32
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
E8M0_BIAS = 127
# Rows from which `w8a16.mx_linear` dequantizes a weight into a scratch of x's dtype (one launch: 1 byte read, 2
# written per weight) and runs cuBLAS on it: at prompt sizes the GEMM is compute-bound, and cuBLAS's bf16 GEMM
# outruns the tiled kernel (whose dequantization sits in its MMA loop) by more than the scratch costs. bf16 and fp32
# x only: fp16 cannot hold every q * 2 ** e. The scratch is transient (engine/kv_budget.py reserves room for it).
DEQUANT_MIN_T = 1024


@dataclass(frozen=True)
class MxWeight:
    """An MXFP8 weight as one value: q [..., N, K] float8_e4m3fn and scale [..., N, K / 32] uint8 (views of the
    module's parameter and buffer, so the module stays the owner of the memory)."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def is_cuda(self) -> bool:
        return self.q.is_cuda

    def dim(self) -> int:
        return self.q.dim()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [..., N, K] in `dtype` (exact in fp32; rounded once to a narrower dtype)."""
        return dequantize_mx(self.q, self.scale, dtype)


def decode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """uint8 ue8m0 bytes -> fp32 powers of two, 2 ** (byte - 127) (exact for every byte below 255)."""
    if scale.dtype != torch.uint8:
        raise TypeError(f"an MXFP8 scale must be uint8 (ue8m0 bytes), got {scale.dtype}")
    return torch.exp2(scale.to(torch.float32) - E8M0_BIAS)


def dequantize_mx(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., N, K] float8_e4m3fn, scale [..., N, K / 32] uint8 -> w [..., N, K] in `dtype` (the product is exact in
    fp32: an e4m3 value times a power of two; `dtype` then rounds it once)."""
    if q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"an MXFP8 weight must be float8_e4m3fn, got {q.dtype}")
    k = q.shape[-1]
    if k % MX_BLOCK or scale.shape != (*q.shape[:-1], k // MX_BLOCK):
        raise ValueError(f"MXFP8 scale shape {tuple(scale.shape)} does not match weight {tuple(q.shape)}: expected "
                         f"{(*q.shape[:-1], k // MX_BLOCK)} (one byte per 1 x {MX_BLOCK} block along the last dim)")
    s = decode_e8m0(scale).repeat_interleave(MX_BLOCK, dim=-1)  # [..., N, K]
    return (q.to(torch.float32) * s).to(dtype)


def quantize_mx(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (K a multiple of 32) -> (q float8_e4m3fn [..., N, K], scale uint8 [..., N, K / 32]): per 1 x 32
    block the smallest power of two s with max|w| / s <= 448 (all-zero blocks take s = 2 ** -127)."""
    k = w.shape[-1]
    if k % MX_BLOCK:
        raise ValueError(f"MXFP8 needs the input dim to be a multiple of {MX_BLOCK}, got {k}")
    blocks = w.float().reshape(*w.shape[:-1], k // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(-1)  # [..., N, K / 32]
    # smallest e with amax / 2**e <= 448: e = ceil(log2(amax / 448)), clamped to ue8m0's range
    e = torch.ceil(torch.log2(amax.clamp(min=torch.finfo(torch.float32).tiny) / E4M3_MAX))
    e = torch.where(amax > 0, e, torch.full_like(e, -E8M0_BIAS)).clamp(-E8M0_BIAS, E8M0_BIAS)
    q = (blocks / torch.exp2(e)[..., None]).clamp(-E4M3_MAX, E4M3_MAX).reshape(w.shape).to(torch.float8_e4m3fn)
    return q, (e + E8M0_BIAS).to(torch.uint8)


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Block FP8: q [..., N, K] float8_e4m3fn, scale [..., ceil(N / bn), ceil(K / bk)] float -> w in `dtype`."""
    if q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"a block-FP8 weight must be float8_e4m3fn, got {q.dtype}")
    bn, bk = block
    n, k = q.shape[-2:]
    want = (*q.shape[:-2], -(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"block-FP8 scale shape {tuple(scale.shape)} does not match weight {tuple(q.shape)} with "
                         f"weight_block_size {[bn, bk]}: expected {want}")
    s = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (q.to(torch.float32) * s).to(dtype)
