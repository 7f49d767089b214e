"""`TritonFused`: the fused-ops backend that runs each elementwise chain as one Triton launch (norm.py, rope.py,
activation.py, argmax.py, moe/router.py) and small-row projections on the decode GEMV (gemv.py), falling back
to the reference composition (backend.ReferenceFused, with its launches this backend's) where a shape does
not fit a fused form. Inference only: no autograd.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from m3eagle.kernels.fused import gemv
from m3eagle.kernels.fused.activation import silu_mul, swiglu_oai
from m3eagle.kernels.fused.argmax import argmax
from m3eagle.kernels.fused.backend import ReferenceFused
from m3eagle.kernels.fused.norm import NORM_CAT_MAX, add_norm, norm_cat
from m3eagle.kernels.fused.reference import rope_inv_freq
from m3eagle.kernels.fused.rope import qkv_rope_store, rope_table
from m3eagle.kernels.moe.router import ROUTER_GEMV_MAX_T, route, route_tokens, router_logits, router_split, router_tile_ok
from m3eagle.kernels.quant.mxfp8 import MxWeight
from m3eagle.kernels.quant.w8a16 import mx_linear
from m3eagle.kernels.triton_utils import interpreting

# ---- the backend object -------------------------------------------------------------------------------


def _freeze(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


class TritonFused(ReferenceFused):
    """The fused Triton ops. It caches RoPE inverse frequencies per (rope config, device) -- computed by
    layers.rope_inv_freq on that device, so they are the reference's exact values -- which is the only
    state it holds; each engine owns its own object."""

    name = "triton"

    def __init__(self, gemv_max_t: int | None = None) -> None:
        self._gemv = gemv
        self._gemv_counters = gemv.SplitCounters()  # this engine's split-K tile counters
        self._inv_freq: dict[Any, tuple[torch.Tensor, float]] = {}
        self._counters: dict[torch.device, torch.Tensor] = {}  # route_tokens' per-token counters, per device
        # id(router weight) -> (a weak reference to it, its version, router_split of it): the tiled router's
        # parts, dropped when the weight is freed
        self._splits: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
        # linear(): steps of up to this many rows may run `gemv.linear` instead of cuBLAS, where
        # `gemv.prefers` says it wins (0: never). None: gemv.MAX_T on CUDA, 0 elsewhere -- under the CPU
        # interpreter the kernel is a test subject (tests/kernels/test_gemv.py), not a speed-up: an engine test
        # running every projection through it took 160 s instead of ~10.
        self.gemv_max_t = gemv_max_t

    def _gemv_takes(self, x, w) -> bool:
        if isinstance(w, MxWeight):  # MXFP8: mx_linear's own GEMV / GEMM (the activation in its epilogue; the
            return False  # norm / residual folds run apart)
        g = self._gemv
        most = self.gemv_max_t if self.gemv_max_t is not None else (g.MAX_T if x.is_cuda else 0)
        return x.shape[0] <= most and g.supports(x, w) and g.prefers(x.shape[0], w.shape[0], w.shape[1])

    def _mx_linear(self, x, w, **act):
        """An MXFP8 weight through the W8A16 kernels (CUDA, or the interpreter); None elsewhere (the reference
        dequantizes). act: mx_linear's activation epilogue."""
        if not (isinstance(w, MxWeight) and (x.is_cuda or interpreting())):
            return None
        return mx_linear(x.contiguous() if x.stride(-1) != 1 else x, w.q, w.scale, **act)

    def linear(self, x, w):
        if isinstance(w, MxWeight):
            y = self._mx_linear(x, w)
            return y if y is not None else super().linear(x, w)
        if self._gemv_takes(x, w):
            return self._gemv.linear(x, w, counters=self._gemv_counters)
        return torch.nn.functional.linear(x, w)

    def _act_config(self, x, w):
        """The GEMV config that runs the activation in its epilogue (unsplit GEMV), else None: two launches."""
        return self._gemv.act_config(x.shape[0], w, x.dtype, x.device) if self._gemv_takes(x, w) else None

    # Where `folds` says yes, timed in a PDL chain of the head's layer on an H200: the o_proj / gate_up fold
    # takes a layer from 11.57 to 10.86 us at T = 1 but from 16.27 to 17.73 at T = 4 (embedded); at T = 1
    # m3-mini's 2048-wide head gains (70.07 -> 69.38 us) and m3-8b's 4096-wide one loses (183.1 -> 190.0 us:
    # every program of gate_up re-reduces the row). So the fold takes at most these rows and weight K:
    FOLD_MAX_T = 1
    FOLD_MAX_K = 2048

    def fold_config(self, t: int, w: torch.Tensor):
        """The unsplit GEMV config under which `norm_linear` / `linear_add` with weight w [N, K] run t rows as
        one launch (their norm prologue / residual epilogue), or None: they run as the separate launches."""
        g = self._gemv
        most = self.gemv_max_t if self.gemv_max_t is not None else (g.MAX_T if w.is_cuda else 0)
        if isinstance(w, MxWeight):  # MXFP8 weights run mx_linear, then the norm / residual apart
            return None
        if not (1 <= t <= min(most, self.FOLD_MAX_T) and w.dim() == 2 and w.shape[1] <= self.FOLD_MAX_K
                and w.stride(1) == 1 and w.dtype in g.DTYPES and g.prefers(t, w.shape[0], w.shape[1])):
            return None
        return g.act_config(t, w, w.dtype, w.device)

    def folds(self, t, w):
        return self.fold_config(t, w) is not None

    def norm_linear(self, x, nw, eps, w, gemma=False, act=None):
        cfg = self.fold_config(x.shape[0], w)
        if (cfg is not None and x.dtype == nw.dtype == w.dtype and x.stride(-1) == 1 and nw.is_contiguous()
                and (act is None or cfg.block_n % 2 == 0)):
            return self._gemv.norm_linear(x, nw, eps, w, gemma, act, cfg)
        return super().norm_linear(x, nw, eps, w, gemma, act)  # the separate launches, each this backend's

    def linear_add(self, x, w, residual):
        cfg = self.fold_config(x.shape[0], w)
        if cfg is not None and x.dtype == w.dtype == residual.dtype and x.stride(1) == 1 and residual.stride(1) == 1:
            return self._gemv.linear_add(x, w, residual, cfg)
        return self.add_residual(self.linear(x, w), residual)

    def linear_argmax(self, x, w, offsets=None, out=None, scatter=None):
        # Unlike the norm / residual folds, this one adds no work to every program: only the last
        # program's reduction of one key per tile, in place of the argmax launch's whole walk.
        cfg = self._act_config(x, w)  # None past T = 4 or where the pick is tl.dot
        cnt = self._gemv_counters.get(x.device) if cfg is not None else None
        if cnt is not None:
            return self._gemv.linear_argmax(x, w, cnt, offsets, out, scatter, cfg)[1]
        return self.argmax(self.linear(x, w), offsets, out, scatter)

    def linear_silu_mul(self, x, w):
        if (y := self._mx_linear(x, w, act="silu")) is not None:
            return y
        if (cfg := self._act_config(x, w)) is not None:
            return self._gemv.linear_act(x, w, "silu", config=cfg)
        return silu_mul(*self.linear(x, w).chunk(2, -1))

    def linear_swiglu_oai(self, x, w, alpha, limit):
        if (y := self._mx_linear(x, w, act="swiglu_oai", alpha=alpha, limit=limit)) is not None:
            return y
        if (cfg := self._act_config(x, w)) is not None:
            return self._gemv.linear_act(x, w, "swiglu_oai", alpha, limit, cfg)
        return swiglu_oai(self.linear(x, w), alpha, limit)

    def rms_norm(self, x, w, eps, gemma=True, out=None):
        return add_norm(x, None, w, eps, gemma=gemma, out=out)[0]

    def add_rms_norm(self, x, residual, w, eps, x2=None, x_scale=1.0, gemma=True, rows=None):
        y, r = add_norm(x, residual, w, eps, x2, x_scale, gemma, rows=rows)
        return y, r

    def rms_norm_cat(self, xs, ws, eps, out, gemma=True, ids=None):
        n = xs[-1].shape[-1]
        if (len(xs) <= NORM_CAT_MAX and out.stride(1) == 1
                and all(x.dtype == xs[0].dtype and x.shape[-1] == n and x.stride(-1) == 1 for x in xs)):
            return norm_cat(list(xs), list(ws), eps, out, gemma, ids)
        return super().rms_norm_cat(xs, ws, eps, out, gemma, ids)  # several launches, each this backend's add_norm

    def add_residual(self, x, residual, x2=None, x_scale=1.0, out=None):
        if out is None and residual is None and x2 is None and x_scale == 1.0:
            return x
        return add_norm(x, residual, None, 0.0, x2, x_scale, r_out=out)[1]

    def _rope_inv_freq(self, positions, rotary_dim, theta, scaling):
        key = (rotary_dim, float(theta), _freeze(scaling), positions.device)
        hit = self._inv_freq.get(key)
        if hit is None:
            hit = rope_inv_freq(rotary_dim, theta, scaling, positions.device)
            # Under CUDA-graph capture the table's kernels would only run at replay, so a table first made
            # there is used but not kept (the engine's eager warm-up steps fill the cache first).
            if positions.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
                self._inv_freq[key] = hit
        return hit

    def rope_cos_sin(self, positions, rotary_dim, theta, dtype, scaling=None):
        inv, mscale = self._rope_inv_freq(positions, rotary_dim, theta, scaling)
        return rope_table(positions, inv, mscale, dtype)

    def rope_qkv_store(self, q, k, v, positions, rotary_dim, theta, k_pool, v_pool, slots, scaling=None):
        rope = (positions, *self._rope_inv_freq(positions, rotary_dim, theta, scaling))
        return qkv_rope_store(q, k, v, None, None, 0.0, None, None, k_pool, v_pool, slots, rope=rope)

    def qk_norm_rope(self, x, w, eps, cos, sin):
        return qkv_rope_store(x, None, None, w, None, eps, cos, sin, None, None, None)

    def qkv_rope_store(self, q, k, v, q_w, k_w, eps, cos, sin, k_pool, v_pool, slots):
        return qkv_rope_store(q, k, v, q_w, k_w, eps, cos, sin, k_pool, v_pool, slots)

    def qkv_index_rope_store(self, q, k, v, q_w, k_w, eps, cos, sin, k_pool, v_pool, slots, iq, ik, iq_w, ik_w,
                             index_rope_dim, ik_pool):
        return qkv_rope_store(q, k, v, q_w, k_w, eps, cos, sin, k_pool, v_pool, slots,
                              index=(iq, ik, iq_w, ik_w, index_rope_dim, ik_pool))

    def swiglu_oai(self, gate_up, alpha, limit):
        return swiglu_oai(gate_up, alpha, limit)

    def silu_mul(self, gate, up):
        return silu_mul(gate, up)

    def router_logits(self, x, weight):
        return router_logits(x, weight)

    def route(self, logits, bias, k):
        return route(logits, bias, k)

    def route_tokens(self, x, weight, bias, k):
        c = self._counters.get(x.device)
        if c is None:
            if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # a zero-fill made during capture would run only at replay: the engine's eager warm-up
                # steps allocate the counters first; anything else takes the two-launch path here
                return route(router_logits(x, weight), bias, k)
            c = self._counters[x.device] = torch.zeros(ROUTER_GEMV_MAX_T, dtype=torch.int32, device=x.device)
        split = None
        if x.shape[0] > ROUTER_GEMV_MAX_T and router_tile_ok(x, weight):
            split = self._router_split(weight)
        return route_tokens(x, weight, bias, k, c, split)

    def _router_split(self, weight: torch.Tensor) -> torch.Tensor | None:
        """router_split(weight), made once per weight (and again if it is modified in place); None while a
        CUDA graph is being captured without one (a split made then would be filled only at replay: the
        graph runner's eager warm-up of the same step makes it first)."""
        hit = self._splits.get(id(weight))
        if hit is not None and hit[0]() is weight and hit[1] == weight._version:
            return hit[2]
        if weight.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        split = router_split(weight)
        if hit is None or hit[0]() is not weight:  # drop the entry with the weight (new versions replace it)
            weakref.finalize(weight, self._splits.pop, id(weight), None)
        self._splits[id(weight)] = (weakref.ref(weight), weight._version, split)
        return split

    def argmax(self, x, offsets=None, out=None, scatter=None):
        return argmax(x, offsets, out, scatter)

