"""The W8A16 MXFP8 kernels (m3eagle/kernels/quant/w8a16.py) held to the plain PyTorch reference (mxfp8.py), on CPU
under the Triton interpreter.

`mx_linear`: every path (the decode GEMV's plain and LEAN bodies and the tiled GEMM, each unsplit and split-K,
the split summed by a second launch or by each tile's last program) equals x.float() @ dequantize_mx(q, s).T
within 1e-5 relative error in fp32 for K = 32..512 (K = 96, 160: a partial last step), N not a multiple of the
block, T in {1, 3, 8, 17, 64}; bit-equal on data whose every product and partial sum is exact in fp32 (small
integers times powers of two), so any summation order gives the same bits; bf16 / fp16 within their rounding. A
mis-applied scale (shifted one block, transposed, 2 ** (127 - s)) must fail that check. The one-launch split-K
sum equals the two-launch one bit for bit for S = 2..8 (the split order), repeats bit for bit and leaves every
counter zero. Kernel mutations these tests were seen to catch: the last program summing in reverse split order
(test_split_one_launch), its counter reset removed (a second call then writes nothing: the reference checks),
the lean body taking a chunk's scale from the next group, a split reading split 0's scales (bf16 and fp16
paths), the lean rows all reading x row 0, the lean split start not advanced.
`mx_moe_experts` equals `moe.reference.experts` on the dequantized weights (E = 4, k = 2, several T). Bad inputs
raise errors that name the argument. Speed is measured on the GPU by benchmarks/w8a16.py.

NOTE: TRITON_INTERPRET is set before anything imports triton, and it holds for the whole pytest process.
"""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from m3eagle.kernels.moe import reference as moe_ref  # noqa: E402
from m3eagle.kernels.quant import w8a16  # noqa: E402
from m3eagle.kernels.quant.mxfp8 import dequantize_mx, quantize_mx  # noqa: E402
from m3eagle.kernels.quant.w8a16 import MxConfig, mx_linear, mx_moe_experts, pick_config  # noqa: E402
from tests.helpers.kernel_spy import spy_launches  # noqa: E402

