"""The fused Triton ops (m3eagle/kernels/fused/ and m3eagle/kernels/moe/router.py) held equal to their PyTorch reference
(m3eagle/kernels/fused/reference.py), on CPU under the Triton interpreter, in fp32.

Op by op: residual add + Gemma / Llama RMSNorm (strided rows, every optional term), the RoPE tables (plain
and yarn), per-head norm + partial RoPE with the K/V cache writes (target attention, the indexer's one-head
pool, the Eagle3 head's norm-free RoPE), SwiGLU-OAI with live clamps, SiLU-mul, and the router with ties.
Then whole models: the tiny target's logits, caches and aux captures, and an Eagle3.1 head's paged step,
with the triton fused ops against the reference ones.

Residual sums and cache copies are bit-exact; elementwise chains agree to an fp32 ulp or two (the
interpreter's numpy exp / cos are not torch's CPU ones); the norms add a reduction-order difference.

NOTE: TRITON_INTERPRET is set before anything imports triton, and it holds for the whole pytest process
(as in test_triton_attention.py).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from m3eagle.kernels.attention.metadata import build_metadata  # noqa: E402
from m3eagle.kernels.fused import reference, registry  # noqa: E402
from m3eagle.kernels.fused.reference import rope_cos_sin, rope_inv_freq  # noqa: E402
from m3eagle.kernels.ops import REFERENCE, make_ops  # noqa: E402
from tests.helpers.kernel_spy import spy_launches  # noqa: E402

CPU = torch.device("cpu")
TRITON = replace(REFERENCE, fused=registry.create("triton"))
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": True, "attention_factor": 1.2}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float = 2e-6) -> None:
    """Max error relative to the reference's largest magnitude."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    assert torch.isfinite(out).all()
    err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
    assert err <= rel, f"max relative error {err:.2e} > {rel:.0e}"


# ---- norms --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gemma", [True, False])
@pytest.mark.parametrize("n", [32, 100, 256])
@pytest.mark.parametrize("terms", ["none", "residual", "x2+scale", "all"])
def test_add_rms_norm(gemma, n, terms):
    g = gen(n)
    x, res, x2 = (torch.randn(7, n, generator=g) * 3 for _ in range(3))
    w = torch.randn(n, generator=g) * 0.3 + (0.0 if gemma else 1.0)
    res = res if terms in ("residual", "all") else None
    x2, scale = (x2, 2.5) if terms in ("x2+scale", "all") else (None, 1.0)
    y, r = TRITON.fused.add_rms_norm(x, res, w, 1e-6, x2, scale, gemma)
    y_ref, r_ref = reference.add_rms_norm(x, res, w, 1e-6, x2, scale, gemma)
    assert torch.equal(r, r_ref)  # the residual stream: same adds, same order, bit-exact
    assert_close(y, y_ref)
    if terms == "none":
        assert r is x  # nothing to add: the input is the residual, not a copy
    # rows: the gather rides in the launch -- output i is input row rows[i], bit-equal to the full op's row
    rows = torch.tensor([6, 0, 3, 3])
    for ops in (REFERENCE, TRITON):
        yr, rr = ops.fused.add_rms_norm(x, res, w, 1e-6, x2, scale, gemma, rows=rows)
        assert yr.shape == rr.shape == (4, n)
        assert torch.equal(rr, r_ref[rows]) and torch.equal(yr, (y if ops is TRITON else y_ref)[rows])


def test_rms_norm_strided_rows_and_out():
    """Rows of a wider buffer in, a slice of another buffer out (the Eagle3 head's fc_norm chunks and
    attention input), and [T, H, D] inputs (per-head norms)."""
    g = gen(1)
    buf = torch.randn(5, 3 * 40, generator=g)
    w = torch.randn(40, generator=g)
    out = torch.full((5, 2 * 40), 7.0)
    got = TRITON.fused.rms_norm(buf[:, 40:80], w, 1e-5, gemma=False, out=out[:, 40:])
    assert got.data_ptr() == out[:, 40:].data_ptr() and torch.all(out[:, :40] == 7.0)
    assert_close(out[:, 40:], reference.rms_norm(buf[:, 40:80], w, 1e-5, gemma=False))
    x3 = torch.randn(4, 3, 16, generator=g)
    assert_close(TRITON.fused.rms_norm(x3, w[:16], 1e-6), reference.rms_norm(x3, w[:16], 1e-6))


@pytest.mark.parametrize("groups", [1, 2, 3, 4])
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("gemma,dtype", [(False, torch.float32), (True, torch.float32), (False, torch.bfloat16)])
def test_rms_norm_cat_is_one_norm_per_block_in_one_launch(groups, gather, gemma, dtype, monkeypatch):
    """rms_norm_cat (the Eagle3 head's [norm(emb), norm(h)] and fc_norm inputs): each output column block
    equals the backend's own rms_norm of its input, bit for bit (the same per-row code), strided rows in,
    a slice of a wider buffer out; with ids the first input is a table whose rows ids are normed (padding
    ids at 0 included); one launch for up to 3 inputs, the per-input norms past that; and the reference
    backend's form is the reference math."""
    from m3eagle.kernels.fused import norm

    launches = spy_launches(monkeypatch, norm, "_norm_cat_kernel", lambda grid, kw: grid)
    g, n, t = gen(groups), 48, 5
    wide = (torch.randn(t, groups * n + 8, generator=g) * 3).to(dtype)
    xs = [wide[:, i * n:(i + 1) * n] for i in range(groups)]  # rows of a wider buffer
    ids = None
    if gather:
        xs[0] = (torch.randn(11, n, generator=g) * 2).to(dtype)  # a table
        ids = torch.tensor([3, 0, 10, 3, 7])
    ws = [(torch.randn(n, generator=g) * 0.3 + (0.0 if gemma else 1.0)).to(dtype) for _ in range(groups)]
    out = torch.full((t, groups * n + 4), 7.0, dtype=dtype)
    for ops in (TRITON.fused, REFERENCE.fused):
        got = ops.rms_norm_cat(xs, ws, 1e-6, out[:, :groups * n], gemma=gemma, ids=ids)
        assert got.data_ptr() == out.data_ptr() and torch.all(out[:, groups * n:] == 7.0)
        for i, (x, w) in enumerate(zip(xs, ws)):
            x = torch.nn.functional.embedding(ids, x) if i == 0 and gather else x
            want = ops.rms_norm(x, w, 1e-6, gemma, out=torch.empty(t, n, dtype=dtype))
            assert torch.equal(out[:, i * n:(i + 1) * n], want), (ops.name, i)
            if ops is REFERENCE.fused:
                assert torch.equal(want, reference.rms_norm(x, w, 1e-6, gemma).to(dtype))
    assert launches == ([(t, groups)] if groups <= norm.NORM_CAT_MAX else [])


