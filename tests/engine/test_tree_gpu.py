"""Draft trees on CUDA: captured tree steps -- decode steps, and prompt / mixed steps on prefill graphs -- replay
to the eager engine's tokens, with and without overlap, and greedy trees equal plain greedy decoding in fp32. A
file of its own: CPU tree tests set TRITON_INTERPRET before triton is imported, and a CUDA test collected with
them would run every kernel under the interpreter."""

from __future__ import annotations

import pytest
import torch

from m3eagle import LLM, SamplingParams
from m3eagle.engine.graph_runner import PREFILL
from tests.helpers.engine_utils import assert_clean

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_tree_graph_replay_equals_eager_cuda(sampled, overlap):
    """On CUDA: tree steps replay captured graphs (decode steps, and prompt / mixed steps on the prefill graphs
    that are on by default), with and without overlap, and give the eager engine's tokens; greedy ones equal
    plain decoding; steps run under sync debug "error"."""
    texts = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):", "x = ["]
    kw = dict(device="cuda", max_num_seqs=8, max_num_tokens=256, max_model_len=512, draft_tree="3,4,16")
    sps = [SamplingParams(temperature=0.8 if sampled else 0.0, top_p=0.95, seed=5 + i, max_tokens=16 + 6 * i,
                          ignore_eos=True) for i in range(len(texts))]
    eager = LLM(enforce_eager=True, overlap=False, **kw)
    graph = LLM(overlap=overlap, **kw)
    assert graph.engine.graphs.use_graphs and graph.engine.cfg.prefill_graphs is True
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


@pytest.mark.parametrize("tree_max_batch", [8, 1], ids=["full", "narrow"])  # 8 = max_num_seqs: always the full tree
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_tree_prefill_graph_replay_equals_eager_cuda(sampled, tree_max_batch):
    """On CUDA a tree engine's prompt and mixed steps replay prefill graphs (on by default): prompts one at a time
    (one-row prompt steps of several token buckets; a prompt longer than the 256-token budget is chunked, its
    later chunks reading the earlier ones' pages), then all at once (several prompt rows, a prefix-cache hit on
    the long prompt, prompt chunks beside tree rows; `narrow`: every step of two rows or more verifies the first
    D nodes, so its mixed steps take (PREFILL, rows, tokens, D) buckets). Under sync debug "error", the replaying
    engine gives the tokens and accepted drafts of the eager engine that pads alike (enforce_eager). Greedy in
    fp32: the replaying tree engine, a tree engine without prefill graphs (prompt steps unpadded, eager) and
    plain greedy decoding agree token for token."""
    texts = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):", "x = ["]
    prompts = texts + ["\n".join(texts) * 24]  # the last: > 256 tokens
    kw = dict(device="cuda", max_num_seqs=8, max_num_tokens=256, max_model_len=1024, draft_tree="3,4,16",
              tree_max_batch=tree_max_batch)
    sps = [SamplingParams(temperature=0.8 if sampled else 0.0, top_p=0.95, seed=9 + i, max_tokens=14 + 5 * i,
                          ignore_eos=True) for i in range(len(prompts))]
    eager = LLM(enforce_eager=True, **kw)
    graph = LLM(**kw)
    outs = {}
    for name, llm in (("eager", eager), ("graph", graph)):
        eng = llm.engine
        assert eng.cfg.prefill_graphs is True and eng.graphs.prefill_buckets
        eng.sync_debug = True
        alone = [llm.generate([p], sp)[0] for p, sp in zip(prompts, sps)]
        together = llm.generate(prompts, sps)
        outs[name] = [(o.outputs[0].token_ids, o.metrics.num_accepted) for o in alone + together]
        assert eng.prefix_cache_hits > 0
        assert_clean(llm)
    assert outs["graph"] == outs["eager"]
    gr = graph.engine.graphs
    keys = {b for b, _ in gr.graphs if isinstance(b, tuple) and b[0] == PREFILL}
    assert gr.use_graphs and gr.num_replays > 0 and len(keys) >= 3 and any(b[1] > 2 for b in keys), keys
    assert any(len(b) == 4 for b in keys) == (tree_max_batch == 1), keys
    if not sampled:
        plain = LLM(device="cuda", num_draft_tokens=0, max_model_len=1024, dtype="float32")
        ref = [o.outputs[0].token_ids for o in plain.generate(prompts, sps)]
        for pg in (True, False):
            tree32 = LLM(dtype="float32", prefill_graphs=pg, **kw)
            tree32.engine.sync_debug = True
            assert [o.outputs[0].token_ids for o in tree32.generate(prompts, sps)] == ref, pg
