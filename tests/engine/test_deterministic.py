"""`LLM(deterministic=True)` on CPU (issue 44's properties at the engine level, tiny random geometry).

Fast tests: the mode's plumbing (make_ops choices, the refusals) and, on the CPU's fp32 reference ops it
selects there, greedy speculative (K = 1, 3) == greedy plain token for token, a request alone == inside a
batch, across prompt chunk sizes. The `slow` test forces the batch-invariant Triton kernels under the
interpreter (the GPU path's code) for the same properties on a smaller workload. The bf16 GPU property table
is tests/engine/test_deterministic_gpu.py.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from m3eagle import LLM, SamplingParams
from m3eagle.bench import geometries
from tests.helpers.engine_utils import assert_clean

BI = {"attention_backend": "batch_invariant", "moe_backend": "batch_invariant", "fused_backend": "batch_invariant"}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 5..40 token ids of the tiny vocabulary (past the MSA top-k: block selection runs)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (int(torch.randint(5, 41, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def make(k: int, **kw) -> LLM:
    t, h = geometries.tiny()
    kw = {"deterministic": True, **kw}
    return LLM(model=t, draft=h if k else None, num_draft_tokens=k, load_format="dummy", device="cpu", page_size=4,
               max_model_len=128, **kw)


def run(llm: LLM, ps: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = [o.outputs[0].token_ids for o in llm.generate(ps, params)]
    assert_clean(llm)
    return outs


def test_deterministic_flag_and_refusals():
    llm = make(0)
    assert llm.deterministic and llm.engine.ops.attention.name == "reference"  # CPU: the fp32 oracle
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        make(0, attention_backend="triton")
    with pytest.raises(ValueError, match="quantization='fp8'"):
        make(0, quantization="fp8")
    with pytest.raises(ValueError, match="deterministic="):
        make(0, deterministic="yes")


def test_greedy_spec_batch_and_chunk_invariant():
    """Greedy K=1 / K=3 == K=0 on every request; each request alone == inside the batch; prompt chunks of
    8 / 2048 tokens give the same tokens."""
    ps = prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    plain = run(make(0), ps, params)
    assert run(make(0, max_num_tokens=8), ps, params) == plain
    for k in (1, 3):
        llm = make(k)
        assert run(llm, ps, params) == plain, f"K={k}"
        assert run(llm, ps[1:2], params) == plain[1:2], f"K={k} alone"


def test_seeded_sampling_alone_equals_batch():
    ps = prompts(3, seed=1)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=7, ignore_eos=True)
    llm = make(0)
    batch = run(llm, ps, params)
    assert [run(llm, [p], params)[0] for p in ps] == batch


def two_layers(k: int, **kw) -> LLM:
    """`make` on the tiny geometry cut to its two kinds of layer: a dense MLP + full attention layer, then an
    MoE + sparse (MSA) layer; the head taps the streams after layers 1, 1 and 2 (the tiny geometry's four
    layers repeat these kinds and tap 2, 2, 1)."""
    t, h = geometries.tiny()
    t = replace(t, num_hidden_layers=2, layer_types=t.layer_types[:2], mlp_layer_types=t.mlp_layer_types[:2])
    h = replace(h, aux_layer_ids=(1, 1, 2))
    kw = {"deterministic": True, **kw}
    return LLM(model=t, draft=h if k else None, num_draft_tokens=k, load_format="dummy", device="cpu", page_size=4,
               max_model_len=128, **kw)


@pytest.mark.slow
def test_batch_invariant_kernels_engine_interpreted():
    """The batch-invariant Triton kernels forced under the interpreter: greedy K=1 with 8-token steps (the
    23-token prompt in four chunks, two of them beside the other row's verify rows; 3 tokens a request: 6 steps)
    == K=0 with whole prompts. On two layers (`two_layers`: one dense / full-attention, one MoE / sparse-attention
    layer, block selection active past 16 tokens), so every batch-invariant kernel kind runs; the interpreter
    runs every launch of every layer (~20 s on 2 cores; 4 layers took a minute)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (run this module alone with it set)")
    ps = prompts(2, seed=2)  # 5 and 23 tokens
    assert sorted(len(p) for p in ps) == [5, 23]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    plain = run(two_layers(0, **BI), ps, params)
    assert run(two_layers(1, max_num_tokens=8, **BI), ps, params) == plain


def seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=11 + i, ignore_eos=True)


def test_seeded_speculation_equals_seeded_plain_with_coupled_verification():
    """The coupled verification: with drafts (K = 1, 3), a seeded request emits the very tokens decoding without
    drafts samples, alone, in a batch and under a preemption forced every 3rd plan (its recompute samples the
    prompt's last position as a plain step does). The head is random, so most drafts are rejected: the emitted
    token at a rejection is the target's own draw, not a residual sample."""
    from tests.helpers.engine_utils import Counters

    ps = prompts(4, seed=3)
    sps = [seeded(i) for i in range(len(ps))]
    # decoding without drafts and without the mode (plain sampling), the reference the coupled draws must equal
    plain = [o.outputs[0].token_ids for o in make(0, deterministic=False).generate(ps, sps)]
    assert [o.outputs[0].token_ids for o in make(0).generate(ps, sps)] == plain
    for k in (1, 3):
        llm = make(k)
        outs = llm.generate(ps, sps)
        assert [o.outputs[0].token_ids for o in outs] == plain, f"K={k}"
        assert sum(o.metrics.num_drafted for o in outs) > sum(o.metrics.num_accepted for o in outs)  # rejections
        assert [o.outputs[0].token_ids for o in llm.generate(ps[2:3], sps[2:3])] == plain[2:3], f"K={k} alone"
        c = Counters(llm, force_every=3)
        assert [o.outputs[0].token_ids for o in llm.generate(ps, sps)] == plain, f"K={k} preempted"
        assert c.preempted > 0
        assert_clean(llm)


def test_without_the_mode_seeded_speculation_draws_other_tokens():
    """The control that keeps the test above meaningful: the default (residual) rejection sampling is exact in
    distribution, but its tokens differ from decoding without drafts on these seeds."""
    ps = prompts(4, seed=3)
    sps = [seeded(i) for i in range(len(ps))]
    plain = [o.outputs[0].token_ids for o in make(0, deterministic=False).generate(ps, sps)]
    spec = [o.outputs[0].token_ids for o in make(3, deterministic=False).generate(ps, sps)]
    assert spec != plain


def test_deterministic_takes_a_draft_tree():
    """The mode couples tree verification too (tests/engine/test_tree_sampling.py checks its tokens)."""
    t, h = geometries.tiny()
    llm = LLM(model=t, draft=h, draft_tree="2,2,4", load_format="dummy", device="cpu", deterministic=True)
    assert llm.engine.runner.coupled
