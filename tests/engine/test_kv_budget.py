"""KV pool sizing (engine/kv_budget.py): from device memory on a GPU, by request shape on a CPU, an explicit
num_pages always. The device's memory is injected, so the arithmetic is checked on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from m3eagle.bench import geometries
from m3eagle.engine.kv_budget import GiB, activation_reserve, bytes_per_slot, resolve_num_pages
from m3eagle.engine.llm_engine import EngineConfig
from m3eagle.models.eagle3 import Eagle3Head
from m3eagle.models.minimax_m3 import MiniMaxM3

CUDA = torch.device("cuda")  # only a label here: mem_info is injected, nothing touches a GPU


@pytest.fixture(scope="module")
def models():
    tcfg, dcfg = geometries.tiny()
    with torch.device("meta"):
        return MiniMaxM3(tcfg), Eagle3Head(dcfg)


def test_bytes_per_slot_counts_every_pool(models):
    target, draft = models
    c, d = target.cfg, draft.cfg
    sparse = sum(c.is_sparse(i) for i in range(c.num_hidden_layers))
    want = (c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim + sparse * c.index_head_dim
            + 2 * d.num_key_value_heads * d.head_dim) * 2  # bf16
    assert bytes_per_slot(target, draft, torch.bfloat16) == want
    assert bytes_per_slot(target, None, torch.float32) == (want - 2 * d.num_key_value_heads * d.head_dim * 2) * 2


def test_pages_from_memory_budget_capped_by_request_shape(models):
    target, draft = models
    cfg = EngineConfig(page_size=16, max_num_tokens=256, max_num_seqs=4, max_model_len=1024, num_draft_tokens=3,
                       gpu_memory_utilization=0.5)
    per_page = bytes_per_slot(target, draft, torch.bfloat16) * 16
    reserve = 1 * GiB + activation_reserve(target.cfg, 256, 4, 3)
    per_seq = -(-(1024 + 8) // 16)
    # Plenty of memory: capped at max_num_seqs full-length sequences (+ the trash page).
    assert resolve_num_pages(cfg, target, draft, torch.bfloat16, CUDA, 3,
                             mem_info=lambda: (70 * GiB, 80 * GiB)) == 1 + 4 * per_seq
    # Tight: (free - (1 - util) * total - reserve) // bytes per page.
    free, total = 40 * GiB + reserve + 100 * per_page + 5, 80 * GiB
    assert resolve_num_pages(cfg, target, draft, torch.bfloat16, CUDA, 3, mem_info=lambda: (free, total)) == 100
    # Prefill graphs keep a prefill step's activations in the graphs' private pool: reserved as well (its
    # largest bucket: 128 real tokens and a token for each padding row, max_num_seqs + 1 at most).
    pg = dataclasses.replace(cfg, prefill_graphs=True, max_prefill_graph_tokens=128)
    free += activation_reserve(target.cfg, 128 + 4 + 1, 4, 3)
    assert resolve_num_pages(pg, target, draft, torch.bfloat16, CUDA, 3, mem_info=lambda: (free, total)) == 100
    assert resolve_num_pages(pg, target, draft, torch.bfloat16, CUDA, 3, mem_info=lambda: (free - 6, total)) == 99
    # An explicit num_pages wins; on a CPU the request shape decides.
    assert resolve_num_pages(EngineConfig(num_pages=77), target, draft, torch.bfloat16, CUDA, 3,
                             mem_info=lambda: (0, 1)) == 77
    assert resolve_num_pages(cfg, target, draft, torch.float32, torch.device("cpu"), 3) == 1 + 4 * per_seq


def test_too_little_memory_names_the_options(models):
    target, draft = models
    cfg = EngineConfig(max_model_len=4096, num_draft_tokens=3)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.9.*max_model_len.*num_pages"):
        resolve_num_pages(cfg, target, draft, torch.bfloat16, CUDA, 3, mem_info=lambda: (1 * GiB, 80 * GiB))


def test_bad_utilization_is_refused():
    from m3eagle import LLM

    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5 must be in \(0, 1\]"):
        LLM(num_draft_tokens=0, device="cpu", gpu_memory_utilization=1.5)


def test_an_mxfp8_model_reserves_the_prompt_paths_dequantized_weight():
    """Prompt steps of DEQUANT_MIN_T tokens or more dequantize one 2-D MXFP8 weight at a time into the activation
    dtype (w8a16.mx_linear): the reserve holds the largest such copy, once for eager steps and once more for the
    prefill graphs' pool when their largest bucket reaches the threshold; nothing for smaller steps or a bf16 model."""
    from m3eagle.engine.kv_budget import dequant_scratch
    from m3eagle.kernels.quant.mxfp8 import DEQUANT_MIN_T
    from m3eagle.models.quant import quantize_online

    tcfg, dcfg = geometries.tiny()
    target = MiniMaxM3(tcfg).to(torch.bfloat16)
    assert dequant_scratch(target, 4096, torch.bfloat16) == 0  # nothing quantized yet
    assert quantize_online(target) > 0
    largest = max(p.numel() for p in target.parameters() if p.dtype == torch.float8_e4m3fn and p.dim() == 2)
    assert dequant_scratch(target, DEQUANT_MIN_T, torch.bfloat16) == 2 * largest
    assert dequant_scratch(target, DEQUANT_MIN_T - 1, torch.bfloat16) == 0
    cfg = EngineConfig(page_size=16, max_num_tokens=DEQUANT_MIN_T, max_num_seqs=4, max_model_len=64,
                       num_draft_tokens=0, gpu_memory_utilization=0.5)
    per_page = bytes_per_slot(target, None, torch.bfloat16) * 16
    reserve = 1 * GiB + activation_reserve(tcfg, DEQUANT_MIN_T, 4, 0) + 2 * largest
    free, total = 40 * GiB + reserve + 10 * per_page, 80 * GiB
    assert resolve_num_pages(cfg, target, None, torch.bfloat16, CUDA, 0, mem_info=lambda: (free, total)) == 10
    assert resolve_num_pages(cfg, target, None, torch.bfloat16, CUDA, 0, mem_info=lambda: (free - 1, total)) == 9
    pg = dataclasses.replace(cfg, prefill_graphs=True, max_prefill_graph_tokens=DEQUANT_MIN_T)
    free += activation_reserve(tcfg, DEQUANT_MIN_T + 4 + 1, 4, 0) + 2 * largest
    assert resolve_num_pages(pg, target, None, torch.bfloat16, CUDA, 0, mem_info=lambda: (free, total)) == 10