def test_rms_norm_cat_rejects_mismatched_inputs():
    from m3eagle.kernels.fused import norm

    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="out \\[T, inputs \\* width\\]"):
        norm.norm_cat([x, x], [x[0], x[0]], 1e-6, torch.empty(3, 16))
    with pytest.raises(ValueError, match="one dtype, one width"):
        norm.norm_cat([x, x.double()], [x[0], x[0]], 1e-6, torch.empty(3, 32))


def test_add_residual_into_a_strided_slice():
    g = gen(2)
    x, res, x2 = (torch.randn(6, 32, generator=g) for _ in range(3))
    aux = torch.zeros(6, 3 * 32)
    got = TRITON.fused.add_residual(x, res, x2, 2.0, out=aux[:, 32:64])
    assert got.data_ptr() == aux[:, 32:64].data_ptr()
    assert torch.equal(aux[:, 32:64], reference.add_residual(x, res, x2, 2.0))
    assert not aux[:, :32].any() and not aux[:, 64:].any()
    assert TRITON.fused.add_residual(x, None) is x


# ---- RoPE ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", [None, YARN])
@pytest.mark.parametrize("rdim", [8, 32])
def test_rope_tables(scaling, rdim):
    pos = torch.tensor([0, 1, 2, 17, 63, 64, 500, 4095, 3])
    cos, sin = TRITON.fused.rope_cos_sin(pos, rdim, 10000.0, torch.float32, scaling)
    cos_ref, sin_ref = rope_cos_sin(pos, rdim, 10000.0, torch.float32, scaling)
    # angles up to ~4e3 rad: cos/sin of the same fp32 angle, different libm (numpy vs torch)
    torch.testing.assert_close(cos, cos_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, sin_ref, rtol=0, atol=1e-6)
    again = TRITON.fused.rope_cos_sin(pos[:2], rdim, 10000.0, torch.float32, scaling)[0]  # cached inv_freq
    torch.testing.assert_close(again, cos_ref[:2], rtol=0, atol=1e-6)
    inv, _ = rope_inv_freq(rdim, 10000.0, scaling)
    assert len(TRITON.fused._inv_freq) >= 1 and any(torch.equal(v[0], inv) for v in TRITON.fused._inv_freq.values())


def tables(t: int, rdim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pos = torch.randint(0, 3000, (t,), generator=gen(seed))
    cos, sin = rope_cos_sin(pos, rdim, 10000.0, torch.float32)
    return pos, cos, sin


@pytest.mark.parametrize("hq,hk,d,rdim", [(4, 2, 16, 8), (5, 1, 24, 24), (16, 4, 64, 32), (3, 3, 8, 2)])
def test_qkv_rope_store(hq, hk, d, rdim):
    """q/k norm + partial RoPE and both pools written at the step's slots; the rest of each pool untouched.
    q/k/v are views of one fused projection output (token stride > H * D), as a qkv GEMM would give."""
    t, s = 9, 40
    g = gen(hq * 100 + d)
    qkv = torch.randn(t, (hq + 2 * hk) * d + 3, generator=g) * 2
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:(hq + 2 * hk) * d].view(t, hk, d)
    qw, kw = torch.randn(d, generator=g) * 0.2, torch.randn(d, generator=g) * 0.2
    _, cos, sin = tables(t, rdim, 3)
    slots = torch.randperm(s, generator=g)[:t]
    pools = [torch.full((s, hk, d), 5.0) for _ in range(4)]
    q_out = TRITON.fused.qkv_rope_store(q, k, v, qw, kw, 1e-6, cos, sin, pools[0], pools[1], slots)
    q_ref = reference.qkv_rope_store(q, k, v, qw, kw, 1e-6, cos, sin, pools[2], pools[3], slots)
    assert_close(q_out, q_ref)
    assert_close(pools[0], pools[2])
    assert torch.equal(pools[1], pools[3])  # V is copied as is
    untouched = torch.ones(s, dtype=torch.bool)
    untouched[slots] = False
    assert torch.all(pools[0][untouched] == 5.0)
    # q alone, with and without the norm (the Eagle3 head's RoPE has none)
    assert_close(TRITON.fused.qk_norm_rope(q, qw, 1e-6, cos, sin), reference.qk_norm_rope(q, qw, 1e-6, cos, sin))
    assert_close(TRITON.fused.qk_norm_rope(q, None, 0.0, cos, sin), reference.qk_norm_rope(q, None, 0.0, cos, sin))


@pytest.mark.parametrize("scaling", [None, YARN])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_qkv_store_computes_the_tables_in_its_launch(scaling, dtype, monkeypatch):
    """The Eagle3 head's q/k/v op: the launch computes cos/sin from the positions. Bit-equal to the same
    launch reading `rope_cos_sin`'s tables (same fp32 angle and functions, rounded to the table dtype),
    one launch instead of two, and close to the reference (other libm)."""
    from m3eagle.kernels.fused import rope

    t, hq, hk, d, s = 7, 4, 2, 16, 30
    g = gen(5)
    q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hk, hk))
    pos = torch.tensor([0, 1, 17, 63, 500, 4095, 3])
    slots = torch.randperm(s, generator=g)[:t]
    pools = [torch.zeros(s, hk, d, dtype=dtype) for _ in range(6)]
    tabled = spy_launches(monkeypatch, rope, "_rope_table_kernel")
    fused = spy_launches(monkeypatch, rope, "_qkv_rope_kernel", lambda grid, kw: kw["TABLE"])
    got = TRITON.fused.rope_qkv_store(q, k, v, pos, d, 10000.0, pools[0], pools[1], slots, scaling)
    assert tabled == [] and fused == [False]  # one launch, no table
    cos, sin = TRITON.fused.rope_cos_sin(pos, d, 10000.0, dtype, scaling)
    want = TRITON.fused.qkv_rope_store(q, k, v, None, None, 0.0, cos, sin, pools[2], pools[3], slots)
    assert torch.equal(got, want) and torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    ref = REFERENCE.fused.rope_qkv_store(q, k, v, pos, d, 10000.0, pools[4], pools[5], slots, scaling)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(pools[0], pools[4], rtol=tol, atol=tol)


