"""Prefix caching on the GPU with CUDA graphs and overlap (bf16, the embedded pair). GPU only: run through the
device tool with `python -m pytest -q -m gpu tests/engine/test_prefix_cache_gpu.py`.

A hit must be invisible: the request that finds its prefix cached computes only its suffix, over cached KV that an
earlier request wrote. Without the batch-invariant mode, bf16 results depend on a step's shapes, so the comparison
pins them: every request runs alone, and both engines prefill in chunks of exactly the hit's length (240 tokens),
so the cache-off engine computes the shared pages as one chunk (as the request that filled the cache did) and the
rest as the next one (as the hit does). Then tokens, and the speculative acceptance, are identical; the steady
state after a hit makes no host sync (torch.cuda.set_sync_debug_mode("error") through engine.sync_debug).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from m3eagle import LLM, SamplingParams
from tests.helpers.engine_utils import assert_clean

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PREFIX = 256  # shared tokens: 16 pages of 16
# A page's key includes the token after it (the head's KV at its last position reads that token), so the shared
# prefix's last page, followed by each prompt's own token, is not found: a hit covers 15 pages.
HIT = PREFIX - 16


def _prompts(llm: LLM) -> list[list[int]]:
    """One shared 256-token prefix (a stdlib module) and four unique suffixes of 9-40 tokens."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    ids = llm.encode(text)
    prefix = ids[:PREFIX]
    return [prefix + ids[PREFIX + 1000 * (i + 1):PREFIX + 1000 * (i + 1) + n] for i, n in enumerate((9, 17, 33, 40))]


def _make(k: int, overlap: bool, caching: bool, deterministic: bool = False) -> LLM:
    return LLM(device="cuda", num_draft_tokens=k, overlap=overlap, enable_prefix_caching=caching,
               max_num_tokens=HIT, max_model_len=1024, max_num_seqs=8, deterministic=deterministic)


def _one_by_one(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> tuple[list[list[int]], list[int]]:
    toks, cached = [], []
    for p in prompts:
        out = llm.generate([p], sp, use_tqdm=False)[0]
        toks.append(out.outputs[0].token_ids)
        cached.append(out.num_cached_tokens)
    return toks, cached


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_hits_equal_the_cache_off_engine_with_graphs(k, overlap, sampled):
    sp = SamplingParams(temperature=0.8 if sampled else 0.0, top_p=0.95, seed=5, max_tokens=48, ignore_eos=True)
    off = _make(k, overlap, False)
    prompts = _prompts(off)
    want, _ = _one_by_one(off, prompts, sp)
    on = _make(k, overlap, True)
    got, cached = _one_by_one(on, prompts, sp)
    assert cached[0] == 0 and all(c == HIT for c in cached[1:]), cached  # every later request hits
    assert got == want
    assert on.engine.graphs.num_replays > 0
    assert_clean(on)
    assert_clean(off)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_acceptance_after_a_hit_equals_the_cache_off_engine(deterministic):
    """The head's KV for the cached tokens is really there: the same drafts are accepted at every position.
    The deterministic mode takes every shape out of the comparison (each row's bits are its own)."""
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    runs = []
    for caching in (False, True):
        llm = _make(3, True, caching, deterministic)
        prompts = _prompts(llm)
        llm.generate([prompts[0]], sp, use_tqdm=False)
        outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts[1:]]
        assert all(o.num_cached_tokens == (HIT if caching else None) for o in outs)  # None: no cache to look in
        m = [(o.metrics.num_drafted, o.metrics.num_accepted, list(o.metrics.accepted_per_position)) for o in outs]
        runs.append(([o.outputs[0].token_ids for o in outs], m))
    assert runs[0][0] == runs[1][0], "tokens differ after a hit"
    for i, (off, on) in enumerate(zip(runs[0][1], runs[1][1])):
        assert off == on, f"prompt {i + 1}: (drafted, accepted, per position) off {off} vs on {on}"
    assert sum(a for _, a, _ in runs[1][1]) > 0  # the trained head does accept here


def test_steady_state_after_a_hit_makes_no_host_sync():
    llm = _make(3, True, True)
    prompts = _prompts(llm)
    sp = SamplingParams(temperature=0.7, seed=1, max_tokens=200, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(max_tokens=2), use_tqdm=False)  # the prefix is now cached
    eng = llm.engine
    reqs = [eng.add_request(p, sp) for p in prompts[1:]]
    for _ in range(4):  # prompts (the hits' suffixes) done, this mode's graphs captured
        eng.step()
    assert all(r.num_cached_tokens == HIT for r in reqs)
    replays = eng.graphs.num_replays
    eng.sync_debug = True
    for _ in range(10):
        eng.step()
    eng.sync_debug = False
    assert eng.graphs.num_replays >= replays + 8
    eng.run()
    assert_clean(llm)
