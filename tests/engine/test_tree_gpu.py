"""Draft trees on CUDA: captured tree steps replay to the eager engine's tokens, with and without overlap, and
greedy trees equal plain greedy decoding in fp32. A file of its own: CPU tree tests set TRITON_INTERPRET before
triton is imported, and a CUDA test collected with them would run every kernel under the interpreter."""

from __future__ import annotations

import pytest
import torch

from m3eagle import LLM, SamplingParams
from tests.helpers.engine_utils import assert_clean

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_tree_graph_replay_equals_eager_cuda(sampled, overlap):
    """On CUDA: tree steps replay captured graphs (decode-only steps; prompt steps eager), with and without
    overlap, and give the eager engine's tokens; greedy ones equal plain decoding; steps run under sync debug
    "error"."""
    texts = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):", "x = ["]
    kw = dict(device="cuda", max_num_seqs=8, max_num_tokens=256, max_model_len=512, draft_tree="3,4,16")
    sps = [SamplingParams(temperature=0.8 if sampled else 0.0, top_p=0.95, seed=5 + i, max_tokens=16 + 6 * i,
                          ignore_eos=True) for i in range(len(texts))]
    eager = LLM(enforce_eager=True, overlap=False, **kw)
    graph = LLM(overlap=overlap, **kw)
    assert graph.engine.graphs.use_graphs and graph.engine.cfg.prefill_graphs is False
    graph.engine.sync_debug = True
    want = [o.outputs[0].token_ids for o in eager.generate(texts, sps)]
    assert [o.outputs[0].token_ids for o in graph.generate(texts, sps)] == want
    assert graph.engine.graphs.num_replays > 0
    if not sampled:
        plain = LLM(device="cuda", num_draft_tokens=0, max_model_len=512, dtype="float32")
        tree32 = LLM(dtype="float32", overlap=overlap, **kw)
        ref = [o.outputs[0].token_ids for o in plain.generate(texts, sps)]
        assert [o.outputs[0].token_ids for o in tree32.generate(texts, sps)] == ref
    assert_clean(graph)
