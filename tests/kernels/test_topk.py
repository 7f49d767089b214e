"""The Triton top-k (m3eagle/kernels/topk/triton_topk.py) held equal to its torch reference (topk/reference.py) and
to a stable descending sort, on CPU under the Triton interpreter: tie-heavy rows (bf16-rounded log-probs, all
equal, runs of -inf, -0.0 beside 0.0), rows of one block (the rerank's candidates, k up to 64) and of many
blocks (a draft vocabulary, k up to 8, each lane's kept list full), the added base score and strided outputs
of the draft tree's expansion, one launch per call.

NOTE: TRITON_INTERPRET is set before anything imports triton, and it holds for the whole pytest process.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from m3eagle.kernels.topk import reference, triton_topk  # noqa: E402
from tests.helpers.kernel_spy import spy_launches  # noqa: E402


def _tie_heavy(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Coarse scores (bf16-rounded normals): ties everywhere; one row of -inf runs, one all equal, one of
    -0.0 / 0.0 pairs, one all -inf but its last column."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(torch.bfloat16).float().reshape(-1, shape[-1])
    m = shape[-1]
    x[0, : m // 3] = float("-inf")
    x[1 % x.shape[0]] = -2.0
    if x.shape[0] > 2:
        x[2, 0::2], x[2, 1::2] = -0.0, 0.0
    if x.shape[0] > 3:
        x[3] = float("-inf")
        x[3, -1] = -5.0
    return x.reshape(shape)


def _sorted(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stable descending sort's first k: the order best() promises."""
    v, i = x.sort(dim=-1, descending=True, stable=True)
    return v[..., :k], i[..., :k]


@pytest.mark.parametrize("m,ks", [(7, (1, 3, 7)), (36, (1, 4, 16, 36)), (300, (1, 8, 64)), (1024, (2, 64)),
                                  (1500, (1, 8)), (6144, (1, 4, 8)), (9000, (3, 8))])
def test_topk_equals_the_reference_and_a_stable_sort(m, ks):
    x = _tie_heavy((5, 2, m) if m <= 1024 else (4, m), seed=m)
    for k in ks:
        want = reference.best(x, k)
        got = triton_topk.best(x, k)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (m, k)
        sv, si = _sorted(x, k)
        rows = [r for r in range(x.numel() // m) if r != 2]  # the sort calls -0.0 and 0.0 equal; best() does not
        assert torch.equal(got[1].reshape(-1, k)[rows], si.reshape(-1, k)[rows]), (m, k)
        assert torch.equal(got[0].abs(), sv.abs())


def test_topk_bf16_log_probs_and_every_lane_full():
    """bf16 log-probs (the head's dtype; the values come back bf16), and a row whose best keys all fall in one
    lane (every lane's kept list then matters in full)."""
    g = torch.Generator().manual_seed(1)
    lp = torch.log_softmax(torch.randn(6, 6144, generator=g), -1).to(torch.bfloat16)
    for k in (1, 4, 8):
        got, want = triton_topk.best(lp, k), reference.best(lp, k)
        assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    x = torch.full((2, 5000), -9.0)
    x[0, 3::1024] = torch.arange(5, dtype=torch.float32)  # lane 3 holds the 5 best
    x[1, 7::1024] = 1.0  # lane 7 holds 5 tied best: the lower columns first
    for k in (5, 8):
        got, want = triton_topk.best(x, k), reference.best(x, k)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), k


def test_topk_adds_the_base_and_writes_strided_views(monkeypatch):
    """The draft tree's expansion: F parents' k best children each, parent score + log q in fp32, written into
    [B, F, k] views of a wider candidate buffer; one launch."""
    seen = spy_launches(monkeypatch, triton_topk, "_topk_kernel")
    g = torch.Generator().manual_seed(2)
    b, f, k, vd, width = 3, 4, 4, 2000, 40
    logp = torch.log_softmax(torch.randn(b, f, vd, generator=g), -1).to(torch.bfloat16).float()
    parent = torch.randn(b, f, generator=g)
    vals = torch.full((b, width), 7.0)
    idx = torch.full((b, width), -1, dtype=torch.int64)
    out = (vals[:, 4: 4 + f * k].view(b, f, k), idx[:, 4: 4 + f * k].view(b, f, k))
    triton_topk.best(logp, k, add=parent, out=out)
    lp, tok = reference.best(logp, k)
    assert torch.equal(idx[:, 4: 4 + f * k], tok.flatten(1))
    assert torch.equal(vals[:, 4: 4 + f * k], (parent[..., None] + lp).flatten(1))
    assert (vals[:, :4] == 7.0).all() and (idx[:, 4 + f * k:] == -1).all()  # nothing outside the views
    assert len(seen) == 1


def test_topk_refuses_what_it_cannot_answer():
    with pytest.raises(ValueError, match="k=9"):
        triton_topk.best(torch.zeros(2, 2000), 9)
    with pytest.raises(ValueError, match="k=5"):
        triton_topk.best(torch.zeros(2, 4), 5)
