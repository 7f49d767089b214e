"""Fused elementwise ops behind one small interface (`FusedOps`) and its plain PyTorch implementation.

`reference` runs the plain PyTorch ops of `reference.py` -- the math the models are defined by, one
kernel per torch op (a Gemma RMSNorm alone is ~8 launches). `triton` runs each chain as one Triton kernel
(`triton_backend.py`); triton is imported only when that backend is built (`registry.py`). The engine owns its object and
hands it to the models in `meta.ops.fused` (see m3eagle/kernels/ops.py), like the attention and MoE backends.

Every method takes tensors and Python numbers only, syncs nothing with the host and keeps shapes fixed by
its inputs, so a step that calls them can be captured in a CUDA graph. Inference only: the Triton ops have
no autograd (training and `forward_seq` call `reference.py` directly).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from m3eagle.kernels.fused import reference
from m3eagle.kernels.quant.mxfp8 import MxWeight


class FusedOps(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, gemma: bool = True,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """reference.rms_norm; `out` ([T, N], any row stride) receives the result when given."""
        ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float,
                     x2: torch.Tensor | None = None, x_scale: float = 1.0, gemma: bool = True,
                     rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """reference.add_rms_norm; with `rows` [R] int64 of the inputs' rows [T, N] only those rows, in
        that order (a fast path folds the gather into the launch)."""
        ...

    def rms_norm_cat(self, xs: Sequence[torch.Tensor], ws: Sequence[torch.Tensor], eps: float, out: torch.Tensor,
                     gemma: bool = True, ids: torch.Tensor | None = None) -> torch.Tensor:
        """out[:, i*N:(i+1)*N] = rms_norm(xs[i], ws[i], eps, gemma) for each input [T, N]; with `ids` [T],
        xs[0] is an embedding table [V, N] and its rows ids are normed (F.embedding(ids, xs[0])). A fast path
        may run them as one launch (the Eagle3 head's projection inputs)."""
        ...

    def add_residual(self, x: torch.Tensor, residual: torch.Tensor | None, x2: torch.Tensor | None = None,
                     x_scale: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def rope_cos_sin(self, positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype,
                     scaling: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def qk_norm_rope(self, x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor,
                     sin: torch.Tensor) -> torch.Tensor: ...

    def qkv_rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                       q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor | None,
                       slots: torch.Tensor) -> torch.Tensor: ...

    def rope_qkv_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       rotary_dim: int, theta: float, k_pool: torch.Tensor, v_pool: torch.Tensor,
                       slots: torch.Tensor, scaling: dict[str, Any] | None = None) -> torch.Tensor:
        """qkv_rope_store without q/k norms, with rope_cos_sin(positions, ...)'s tables: for a layer that is
        its forward's only reader of them (the Eagle3 head), so a fast path computes them in its launch."""
        ...

    def qkv_index_rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_w: torch.Tensor | None,
                             k_w: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                             k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, iq: torch.Tensor,
                             ik: torch.Tensor, iq_w: torch.Tensor, ik_w: torch.Tensor, index_rope_dim: int,
                             ik_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """reference.qkv_index_rope_store: (q, iq); K/V and index-K written at `slots`."""
        ...

    def swiglu_oai(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor: ...

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """F.linear(x, w) without bias: x [T, K], w [N, K] -> [T, N] (a fast path may sum in another order).
        w may be an MxWeight (MXFP8): every op taking a weight accepts one (the W8A16 kernels, or dequantized).
        w is a weight: no kernel writes it (the GEMV may read it before its predecessor ends: pdl.preload_weights)."""
        ...

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...

    def linear_silu_mul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """silu_mul(*linear(x, w).chunk(2, -1)): the Llama MLP's packed gate / up projection w [2I, K] and its
        activation, x [T, K] -> [T, I] (a fast path computes the activation in the GEMV's epilogue)."""
        ...

    def linear_swiglu_oai(self, x: torch.Tensor, w: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """swiglu_oai(linear(x, w), alpha, limit): M3's packed gate_up_proj w [2I, K] and its activation, x [T, K]
        -> [T, I] (a fast path computes the activation in the GEMV's epilogue)."""
        ...

    def folds(self, t: int, w: torch.Tensor) -> bool:
        """Whether `norm_linear` / `linear_add` with weight w run t rows as one launch (a model takes its
        folded form only where they do: their fallback is the separate launches)."""
        ...

    def norm_linear(self, x: torch.Tensor, nw: torch.Tensor, eps: float, w: torch.Tensor, gemma: bool = False,
                    act: str | None = None) -> torch.Tensor:
        """linear(rms_norm(x, nw, eps, gemma), w); with act="silu" w is a packed gate / up weight and the result
        silu_mul's. A fast path normalises in the GEMV's prologue (its sum of squares then runs in another
        order)."""
        ...

    def linear_add(self, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """add_residual(linear(x, w), residual): a projection and the residual add after it."""
        ...

    def linear_argmax(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, scatter: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                      ) -> torch.Tensor:
        """argmax(linear(x, w), offsets, out, scatter): a greedy pick that reads nothing of the logits but
        their argmax (a fast path picks it in the GEMV's launch)."""
        ...

    def router_logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """reference.router_logits: x [T, H] -> [T, E] fp32 (a fast path may sum in another order)."""
        ...

    def route(self, logits: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def route_tokens(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """route(router_logits(x, weight), bias, k): the whole router (a fast path may fuse the two)."""
        ...

    def argmax(self, x: torch.Tensor, offsets: torch.Tensor | None = None, out: torch.Tensor | None = None,
               scatter: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
        """reference.argmax: x [N, V] (any float dtype) -> [N] int64, the first maximum of each row (NaN
        counts as the largest, as torch.argmax), plus offsets[that index] when given (a draft -> target
        id map); also written to `out` [N] and to buf[rows[n], col] for `scatter` = (buf, rows, col)."""
        ...


class ReferenceFused:
    """The plain PyTorch ops: the CPU path and the oracle. Stateless."""

    name = "reference"

    def rms_norm(self, x, w, eps, gemma=True, out=None):
        y = reference.rms_norm(x, w, eps, gemma)
        return y if out is None else out.copy_(y)

    def add_rms_norm(self, x, residual, w, eps, x2=None, x_scale=1.0, gemma=True, rows=None):
        if rows is not None:
            x, residual, x2 = (t[rows] if t is not None else None for t in (x, residual, x2))
        return reference.add_rms_norm(x, residual, w, eps, x2, x_scale, gemma)

    def rms_norm_cat(self, xs, ws, eps, out, gemma=True, ids=None):
        # self.rms_norm: a backend without its own fused form (triton past NORM_CAT_MAX inputs) runs its norms
        for i, (x, w) in enumerate(zip(xs, ws)):
            x = torch.nn.functional.embedding(ids, x) if i == 0 and ids is not None else x
            self.rms_norm(x, w, eps, gemma, out=out[:, i * x.shape[-1]:(i + 1) * x.shape[-1]])
        return out

    def add_residual(self, x, residual, x2=None, x_scale=1.0, out=None):
        r = reference.add_residual(x, residual, x2, x_scale)
        return r if out is None else out.copy_(r)

    def rope_cos_sin(self, positions, rotary_dim, theta, dtype, scaling=None):
        return reference.rope_cos_sin(positions, rotary_dim, theta, dtype, scaling)

    def qk_norm_rope(self, x, w, eps, cos, sin):
        return reference.qk_norm_rope(x, w, eps, cos, sin)

    def qkv_rope_store(self, q, k, v, q_w, k_w, eps, cos, sin, k_pool, v_pool, slots):
        return reference.qkv_rope_store(q, k, v, q_w, k_w, eps, cos, sin, k_pool, v_pool, slots)

    def rope_qkv_store(self, q, k, v, positions, rotary_dim, theta, k_pool, v_pool, slots, scaling=None):
        cos, sin = self.rope_cos_sin(positions, rotary_dim, theta, q.dtype, scaling)
        return self.qkv_rope_store(q, k, v, None, None, 0.0, cos, sin, k_pool, v_pool, slots)

    def qkv_index_rope_store(self, q, k, v, q_w, k_w, eps, cos, sin, k_pool, v_pool, slots, iq, ik, iq_w, ik_w,
                             index_rope_dim, ik_pool):
        return reference.qkv_index_rope_store(q, k, v, q_w, k_w, eps, cos, sin, k_pool, v_pool, slots, iq, ik,
                                              iq_w, ik_w, index_rope_dim, ik_pool)

    def linear(self, x, w):
        if isinstance(w, MxWeight):  # the plain path dequantizes (exact: an e4m3 value times a power of two)
            w = w.dequantize(x.dtype)
        return torch.nn.functional.linear(x, w)

    def swiglu_oai(self, gate_up, alpha, limit):
        return reference.swiglu_oai(gate_up, alpha, limit)

    def silu_mul(self, gate, up):
        return reference.silu_mul(gate, up)

    def linear_silu_mul(self, x, w):
        return self.silu_mul(*self.linear(x, w).chunk(2, -1))

    def linear_swiglu_oai(self, x, w, alpha, limit):
        return self.swiglu_oai(self.linear(x, w), alpha, limit)

    def folds(self, t, w):
        return False

    def norm_linear(self, x, nw, eps, w, gemma=False, act=None):
        # self's ops: a backend without the fold for this shape (triton) runs these as its separate launches
        if act not in (None, "silu"):
            raise ValueError(f"norm_linear: act={act!r}; None or 'silu'")
        xn = self.rms_norm(x, nw, eps, gemma)
        return self.linear_silu_mul(xn, w) if act == "silu" else self.linear(xn, w)

    def linear_add(self, x, w, residual):
        return self.add_residual(self.linear(x, w), residual)

    def linear_argmax(self, x, w, offsets=None, out=None, scatter=None):
        return self.argmax(self.linear(x, w), offsets, out, scatter)

    def router_logits(self, x, weight):
        return reference.router_logits(x, weight)

    def route(self, logits, bias, k):
        return reference.route(logits, bias, k)

    def route_tokens(self, x, weight, bias, k):
        return reference.route_tokens(x, weight, bias, k)

    def argmax(self, x, offsets=None, out=None, scatter=None):
        return reference.argmax(x, offsets, out, scatter)
