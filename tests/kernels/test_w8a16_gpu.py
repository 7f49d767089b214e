"""`mx_linear` on the GPU: the prompt path (from DEQUANT_MIN_T rows it dequantizes into a bf16 scratch and runs
cuBLAS) and the activation epilogue. Run through the device tool:
`python -m pytest -q -m gpu tests/kernels/test_w8a16_gpu.py`.

- its output has the bits of torch.mm on the reference's dequantized weight (the same cuBLAS call), at M3's
  q/k/v width and at a ragged K;
- captured in a CUDA graph, it replays to the eager bits, with the weight's scale bytes changed between replays
  (the scratch is rebuilt every call, nothing of the capture's weight is kept);
- the activation epilogue at real gate_up shapes has the bits of mx_linear then the activation's kernel.
"""

from __future__ import annotations

import pytest
import torch

from m3eagle.kernels.quant import w8a16
from m3eagle.kernels.quant.mxfp8 import dequantize_mx, quantize_mx

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("t,n,k", [(w8a16.DEQUANT_MIN_T, 9216, 6144), (2048, 1000, 1056)])
def test_prompt_gemm_has_the_bits_of_cublas_on_the_dequantized_weight(t, n, k):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, s = quantize_mx(torch.randn(n, k, device="cuda", generator=g) * k ** -0.5)
    x = torch.randn(t, k, device="cuda", generator=g).to(torch.bfloat16)
    assert torch.equal(w8a16.mx_dequantize(q, s), dequantize_mx(q, s, torch.bfloat16))
    assert torch.equal(w8a16.mx_linear(x, q, s), torch.mm(x, dequantize_mx(q, s, torch.bfloat16).t()))


def test_prompt_gemm_graph_replay_equals_eager():
    g = torch.Generator(device="cuda").manual_seed(1)
    t, n, k = w8a16.DEQUANT_MIN_T, 2048, 2048
    q, s = quantize_mx(torch.randn(n, k, device="cuda", generator=g) * k ** -0.5)
    x = torch.randn(t, k, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(t, n, dtype=torch.bfloat16, device="cuda")
    w8a16.mx_linear(x, q, s, out=out)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w8a16.mx_linear(x, q, s, out=out)
    for _ in range(2):
        s.add_(1)  # other scales between replays: the replay must read them
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.mm(x, dequantize_mx(q, s, torch.bfloat16).t()))


@pytest.mark.parametrize("act", ["swiglu_oai", "silu"])
@pytest.mark.parametrize("t,n,k", [(1, 24576, 4096), (1, 3072, 4096), (4, 24576, 6144), (64, 6144, 6144)])
def test_activation_epilogue_equals_the_two_launches(t, n, k, act):
    """The packed gate_up of m3-8b's dense MLP / shared expert and M3's, at decode and at a small prompt: the
    activation in mx_linear's epilogue (the table's path: the tiled GEMM split in one launch, or the GEMV) has
    the bits of mx_linear then the activation's own kernel, compiled for the GPU."""
    from m3eagle.kernels.fused import activation

    g = torch.Generator(device="cuda").manual_seed(t + n)
    q, s = quantize_mx(torch.randn(n, k, device="cuda", generator=g) * k ** -0.5)
    x = (torch.randn(t, k, device="cuda", generator=g) * 4).to(torch.bfloat16)
    y = w8a16.mx_linear(x, q, s)
    want = activation.swiglu_oai(y, 1.702, 7.0) if act == "swiglu_oai" else activation.silu_mul(*y.chunk(2, -1))
    assert torch.equal(w8a16.mx_linear(x, q, s, act=act, alpha=1.702, limit=7.0), want)
