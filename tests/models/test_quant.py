"""MXFP8 weights inside the model: online quantization (`quantization="fp8"`), the MxWeight dispatch to the W8A16
kernels, and the same tokens as a model that holds the dequantized values.

The reference path dequantizes each MXFP8 weight into the activation dtype exactly (an e4m3 value times a power
of two), so a quantized model and a plain model holding the dequantized weights compute the same numbers: the
tests hold them to bit equality (logits) and token equality (the engine, plain and speculative). The Triton path
(W8A16 kernels under the CPU interpreter) sums in another order, so it is held to tokens, and a spy proves the
W8A16 kernels ran.
"""

from __future__ import annotations

import copy
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (see test_triton_attention.py)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from m3eagle.distributed.layers import SCALE_SUFFIX, is_quantized, weight_of  # noqa: E402
from m3eagle.kernels.quant import w8a16  # noqa: E402
from m3eagle.kernels.quant.mxfp8 import MxWeight  # noqa: E402
from m3eagle.loader.checkpoint import load_target, save_target  # noqa: E402
from m3eagle.models.layers import PackedLinears, pack_projections  # noqa: E402
from m3eagle.models.quant import quantizable, quantize_online  # noqa: E402
from tests.helpers.engine_utils import greedy  # noqa: E402
from tests.helpers.kernel_spy import count_calls  # noqa: E402

PROMPTS = [[9, 21, 33, 4, 17], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60], [7, 8]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random MiniMax-M3 whose every projection's input dim is a multiple of 32 (MXFP8 blocks)."""
    from tests.helpers.hf_utils import random_hf_model, tiny_hf_config

    cfg = tiny_hf_config(seed=3, hidden=64, head_dim=16, inter=32, dense_inter=64, shared_inter=32, index_head_dim=32)
    d = tmp_path_factory.mktemp("mx_tiny")
    random_hf_model(cfg, seed=3).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def head_dir(model_dir, tmp_path_factory):
    from tests.helpers.spec_utils import random_head

    return random_head(model_dir, tmp_path_factory.mktemp("mx_head"))


def dequantized(model: nn.Module) -> nn.Module:
    """A copy of `model` whose MXFP8 weights are plain fp32 tensors holding the dequantized values."""
    out = copy.deepcopy(model)
    for _, m, p in quantizable(out):
        if is_quantized(m, p):
            w = weight_of(m, p).dequantize(torch.float32)
            del m._buffers[p + SCALE_SUFFIX]
            setattr(m, p, nn.Parameter(w, requires_grad=False))
    return out


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model.forward_seq(ids)[0][0])


def test_online_quantization_takes_every_projection_and_expert_only(model_dir):
    model = load_target(model_dir)
    before = {n: t.dtype for n, t in model.state_dict().items()}
    n = quantize_online(model)
    names = [name for name, _, _ in quantizable(model)]
    assert n == len(names) > 0
    sd = model.state_dict()
    for name in names:
        assert sd[name].dtype == torch.float8_e4m3fn and sd[name + SCALE_SUFFIX].dtype == torch.uint8, name
    kinds = {name.split(".")[-2] for name in names}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "experts", "gate_up_proj", "down_proj"} <= kinds
    untouched = [k for k in before if k not in names]
    assert all(sd[k].dtype == before[k] for k in untouched)  # embeddings, lm_head, routers, norms as they were
    assert sd["lm_head.weight"].dtype == torch.float32 and sd["layers.1.mlp.gate.weight"].dtype == torch.float32
    assert quantize_online(model) == 0  # idempotent


def test_quantized_logits_equal_the_dequantized_model_bit_for_bit(model_dir):
    model = load_target(model_dir)
    quantize_online(model)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    a, b = logits(model, ids), logits(dequantized(model), ids)
    assert torch.equal(a, b)
    plain_model = load_target(model_dir)
    assert not torch.equal(a, logits(plain_model, ids))  # the quantized model is another model...
    plain = dict(plain_model.named_parameters())
    for name, m, p in quantizable(model):  # ...whose weights are the plain ones within e4m3's 3 mantissa bits
        w = weight_of(m, p).dequantize()
        assert ((w - plain[name]).norm() / plain[name].norm()).item() < 0.04, name


