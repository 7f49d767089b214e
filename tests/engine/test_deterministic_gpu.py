"""Issue 44's property table on the GPU in bf16, with `deterministic=True` (CUDA graphs, overlap, defaults).

Run: `python -m pytest -q -m gpu tests/engine/test_deterministic_gpu.py` (one H100, a few minutes). Each row of
the table must read "all identical":

- kernels in bf16 on the real MMAs: the GEMM's, attention's and the MoE's rows are the same bits alone and
  inside batches (the hardware check of "an MMA element depends only on its own row and column"), and a
  batch-dependent split makes them differ (the mutation check);
- m3-mini random weights and the embedded pair: greedy K = 1, 3, 5 == K = 0 on every request (m3-8b: the core
  rows, K = 3, one batch size and chunk size);
- a request alone == inside batches of 2..64 mixed with other requests (greedy K = 3);
- prompt chunks of 256 / 2,048 / 8,192 tokens, overlap on / off, forced preemption: the same tokens;
- two runs of the same workload: identical; seeded sampling (T = 0.8, top-p 0.95) alone == in a batch.

`properties(...)` holds the engine-level logic; `test_properties_logic_on_cpu` runs it on the tiny geometry
with the CPU's reference ops so the logic itself is exercised by the CPU suite.
"""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch

from m3eagle import LLM, SamplingParams
from m3eagle.bench import geometries
from m3eagle.loader.assets import ASSETS
from tests.helpers.engine_utils import Counters

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=11, ignore_eos=True)


def prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


def model_of(name: str):
    """(target, draft, load_format) of a property-table model."""
    if name == "embedded":
        return ASSETS / "target", ASSETS / "draft", "auto"
    t, h = {"m3-mini": geometries.m3_mini, "m3-8b": geometries.m3_8b}.get(name, geometries.tiny)()
    return t, h, "dummy"


class Engines:
    """Builds one LLM at a time (frees the previous one: each holds its weights and KV pool)."""

    def __init__(self, name: str, device: str, **base):
        self.name, self.device, self.base = name, device, base
        self.llm: LLM | None = None

    def __call__(self, k: int, **kw) -> LLM:
        self.llm = None
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
        target, draft, fmt = model_of(self.name)
        self.llm = LLM(model=target, draft=draft if k else None, num_draft_tokens=k, load_format=fmt,
                       device=self.device, deterministic=True, **{**self.base, **kw})
        return self.llm


def tokens(llm: LLM, ps: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(ps, params)]


