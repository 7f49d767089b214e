"""Sampling on the GPU: a row draws the same token alone and inside a batch. GPU only: run through the device tool
with `python -m pytest -q -m gpu tests/sampling/test_sampling_gpu.py`.

torch's CUDA cumsum scans a one-row tensor with CUB's device-wide scan and several rows with a row-blocked scan;
with float prefix sums the two orders moved a CDF edge by an ulp, and on nearly flat distributions (random
weights; top-p keeping most of the vocabulary) a seeded request sampled alone drew another token than in a batch.
The sampler sums in fixed point. The condition is forced on the CPU
(tests/sampling/test_sampling.py::test_prefix_sums_run_on_integers_so_no_scan_order_reaches_the_draw: any float
cumsum in sampling fails it); this test is the regression check on the real CUDA sort / softmax / scan kernels,
whose orders the CPU cannot reproduce (flat rows make an order-dependent sum likely to show, not certain).
"""

from __future__ import annotations

import pytest
import torch

from m3eagle.sampling.sampler import SamplingTensors, sample

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("vocab", [32000, 200064])
def test_a_row_draws_the_same_token_alone_and_in_a_batch(vocab):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(vocab)
    n, rounds = 48, 8
    for r in range(rounds):
        logits = torch.randn(n, vocab, device=dev, generator=g) * 0.05  # nearly flat, as random weights give
        st = SamplingTensors(torch.full((n,), 0.8, device=dev), torch.zeros(n, dtype=torch.int64, device=dev),
                             torch.full((n,), 0.95, device=dev), torch.arange(n, device=dev) + 1000 * r,
                             torch.zeros(n, dtype=torch.bool, device=dev))
        pos = torch.arange(n, device=dev) * 3 + r
        batch, _ = sample(logits, st, pos)
        rows = (st.temperature, st.top_k, st.top_p, st.seed, st.greedy)
        alone = torch.cat([sample(logits[i:i + 1], SamplingTensors(*(t[i:i + 1] for t in rows)), pos[i:i + 1])[0]
                           for i in range(n)])
        assert torch.equal(batch, alone), (r, (batch != alone).nonzero().flatten().tolist())