def test_packing_keeps_values_and_scales_together(model_dir):
    model = load_target(model_dir)
    quantize_online(model)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    want = logits(model, ids)
    assert pack_projections(model) > 0
    groups = [v for m in model.modules() for v in vars(m).values() if isinstance(v, PackedLinears)]
    for g in groups:
        assert g.is_packed() and isinstance(g.packed_weight(), MxWeight)
        w = g.packed_weight()
        assert w.scale.shape == (w.q.shape[0], w.q.shape[1] // 32)
    x = torch.randn(3, model.cfg.hidden_size)
    g = groups[0]
    parts = g(x)  # the packed GEMM (dequantized on this path) equals each module's own
    for m, y in zip(g.mods, parts):
        assert torch.equal(y, m(x))
    assert torch.equal(logits(model, ids), want)
    m0 = g.mods[0]
    m0.weight_scale_inv = m0.weight_scale_inv.clone()  # a reloaded scale: the stale pack is never used
    assert not g.is_packed()


def test_engine_tokens_equal_the_dequantized_checkpoint(model_dir, head_dir, make_llm, tmp_path):
    """LLM(quantization="fp8") gives the tokens of a bf16-style checkpoint holding the dequantized weights, plain
    and with speculation (K=3 equals K=0: speculation stays lossless on FP8 weights)."""
    model = load_target(model_dir)
    quantize_online(model)
    save_target(dequantized(model), tmp_path / "deq")
    want = [o.outputs[0].token_ids for o in make_llm(tmp_path / "deq", num_draft_tokens=0).generate(PROMPTS, greedy(8))]
    q = make_llm(model_dir, num_draft_tokens=0, quantization="fp8")
    assert q.target.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    assert [o.outputs[0].token_ids for o in q.generate(PROMPTS, greedy(8))] == want
    spec = make_llm(model_dir, draft=head_dir, num_draft_tokens=3, quantization="fp8")
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy(8))] == want


def test_triton_path_runs_the_w8a16_kernels(model_dir, monkeypatch):
    """A quantized model's projections (packed q/k/v, o_proj, MLPs) and routed experts through the Triton ops run
    the W8A16 kernels (spied) and match the reference ops, which dequantize, within fp32 summation order."""
    pytest.importorskip("triton")
    from m3eagle.kernels.fused import triton_backend
    from m3eagle.kernels.ops import make_ops
    from m3eagle.models.layers import SparseMoE

    linear_calls = count_calls(monkeypatch, triton_backend, "mx_linear")
    moe_calls = count_calls(monkeypatch, w8a16, "mx_moe_experts")
    model = load_target(model_dir)
    quantize_online(model)
    pack_projections(model)
    fast, ref = make_ops("reference", "triton", "cpu", "triton"), make_ops("reference", "reference", "cpu", "reference")
    x = torch.randn(3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    layer = next(lay for lay in model.layers if isinstance(lay.mlp, SparseMoE))
    pairs = [(layer.self_attn.proj(x, fast.fused), layer.self_attn.proj(x, ref.fused)),
             (layer.self_attn.o_proj(x, fast.fused), layer.self_attn.o_proj(x, ref.fused))]
    n_linear = len(linear_calls)
    w, idx = layer.mlp.gate(x)
    fa, fb, fs = layer.mlp.expert_parts(x, w, idx, fast.moe, fast.fused)
    ra, rb, rs = layer.mlp.expert_parts(x, w, idx, ref.moe, ref.fused)
    # the shared expert rides in the W8A16 MoE's two launches (no GEMM of its own); the reference keeps it apart
    assert fb is None and fs == 1.0 and rb is not None and len(linear_calls) == n_linear
    pairs += [([fa], [ra * rs + rb])]
    for got, want in pairs:
        for g, r in zip(got, want):
            assert torch.allclose(g, r, rtol=1e-5, atol=1e-5)
    assert n_linear >= 2 and len(moe_calls) == 1


def test_unknown_quantization_is_refused_by_name(model_dir):
    from m3eagle import LLM

    with pytest.raises(ValueError, match=r"quantization='int4'.*'fp8'"):
        LLM(model_dir, device="cpu", num_draft_tokens=0, quantization="int4")