def test_indexer_shapes_one_head_pool_and_sliced_tables():
    """The indexer: iq [T, Hi, Di], ik [T, 1, Di] into a [S, Di] pool, no V, and RoPE tables that are the
    first index_rope_dim columns of the target's (a strided slice: channel i and i + r/2 have different
    frequencies there, so the kernel must read both from the table)."""
    t, hi, di, rdim, s = 6, 2, 8, 16, 20
    g = gen(4)
    iq, ik = torch.randn(t, hi, di, generator=g), torch.randn(t, 1, di, generator=g)
    qw, kw = torch.randn(di, generator=g) * 0.2, torch.randn(di, generator=g) * 0.2
    _, cos, sin = tables(t, rdim, 5)
    r = min(di, rdim)
    slots = torch.tensor([19, 0, 7, 8, 2, 11])
    pool, pool_ref = torch.zeros(s, di), torch.zeros(s, di)
    got = TRITON.fused.qkv_rope_store(iq, ik, None, qw, kw, 1e-6, cos[:, :r], sin[:, :r], pool, None, slots)
    ref = reference.qkv_rope_store(iq, ik, None, qw, kw, 1e-6, cos[:, :r], sin[:, :r], pool_ref, None, slots)
    assert_close(got, ref)
    assert_close(pool, pool_ref)


@pytest.mark.parametrize("d,di,rdim,r", [(16, 8, 8, 4), (8, 16, 8, 8), (24, 24, 12, 12)])
def test_qkv_index_rope_store_one_launch(d, di, rdim, r):
    """A sparse layer's five projections in one launch: q/k/v as qkv_rope_store, plus the indexer's q heads
    (returned) and its one k head (into the [S, Di] index-K pool), with index dims other than the head dim
    and RoPE on the first r columns of the layer's tables. Equal to the reference's two calls; slots
    outside the step untouched in every pool; and one kernel launch, not two."""
    t, hq, hk, hi, s = 7, 4, 2, 3, 30
    g = gen(d * 10 + di)
    raw = torch.randn(t, (hq + 2 * hk) * d + (hi + 1) * di + 1, generator=g) * 2  # one packed GEMM's output
    q = raw[:, : hq * d].view(t, hq, d)
    k = raw[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v = raw[:, (hq + hk) * d:(hq + 2 * hk) * d].view(t, hk, d)
    o = (hq + 2 * hk) * d
    iq = raw[:, o:o + hi * di].view(t, hi, di)
    ik = raw[:, o + hi * di:o + (hi + 1) * di].view(t, 1, di)
    w = [torch.randn(n, generator=g) * 0.2 for n in (d, d, di, di)]
    _, cos, sin = tables(t, rdim, 6)
    slots = torch.randperm(s, generator=g)[:t]
    pools = [[torch.full((s, hk, d), 5.0), torch.full((s, hk, d), 5.0), torch.full((s, di), 5.0)] for _ in range(2)]
    args = (q, k, v, w[0], w[1], 1e-6, cos, sin)
    got = TRITON.fused.qkv_index_rope_store(*args, *pools[0][:2], slots, iq, ik, w[2], w[3], r, pools[0][2])
    ref = reference.qkv_index_rope_store(*args, *pools[1][:2], slots, iq, ik, w[2], w[3], r, pools[1][2])
    for a, b in zip(got, ref):
        assert_close(a, b)
    for a, b in zip(pools[0], pools[1]):
        assert_close(a, b)
    untouched = torch.ones(s, dtype=torch.bool)
    untouched[slots] = False
    assert all(torch.all(p[untouched] == 5.0) for p in pools[0])
    from m3eagle.kernels.fused import rope

    launches = []
    real = rope._qkv_rope_kernel

    class Count:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    rope._qkv_rope_kernel = Count()
    try:
        TRITON.fused.qkv_index_rope_store(*args, *pools[0][:2], slots, iq, ik, w[2], w[3], r, pools[0][2])
    finally:
        rope._qkv_rope_kernel = real
    assert len(launches) == 1
    with pytest.raises(ValueError, match="index rope dim"):
        TRITON.fused.qkv_index_rope_store(*args, *pools[0][:2], slots, iq, ik, w[2], w[3], r + 1, pools[0][2])


# ---- activations --------------------------------------------------------------------------------------


@pytest.mark.parametrize("inter", [40, 128, 1500])
def test_swiglu_oai(inter):
    gu = torch.randn(5, 2 * inter, generator=gen(inter)) * 6  # |x| > 7 often: both clamps are live
    assert (gu[:, :inter] > 7).any() and (gu[:, inter:] < -7).any()
    assert_close(TRITON.fused.swiglu_oai(gu, 1.702, 7.0), reference.swiglu_oai(gu, 1.702, 7.0))
    x3 = gu.view(5, 1, 2 * inter)  # leading dims are kept
    assert TRITON.fused.swiglu_oai(x3, 1.702, 7.0).shape == (5, 1, inter)


def test_silu_mul():
    g = gen(6)
    gate, up = torch.randn(7, 96, generator=g) * 4, torch.randn(7, 96, generator=g)
    assert_close(TRITON.fused.silu_mul(gate, up), reference.silu_mul(gate, up))


# ---- router -------------------------------------------------------------------------------------------


def stable_topk(biased: torch.Tensor, k: int) -> torch.Tensor:
    """The tie rule spelled out: highest first, lowest expert id first among equals."""
    return torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :k]


@pytest.mark.parametrize("e,k", [(4, 2), (60, 3), (256, 8), (128, 1)])
def test_route_matches_reference_and_topk(e, k):
    g = gen(e + k)
    logits = torch.randn(33, e, generator=g) * 2
    bias = torch.randn(e, generator=g) * 0.3
    w, idx = TRITON.fused.route(logits, bias, k)
    w_ref, idx_ref = reference.route(logits, bias, k)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(idx, idx_ref)  # same experts in the same order
    assert_close(w, w_ref)
    # without ties, the chosen set is torch.topk's (what transformers computes)
    top = torch.topk(torch.sigmoid(logits) + bias, k, dim=-1).indices
    assert torch.equal(idx.sort(-1).values, top.sort(-1).values)
    # the weights are the plain sigmoid scores, renormalised
    s = torch.sigmoid(logits).gather(1, idx)
    assert_close(w, s / s.sum(-1, keepdim=True))


