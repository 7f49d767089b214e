"""The batch-invariant kernels (m3eagle/kernels/batch_invariant/), on CPU under the Triton interpreter.

Each test computes one row (a token, a (token, expert) pair) several ways -- alone, at different positions
inside batches of 2..64 rows, as a decode row, a verify row or a token of prompt chunks of several sizes --
and asserts the bits are identical, then holds the result to the PyTorch oracle within rounding. The
launch-shape choices are checked to be pure functions of one row's shape, and the mutation tests make one
choice batch-dependent again (a split, a K step) and show the invariance assertion then fails: the checks
can fail.

NOTE: TRITON_INTERPRET is set before anything imports triton, and it holds for the whole pytest process.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

import inspect  # noqa: E402
from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from m3eagle.kernels.attention import reference, triton_kernels  # noqa: E402
from m3eagle.kernels.attention.metadata import TRASH_PAGE, build_metadata  # noqa: E402
from m3eagle.kernels.batch_invariant import attention as bi_attention  # noqa: E402
from m3eagle.kernels.batch_invariant import matmul  # noqa: E402
from m3eagle.kernels.batch_invariant import moe as bi_moe  # noqa: E402
from m3eagle.kernels.batch_invariant import router as bi_router  # noqa: E402
from m3eagle.kernels.batch_invariant.fused import BatchInvariantFused  # noqa: E402
from m3eagle.kernels.fused.reference import rope_cos_sin  # noqa: E402
from m3eagle.kernels.moe import reference as moe_reference  # noqa: E402
from m3eagle.kernels.ops import make_ops  # noqa: E402
from tests.helpers.kernel_spy import count_calls, spy_launches  # noqa: E402

CPU = torch.device("cpu")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- the selection functions ---------------------------------------------------------------------------


def test_selection_functions_see_one_rows_shape_only():
    """Every launch-shape choice takes the shape of one row's work: no rows, tokens or KV bound to read."""
    assert list(inspect.signature(matmul.matmul_config).parameters) == ["n", "k", "dtype"]
    assert list(inspect.signature(bi_attention.dense_config).parameters) == ["head_dim", "group"]
    assert list(inspect.signature(bi_attention.sparse_config).parameters) == ["block_size"]
    assert list(inspect.signature(bi_attention.index_config).parameters) == ["block_size", "index_dim"]
    assert list(inspect.signature(bi_moe.moe_config).parameters) == ["num_experts", "hidden", "inter", "top_k",
                                                                     "dtype"]
    assert list(inspect.signature(bi_router.router_config).parameters) == ["n_exp", "hidden"]
    # pure: equal arguments, equal answers; and the GEMM's K split is whole K steps of a fixed tile
    for n, k in ((96, 300), (2048, 2048), (151_000, 2048), (16, 64)):
        for dt in (torch.float32, torch.bfloat16):
            a, b = matmul.matmul_config(n, k, dt), matmul.matmul_config(n, k, dt)
            assert a == b and 1 <= a.splits <= matmul.MAX_SPLITS and a.block_m in (32, 64)


def test_make_ops_deterministic():
    """deterministic: 'auto' is the reference on CPU and batch_invariant on CUDA; batch-dependent backends
    are refused by name, the invariant ones may be forced (the interpreter tests' engines do)."""
    ops = make_ops(device="cpu", deterministic=True)
    assert (ops.attention.name, ops.moe.name, ops.fused.name) == ("reference", "reference", "reference")
    ops = make_ops("batch_invariant", "batch_invariant", "cpu", "batch_invariant", deterministic=True)
    assert (ops.attention.name, ops.moe.name, ops.fused.name) == ("batch_invariant",) * 3
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        make_ops("triton", device="cpu", deterministic=True)
    # on CUDA the PyTorch reference runs cuBLAS, whose tiles follow the row count: refused there (the check
    # precedes building anything, so it runs without a GPU)
    with pytest.raises(ValueError, match="moe_backend='reference'.*cuda"):
        make_ops("auto", "reference", "cuda", deterministic=True)