CONFIGS = {
    "auto": None,
    "gemv": MxConfig(False, 1, 8, 64),  # block_m is ignored by the GEMV (BLOCK_T = next_pow2(T))
    "gemv_split": MxConfig(False, 1, 16, 32, split_k=3),  # partials + the ordered second-stage sum
    "gemm": MxConfig(True, 16, 32, 64, group_m=2),
    "gemm_bk128": MxConfig(True, 32, 16, 128),  # K % BLOCK_K != 0 for K = 96, 160
    "lean": MxConfig(False, 1, 8, 64, lean=True),  # 8-wide chunks; K = 96, 160: a partial last step
    "lean_split": MxConfig(False, 1, 16, 32, lean=True, split_k=3, one_launch=True),  # last program sums
    "gemm_split": MxConfig(True, 16, 32, 64, split_k=3, one_launch=True),
    "gemm_split_2l": MxConfig(True, 16, 16, 64, split_k=2),  # the partials' sum as a second launch
}
GEMV = ("gemv", "lean")  # config names of the GEMV (T <= 8 only)
SHAPES = [(32, 33), (96, 40), (160, 17), (512, 24)]  # (K, N)
# every config at every row count it takes, each shape at least once per path (the CPU interpreter is slow)
CASES = [(t, k, n, c) for t in (1, 3, 8, 17, 64) for i, (k, n) in enumerate(SHAPES) for c in CONFIGS
         if not (c.startswith(GEMV) and t > 8) and not (t == 64 and k == 512) and (i + t) % 2 == 0]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_weight(seed: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_mx of a weight whose blocks span ~2**6 in magnitude (scales differ from block to block)."""
    g = gen(seed)
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-8, -2, (n, k // 32), generator=g).float()
                                                    ).repeat_interleave(32, dim=1)
    return quantize_mx(w)


def exact_data(seed: int, t: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x small integers, q integers in [-8, 8] (exact in e4m3), scales 2 ** -3 .. 2 ** 3: every product and every
    partial sum is a multiple of 2 ** -3 below 2 ** 17, exact in fp32 -- any summation order gives the same bits."""
    g = gen(seed)
    x = torch.randint(-4, 5, (t, k), generator=g).float()
    q = torch.randint(-8, 9, (n, k), generator=g).float().to(torch.float8_e4m3fn)
    s = torch.randint(124, 131, (n, k // 32), generator=g).to(torch.uint8)
    return x, q, s


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("t,k,n,name", CASES)
def test_linear_fp32_matches_reference(t, k, n, name):
    g = gen(t * 1000 + k + n)
    x = torch.randn(t, k + 16, generator=g)[:, 8:8 + k]  # a column slice: row stride > K
    q, s = random_weight(n + k, n, k)
    y = mx_linear(x, q, s, config=CONFIGS[name])
    ref = x @ dequantize_mx(q, s).T
    assert y.shape == (t, n) and y.dtype == torch.float32
    assert torch.isfinite(y).all(), "non-finite output: an unwritten element was read"
    assert rel_err(y, ref) <= 1e-5


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("t", [1, 8, 17])
def test_linear_bit_exact_on_exact_data(t, name):
    if name.startswith(GEMV) and t > 8:
        pytest.skip("the GEMV takes T <= 8")
    x, q, s = exact_data(t, t, 21, 160)
    ref = x @ dequantize_mx(q, s).T
    assert torch.equal(mx_linear(x, q, s, config=CONFIGS[name]), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(33, 96), (5, 1056)])  # K < BLOCK_K; K past one BLOCK_K of 512, ragged
def test_dequantize_equals_the_reference(n, k, dtype):
    """`mx_dequantize` gives `dequantize_mx`'s bits: the fp32 product is exact and rounds once (in bf16 nothing
    rounds at these scales: e4m3's 3 mantissa bits fit bf16's 7)."""
    q, s = random_weight(n * k, n, k)
    assert torch.equal(w8a16.mx_dequantize(q, s, dtype), dequantize_mx(q, s, dtype))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's q * inf
def test_dequantize_scale_bytes_at_the_ends():
    """Scale bytes 0 (the subnormal 2 ** -127), 1, 254 and 255 (inf, as decode_e8m0: q * inf, 0 * inf = nan) in
    fp32, as the reference computes them."""
    g = gen(3)
    q = (torch.randn(4, 128, generator=g) * 8).to(torch.float8_e4m3fn)
    q[:, :3] = 0.0
    s = torch.tensor([[0, 1, 254, 255]] * 4, dtype=torch.uint8)
    torch.testing.assert_close(w8a16.mx_dequantize(q, s, torch.float32), dequantize_mx(q, s), rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_past_the_threshold_dequantizes_then_multiplies(dtype, monkeypatch):
    """From DEQUANT_MIN_T rows (lowered here: the interpreter is slow) bf16 / fp32 x take one dequantizing launch
    and torch.mm on the scratch: the bits of torch.mm on the reference's weight, into `out` too; below it, and
    with an explicit config, the tiled kernel runs. A mis-applied scale fails through this path as well."""
    monkeypatch.setattr(w8a16, "DEQUANT_MIN_T", 10)
    deq = spy_launches(monkeypatch, w8a16, "_mx_dequant_kernel")
    tiled = spy_launches(monkeypatch, w8a16, "_mx_gemm_kernel")
    q, s = random_weight(11, 40, 96)
    x = torch.randn(10, 96, generator=gen(4)).to(dtype)
    ref = torch.mm(x, dequantize_mx(q, s, dtype).t())
    assert torch.equal(mx_linear(x, q, s), ref)
    out = torch.full((10, 48), float("nan"), dtype=dtype)[:, 4:44]  # a view: row stride 48
    assert mx_linear(x, q, s, out=out) is out and torch.equal(out, ref)
    assert len(deq) == 2 and not tiled
    for what, bad in _mutations(s).items():
        if bad.shape == s.shape:
            assert rel_err(mx_linear(x, q, bad), ref) > 1e-2, what
    n_deq = len(deq)
    mx_linear(x[:9], q, s)  # below the threshold (past the GEMV's rows): the tiled kernel
    mx_linear(x, q, s, config=pick_config(10, 40, 96))  # a config: always the kernels
    assert len(deq) == n_deq and len(tiled) == 2


def test_linear_fp16_never_dequantizes(monkeypatch):
    """fp16 cannot hold every q * 2 ** e: its rows keep the tiled kernel (scales applied after the MMA)."""
    monkeypatch.setattr(w8a16, "DEQUANT_MIN_T", 10)
    deq = spy_launches(monkeypatch, w8a16, "_mx_dequant_kernel")
    q, s = random_weight(12, 24, 64)
    x = torch.randn(10, 64, generator=gen(5)).half()
    assert rel_err(mx_linear(x, q, s), x.float() @ dequantize_mx(q, s).T) <= 1e-3 and not deq


# configs whose launch applies the activation in its epilogue; the rest run mx_linear, then the activation's launch
ACT_FUSED = ("gemv", "gemm", "gemm_bk128", "gemm_split")
ACT_CASES = [(t, name) for t in (1, 3, 17) for name in CONFIGS if not (name.startswith(GEMV) and t > 8)]


@pytest.mark.parametrize("act", ["swiglu_oai", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,name", ACT_CASES)
def test_linear_act_equals_the_two_launches(t, name, dtype, act, monkeypatch):
    """mx_linear(act=...) on a packed [gate; up] weight has the bits of mx_linear then the activation's own kernel
    (limit 0.5: the clamps bite), on every path; where the path folds it, no activation launch runs (the lean
    GEMV contracts FMAs, a 1-column GEMV block has no (gate, up) pair and the two-launch splits sum apart: those
    keep the second launch)."""
    from m3eagle.kernels.fused import activation

    q, s = random_weight(3, 66, 96)  # I = 33: a partial column tile
    x = (torch.randn(t, 96, generator=gen(t)) * 4).to(dtype)
    y = mx_linear(x, q, s, config=CONFIGS[name])
    want = activation.swiglu_oai(y, 1.702, 0.5) if act == "swiglu_oai" else activation.silu_mul(*y.chunk(2, -1))
    kernel = "_swiglu_kernel" if act == "swiglu_oai" else "_silu_mul_kernel"
    apart = spy_launches(monkeypatch, activation, kernel)
    got = mx_linear(x, q, s, config=CONFIGS[name], act=act, alpha=1.702, limit=0.5)
    assert got.shape == (t, 33) and torch.equal(got, want)
    fused = name in ACT_FUSED or (name == "auto" and t > 8)  # auto at T <= 8 here: a 1-column GEMV block
    assert len(apart) == (0 if fused else 1), (name, len(apart))


def test_linear_act_bad_inputs():
    q, s = random_weight(1, 33, 64)
    with pytest.raises(ValueError, match="act='gelu'"):
        mx_linear(torch.randn(1, 64), q, s, act="gelu")
    with pytest.raises(ValueError, match="even N"):
        mx_linear(torch.randn(1, 64), q, s, act="silu")
    q, s = random_weight(1, 32, 64)
    with pytest.raises(ValueError, match=r"out must be \[1, 16\]"):
        mx_linear(torch.randn(1, 64), q, s, act="silu", out=torch.empty(1, 32))


def _mutations(s: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"shifted one block": torch.roll(s, 1, dims=1), "transposed": s.T.contiguous(),
            "2**(127-s)": (254 - s.int()).to(torch.uint8)}


@pytest.mark.parametrize("name", ["gemv", "gemv_split", "gemm", "lean", "lean_split", "gemm_split"])
@pytest.mark.parametrize("t", [1, 17])
def test_misapplied_scale_fails(t, name):
    """Each mis-application of the scale, run through the kernel, misses the reference by far."""
    if name.startswith(GEMV) and t > 8:
        pytest.skip("the GEMV takes T <= 8")
    n, k = 4, 128  # scale [4, 4]: its transpose has the right shape
    x, q, s = exact_data(7, t, n, k)
    ref = x @ dequantize_mx(q, s).T
    assert torch.equal(mx_linear(x, q, s, config=CONFIGS[name]), ref)
    for what, bad in _mutations(s).items():
        assert not torch.equal(bad, s), what
        assert rel_err(mx_linear(x, q, bad, config=CONFIGS[name]), ref) > 1e-2, what


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,name", [(1, "gemv"), (3, "gemv_split"), (8, "auto"), (17, "gemm"), (64, "auto"),
                                    (2, "lean"), (3, "lean_split"), (5, "gemm_split"), (17, "gemm_split_2l")])
def test_linear_half_inputs(t, name, dtype):
    g = gen(t)
    x = torch.randn(t, 96, generator=g).to(dtype)
    q, s = random_weight(5, 33, 96)
    y = mx_linear(x, q, s, config=CONFIGS[name])
    assert y.dtype == dtype
    # the interpreter truncates fp32 -> bf16 (not round-to-nearest): one bf16 ulp of the output
    assert rel_err(y, x.float() @ dequantize_mx(q, s).T) <= (8e-3 if dtype == torch.bfloat16 else 1e-3)


def test_split_deterministic_and_out():
    x = torch.randn(3, 512, generator=gen(1))
    q, s = random_weight(2, 24, 512)
    cfg = MxConfig(False, 1, 8, 32, split_k=8)
    a = mx_linear(x, q, s, config=cfg)
    out = torch.full((3, 24), float("nan"))
    b = mx_linear(x, q, s, out=out, config=cfg)
    assert b is out and torch.equal(a, b)
    assert rel_err(a, x @ dequantize_mx(q, s).T) <= 1e-5


SPLIT_PATHS = {"gemm": MxConfig(True, 16, 16, 32), "lean": MxConfig(False, 1, 16, 32, lean=True)}


@pytest.mark.parametrize("t,path", [(1, "lean"), (3, "gemm"), (8, "lean"), (8, "gemm")])
def test_split_one_launch(t, path, monkeypatch):
    """Split-K summed by each tile's last program (one launch, counters): for S = 2..8 (K = 256 in 32-wide steps,
    N = 24 not a multiple of the block) bit-equal to the same partials summed by `_split_sum_kernel` in split order
    (a second launch), bit-equal from call to call, within fp32 rounding of the reference, and the counters are
    zero again after every call (a graph replay needs no memset)."""
    from dataclasses import replace

    from tests.helpers.kernel_spy import spy_launches

    kernel = "_mx_gemm_kernel" if path == "gemm" else "_mx_gemv_kernel"
    launches = spy_launches(monkeypatch, w8a16, kernel)
    sums = spy_launches(monkeypatch, w8a16, "_split_sum_kernel")
    x = torch.randn(t, 256, generator=gen(t))
    q, s = random_weight(t + 1, 24, 256)
    ref = x @ dequantize_mx(q, s).T
    for split in range(2, 9):
        one = replace(SPLIT_PATHS[path], split_k=split, one_launch=True)
        a = mx_linear(x, q, s, out=torch.full((t, 24), float("nan")), config=one)
        assert launches[-1]["ONE_LAUNCH"] and launches[-1]["SPLIT"] and len(sums) == split - 2, split
        assert not w8a16.split_counters(x.device).any(), f"S={split}: a counter left non-zero"
        b = mx_linear(x, q, s, out=torch.full((t, 24), float("nan")), config=one)
        two = mx_linear(x, q, s, config=replace(one, one_launch=False))
        assert len(sums) == split - 1 and not launches[-1]["ONE_LAUNCH"]  # the second launch summed these
        assert torch.equal(a, b) and torch.equal(a, two), f"S={split}: the sum is not the split-order sum"
        assert rel_err(a, ref) <= 1e-5, split


def test_split_counters_not_made_in_a_capture(monkeypatch):
    """While a CUDA graph is being captured the counters are not allocated (a zero-fill captured in the graph would
    run only at replay): that call sums its partials in a second launch; once made they are reused, never grown."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert w8a16.split_counters("cuda:7") is None and torch.device("cuda:7") not in w8a16._COUNTERS
    c = w8a16.split_counters("cpu")
    assert c is not None and c.dtype == torch.int32 and c.numel() == w8a16.MAX_TILES
    assert w8a16.split_counters(torch.device("cpu")) is c
    monkeypatch.setattr(w8a16, "split_counters", lambda device: None)
    from tests.helpers.kernel_spy import spy_launches

    sums = spy_launches(monkeypatch, w8a16, "_split_sum_kernel")
    x = torch.randn(2, 256, generator=gen(3))
    q, s = random_weight(4, 20, 256)
    y = mx_linear(x, q, s, config=MxConfig(True, 16, 16, 32, split_k=4, one_launch=True))
    assert len(sums) == 1 and rel_err(y, x @ dequantize_mx(q, s).T) <= 1e-5


def test_pick_config_paths():
    from m3eagle.kernels.quant import w8a16

    for t in range(1, 9):  # an untuned shape: the rule's GEMV
        assert not pick_config(t, 6000, 6144).use_dot
    assert w8a16.TUNED  # the package ships its table
    for (t, n, k), cfg in w8a16.TUNED.items():  # tuned shapes: the table's entry, for every T of its bucket
        assert cfg.block_k % 32 == 0 and t in (1, 2, 4, 8)
        assert all(pick_config(r, n, k) == cfg for r in range(t // 2 + 1, t + 1))
    for t in (9, 17, 64, 2048):
        cfg = pick_config(t, 6144, 6144)
        assert cfg.use_dot and cfg.block_k % 32 == 0
    assert pick_config(1, 9216, 6144) == pick_config(1, 9216, 6144)  # a pure function of the shape
    assert pick_config(1, 256, 6144).split_k > 1  # few output tiles: split-K


def test_tuned_table_has_a_section_per_gpu_model(tmp_path, monkeypatch):
    """Each GPU model's winners stay its own: a process uses its device's section and the other sections' entries
    where its own has none; writing one device's winners leaves the other's untouched; without CUDA the sections
    apply in file order. pick_config then follows the chosen view."""
    from m3eagle.kernels.quant import w8a16

    a = MxConfig(False, 1, 4, 256)
    b = MxConfig(False, 1, 8, 512, split_k=2)
    c = MxConfig(False, 1, 2, 128)
    table = tmp_path / "w8a16_configs.json"
    monkeypatch.setattr(w8a16, "TUNED_PATH", table)
    monkeypatch.setattr(w8a16, "TUNED", dict(w8a16.TUNED))  # the module's dicts come back after the test
    monkeypatch.setattr(w8a16, "MOE_TUNED", dict(w8a16.MOE_TUNED))
    monkeypatch.setattr(w8a16, "_VIEW", [None])
    w8a16.write_tuned({(1, 640, 512): a, (2, 640, 512): c}, "first", {"block_n": 8, "block_k": 256, "num_warps": 4},
                      "GPU A")
    w8a16.write_tuned({(1, 640, 512): b}, "second", None, "GPU B")
    assert w8a16._VIEW == ["GPU B"]
    assert pick_config(1, 640, 512) == b and pick_config(2, 640, 512) == c  # B's own, then A's where B has none
    assert w8a16.MOE_TUNED == {"block_n": 8, "block_k": 256, "num_warps": 4}  # B has no MoE blocks: A's
    w8a16.use_device("GPU A")
    assert pick_config(1, 640, 512) == a
    assert w8a16.tuned_view(None)[0][(1, 640, 512)] == a  # no device: file order, A first
    assert w8a16.tuned_view("GPU C")[0][(1, 640, 512)] == a  # an unknown model: the same
    w8a16.write_tuned({(4, 640, 512): c}, "third", None, "GPU B")  # a merge: B's earlier entry stays
    assert w8a16.tuned_view("GPU B")[0][(1, 640, 512)] == b and w8a16.tuned_view("GPU B")[0][(4, 640, 512)] == c
    assert list(json.loads(table.read_text())["devices"]) == ["GPU A", "GPU B"]


def test_the_shipped_table_keeps_each_gpus_winners():
    """The package's table: the H200's T = 1 winners at the M3 / m3-8b shapes and the H100's other entries sit in
    their own sections, and an H100 process still finds a config for every shape either measured."""
    from m3eagle.kernels.quant import w8a16

    sections = w8a16._load_sections()
    assert {"NVIDIA H100 80GB HBM3", "NVIDIA H200"} <= set(sections)
    h100, h200 = sections["NVIDIA H100 80GB HBM3"][0], sections["NVIDIA H200"][0]
    assert h100 and h200 and all(t == 1 for t, _, _ in h200)
    view = w8a16.tuned_view("NVIDIA H100 80GB HBM3")[0]
    assert set(view) == set(h100) | set(h200) and all(view[key] == cfg for key, cfg in h100.items())


# ---- MoE ------------------------------------------------------------------------------------------------


def moe_data(seed: int, t: int, e: int = 4, k: int = 2, h: int = 96, inter: int = 64, dtype=torch.float32):
    g = gen(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = torch.randn(e, 2 * inter, h, generator=g) * h ** -0.5
    w2 = torch.randn(e, h, inter, generator=g) * inter ** -0.5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, k] distinct per token
    wts = torch.rand(t, k, generator=g)
    return x, wts, ids, *quantize_mx(w13), *quantize_mx(w2)


ALPHA, LIMIT = 1.702, 7.0


@pytest.mark.parametrize("t,lean", [(1, False), (3, False), (8, False), (17, False), (1, True), (3, True)])
def test_moe_matches_reference(t, lean, monkeypatch):
    """Both GEMV bodies (plain; LEAN, whose launches must really take it) against the reference."""
    x, wts, ids, q13, s13, q2, s2 = moe_data(t, t)
    if t == 3:
        ids[1, 0] = -1  # a pair routed outside [0, E): contributes zero, as in the reference
    seen = [spy_launches(monkeypatch, w8a16, name, lambda grid, kw: kw["LEAN"])
            for name in ("_mx_moe_gate_up_kernel", "_mx_moe_down_kernel")]
    out = mx_moe_experts(x, wts, ids, q13, s13, q2, s2, ALPHA, LIMIT, lean=lean)
    assert seen == [[lean], [lean]]
    ref = moe_ref.experts(x, wts, ids, dequantize_mx(q13, s13), dequantize_mx(q2, s2), ALPHA, LIMIT)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert rel_err(out, ref) <= 1e-5


def test_moe_body_follows_the_tables_moe_entry(monkeypatch):
    """lean=None takes the tuned table's "moe" entry (its "lean" key; absent: the plain body) at decode sizes."""
    x, wts, ids, q13, s13, q2, s2 = moe_data(5, 2)
    seen = spy_launches(monkeypatch, w8a16, "_mx_moe_down_kernel", lambda grid, kw: kw["LEAN"])
    monkeypatch.setitem(w8a16.MOE_TUNED, "lean", True)
    mx_moe_experts(x, wts, ids, q13, s13, q2, s2, ALPHA, LIMIT)
    monkeypatch.delitem(w8a16.MOE_TUNED, "lean")
    mx_moe_experts(x, wts, ids, q13, s13, q2, s2, ALPHA, LIMIT)
    assert seen == [True, False]


def test_moe_bf16():
    x, wts, ids, q13, s13, q2, s2 = moe_data(11, 4, dtype=torch.bfloat16)
    out = mx_moe_experts(x, wts, ids, q13, s13, q2, s2, ALPHA, LIMIT)
    ref = moe_ref.experts(x, wts, ids, dequantize_mx(q13, s13, torch.bfloat16), dequantize_mx(q2, s2, torch.bfloat16),
                          ALPHA, LIMIT)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref.float()) <= 3e-2  # bf16 roundings (the interpreter truncates) at three stages


def shared_data(seed: int, h: int = 96, s_inter: int = 64):
    g = gen(seed)
    s13 = torch.randn(2 * s_inter, h, generator=g) * h ** -0.5
    s2 = torch.randn(h, s_inter, generator=g) * s_inter ** -0.5
    return (*quantize_mx(s13), *quantize_mx(s2))


def shared_ref(x, wts, ids, q13, s13, q2, s2, shared, scale):
    """routed * scale + shared on the dequantized weights (the model's sum, as SparseMoE.forward takes it)."""
    sq13, ss13, sq2, ss2 = shared
    routed = moe_ref.experts(x, wts, ids, dequantize_mx(q13, s13), dequantize_mx(q2, s2), ALPHA, LIMIT)
    one = moe_ref.experts(x, torch.ones(x.shape[0], 1), torch.zeros(x.shape[0], 1, dtype=torch.long),
                          dequantize_mx(sq13, ss13)[None], dequantize_mx(sq2, ss2)[None], ALPHA, LIMIT)
    return routed * scale + one


@pytest.mark.parametrize("t,s_inter,lean", [(1, 64, False), (3, 96, False), (5, 32, False), (3, 96, True)])
def test_moe_with_shared_expert(t, s_inter, lean):
    """The shared expert in the routed launches (wider, as wide and narrower than I = 64): the model's sum
    routed * routed_scale + shared, in two launches; a scale applied to the shared expert too, or dropped, fails."""
    x, wts, ids, q13, s13, q2, s2 = moe_data(30 + t, t)
    shared = shared_data(40 + t, s_inter=s_inter)
    out = mx_moe_experts(x, wts, ids, q13, s13, q2, s2, ALPHA, LIMIT, shared=shared, routed_scale=2.5, lean=lean)
    ref = shared_ref(x, wts, ids, q13, s13, q2, s2, shared, 2.5)
    assert out.shape == ref.shape and rel_err(out, ref) <= 1e-5
    assert rel_err(out, shared_ref(x, wts, ids, q13, s13, q2, s2, shared, 1.0)) > 1e-2  # the scale is applied
    plain = mx_moe_experts(x, wts, ids, q13, s13, q2, s2, ALPHA, LIMIT)
    assert rel_err(out, plain * 2.5) > 1e-2  # the shared expert is there


def test_moe_with_shared_expert_bf16():
    x, wts, ids, q13, s13, q2, s2 = moe_data(12, 2, dtype=torch.bfloat16)
    shared = shared_data(13)
    out = mx_moe_experts(x, wts, ids, q13, s13, q2, s2, ALPHA, LIMIT, shared=shared, routed_scale=2.0)
    ref = shared_ref(x.float(), wts, ids, q13, s13, q2, s2, shared, 2.0)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) <= 3e-2


# ---- bad inputs -----------------------------------------------------------------------------------------


def _lin():
    x = torch.randn(2, 64)
    q, s = random_weight(0, 8, 64)
    return x, q, s


LINEAR_BAD = {
    "q dtype": (lambda x, q, s: (x, q.float(), s), TypeError, "q must be a float8_e4m3fn"),
    "scale dtype": (lambda x, q, s: (x, q, s.float()), TypeError, "scale must be a uint8"),
    "scale shape": (lambda x, q, s: (x, q, s[:, :1].contiguous()), ValueError, "scale shape"),
    "K % 32": (lambda x, q, s: (x[:, :48], q[:, :48].contiguous(), s[:, :1].contiguous()), ValueError, "K % 32"),
    "x shape": (lambda x, q, s: (x[:, :32], q, s), ValueError, "x shape"),
    "x dtype": (lambda x, q, s: (x.to(torch.int32), q, s), TypeError, "x must be"),
    "q 3-D": (lambda x, q, s: (x, q[None], s[None]), ValueError, "q must be 2-D"),
}


@pytest.mark.parametrize("case", list(LINEAR_BAD))
def test_linear_bad_inputs(case):
    mutate, exc, msg = LINEAR_BAD[case]
    with pytest.raises(exc, match=msg.replace("(", r"\(").replace("*", r"\*")):
        mx_linear(*mutate(*_lin()))


def test_linear_bad_out():
    x, q, s = _lin()
    with pytest.raises(ValueError, match="out must be"):
        mx_linear(x, q, s, out=torch.empty(2, 8, dtype=torch.bfloat16))


MOE_BAD = {
    "w13_q dtype": (lambda a: {**a, "w13_q": a["w13_q"].float()}, TypeError, "w13_q must be"),
    "w13_s shape": (lambda a: {**a, "w13_s": a["w13_s"][:, :, :1].contiguous()}, ValueError, "w13_s shape"),
    "w2_q shape": (lambda a: {**a, "w2_q": a["w2_q"][:, :32].contiguous(), "w2_s": a["w2_s"][:, :32].contiguous()},
                   ValueError, "w2_q shape"),
    "w2_s dtype": (lambda a: {**a, "w2_s": a["w2_s"].float()}, TypeError, "w2_s must be"),
    "topk_ids float": (lambda a: {**a, "topk_ids": a["topk_ids"].float()}, ValueError, "topk_ids must be"),
    "topk_weights shape": (lambda a: {**a, "topk_weights": a["topk_weights"][:, :1]}, ValueError, "topk_weights must"),
    "x hidden": (lambda a: {**a, "x": a["x"][:, :64]}, ValueError, "x shape"),
}


@pytest.mark.parametrize("case", list(MOE_BAD))
def test_moe_bad_inputs(case):
    x, wts, ids, q13, s13, q2, s2 = moe_data(0, 2)
    args = dict(x=x, topk_weights=wts, topk_ids=ids, w13_q=q13, w13_s=s13, w2_q=q2, w2_s=s2)
    mutate, exc, msg = MOE_BAD[case]
    with pytest.raises(exc, match=msg):
        mx_moe_experts(**mutate(args), alpha=ALPHA, limit=LIMIT)


def test_moe_bad_shared_expert():
    x, wts, ids, q13, s13, q2, s2 = moe_data(0, 2)
    sq13, ss13, sq2, ss2 = shared_data(1)
    with pytest.raises(ValueError, match="shared must be"):
        mx_moe_experts(x, wts, ids, q13, s13, q2, s2, ALPHA, LIMIT, shared=(sq13, ss13))
    wrong = shared_data(1, h=64)
    with pytest.raises(ValueError, match=r"shared expert's s13_q \(128, 64\).*H = 96"):
        mx_moe_experts(x, wts, ids, q13, s13, q2, s2, ALPHA, LIMIT, shared=wrong)
    with pytest.raises(TypeError, match="shared s2_q must be a float8_e4m3fn"):
        mx_moe_experts(x, wts, ids, q13, s13, q2, s2, ALPHA, LIMIT, shared=(sq13, ss13, sq2.float(), ss2))


def test_module_layering():
    """kernels/ imports nothing from models / engine and above (lint-imports checks the whole package)."""
    src = open(w8a16.__file__).read()
    assert "m3eagle.models" not in src and "m3eagle.engine" not in src


@pytest.mark.parametrize("act", ["swiglu_oai", "silu"])
def test_triton_fused_runs_mxfp8_gate_up_with_its_activation_in_the_epilogue(act, monkeypatch):
    """The model's MLP calls `fused.linear_swiglu_oai` / `linear_silu_mul`: with an MXFP8 weight the Triton backend
    runs mx_linear's epilogue (no activation launch), with the bits of its plain linear then the activation."""
    from m3eagle.kernels.fused import activation
    from m3eagle.kernels.fused.triton_backend import TritonFused
    from m3eagle.kernels.quant.mxfp8 import MxWeight

    fused = TritonFused()
    q, s = random_weight(4, 64, 96)
    w, x = MxWeight(q, s), torch.randn(12, 96, generator=gen(6)).bfloat16()  # 12 rows: the tiled GEMM
    y = fused.linear(x, w)
    want = activation.swiglu_oai(y, 1.702, 7.0) if act == "swiglu_oai" else activation.silu_mul(*y.chunk(2, -1))
    apart = spy_launches(monkeypatch, activation, "_swiglu_kernel" if act == "swiglu_oai" else "_silu_mul_kernel")
    got = fused.linear_swiglu_oai(x, w, 1.702, 7.0) if act == "swiglu_oai" else fused.linear_silu_mul(x, w)
    assert torch.equal(got, want) and not apart
