"""How many KV pages an engine gets.

On a GPU the pool is sized by device memory, as vLLM's `gpu_memory_utilization` does: of the device's total
memory, the fraction `gpu_memory_utilization` may be used by this process; what the loaded weights (and
anything else) already hold is taken off, a reserve for the step's activations (an MXFP8 model's prompt steps
also dequantize one weight at a time), CUDA graphs and library workspaces is set aside, and the rest becomes
pages -- at most as many as max_num_seqs sequences of max_model_len can use. A page holds `page_size` tokens of
every pool indexed by the same slots: target K/V (this rank's KV heads), index-K on sparse layers, the Eagle3
head's K/V.

On a CPU (tests, the embedded model) the pool is sized by request shape: enough for min(max_num_seqs, 16)
full-length sequences. An explicit `num_pages` always wins. Under tensor parallelism every rank must hold
the same page count (rank 0's page ids index every rank's pools), so the ranks agree on the smallest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from m3eagle.kernels.quant.mxfp8 import DEQUANT_MIN_T

log = logging.getLogger("m3eagle")

GiB = 1 << 30
FIXED_RESERVE = 1 * GiB  # CUDA graphs' pool, cuBLAS / Triton workspaces, NCCL buffers, allocator slack


def bytes_per_slot(target: Any, draft: Any, dtype: torch.dtype) -> int:
    """Bytes one cache slot (one token) takes across every pool, from the models' own cache builders run
    on the meta device (so tensor-parallel head counts and sparse layers are counted as allocated)."""
    meta = torch.device("meta")
    caches = list(target.new_caches(1, dtype, meta)) + ([draft.new_cache(1, dtype, meta)] if draft is not None
                                                        else [])
    return sum(t.numel() * t.element_size() for c in caches for t in (c.k, c.v, c.idx_k) if t is not None)


def activation_reserve(target_cfg: Any, max_num_tokens: int, max_num_seqs: int, k: int) -> int:
    """A generous bound on one step's transient tensors: per scheduled token a few hidden-size buffers and
    the widest MLP / MoE intermediate (bf16 or fp32 alike counted at 4 bytes), plus fp32 logits and
    probabilities of the sampled positions ([rows x (K + 1), vocab], a few copies)."""
    c = target_cfg
    inter = max(c.dense_intermediate_size, c.intermediate_size * c.num_experts_per_tok,
                c.shared_intermediate_size) * 2
    per_token = (8 * c.hidden_size + inter) * 4
    sampled = max_num_seqs * (k + 1) * c.vocab_size * 4 * 4
    return max_num_tokens * per_token + sampled


def dequant_scratch(target: Any, num_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of the W8A16 prompt path's transient copy of a weight: a step of DEQUANT_MIN_T tokens or more
    dequantizes each 2-D MXFP8 weight in turn into `dtype` for cuBLAS (w8a16.mx_linear), so the largest one is
    held at a time. 0 for an unquantized model or smaller steps."""
    if num_tokens < DEQUANT_MIN_T:
        return 0
    # every module's 2-D fp8 `weight`: the projections' parameters and the packed q/k/v (PackedLinears)
    weights = [getattr(m, "weight", None) for m in target.modules()]
    sizes = [w.numel() for w in weights if isinstance(w, torch.Tensor) and w.dim() == 2
             and w.dtype == torch.float8_e4m3fn]
    return max(sizes, default=0) * dtype.itemsize


def pages_per_seq(cfg: Any, k: int) -> int:
    """Pages one sequence of max_model_len can hold, with room for 2 x (1 + K) speculative positions."""
    return -(-(cfg.max_model_len + 2 * (k + 1)) // cfg.page_size)


def resolve_num_pages(cfg: Any, target: Any, draft: Any, dtype: torch.dtype, device: torch.device, k: int,
                      tp: Any = None, mem_info: Callable[[], tuple[int, int]] | None = None) -> int:
    """The page count of the engine's pool (page 0 is the trash page). `cfg` is the EngineConfig;
    `mem_info` () -> (free, total) bytes replaces torch.cuda.mem_get_info (tests)."""
    per_seq = pages_per_seq(cfg, k)
    if cfg.num_pages:
        return cfg.num_pages
    if device.type != "cuda" and mem_info is None:
        return 1 + per_seq * min(cfg.max_num_seqs, 16)
    util = cfg.gpu_memory_utilization
    free, total = mem_info() if mem_info is not None else torch.cuda.mem_get_info(device)
    per_page = bytes_per_slot(target, draft, dtype) * cfg.page_size
    reserve = (FIXED_RESERVE + activation_reserve(target.cfg, cfg.max_num_tokens, cfg.max_num_seqs, k)
               + dequant_scratch(target, cfg.max_num_tokens, dtype))
    if cfg.prefill_graphs:  # the graphs' private pool holds a prefill step's activations too (its padding rows'
        # tokens included: the largest bucket holds max_prefill_graph_tokens real ones and a token per row)
        graph_tokens = min(cfg.max_prefill_graph_tokens, cfg.max_num_tokens) + cfg.max_num_seqs + 1
        reserve += (activation_reserve(target.cfg, graph_tokens, cfg.max_num_seqs, k)
                    + dequant_scratch(target, graph_tokens, dtype))
    budget = free - (1.0 - util) * total - reserve
    want = 1 + per_seq * cfg.max_num_seqs
    pages = max(0, min(want, int(budget // per_page)))
    if tp is not None and getattr(tp, "size", 1) > 1:
        import torch.distributed as dist

        t = torch.tensor([pages], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.control)
        pages = int(t.item())
    if pages < 1 + per_seq:
        raise ValueError(
            f"the KV pool does not fit one sequence of max_model_len={cfg.max_model_len}: "
            f"{max(budget, 0) / GiB:.2f} GiB left for it ({free / GiB:.1f} GiB free of {total / GiB:.1f} GiB, "
            f"gpu_memory_utilization={util}, {reserve / GiB:.2f} GiB reserved for activations and graphs), "
            f"{per_page * (1 + per_seq) / GiB:.2f} GiB needed; raise gpu_memory_utilization, lower "
            "max_model_len / max_num_tokens / max_num_seqs, or set num_pages")
    log.info("KV pool sized from device memory: %d pages x %d tokens (%.2f GiB; %.1f GiB free of %.1f GiB, "
             "gpu_memory_utilization=%s, %.2f GiB reserved for activations and graphs)%s", pages, cfg.page_size,
             pages * per_page / GiB, free / GiB, total / GiB, util, reserve / GiB,
             "" if pages < want else f"; capped at max_num_seqs={cfg.max_num_seqs} full-length sequences")
    return pages