@pytest.mark.parametrize("e,k", [(4, 2), (8, 3), (64, 8), (256, 8)])
@pytest.mark.parametrize("levels", [1, 3])
def test_route_ties_take_the_lowest_ids(e, k, levels):
    """Equal biased scores: the lowest ids win, in id order (a zero router is the extreme case). CPU
    torch.topk would pick others (see reference.route), so the rule is pinned here, and the GPU check
    (benchmarks/fused_ops.py) pins it against CUDA torch.topk."""
    g = gen(e * 10 + levels)
    logits = torch.randint(0, levels, (17, e), generator=g).float()
    bias = torch.randint(0, levels, (e,), generator=g).float() * 0.25
    biased = torch.sigmoid(logits) + bias
    want = stable_topk(biased, k)
    for fused in (REFERENCE.fused, TRITON.fused):
        w, idx = fused.route(logits, bias, k)
        assert torch.equal(idx, want), fused.name
    w, idx = TRITON.fused.route(torch.zeros(3, e), torch.zeros(e), k)
    assert torch.equal(idx, torch.arange(k).expand(3, k)) and torch.all(w == 1.0 / k)


def test_route_minus_inf_experts_are_taken_once():
    """Experts with a -inf biased score still fill the top-k when they must, each once, lowest id first."""
    logits = torch.randn(4, 6, generator=gen(7))
    bias = torch.tensor([float("-inf"), 0.0, float("-inf"), float("-inf"), float("-inf"), float("-inf")])
    for fused in (REFERENCE.fused, TRITON.fused):
        _, idx = fused.route(logits, bias, 3)
        assert idx.tolist() == [[1, 0, 2]] * 4, fused.name