# ---- the GEMM ------------------------------------------------------------------------------------------


def _rows_invariant(f, x: torch.Tensor, sizes=(1, 2, 3, 7, 16, 33, 64)) -> None:
    """f(x[a:a+m])[j] == f(x)[a+j] bit for bit, the row at several positions of batches of several sizes."""
    full = f(x)
    for m in sizes:
        for a in {0, max(0, x.shape[0] - m), (x.shape[0] - m) // 2}:
            part = f(x[a:a + m])
            assert torch.equal(part, full[a:a + m]), f"rows {a}..{a + m} differ from the same rows in the batch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(96, 300), (40, 64)])
def test_matmul_rows_invariant(dtype, n, k):
    g = gen(1)
    x = torch.randn(64, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    _rows_invariant(lambda a: matmul.linear(a, w), x)
    ref = matmul.reference_linear(x.float(), w.float())
    err = (matmul.linear(x, w).float() - ref).abs().max() / ref.abs().max()
    # fp32: summation order only; bf16: one output rounding (the interpreter truncates, so up to an ulp)
    assert err <= (1e-5 if dtype == torch.float32 else 1e-2), err


def test_matmul_mutation_fails():
    """A K split chosen from the row count (as split-K GEMMs do) breaks the invariance test above."""
    g = gen(2)
    x, w = torch.randn(64, 256, generator=g), torch.randn(48, 256, generator=g)

    def mutated(a):
        cfg = matmul.matmul_config(w.shape[0], w.shape[1], w.dtype)
        return matmul.linear(a, w, config=replace(cfg, splits=1 if a.shape[0] <= 4 else 4))

    with pytest.raises(AssertionError, match="differ"):
        _rows_invariant(mutated, x, sizes=(1, 64))


# ---- norms, routing and the fused composition ----------------------------------------------------------


def test_fused_ops_rows_invariant():
    """The fused ops the mode runs (norms, the folded gate_up + activation, LM head + argmax and router launches,
    the unfolded norm + GEMM) keep a row's bits independent of the batch."""
    f = BatchInvariantFused()
    g = gen(3)
    x, r = torch.randn(64, 96, generator=g), torch.randn(64, 96, generator=g)
    nw = torch.randn(96, generator=g)
    w = torch.randn(80, 96, generator=g)
    rw, bias = torch.randn(4, 96, generator=g), torch.randn(4, generator=g) * 0.1
    few = (1, 7, 64)
    _rows_invariant(lambda a: f.rms_norm(a, nw, 1e-6), x, few)
    _rows_invariant(lambda a: torch.cat(f.add_rms_norm(a[:, :96], a[:, 96:], nw, 1e-6), 1), torch.cat([x, r], 1), few)
    _rows_invariant(lambda a: f.norm_linear(a, nw, 1e-6, w), x, few)
    _rows_invariant(lambda a: f.linear_swiglu_oai(a, w, 1.702, 7.0), x, few)
    _rows_invariant(lambda a: f.linear_argmax(a, w), x, few)
    # the router is one program per (token, expert) under the interpreter: 17 rows keep it short
    _rows_invariant(lambda a: torch.cat([t.float() for t in f.route_tokens(a, rw, bias, 2)], 1), x[:17], (1, 7, 17))
    assert not f.folds(1, w)


# ---- attention -----------------------------------------------------------------------------------------

PAGE, HQ, HKV, D, HI, DI, BLOCK, TOPK, LOCAL = 4, 4, 2, 16, 2, 8, 4, 3, 1


class Seq:
    """One sequence's K/V / index-K in paged pools (a shuffled page table) and its per-position q / iq."""

    def __init__(self, seed: int, length: int = 44, pages: int = 40):
        g = gen(seed)
        self.length = length
        held = -(-length // PAGE)
        self.table = torch.randperm(pages, generator=g)[:held] + 1  # page 0 is the trash page
        s = (pages + 1) * PAGE
        self.k, self.v = torch.randn(s, HKV, D, generator=g), torch.randn(s, HKV, D, generator=g)
        self.ik = torch.randn(s, DI, generator=g)
        self.q, self.iq = torch.randn(length, HQ, D, generator=g), torch.randn(length, HI, DI, generator=g)


def _step(seq: Seq, rows: list[tuple[int, int]], extra_kv: int):
    """rows = [(first position, tokens)] of `seq` -> (meta, q, iq): one row per entry, its KV up to its last
    token; the KV bound overshoots by extra_kv, as the host's optimistic bound does."""
    q_lens = [n for _, n in rows]
    kv = [s + n for s, n in rows]
    width = -(-(max(kv) + extra_kv) // PAGE) + 1
    table = torch.full((len(rows), width), TRASH_PAGE, dtype=torch.int64)
    for r, n in enumerate(kv):  # a row holds the pages its KV needs; TRASH_PAGE past them
        held = min(-(-n // PAGE), width)
        table[r, :held] = seq.table[:held]
    meta = build_metadata(q_lens, torch.tensor(kv), table, PAGE, CPU, max_kv=max(kv) + extra_kv)
    pos = torch.cat([torch.arange(s, s + n) for s, n in rows])
    return meta, seq.q[pos].contiguous(), seq.iq[pos].contiguous()


def _token_outputs(backend, seq: Seq, p: int, sparse: bool) -> dict[str, torch.Tensor]:
    """Position p's attention output [HQ, D] computed as a decode row, a verify row (two places), and a
    token of prompt chunks of several sizes, each among other rows of the same pools."""
    ways = {"decode": ([(p, 1)], 0), "decode+batch": ([(5, 3), (p, 1), (0, 9)], 7),
            "verify@0": ([(p, 4)], 3), "verify@2": ([(0, 1), (p - 2, 4)], 1)}
    for c in (3, 16, 44):
        start = (p // c) * c
        n = min(c, seq.length - start)
        ways[f"chunk{c}"] = ([(1, 2), (start, n)], 0)
    out = {}
    for name, (rows, extra) in ways.items():
        meta, q, iq = _step(seq, rows, extra)
        if sparse:
            o = backend.sparse_attention(q, seq.k, seq.v, meta, 0.25, iq, seq.ik, BLOCK, TOPK, LOCAL)
        else:
            o = backend.attention(q, seq.k, seq.v, meta, 0.25)
        flat = 0
        for s, n in rows:  # the flat token of position p in the target row (the last row holding it)
            if s <= p < s + n:
                at = flat + p - s
            flat += n
        out[name] = o[at]
        if name == "chunk16":
            ref = reference.paged_attention(q, seq.k, seq.v, meta, 0.25, *((iq, seq.ik, BLOCK, TOPK, LOCAL)
                                                                         if sparse else ()))
            err = (o - ref).abs().max() / ref.abs().max()
            assert err <= 1e-4, err
    return out


def _assert_same(outs: dict[str, torch.Tensor]) -> None:
    first = next(iter(outs))
    for name, o in outs.items():
        assert torch.equal(o, outs[first]), f"{name} differs from {first}"


@pytest.mark.parametrize("sparse", [False, True])
def test_attention_token_invariant(sparse):
    """A query token's output is the same bits as a decode row, a verify row and a token of prompt chunks of
    3 / 16 / 44 tokens, at several positions (MSA: past the top-k, so the indexer really selects)."""
    backend = bi_attention.BatchInvariantBackend()
    seq = Seq(4)
    for p in (21, 40):
        _assert_same(_token_outputs(backend, seq, p, sparse))


def test_sparse_short_context_skips_the_indexer_same_bits(monkeypatch):
    """A step whose KV bound fits the top-k walks every visible block without the indexer: a token there has the
    bits it has in steps whose bound (another row's context, the host's overshoot) runs the indexer."""
    backend = bi_attention.BatchInvariantBackend()
    calls = count_calls(monkeypatch, backend, "select_blocks")
    seq = Seq(6)
    for p in (5, 10):  # 2 and 3 blocks of 4 keys: within TOPK = 3 alone, past it beside longer rows
        outs = _token_outputs(backend, seq, p, sparse=True)
        _assert_same(outs)
        assert 0 < len(calls) < len(outs), (p, len(calls))  # both paths ran
        calls.clear()


def test_attention_mutation_fails(monkeypatch):
    """Split-KV chosen from the batch (the triton backend's policy) breaks the invariance test above."""
    real = triton_kernels.dense_attention

    def split_by_batch(q, k, v, meta, scale, **kw):
        kw["num_splits"], kw["block_n"] = (1 if meta.num_tokens <= 1 else 3), 16
        return real(q, k, v, meta, scale, **kw)

    monkeypatch.setattr(triton_kernels, "dense_attention", split_by_batch)
    with pytest.raises(AssertionError, match="differs"):
        _assert_same(_token_outputs(bi_attention.BatchInvariantBackend(), Seq(5), 37, sparse=False))


def test_prompt_kv_bytes_chunk_invariant():
    """A prompt's K/V and index-K pool bytes are identical however it is chunked: the projections run the
    batch-invariant GEMM and the norm + RoPE + store launch is one program per token."""
    f = BatchInvariantFused()
    g = gen(6)
    n, hidden = 23, 32
    x = torch.randn(n, hidden, generator=g)
    w = torch.randn(HQ * D + 2 * HKV * D + HI * DI + DI, hidden, generator=g) * 0.2
    qn, kn, iqn, ikn = (torch.rand(d, generator=g) + 0.5 for d in (D, D, DI, DI))
    slots = torch.randperm(64, generator=g)[:n]

    def run(chunks: list[int]) -> tuple[torch.Tensor, ...]:
        kp, vp, ikp = torch.zeros(64, HKV, D), torch.zeros(64, HKV, D), torch.zeros(64, DI)
        s = 0
        for c in chunks:
            pos = torch.arange(s, s + c)
            y = f.linear(x[s:s + c], w)
            q, k, v, iq, ik = y.split([HQ * D, HKV * D, HKV * D, HI * DI, DI], 1)
            cos, sin = rope_cos_sin(pos, D, 10000.0, torch.float32)
            f.qkv_index_rope_store(q.view(c, HQ, D), k.view(c, HKV, D), v.view(c, HKV, D), qn, kn, 1e-6, cos, sin,
                                   kp, vp, slots[s:s + c], iq.view(c, HI, DI), ik.view(c, 1, DI), iqn, ikn, DI, ikp)
            s += c
        return kp, vp, ikp

    whole = run([n])
    for chunks in ([1] * n, [7, 16], [5, 5, 5, 8], [22, 1]):
        for a, b in zip(run(chunks), whole):
            assert torch.equal(a, b), chunks


# ---- MoE -----------------------------------------------------------------------------------------------


def _moe_case(seed: int, t: int = 40, e: int = 8, h: int = 64, i: int = 32, k: int = 2):
    g = gen(seed)
    x = torch.randn(t, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1
    logits = torch.randn(t, e, generator=g)
    idx = logits.topk(k).indices
    return x, torch.softmax(logits.gather(1, idx), -1), idx, w13, w2


def test_moe_rows_invariant():
    """A token's routed output is the same bits alone and inside batches of any size (each batch routes its
    tokens to the experts in a different mix, so the token's row moves inside its experts' row blocks)."""
    impl = bi_moe.BatchInvariantMoE()
    x, wts, idx, w13, w2 = _moe_case(7)
    f = lambda sl: impl.experts(x[sl], wts[sl], idx[sl], w13, w2, 1.702, 7.0)  # noqa: E731
    full = f(slice(None))
    for a, m in ((0, 1), (39, 1), (3, 2), (10, 17), (1, 33)):
        assert torch.equal(f(slice(a, a + m)), full[a:a + m]), (a, m)
    ref = moe_reference.experts(x, wts, idx, w13, w2, 1.702, 7.0)
    assert ((full - ref).abs().max() / ref.abs().max()) <= 1e-5


@pytest.mark.parametrize("shared_inter", [32, 48])
def test_moe_shared_expert_rides_in_the_routed_launches_rows_invariant(shared_inter):
    """The shared expert as one more expert of the sorted launches (its own width too): a token's whole MoE output
    (routed_scale * routed + shared) is the same bits alone and in batches on both sides of the fused-combine
    threshold, and matches the reference within rounding."""
    impl = bi_moe.BatchInvariantMoE()
    x, wts, idx, w13, w2 = _moe_case(10)
    g = gen(11)
    s13 = torch.randn(2 * shared_inter, x.shape[1], generator=g) * 0.1
    s2 = torch.randn(x.shape[1], shared_inter, generator=g) * 0.1
    f = lambda sl: impl.experts_and_shared(x[sl], wts[sl], idx[sl], w13, w2, s13, s2, 1.702, 7.0, 2.0)  # noqa: E731
    full = f(slice(None))
    assert full is not None
    for a, m in ((0, 1), (39, 1), (3, 2), (10, 17), (1, 33)):
        assert torch.equal(f(slice(a, a + m)), full[a:a + m]), (a, m)
    t = x.shape[0]
    shared = moe_reference.experts(x, torch.ones(t, 1), torch.zeros(t, 1, dtype=torch.long), s13[None], s2[None],
                                   1.702, 7.0)
    ref = moe_reference.experts(x, wts, idx, w13, w2, 1.702, 7.0) * 2.0 + shared
    assert ((full - ref).abs().max() / ref.abs().max()) <= 1e-5


def test_moe_shared_expert_it_cannot_index_runs_apart():
    """A shared expert the sorted GEMMs cannot index (another dtype) is refused for every step alike: None, so the
    model runs it apart."""
    impl = bi_moe.BatchInvariantMoE()
    x, wts, idx, w13, w2 = _moe_case(12)
    s13, s2 = torch.zeros(64, x.shape[1], dtype=torch.float64), torch.zeros(x.shape[1], 32, dtype=torch.float64)
    for m in (1, 40):
        assert impl.experts_and_shared(x[:m], wts[:m], idx[:m], w13, w2, s13, s2, 1.702, 7.0, 2.0) is None


def test_moe_small_steps_fuse_the_combine(monkeypatch):
    """Steps of up to COMBINE_FUSE_MAX_T tokens sum in the down launch (no combine launch), wider ones launch the
    combine; the counters are zero after either (test_moe_rows_invariant holds the two sides' bits equal)."""
    from m3eagle.kernels.moe import triton_moe

    impl = bi_moe.BatchInvariantMoE()
    x, wts, idx, w13, w2 = _moe_case(9)
    launched = spy_launches(monkeypatch, triton_moe, "_combine_kernel")
    small = triton_moe.COMBINE_FUSE_MAX_T
    impl.experts(x[:small], wts[:small], idx[:small], w13, w2, 1.702, 7.0)
    assert launched == []
    impl.experts(x[:small + 1], wts[:small + 1], idx[:small + 1], w13, w2, 1.702, 7.0)
    assert len(launched) == 1
    assert not impl._counters.get(x.device).any()


def test_moe_mutation_fails(monkeypatch):
    """A K step chosen from the token count (as the tuning table's buckets do) breaks that invariance."""
    real = bi_moe.moe_config
    x, wts, idx, w13, w2 = _moe_case(8)

    def by_tokens(e, h, i, k, dt):
        return replace(real(e, h, i, k, dt), block_k=32 if by_tokens.t == 1 else 64)

    monkeypatch.setattr(bi_moe, "moe_config", by_tokens)
    impl = bi_moe.BatchInvariantMoE()
    by_tokens.t = 40
    full = impl.experts(x, wts, idx, w13, w2, 1.702, 7.0)
    by_tokens.t = 1
    alone = [torch.equal(impl.experts(x[j:j + 1], wts[j:j + 1], idx[j:j + 1], w13, w2, 1.702, 7.0)[0], full[j])
             for j in range(8)]
    assert not all(alone)