def diff(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Indices of the requests whose tokens differ."""
    return [i for i, (x, y) in enumerate(zip(a, b)) if x != y]


def first_diffs(a: list[list[int]], b: list[list[int]]) -> dict[int, int]:
    """Request index -> the first token index where a and b differ (their lengths, where one is a prefix)."""
    out = {}
    for i in diff(a, b):
        x, y = a[i], b[i]
        out[i] = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    return out


def properties(eng: Engines, ps: list[list[int]], extra: list[list[int]], ks=(1, 3, 5), chunks=(256, 2048, 8192),
               batches=(2, 8, 24, 64), params: SamplingParams = GREEDY) -> None:
    """Every row of the table on one model. `ps`: the workload; `extra`: other requests to batch with. Every row
    runs; the assertion at the end names each row that failed, with its requests' first differing tokens."""
    failed: dict[str, dict[int, int]] = {}

    def check(row: str, got: list[list[int]], want: list[list[int]]) -> None:
        if d := first_diffs(got, want):
            failed[row] = d

    base = tokens(eng(0), ps, params)
    check("two runs differ", tokens(eng.llm, ps, params), base)
    for k in ks:
        check(f"greedy K={k} != K=0", tokens(eng(k), ps, params), base)
    spec = eng.llm  # the widest K: alone / in batches
    probe = ps[: min(4, len(ps))]
    alone = [tokens(spec, [p], params)[0] for p in probe]
    check("alone != in the workload's batch", alone, base[: len(probe)])
    for b in batches:
        mix = (probe + extra)[:b]
        got = tokens(spec, mix[::-1], params)[::-1][: len(probe)]  # the probes at other batch positions
        check(f"alone != inside a batch of {b}", got, alone[: len(got)])
    for c in chunks:
        check(f"max_num_tokens={c}", tokens(eng(3, max_num_tokens=c), ps, params), base)
    check("overlap off", tokens(eng(3, overlap=False), ps, params), base)
    llm = eng(3, overlap=True)
    Counters(llm, force_every=3)
    check("forced preemption", tokens(llm, ps, params), base)
    seeded_plain = None
    for k in (0, 3):  # seeded sampling: alone == in the batch == without drafts (coupled verification)
        llm = eng(k)
        batch = tokens(llm, ps, SEEDED)
        seeded_plain = batch if seeded_plain is None else seeded_plain
        check(f"seeded K={k} != seeded K=0", batch, seeded_plain)
        check(f"seeded K={k}: alone != in the batch", [tokens(llm, [p], SEEDED)[0] for p in probe],
              batch[: len(probe)])
    Counters(llm, force_every=3)
    check("seeded K=3, forced preemption", tokens(llm, ps, SEEDED), seeded_plain)
    assert not failed, f"{eng.name}: rows that differ (request: first differing token): {failed}"


def test_properties_logic_on_cpu():
    """The table's logic on the tiny geometry with the CPU's fp32 reference ops (small sizes)."""
    eng = Engines("tiny", "cpu", page_size=4, max_model_len=256)
    ps = prompts(3, 5, 40, 500)
    properties(eng, ps, prompts(3, 5, 30, 500, seed=1), ks=(2,), chunks=(8,), batches=(4,),
               params=replace(GREEDY, max_tokens=5))


# ---- GPU -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["m3-mini", "embedded"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_property_table(name):
    vocab = 32000 if name == "m3-mini" else 500
    eng = Engines(name, "cuda", dtype="bfloat16", max_model_len=4096, num_pages=1 + 64 * 160, max_num_seqs=64)
    ps = prompts(12, 40, 2000, vocab)
    properties(eng, ps, prompts(60, 40, 600, vocab, seed=1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_property_table_m3_8b():
    """The table's core rows on m3-8b (~10B parameters, random weights; one engine at a time): greedy K=3 ==
    K=0, a request alone == inside a batch of 16, chunks of 256 tokens, seeded K=3 == seeded K=0."""
    eng = Engines("m3-8b", "cuda", dtype="bfloat16", max_model_len=2048, num_pages=1 + 16 * 100, max_num_seqs=16)
    ps = prompts(8, 40, 1200, 32000)
    properties(eng, ps, prompts(12, 40, 400, 32000, seed=1), ks=(3,), chunks=(256,), batches=(16,))


def _kernels_case(device: str):
    from m3eagle.kernels.batch_invariant import matmul, moe

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(64, 2048, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(3072, 2048, generator=g, device=device) * 0.02).to(torch.bfloat16)
    return matmul, moe, x, w


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_rows_invariant_bf16():
    """bf16 on the real MMAs: a row alone, at every position of batches of 2..64, is the same bits; a K split
    chosen from the row count (the mutation) is not."""
    matmul, moe, x, w = _kernels_case("cuda")
    full = matmul.linear(x, w)
    for m in (1, 2, 3, 8, 17, 33, 64):
        for a in range(0, 64 - m + 1, max(1, (64 - m) // 3 or 1)):
            assert torch.equal(matmul.linear(x[a:a + m], w), full[a:a + m]), (a, m)
    cfg = matmul.matmul_config(*w.shape, w.dtype)
    mutated = [torch.equal(matmul.linear(x[a:a + 1], w, config=replace(cfg, splits=1)), full[a:a + 1])
               for a in range(64)] if cfg.splits > 1 else [
               torch.equal(matmul.linear(x[a:a + 1], w, config=replace(cfg, splits=4)), full[a:a + 1])
               for a in range(64)]
    assert not all(mutated), "a row-count-dependent K split went unnoticed"
    impl = moe.BatchInvariantMoE()
    e, h, i, k = 32, 2048, 1024, 4
    gu = (torch.randn(e, 2 * i, h, device="cuda") * 0.02).to(torch.bfloat16)
    dn = (torch.randn(e, h, i, device="cuda") * 0.02).to(torch.bfloat16)
    logits = torch.randn(64, e, device="cuda")
    idx = logits.topk(k).indices
    wts = torch.softmax(logits.gather(1, idx), -1)
    out = impl.experts(x, wts, idx, gu, dn, 1.702, 7.0)
    for a, m in ((0, 1), (63, 1), (5, 2), (9, 31)):
        assert torch.equal(impl.experts(x[a:a + m], wts[a:a + m], idx[a:a + m], gu, dn, 1.702, 7.0), out[a:a + m])
