"""A 128k-token prompt end to end on the GPU: the engine sizes KV and index-K pools for it,
prefills it in chunks through the MiniMax sparse attention layers, and decodes with speculation, without
the activation memory of a 128k-token step. GPU only: `python -m pytest -q -m gpu tests/engine/test_long_context.py`
(on a CPU the reference attention of one 8k chunk against 128k keys would need tens of GB).
"""

from __future__ import annotations

import pytest
import torch

from m3eagle import LLM, SamplingParams
from tests.helpers.engine_utils import assert_clean

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONTEXT = 131072
NEW = 16
CHUNK = 8192


def test_128k_prompt_chunked_prefill_fits_and_decodes():
    from m3eagle.bench import geometries

    target, head = geometries.m3_mini()  # random weights, 12 layers: 2 full attention + 10 MSA
    llm = LLM(target, head, num_draft_tokens=3, device="cuda", load_format="dummy",
              max_model_len=CONTEXT + NEW + 8, max_num_seqs=2, max_num_tokens=CHUNK)
    pool = llm.engine.pool
    assert pool.num_usable * pool.page_size >= CONTEXT + NEW  # sized by the engine for the whole prompt
    prompt = torch.randint(3, target.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(0)).tolist()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    steps0 = llm.engine.num_steps
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)[0]
    torch.cuda.synchronize()
    assert len(out.outputs[0].token_ids) == NEW and out.metrics is not None
    assert llm.engine.num_steps - steps0 >= CONTEXT // CHUNK  # chunked, not one 128k step
    peak = torch.cuda.max_memory_allocated() - base
    # One 8k-token chunk's activations (attention partials, MoE buffers, logits of sampled rows), not a
    # 128k step's: the bound is far below what [128k, hidden] activations per layer would take.
    assert peak < 6 * 2**30, f"peak activation memory {peak / 2**30:.2f} GiB"
    assert_clean(llm)
