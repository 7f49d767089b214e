"""Packed projections (models.layers.PackedLinears): one GEMM where the paged path ran several, with the
modules' weights turned into views of the packed tensor."""

from __future__ import annotations

import torch
import torch.nn as nn

from m3eagle.models.layers import PackedLinears, pack_projections


def _linears(*outs: int, inp: int = 24) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(inp, n, bias=False) for n in outs]


def test_packed_outputs_equal_separate_and_weights_become_views():
    mods = _linears(16, 8, 8, 4)
    before = [m.weight.detach().clone() for m in mods]
    x = torch.randn(5, 24)
    want = [m(x) for m in mods]
    g = PackedLinears(mods)
    assert not g.is_packed()
    g.pack()
    assert g.is_packed() and g.weight.shape == (36, 24)
    for m, w in zip(mods, before):
        assert torch.equal(m.weight, w)  # same values, same Parameter objects
        assert m.weight.untyped_storage().data_ptr() == g.weight.untyped_storage().data_ptr()
    got = g(x)
    assert [t.shape for t in got] == [(5, 16), (5, 8), (5, 8), (5, 4)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # in-place updates (a loader's copy_, an optimizer step) reach the packed tensor
    with torch.no_grad():
        mods[1].weight.add_(1.0)
    torch.testing.assert_close(g(x)[1], mods[1](x), rtol=1e-6, atol=1e-6)


def test_a_replaced_weight_is_never_served_from_a_stale_pack():
    mods = _linears(8, 8)
    g = PackedLinears(mods)
    g.pack()
    mods[0].weight = nn.Parameter(torch.ones(8, 24))  # e.g. a reload that swaps the tensor
    assert not g.is_packed()
    x = torch.randn(3, 24)
    torch.testing.assert_close(g(x)[0], x.sum(-1, keepdim=True).expand(3, 8))
    g.pack()  # packing again picks the new weight up
    assert g.is_packed()
    torch.testing.assert_close(g(x)[0], x.sum(-1, keepdim=True).expand(3, 8))


def test_engine_packs_target_and_head(model_dir, head_dir):
    from m3eagle import LLM

    llm = LLM(model_dir, head_dir, num_draft_tokens=2, device="cpu", max_num_seqs=2, max_model_len=64)
    groups = [v for mod in (llm.target, llm.draft) for m in mod.modules() for v in vars(m).values()
              if isinstance(v, PackedLinears)]
    n_attn = llm.target.cfg.num_hidden_layers
    assert len(groups) == n_attn + 2  # every target attention layer; the head's q/k/v and gate/up
    assert all(g.is_packed() for g in groups)
    assert pack_projections(llm.target) == n_attn  # idempotent
    # the state dict is the unpacked model's, name for name and value for value
    from m3eagle.models.minimax_m3 import MiniMaxM3

    with torch.device("meta"):
        fresh = MiniMaxM3(llm.target.cfg)
    sd = llm.target.state_dict()
    assert list(sd) == list(fresh.state_dict())
    q = llm.target.layers[0].self_attn
    key = next(k for k in sd if k.endswith("layers.0.self_attn.q_proj.weight"))
    assert torch.equal(sd[key], q.proj.weight[: q.q_proj.weight.shape[0]])
