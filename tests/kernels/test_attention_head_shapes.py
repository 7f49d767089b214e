"""The dense Triton attention kernel over every head shape an Eagle3 head may have, held equal to
`reference.paged_attention` under the Triton interpreter.

The kernel serves any plausible shape: head_dim 64 / 96 / 128 / 192 / 256 / 512 (512 once crashed it on
Hopper: registers and shared memory), 4 to 64 query heads, GQA group 1 (MHA) to 16. Each case is one mixed
step (a prompt chunk over a cached prefix, decode rows, a 1+K verify row) over a shuffled paged pool, run
unsplit and split (the combine), with tiny lengths so that the interpreter stays fast. `dense_tile` (the
launch shape, a pure function of the head shape) is checked to stay in the register budget for every shape.

The two public MiniMax-M3 heads have their own test at their real attention shapes (docs/eagle3_heads.md):
64 query heads of 128 with 64 KV heads (Inferact/MiniMax-M3-EAGLE3) or 4 (-GQA, group 16).

Not run here: bf16 pools (the interpreter's bf16 path is not the GPU's). This grid (with longer rows:
decode over 3,000 keys, verify 4x4, a 200-token chunk) was run in bf16 on an H100 against the fp32
reference, all within 5e-3, no register spills beyond 2 at D=512.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (kernels decorate at import)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from m3eagle.kernels.attention import reference, triton_kernels  # noqa: E402
from m3eagle.kernels.attention.triton_backend import TritonBackend  # noqa: E402
from tests.kernels.test_triton_attention import assert_close  # noqa: E402
from tests.kernels.test_triton_attention import make_step as attention_step  # noqa: E402

HEAD_DIMS = [64, 96, 128, 192, 256, 512]
# Every head_dim as MHA (4 / 4) and as GQA (16 / 4); then a group that is no power of 2 (48 / 4), groups of 16
# (16 / 1) at the target's and the widest head_dim, and the widest 64-head GQA (the interpreter's cost grows
# with heads x head_dim; 64-head MHA at head_dim 128 and 512 ran on an H100 in bf16).
GRID = [(d, 4, 4) for d in HEAD_DIMS] + [(d, 16, 4) for d in HEAD_DIMS] + [
    (96, 48, 4), (128, 16, 1), (512, 16, 1), (512, 64, 4)]


def make_step(seed: int, q_lens: list[int], kv_lens: list[int], page: int, hq: int, hkv: int, d: int):
    """The attention tests' paged step (poisoned slots past every row's keys), at this head shape."""
    s = attention_step(seed, q_lens, kv_lens, page, hq=hq, hkv=hkv, d=d, extra_kv=3, extra_cols=1)
    return s.meta, s.q, s.k, s.v


@pytest.mark.parametrize("d,hq,hkv", GRID)
def test_dense_head_shapes_match_reference(d, hq, hkv):
    # a prompt chunk (3 new on 6 cached), a decode row, a 1+2 verify row; page 4 divides no length
    meta, q, k, v = make_step(d * 1000 + hq * 10 + hkv, [3, 1, 3], [9, 5, 7], 4, hq, hkv, d)
    scale = d ** -0.5
    ref = reference.paged_attention(q, k, v, meta, scale)
    for splits in (1, 2):
        out = torch.full_like(q, float("nan"))
        triton_kernels.dense_attention(q, k, v, meta, scale, num_splits=splits, block_n=64, out=out)
        assert_close(out, ref)
    assert_close(TritonBackend().attention(q, k, v, meta, scale), ref)


# (head_dim, query heads, KV heads) of the published MiniMax-M3 heads' config.json
M3_HEADS = {"Inferact/MiniMax-M3-EAGLE3": (128, 64, 64), "Inferact/MiniMax-M3-EAGLE3-GQA": (128, 64, 4)}


@pytest.mark.parametrize("name", sorted(M3_HEADS))
def test_public_m3_head_shapes_match_reference(name):
    """The engine's entry (TritonBackend.attention, which picks the split) on a prompt chunk over a cached
    prefix plus a decode row, and a split launch of the 1+K verify row. The interpreter runs one program per
    (row, KV head, split): 64 KV heads keep this to two short rows."""
    d, hq, hkv = M3_HEADS[name]
    scale = d ** -0.5
    meta, q, k, v = make_step(hq * 10 + hkv, [3, 1], [9, 5], 4, hq, hkv, d)
    assert_close(TritonBackend().attention(q, k, v, meta, scale), reference.paged_attention(q, k, v, meta, scale))
    meta, q, k, v = make_step(hq * 10 + hkv + 1, [4], [6], 4, hq, hkv, d)
    out = triton_kernels.dense_attention(q, k, v, meta, scale, num_splits=2, block_n=16)
    assert_close(out, reference.paged_attention(q, k, v, meta, scale))


def test_dense_tile_is_a_pure_function_within_budget():
    for d in HEAD_DIMS + [16, 24, 1024]:
        for group in (1, 2, 3, 4, 8, 12, 16, 32):
            for max_q in (1, 4, 8, 64, 512):
                for block_n in (16, 32, 64, 128):
                    check_tile(d, group, max_q, block_n)


def check_tile(d: int, group: int, max_q: int, block_n: int) -> None:
    tile = triton_kernels.dense_tile(d, group, max_q, block_n)
    assert tile == triton_kernels.dense_tile(d, group, max_q, block_n)
    m = tile.block_q * tile.block_g
    assert m >= 16 and tile.block_n >= 16 and tile.block_g >= group and tile.block_d >= d  # smallest tl.dot
    assert tile.block_q <= max(triton_kernels._pow2(max_q), 16)
    if tile.block_d <= 128:  # the measured policy of the target's head (D=128) and the small models: unchanged
        assert (tile.block_n, tile.num_warps, tile.num_stages) == (block_n, 4, None)
        assert (tile.block_q, tile.block_g) == triton_kernels._q_tile(group, max_q)
    else:
        # the fp32 accumulator and the K/V tiles stay within 64 x 128 elements per 4 warps (the D=128
        # shape); GQA groups wider than that budget take 8 warps
        warps4 = tile.num_warps // 4
        assert tile.block_n * tile.block_d <= 64 * 128 * max(1, warps4)
        assert m * tile.block_d <= 64 * 128 * warps4 or m == tile.block_g
        assert tile.num_stages == 2 and tile.num_warps in (4, 8)


def test_combine_covers_wide_heads_in_slices():
    """A split launch of a 512-wide head: the combine merges it in 128-wide slices (grid axis 2)."""
    meta, q, k, v = make_step(7, [1, 2], [20, 11], 4, 2, 1, 512)
    ref = reference.paged_attention(q, k, v, meta, 0.05)
    out = triton_kernels.dense_attention(q, k, v, meta, 0.05, num_splits=4, block_n=16)
    assert_close(out, ref)


def test_head_dim_mismatch_is_refused():
    meta, q, k, v = make_step(1, [1], [3], 4, 2, 1, 64)
    with pytest.raises(ValueError, match="head_dim 64 but k_pool / v_pool head_dim 32"):
        triton_kernels.dense_attention(q, k[..., :32].contiguous(), v[..., :32].contiguous(), meta, 0.1)
