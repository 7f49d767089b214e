"""MXFP8 weights on the GPU (`quantization="fp8"`): the W8A16 kernels inside the whole engine. GPU only: run
through the device tool with `python -m pytest -q -m gpu tests/engine/test_fp8_gpu.py`.

- CUDA-graph replay of FP8 steps equals eager execution token for token (plain, K = 3; overlap), so the W8A16
  GEMV / GEMM / MoE launches are capturable and read no stale host value;
- the FP8 steady state makes no host sync (torch's sync debug mode raises on one);
- the W8A16 model's logits stay within bf16 rounding of a bf16 model holding the dequantized weights (the
  kernels sum in another order than cuBLAS, so equality is not expected), and the engine really runs the FP8
  weights (one byte per weight on the device).
"""

from __future__ import annotations

import pytest
import torch

from m3eagle import LLM
from tests.engine.test_cuda_graphs import assert_steady_state_sync_free, params, run_with_arrivals
from tests.helpers.engine_utils import assert_clean

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def make(k: int, eager: bool, **kw) -> LLM:
    kw = {"max_num_seqs": 16, "max_num_tokens": 256, "max_model_len": 512, **kw}
    return LLM(device="cuda", num_draft_tokens=k, overlap=True, enforce_eager=eager, quantization="fp8", **kw)


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_fp8_graph_replay_equals_eager(k, sampled):
    sps = params(sampled)
    eager = make(k, True)
    want = run_with_arrivals(eager, sps)
    assert_clean(eager)
    del eager
    graphs = make(k, False)
    assert graphs.target.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    assert run_with_arrivals(graphs, sps) == want
    assert graphs.engine.graphs.num_replays > 0
    assert_clean(graphs)


def test_fp8_steady_state_makes_no_host_sync():
    assert_steady_state_sync_free(make(3, False))


@pytest.mark.parametrize("t", [1, 5, 300])
def test_fp8_ops_within_bf16_of_the_dequantized_weights(t):
    """Every quantized projection and each MoE layer of the embedded target, through the engine's ops (W8A16
    GEMV at T <= 8, the GEMM above, the MXFP8 MoE), against bf16 cuBLAS / the reference MoE on the dequantized
    weights: within bf16 rounding."""
    from m3eagle.distributed.layers import weight_of
    from m3eagle.kernels.moe.backend import ReferenceMoE
    from m3eagle.kernels.ops import make_ops
    from m3eagle.loader.assets import default_model_paths
    from m3eagle.loader.checkpoint import load_target
    from m3eagle.models.layers import Experts
    from m3eagle.models.quant import quantizable, quantize_online

    target = load_target(default_model_paths()[0], torch.bfloat16, "cuda")
    assert quantize_online(target) > 0
    ops = make_ops(device="cuda")
    g = torch.Generator(device="cuda").manual_seed(t)
    checked = 0
    for name, m, p in quantizable(target):
        w = weight_of(m, p)
        if isinstance(m, Experts):
            if p != "gate_up_proj":
                continue
            x = torch.randn(t, w.shape[2], device="cuda", generator=g).to(torch.bfloat16)
            idx = torch.stack([torch.randperm(w.shape[0], device="cuda", generator=g)[:2] for _ in range(t)])
            wts = torch.rand(t, 2, device="cuda", generator=g)
            down = weight_of(m, "down_proj")
            y = ops.moe.experts(x, wts, idx, w, down, m.alpha, m.limit)
            ref = ReferenceMoE().experts(x, wts, idx, w.dequantize(torch.bfloat16), down.dequantize(torch.bfloat16),
                                         m.alpha, m.limit)
        else:
            x = torch.randn(t, w.shape[1], device="cuda", generator=g).to(torch.bfloat16)
            y = ops.fused.linear(x, w)
            ref = torch.nn.functional.linear(x, w.dequantize(torch.bfloat16))
        err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        assert err <= 2e-2, (name, err)
        checked += 1
    assert checked > 10


@pytest.mark.parametrize("t", [1, 5])
def test_fp8_moe_with_its_shared_expert_within_bf16_of_the_parts(t):
    """Each MoE layer of the quantized embedded target at decode sizes: the engine's ops run the shared expert
    inside the W8A16 MoE's two launches (no part left for the next add + norm), within bf16 rounding of the
    reference ops' routed * routed_scale + shared on the dequantized weights."""
    from m3eagle.kernels.ops import make_ops
    from m3eagle.loader.assets import default_model_paths
    from m3eagle.loader.checkpoint import load_target
    from m3eagle.models.layers import SparseMoE
    from m3eagle.models.quant import quantize_online

    target = load_target(default_model_paths()[0], torch.bfloat16, "cuda")
    assert quantize_online(target) > 0
    fast = make_ops(device="cuda")
    ref = make_ops("reference", "reference", "cuda", "reference")
    g = torch.Generator(device="cuda").manual_seed(t)
    layers = [lay.mlp for lay in target.layers if isinstance(lay.mlp, SparseMoE)]
    assert layers and all(m.quantized() == 4 for m in layers)
    for moe in layers:
        x = torch.randn(t, moe.experts.gate_up_proj.shape[2], device="cuda", generator=g).to(torch.bfloat16)
        w, idx = moe.gate(x)
        out, rest, scale = moe.expert_parts(x, w, idx, fast.moe, fast.fused)
        ra, rb, rs = moe.expert_parts(x, w, idx, ref.moe, ref.fused)
        assert rest is None and scale == 1.0
        want = (ra.float() * rs + rb.float())
        err = ((out.float() - want).abs().max() / want.abs().max()).item()
        assert err <= 2e-2, err