@pytest.mark.parametrize("t,e,h", [(1, 32, 64), (3, 6, 100), (33, 34, 600), (64, 3, 1030), (2, 4, 5000),
                                   (65, 8, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_logits_match_the_reference_gemm(t, e, h, dtype):
    """The router GEMV kernel (fp32 weights, activations of any dtype) equals the cast + F.linear reference
    to fp32 summation order, in both launch shapes: one expert row per program (T * E <= 1024; H = 5000
    past one 4096-wide load) and 4-row programs (33 x 34: E not a multiple of 4; H = 600 in two 512-wide chunks).
    T = 65 takes the reference path itself."""
    from m3eagle.kernels.moe import router

    x = (torch.randn(t, h, generator=gen(t + e)) * 2).to(dtype)
    w = torch.randn(e, h, generator=gen(h))
    out = TRITON.fused.router_logits(x, w)
    ref = reference.router_logits(x, w)
    assert out.dtype == torch.float32 and out.shape == (t, e)
    assert_close(out, ref)  # 2e-6: fp32 sums of up to 5,000 terms in another order
    if t > router.ROUTER_GEMV_MAX_T:
        assert torch.equal(out, ref)
    # a strided activation view is read as is (the packed projections hand over column views)
    wide = torch.randn(t, h + 8, generator=gen(5)).to(dtype)
    assert_close(TRITON.fused.router_logits(wide[:, 4:h + 4], w), reference.router_logits(wide[:, 4:h + 4], w))


def test_route_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="fused_backend='reference'"):
        TRITON.fused.route(torch.zeros(2, 4), torch.zeros(4), 5)


# ---- step inputs (the overlap correction; positions and slots) ------------------------------------------


@pytest.mark.parametrize("v", [7, 4096, 6144, 8195])  # under one block, one, one and a half, a ragged tail
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_equal_reference_with_ties_nan_and_offsets(v, dtype):
    """The fused argmax (+ the draft -> target id map) against torch.argmax: rows with ties inside a block,
    across blocks and at the ragged tail (the first maximum wins), an all -inf row, rows with NaN (torch
    returns the first NaN), bf16 logits read without an fp32 copy; every row differs from a sabotaged
    last-maximum rule."""
    g = gen(v)
    x = torch.randn(9, v, generator=g).to(dtype)
    top = x.max() + 1
    x[1, [min(3, v - 1), v - 1]] = top  # a tie: the earlier column
    x[2, :] = float("-inf")  # all -inf: index 0
    x[3, [v // 2, v - 1]] = float("nan")  # the first NaN
    x[4, [0, v - 1]] = top  # first and last column tie
    if v > 4096:
        x[5, [4095, 4096]] = top  # a tie across the block boundary
    x[6, v - 1] = float("nan")  # a NaN in the last column only
    x[7, :] = 0.0  # every column ties: 0
    offsets = torch.randint(-5, 5, (v,), generator=g)
    for off in (None, offsets):
        want = reference.argmax(x, off)
        got = TRITON.fused.argmax(x, off)
        assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)
    assert reference.argmax(x)[[1, 2, 3, 4, 6, 7]].tolist() == [min(3, v - 1), 0, v // 2, 0, v - 1, 0]
    # a strided view (the engine's [B, K+1, V] logits reshaped) and an empty batch
    assert torch.equal(TRITON.fused.argmax(x[::2]), reference.argmax(x[::2]))
    assert TRITON.fused.argmax(x[:0]).shape == (0,)


def test_argmax_writes_a_strided_out_and_scatters_into_slot_rows():
    """The draft loop's argmax writes step j's tokens into column j of the [B, K] drafts and of the rows
    `s` of the slot buffer (the stack + index_copy it replaces); every other entry stays as it was."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 300, generator=g).to(torch.bfloat16)
    off = torch.randint(-3, 3, (300,), generator=g)
    rows = torch.tensor([4, 0, 6, 6, 2])  # a repeated row (the dump slot's): every writer stores its own value
    for fused in (REFERENCE.fused, TRITON.fused):
        drafts = torch.full((5, 3), -1, dtype=torch.int64)
        buf = torch.full((7, 3), -2, dtype=torch.int64)
        got = fused.argmax(x, off, out=drafts[:, 1], scatter=(buf, rows, 2))
        want = x.float().argmax(-1) + off[x.float().argmax(-1)]
        assert torch.equal(got, want) and torch.equal(drafts[:, 1], want)
        assert (drafts[:, [0, 2]] == -1).all()
        keep = torch.ones(7, 3, dtype=torch.bool)
        keep[rows, 2] = False
        assert (buf[keep] == -2).all() and torch.equal(buf[[4, 0, 2], 2], want[[0, 1, 4]])
        assert buf[6, 2].item() in (want[2].item(), want[3].item())
    with pytest.raises(ValueError, match="scatter needs"):
        TRITON.fused.argmax(x, off, scatter=(buf, rows, 3))


# ---- registry -----------------------------------------------------------------------------------------


def test_registry_and_make_ops():
    assert registry.names() == ["batch_invariant", "reference", "triton"]
    assert make_ops(device="cpu").fused.name == "reference"  # auto on CPU
    assert make_ops(device="cpu", fused="triton").fused.name == "triton"
    assert REFERENCE.fused.name == "reference"
    with pytest.raises(ValueError, match="fused_backend"):
        registry.create("cuda-graphs")
    a, b = registry.create("triton"), registry.create("triton")
    assert a is not b  # per engine: no shared cache


@pytest.mark.slow
def test_reference_path_does_not_import_triton():
    import subprocess
    import sys

    # Vacuous (not failing) if something else in the package already imports triton.
    code = ("import sys, torch; from m3eagle.kernels.ops import REFERENCE, make_ops; before = 'triton' in sys.modules; "
            "f = make_ops(device='cpu').fused; x = torch.randn(3, 8); f.add_rms_norm(x, x, torch.zeros(8), 1e-6); "
            "f.route(torch.randn(3, 4), torch.zeros(4), 2); "
            "assert ('triton' in sys.modules) == before, 'the reference fused path imported triton'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "1"})


# ---- whole models -------------------------------------------------------------------------------------


def tiny_target(seed: int, scaling: dict | None = None):
    from m3eagle.config import DENSE_MLP, FULL, MOE_MLP, SPARSE, M3Config
    from m3eagle.models.minimax_m3 import MiniMaxM3

    # index_head_dim 4 < rotary_dim 8: the indexer's RoPE reads a sliced table
    cfg = M3Config(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, rotary_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6,
                   intermediate_size=16, dense_intermediate_size=32, shared_intermediate_size=16,
                   num_local_experts=8, num_experts_per_tok=3, routed_scaling_factor=2.5, swiglu_alpha=1.702,
                   swiglu_limit=7.0, layer_types=(FULL, SPARSE, SPARSE),
                   mlp_layer_types=(DENSE_MLP, MOE_MLP, MOE_MLP), index_n_heads=2, index_head_dim=4,
                   index_block_size=4, index_topk_blocks=2, index_local_blocks=1, rope_scaling=scaling)
    torch.manual_seed(seed)
    model = MiniMaxM3(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.3)  # norm weights too: (1 + w) and w both matter
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0.0, 0.1)
    return model


def page_table() -> torch.Tensor:
    table = torch.zeros(2, 8, dtype=torch.int64)
    table[0, :6] = torch.tensor([3, 9, 1, 7, 11, 5])
    table[1, :5] = torch.tensor([2, 10, 4, 8, 6])
    return table


STEPS = [([12, 9], [12, 9]), ([6, 1], [18, 10]), ([1, 4], [19, 14])]  # (q_lens, kv_lens after the step)
AUX_IDS = (2, 2, 0, 3)  # repeated, the embedding (0) and the last layer's output (3)


def run_target(model, ops) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    """Three engine-like steps (two prompts, one chunked; then a decode row and a 1+3 verify row) with
    `ops` reaching the model as the engine hands it: meta.ops. Returns logits, aux captures, caches."""
    caches = model.new_caches(12 * 4, torch.float32, CPU)
    ids_gen = gen(5)
    logits, aux = [], []
    with torch.no_grad():
        for q_lens, kv_lens in STEPS:
            meta = replace(build_metadata(q_lens, torch.tensor(kv_lens), page_table(), 4, CPU, max_kv=24), ops=ops)
            ids = torch.randint(0, 64, (sum(q_lens),), generator=ids_gen)
            out = torch.full((sum(q_lens) + 2, len(AUX_IDS) * 32), 9.0)  # padded rows stay untouched
            hidden = model(ids, meta.positions, meta, caches, AUX_IDS, out)
            logits.append(model.compute_logits(hidden))
            aux.append(out)
    return logits, aux, caches


@pytest.mark.parametrize("scaling", [None, YARN])
def test_target_logits_equal_with_triton_fused_ops(scaling):
    model = tiny_target(0, scaling)
    ref_logits, ref_aux, ref_caches = run_target(model, REFERENCE)
    logits, aux, caches = run_target(model, TRITON)
    for out, ref in zip(logits, ref_logits):
        assert_close(out, ref, rel=1e-5)
    for out, ref in zip(aux, ref_aux):
        assert_close(out, ref, rel=1e-5)
        assert torch.all(out[-2:] == 9.0)
    for c, r in zip(caches, ref_caches):
        assert_close(c.k, r.k, rel=1e-5)
        assert torch.equal(c.v, r.v) or (c.v - r.v).abs().max() < 1e-5
        if r.idx_k is not None:
            assert_close(c.idx_k, r.idx_k, rel=1e-5)


def test_target_logits_with_the_decode_gemv(monkeypatch):
    """The decode GEMV (fused/gemv.py) inside the model: with fused ops that take it on CPU too
    (gemv_max_t set; the default leaves it to CUDA), one-token steps run every projection and lm_head
    through it and give the reference's logits, K/V and aux captures within fp32 rounding."""
    from m3eagle.kernels.fused import gemv
    from m3eagle.kernels.fused.triton_backend import TritonFused

    calls = []
    linear = gemv.linear
    monkeypatch.setattr(gemv, "linear", lambda *a, **kw: calls.append(a[1].shape) or linear(*a, **kw))
    picks = spy_launches(monkeypatch, gemv, "_linear_kernel", lambda grid, kw: kw["ARGMAX"])
    ops = replace(REFERENCE, fused=TritonFused(gemv_max_t=gemv.MAX_T))
    model = tiny_target(2)
    outs = []
    for o in (REFERENCE, ops):
        caches = model.new_caches(12 * 4, torch.float32, CPU)
        got = []
        with torch.no_grad():
            for q_lens, kv_lens in (([5, 3], [5, 3]), ([1, 1], [6, 4]), ([1, 1], [7, 5])):
                meta = replace(build_metadata(q_lens, torch.tensor(kv_lens), page_table(), 4, CPU, max_kv=24), ops=o)
                ids = torch.tensor([7, 3, 11, 5, 2, 9, 1, 4][:sum(q_lens)])
                aux = torch.zeros(sum(q_lens), len(AUX_IDS) * 32)
                hidden = model(ids, meta.positions, meta, caches, AUX_IDS, aux)
                got += [model.compute_logits(hidden, o.fused), aux]
                # the greedy pick in lm_head's launch (one launch fewer per step) is the logits' argmax
                want = model.compute_logits(hidden, o.fused, fp32=False).argmax(-1)
                assert torch.equal(model.greedy_ids(hidden, o.fused), want)
        outs.append((got, caches))
    assert {tuple(shape) for shape in calls} >= {(64, 32)}  # lm_head [V, H] among them
    assert True in picks  # the decode steps' greedy pick ran in lm_head's launch
    assert len(calls) >= 2 * 4  # every layer's projections, two decode steps
    for out, ref in zip(outs[1][0], outs[0][0]):
        assert_close(out, ref, rel=1e-5)
    for c, r in zip(outs[1][1], outs[0][1]):
        assert_close(c.k, r.k, rel=1e-5)


def test_target_reference_ops_equal_the_oracle():
    """The restructured paged path (residual adds deferred into the next norm) with the reference ops is the
    contiguous oracle's math: one prompt through both."""
    model = tiny_target(1)
    ids = torch.randint(0, 64, (1, 12), generator=gen(8))
    with torch.no_grad():
        seq, seq_aux = model.forward_seq(ids, AUX_IDS)
        caches = model.new_caches(12 * 4, torch.float32, CPU)
        meta = build_metadata([12], torch.tensor([12]), page_table()[:1], 4, CPU, max_kv=24)
        aux = torch.zeros(12, len(AUX_IDS) * 32)
        for ops in (REFERENCE, TRITON):
            hidden = model(ids[0], meta.positions, replace(meta, ops=ops), caches, AUX_IDS, aux)
            assert_close(hidden, seq[0], rel=1e-5)
            assert_close(aux, seq_aux[0], rel=1e-5)


@pytest.mark.parametrize("norm_output", [False, True])
def test_eagle3_head_paged_step_equal_with_triton_fused_ops(norm_output):
    from m3eagle.models.eagle3 import Eagle3Config, Eagle3Head

    cfg = Eagle3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                       vocab_size=64, draft_vocab_size=64, aux_layer_ids=(1, 2, 3), target_hidden_size=32,
                       fc_norm=True, norm_output=norm_output)
    torch.manual_seed(2)
    head = Eagle3Head(cfg).eval()
    with torch.no_grad():
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.3)
    q_lens, kv_lens = [5, 3], torch.tensor([9, 3])
    meta = build_metadata(q_lens, kv_lens, page_table(), 4, CPU, max_kv=24)
    g = gen(9)
    ids = torch.randint(0, 64, (8,), generator=g)
    aux = torch.randn(8, 3 * 32, generator=g)
    outs = []
    with torch.no_grad():
        for ops in (REFERENCE, TRITON):
            cache = head.new_cache(12 * 4, torch.float32, CPU)
            m = replace(meta, ops=ops)
            h_out, h_next = head(ids, m.positions, aux, m, cache, from_aux=True)
            k0 = cache.k.clone()
            rows = torch.tensor([4, 7])  # each row's last token (draft step 0 keeps only those outputs)
            ho_r, hn_r = head(ids, m.positions, aux, m, cache, from_aux=True, rows=rows)
            assert torch.equal(ho_r, h_out[rows]) and torch.equal(hn_r, h_next[rows]) and torch.equal(cache.k, k0)
            h_out2, _ = head(ids, m.positions, h_next, m, cache, from_aux=False)  # a later draft step
            outs.append((h_out, h_next, h_out2, cache.k, cache.v))
    for out, ref in zip(*outs):
        assert_close(out, ref, rel=1e-5)


def test_engine_tokens_equal_with_triton_fused_ops(make_llm):
    """Through the engine: the embedded model and its Eagle3 head (K=3), greedy, on CPU in fp32. The tokens
    and the draft acceptance with fused_backend='triton' equal those with 'reference'."""
    from m3eagle import SamplingParams

    prompts = [[5, 17, 301, 42, 7], [12, 13]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = {}
    for name in ("reference", "triton"):
        llm = make_llm(None, fused_backend=name, num_draft_tokens=3, page_size=16)
        assert llm.ops.fused.name == name
        outs[name] = [(o.outputs[0].token_ids, o.metrics.num_accepted) for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["reference"]


def test_plain_greedy_steps_launch_no_acceptance(make_llm, monkeypatch):
    """Without drafts a greedy row emits its argmax: the step takes a constant count instead of the
    acceptance launch, and its tokens equal the reference backend's."""
    from m3eagle import SamplingParams
    from m3eagle.engine import step_kernels

    accepts = spy_launches(monkeypatch, step_kernels, "_accept_kernel")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = {name: [o.outputs[0].token_ids for o in make_llm(None, fused_backend=name, num_draft_tokens=0,
                                                             page_size=16).generate([[5, 17, 301]], params)]
            for name in ("reference", "triton")}
    assert outs["triton"] == outs["reference"] and len(outs["triton"][0]) == 3
    assert accepts == []


# (64, 3, 40, 2): the widest step the GEMV router takes, with E = 3 (one program per token and expert: 192
# programs; E = 8 spent 11 s of the interpreter on the same code path -- E not a power of two, BLOCK_E = 1)
@pytest.mark.parametrize("t,e,h,k", [(1, 32, 64, 4), (3, 16, 300, 4), (33, 34, 600, 3), (64, 3, 40, 2),
                                     (65, 8, 32, 2)])
def test_route_tokens_one_launch_equals_the_two(t, e, h, k):
    """The fused router (GEMV, then the token's last program routes it) gives exactly what router_logits +
    route give on the same backend, and the reference's experts; its per-token counters are back at zero
    after every launch (the next launch depends on it). T = 65 takes the tiled router (its own GEMM order:
    the reference's experts, weights to fp32 rounding; test_route_tiles_* hold it).
    NOTE: the interpreter's barrier and atomics let every program see every other's logits, so routing
    by the wrong program would pass here (checked); benchmarks/fused_ops.py checks the experts on the GPU."""
    from m3eagle.kernels.fused import triton_backend
    from m3eagle.kernels.moe import router

    fused = triton_backend.TritonFused()
    for seed in range(3 if t <= 16 else 1):  # the interpreter's time grows with T: one draw of the wide steps
        x = torch.randn(t, h, generator=gen(seed + t))
        w = torch.randn(e, h, generator=gen(seed + h)) / h**0.5  # logits ~ N(0, 1): sigmoids far from 0 and 1
        bias = torch.randn(e, generator=gen(seed + e)) * 0.1
        got_w, got_idx = fused.route_tokens(x, w, bias, k)
        want_w, want_idx = fused.route(fused.router_logits(x, w), bias, k)
        if t <= router.ROUTER_GEMV_MAX_T:
            assert torch.equal(got_idx, want_idx) and torch.equal(got_w, want_w)
        ref_w, ref_idx = reference.route_tokens(x, w, bias, k)
        assert torch.equal(got_idx, ref_idx)
        assert_close(got_w, ref_w)
        assert got_w.std() > 0.01  # distinct weights: not a saturated (all-tied) router
    counters = fused._counters.get(torch.device("cpu"))
    if t <= router.ROUTER_GEMV_MAX_T:
        assert counters is not None and not counters.any()


def test_route_tokens_preloading_the_expert_rows_is_bit_equal(monkeypatch):
    """With PDL's weight preload (the router's expert rows read before the wait, one H tile:
    pdl.preload_weights forced on; the interpreter has no wait) the fused router gives the same weights,
    experts and counters as without it; past one H tile it does not take it."""
    from m3eagle.kernels import pdl
    from m3eagle.kernels.moe import router

    cases = [(1, 32, 64, 4), (3, 16, 300, 4), (2, 8, 5000, 2)]  # the last: H > the decode router's one tile
    data = [(torch.randn(t, h, generator=gen(t + h)), torch.randn(e, h, generator=gen(e)) / h**0.5,
             torch.randn(e, generator=gen(k)) * 0.1, k) for t, e, h, k in cases]
    counters = torch.zeros(8, dtype=torch.int32)
    want = [router.route_tokens(x, w, b, k, counters) for x, w, b, k in data]
    launches = spy_launches(monkeypatch, router, "_router_topk_kernel")
    monkeypatch.setattr(pdl, "preload_weights", lambda launch: True)
    for (x, w, b, k), (ww, wi) in zip(data, want):
        gw, gi = router.route_tokens(x, w, b, k, counters)
        assert torch.equal(gi, wi) and torch.equal(gw, ww)
    assert [kw["PRELOAD"] for kw in launches] == [True, True, False]
    assert not counters.any()


# ---- the tiled router (prompt-sized steps) ----------------------------------------------------------------


def test_router_split_is_exact():
    """Three bf16 parts sum to the fp32 weight exactly (in fp32, in order), across magnitudes from 1e-25 to
    1e30, signs, and values that round up in bf16 (the parts change sign)."""
    from m3eagle.kernels.moe import router

    w = torch.randn(64, 300, generator=gen(3)) * torch.logspace(-25, 30, 300)[None, :]
    w[0, :8] = torch.tensor([1 + 2**-8, 1 + 2**-9 + 2**-23, -(1 - 2**-24), 3.0, 0.0, -0.0, 2**-110, 1e38])
    parts = router.router_split(w)
    assert parts.shape == (3, 64, 300) and parts.dtype == torch.bfloat16
    assert torch.equal(parts[0].float() + parts[1].float() + parts[2].float(), w)


@pytest.mark.parametrize("t,e,h,k", [(65, 8, 32, 2), (300, 32, 200, 4), (100, 128, 64, 8), (70, 3, 50, 2),
                                     (129, 256, 40, 4), (17, 34, 130, 3)])
def test_route_tiles_match_the_reference(t, e, h, k):
    """One launch for the router GEMM (bf16 x times the three bf16 parts of the fp32 weight, fp32
    accumulation) and the route, BLOCK_M tokens per program: the reference's experts (cast + fp32 GEMM +
    route) in its order, its weights to fp32 rounding. Shapes: a partial last tile (65, 300, 17), E not a
    power of two and below the dot's 16 columns (3, 34), E = 256 (the tile's limit), H not a multiple of
    the chunk (200, 50, 130), k up to 8; block_m 16 and 64, block_h 32 and 128."""
    from m3eagle.kernels.moe import router

    for seed in range(2):
        x = torch.randn(t, h, generator=gen(seed + t)).to(torch.bfloat16)
        w = torch.randn(e, h, generator=gen(seed + h)) / h**0.5  # logits ~ N(0, 1)
        bias = torch.randn(e, generator=gen(seed + e)) * 0.1
        ref_w, ref_idx = reference.route_tokens(x, w, bias, k)
        for block_m, block_h in ((16, 32), (64, 128)):
            got_w, got_idx = router.route_tiles(x, router.router_split(w), bias, k, block_m, block_h)
            assert got_idx.dtype == torch.int64 and torch.equal(got_idx, ref_idx)
            assert_close(got_w, ref_w)
        assert ref_w.std() > 0.01  # distinct weights: not a saturated (all-tied) router


def test_route_tiles_ties_nan_and_minus_inf():
    """The tie rule on whole tiles: equal logits (identical weight rows) go to the lowest ids in order; a
    NaN logit ranks first (torch.sort's place for NaN); -inf-biased experts fill the top-k only when they
    must, each once. Rows of one tile get their own routing (a row of ties next to ordinary rows)."""
    from m3eagle.kernels.moe import router

    t, e, h, k = 40, 6, 32, 3
    x = torch.randn(t, h, generator=gen(1)).to(torch.bfloat16)
    w = torch.randn(e, h, generator=gen(2)) / h**0.5
    w[3] = w[1]  # experts 1 and 3 always tie
    x[5] = 0.0  # every logit 0: all six tie
    x[7, 0] = float("nan")  # every logit NaN
    for bias in (torch.zeros(e), torch.tensor([float("-inf"), 0.0, float("-inf"), 0.0, float("-inf"),
                                               float("-inf")])):
        ref_w, ref_idx = reference.route_tokens(x, w, bias, k)
        got_w, got_idx = router.route_tiles(x, router.router_split(w), bias, k)
        assert torch.equal(got_idx, ref_idx)
        assert torch.allclose(got_w, ref_w, rtol=2e-6, atol=0, equal_nan=True)
        assert got_idx[5].tolist() == ([0, 1, 2] if not bias[0] else [1, 3, 0])
        assert got_idx[7].tolist() == [0, 1, 2] and got_w[7].isnan().all()
    both = (got_idx == 1).any(1) & (got_idx == 3).any(1)
    assert both.sum() > 5 and ((got_idx == 1).int().argmax(1) < (got_idx == 3).int().argmax(1))[both].all()


def test_route_tokens_takes_the_tiled_router_past_the_gemv_limit(monkeypatch):
    """TritonFused.route_tokens: T <= ROUTER_GEMV_MAX_T -> the one-launch GEMV router; above it the tiled
    router for bf16 activations, an fp32 weight with E <= ROUTER_TILE_MAX_E and T >= H / 4, else the
    reference's cast + GEMM + route. The weight's split is made once, again after an in-place change, and
    dropped with the weight."""
    from m3eagle.kernels.fused import triton_backend
    from m3eagle.kernels.moe import router

    calls, splits = [], []
    real_tiles, real_split = router.route_tiles, router.router_split
    monkeypatch.setattr(router, "route_tiles", lambda *a, **kw: calls.append(1) or real_tiles(*a, **kw))
    monkeypatch.setattr(triton_backend, "router_split", lambda w: splits.append(1) or real_split(w))
    fused = triton_backend.TritonFused()
    lim, big = router.ROUTER_GEMV_MAX_T, router.ROUTER_TILE_MAX_E + 1
    wide = (lim + 1) * router.ROUTER_TILE_MIN_T_PER_H
    for t, e, h, dtype, tiled in ((lim, 8, 32, torch.bfloat16, False), (lim + 1, 8, 32, torch.bfloat16, True),
                                  (lim + 1, 8, 32, torch.float32, False), (lim + 1, big, 32, torch.bfloat16, False),
                                  (lim + 1, 8, wide, torch.bfloat16, True), (lim + 1, 8, wide + 1, torch.bfloat16, False)):
        x = torch.randn(t, h, generator=gen(t)).to(dtype)
        w = torch.randn(e, h, generator=gen(e)) / h**0.5
        bias = torch.zeros(e)
        calls.clear()
        got_w, got_idx = fused.route_tokens(x, w, bias, 2)
        ref_w, ref_idx = reference.route_tokens(x, w, bias, 2)
        assert bool(calls) == tiled, (t, e, h, dtype)
        assert torch.equal(got_idx, ref_idx)
        assert_close(got_w, ref_w)
    x = torch.randn(lim + 1, 32, generator=gen(0)).to(torch.bfloat16)
    w = torch.randn(8, 32, generator=gen(1))
    splits.clear()
    fused.route_tokens(x, w, torch.zeros(8), 2)
    fused.route_tokens(x, w, torch.zeros(8), 2)
    assert len(splits) == 1
    w.mul_(-1.0)  # in place: the cached split is stale
    _, idx = fused.route_tokens(x, w, torch.zeros(8), 2)
    assert len(splits) == 2 and torch.equal(idx, reference.route_tokens(x, w, torch.zeros(8), 2)[1])
    assert id(w) in fused._splits
    key = id(w)
    del w  # the cached split goes with its weight
    assert key not in fused._splits


@pytest.mark.parametrize("dtype", [torch.float32])  # fp32: a tight bound; the bf16 roundings: test_gemv's test
def test_eagle3_head_folded_gemv_step_equals_its_separate_launches(dtype, monkeypatch):
    """The draft step's folds: with the decode GEMV on (gemv_max_t), a one-token draft step adds the attention's
    residual in o_proj's epilogue and runs the post-attention norm in gate_up's prologue (with its silu
    epilogue): no add_rms_norm launch between them. Its h_out, h_next and K/V equal the same backend's
    separate launches (the fold switched off) to the norm's fp32 sum order, and the reference's. Steps of
    more tokens than FOLD_MAX_T and weights wider than FOLD_MAX_K (where the fold measured slower) keep the
    separate launches."""
    from m3eagle.kernels.fused import gemv, norm, triton_backend
    from m3eagle.models.eagle3 import Eagle3Config, Eagle3Head
    from m3eagle.models.layers import pack_projections

    cfg = Eagle3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                       vocab_size=64, draft_vocab_size=40, aux_layer_ids=(1, 2, 3), target_hidden_size=32)
    torch.manual_seed(3)
    head = Eagle3Head(cfg).eval()
    with torch.no_grad():
        for p in head.parameters():
            torch.nn.init.normal_(p, std=0.3)
    head = head.to(dtype)
    pack_projections(head)
    fused = triton_backend.TritonFused(gemv_max_t=gemv.MAX_T)
    folded = replace(REFERENCE, fused=fused)
    g = gen(11)
    meta = build_metadata([1], torch.tensor([6]), page_table()[:1], 4, CPU, max_kv=24)
    ids = torch.randint(0, 64, (1,), generator=g)
    hidden = (torch.randn(1, 32, generator=g) * 2).to(dtype)
    lin = spy_launches(monkeypatch, gemv, "_linear_kernel", lambda grid, kw: (kw["NORM"], kw["RES"], kw["ACT"]))
    norms = spy_launches(monkeypatch, norm, "_add_norm_kernel")
    outs = {}
    for name, ops in (("folded", folded), ("reference", REFERENCE), ("separate", folded)):
        if name == "separate":
            monkeypatch.setattr(fused, "folds", lambda t, w: False)
        lin.clear(), norms.clear()
        cache = head.new_cache(12 * 4, dtype, CPU)
        m = replace(meta, ops=ops)
        with torch.no_grad():
            h_out, h_next = head(ids, m.positions, hidden, m, cache, from_aux=False)
        outs[name] = (h_out.float(), h_next.float(), cache.k.float(), cache.v.float())
        if name == "folded":  # q/k/v, o + residual, norm + gate_up + silu, down; the final norm only
            assert sorted(lin) == sorted([(False, False, 0), (False, True, 0), (True, False, 1), (False, False, 0)])
            assert len(norms) == 1
        if name == "separate":
            assert sorted(lin) == sorted([(False, False, 0)] * 3 + [(False, False, 1)]) and len(norms) == 2
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for name in ("separate", "reference"):
        for out, ref in zip(outs["folded"], outs[name]):
            assert (out - ref).abs().max() <= tol * max(1.0, ref.abs().max().item()), name
    # the greedy pick (fewer launches per draft): lm_head + argmax + d2t in one launch, the drafts' column and slot rows
    # written by it; equal to the logits' argmax of the separate launches
    head.set_vocab_mapping(torch.randperm(64, generator=g)[:40])
    h_out = outs["folded"][0].to(dtype)
    drafts, slots = torch.full((1, 3), -1), torch.full((4, 3), -1)
    am = spy_launches(monkeypatch, gemv, "_linear_kernel", lambda grid, kw: kw["ARGMAX"])
    got = head.greedy_ids(h_out, fused, drafts[:, 1], (slots, torch.tensor([2]), 1))
    assert am == [True]  # one launch
    want = head.draft_to_target(head.compute_logits(h_out, fused, fp32=False).argmax(-1))
    assert torch.equal(got, want) and drafts[0, 1] == want[0] and slots[2, 1] == want[0]
    monkeypatch.undo()
    lin = spy_launches(monkeypatch, gemv, "_linear_kernel", lambda grid, kw: (kw["NORM"], kw["RES"]))
    t = triton_backend.TritonFused.FOLD_MAX_T + 1
    m = replace(build_metadata([1] * t, torch.tensor([6, 3, 5][:t]), page_table()[:t], 4, CPU, max_kv=24), ops=folded)
    with torch.no_grad():
        head(torch.arange(t), m.positions, hidden.expand(t, -1), m, head.new_cache(12 * 4, dtype, CPU), from_aux=False)
    assert len(lin) == 4 and not any(norm or res for norm, res in lin)
    f = triton_backend.TritonFused(gemv_max_t=gemv.MAX_T)  # and weights wider than FOLD_MAX_K (m3-8b's 4096) neither
    k = f.FOLD_MAX_K
    assert f.folds(1, torch.zeros(8, k)) and not f.folds(1, torch.zeros(8, 2 * k)) and not f.folds(2, torch.zeros(8, k))
