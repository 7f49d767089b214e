"""Parity with the oracle, transformers' MiniMaxM3VLForCausalLM (fp32, random tiny configs):

- logits of m3eagle's paged path (and its contiguous path) equal transformers' on contexts several times
  index_topk_blocks * index_block_size long, so that sparse block selection is really active;
- chunked, batched paged prefill into shared caches equals one-shot;
- greedy generation through `LLM` equals transformers' greedy `generate` token for token, batched,
  chunked and with preemption forced.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from m3eagle import LLM, SamplingParams
from m3eagle.kernels.attention.metadata import TRASH_PAGE, build_metadata
from m3eagle.loader.checkpoint import load_target
from m3eagle.models.minimax_m3 import MiniMaxM3
from tests.helpers.engine_utils import Counters
from tests.helpers.hf_utils import random_hf_model, tiny_hf_config

CPU = torch.device("cpu")
RTOL = 1e-4

# Varied: seed, GQA ratio (MQA / GQA / MHA), index heads, local blocks, tied embeddings, rotary factor,
# block size / top-k, and expert widths where the fused gate_up is not square.
CONFIGS = {
    "gqa2-local1-rf0.5": dict(seed=0),
    "mqa-local2-rf1.0": dict(seed=1, heads=4, kv_heads=1, index_heads=1, local_blocks=2, rotary_factor=1.0),
    "gqa4-idx4-tied": dict(seed=2, heads=8, kv_heads=2, index_heads=4, tie=True, rotary_factor=0.5),
    "mha-local2-tied-rf1.0": dict(seed=3, heads=4, kv_heads=4, local_blocks=2, tie=True, rotary_factor=1.0,
                                  intermediate_size=16),
    "block4-top3-idx1": dict(seed=4, block=4, topk=3, index_heads=1, experts=6, top_k=3, intermediate_size=20),
}
LENGTHS = (96, 131, 160)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def case(request, tmp_path_factory):
    """(hf model, m3eagle target) sharing one random checkpoint."""
    kw = dict(CONFIGS[request.param])
    inter = kw.pop("intermediate_size", None)
    cfg = tiny_hf_config(**kw)
    if inter is not None:
        cfg.intermediate_size = inter
    hf = random_hf_model(cfg, kw["seed"])
    d = tmp_path_factory.mktemp(f"parity_{request.param}")
    hf.save_pretrained(d)
    return hf, load_target(d)


def paged_forward(model: MiniMaxM3, chunks: list[list[torch.Tensor]], page_size: int, seed: int = 0,
                  ) -> list[torch.Tensor]:
    """Run rows of token chunks step by step through shared paged caches; pages are scattered and
    interleaved between rows. chunks[step][row] are the new tokens of that row at that step.
    Returns per-row logits of all tokens, concatenated over steps."""
    rows = len(chunks[0])
    totals = [sum(c[r].numel() for c in chunks) for r in range(rows)]
    per_row = [-(-n // page_size) for n in totals]
    g = torch.Generator().manual_seed(seed)
    pages = (torch.randperm(sum(per_row) + 3, generator=g) + 1).tolist()
    width = max(per_row) + 1
    table = torch.full((rows, width), TRASH_PAGE, dtype=torch.int64)
    held: list[list[int]] = [[] for _ in range(rows)]
    while pages and any(len(h) < n for h, n in zip(held, per_row)):
        for r in range(rows):  # round-robin, so rows' pages interleave in the pool
            if len(held[r]) < per_row[r]:
                held[r].append(pages.pop())
    for r in range(rows):
        table[r, : per_row[r]] = torch.tensor(held[r])
    caches = model.new_caches((sum(per_row) + 4) * page_size, torch.float32, CPU)
    done = [0] * rows
    out: list[list[torch.Tensor]] = [[] for _ in range(rows)]
    for step in chunks:
        q_lens = [c.numel() for c in step]
        kv = torch.tensor([done[r] + q_lens[r] for r in range(rows)])
        meta = build_metadata(q_lens, kv, table, page_size, CPU, int(kv.max()))
        with torch.no_grad():
            logits = model.compute_logits(model(torch.cat(step), meta.positions, meta, caches))
        for r, piece in enumerate(logits.split(q_lens)):
            out[r].append(piece)
            done[r] += q_lens[r]
    return [torch.cat(o) for o in out]


def test_paged_logits_match_transformers(case):
    """One-shot paged prefill and the contiguous path equal transformers' logits (max rel err 1e-4)."""
    hf, model = case
    g = torch.Generator().manual_seed(1)
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(0, model.cfg.vocab_size, (n,), generator=g)
        with torch.no_grad():
            ref = hf(ids[None]).logits[0].float()
            seq = model.compute_logits(model.forward_seq(ids[None])[0][0])
        paged = paged_forward(model, [[ids]], page_size=(4, 3, 16)[i], seed=i)[0]
        assert rel_err(paged, ref) <= RTOL
        assert rel_err(seq, ref) <= RTOL


def test_contexts_exercise_sparse_selection(case):
    """Guard for the parity test: at these lengths the sparse layers' block selection changes the
    logits (a dense variant of the same weights differs), so parity really covers sparsity."""
    hf, model = case
    dense = MiniMaxM3(dataclasses.replace(model.cfg, index_topk_blocks=1000))
    dense.load_state_dict(model.state_dict())
    ids = torch.randint(0, model.cfg.vocab_size, (1, LENGTHS[-1]), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
        d = dense.compute_logits(dense.forward_seq(ids)[0][0])
    assert rel_err(d, ref) > 1e-3


def test_chunked_batched_paged_prefill_equals_one_shot(case):
    """Two sequences fed together in chunks (a big prefill, a 4-token verify-like extend, a 1-token decode
    and the rest) through the same caches give the logits of one-shot prefill of each sequence."""
    _, model = case
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, model.cfg.vocab_size, (150,), generator=g)
    b = torch.randint(0, model.cfg.vocab_size, (97,), generator=g)
    cuts_a, cuts_b = (0, 61, 65, 66, 150), (0, 40, 41, 45, 97)
    chunks = [[a[cuts_a[i]:cuts_a[i + 1]], b[cuts_b[i]:cuts_b[i + 1]]] for i in range(4)]
    got = paged_forward(model, chunks, page_size=4, seed=5)
    for seq, logits in zip((a, b), got):
        with torch.no_grad():
            ref = model.compute_logits(model.forward_seq(seq[None])[0][0])
        assert rel_err(logits, ref) <= RTOL


# ------------------------------------------------------------------------------------------------
# greedy generation vs transformers.generate
# ------------------------------------------------------------------------------------------------

PROMPT_LENS = (3, 70, 12, 40, 5, 25, 33, 9)
NEW = 24


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_greedy(tiny_model, prompts):
    """transformers' own greedy generate on two prompts (the slow, literal oracle)."""
    _, hf = tiny_model
    out = {}
    for i in (0, 1):
        ids = torch.tensor([prompts[i]])
        with torch.no_grad():
            gen = hf.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        out[i] = gen[0, ids.shape[1]:].tolist()
    return out


@pytest.fixture(scope="module")
def oracle_greedy(tiny_model, prompts, hf_greedy):
    """Greedy continuations that transformers confirms: prompts 0 and 1 equal its generate() token for
    token; for every prompt each token is transformers' argmax given the prefix (one teacher-forced
    forward per prompt -- the same condition as greedy generate, without the slow loop)."""
    d, hf = tiny_model
    llm = LLM(d, device="cpu", page_size=16, max_model_len=128, max_num_tokens=1024)
    outs = [llm.generate([p], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))[0]
            for p in prompts]  # one request at a time, one-shot prefill
    for i, ref in hf_greedy.items():
        assert outs[i].outputs[0].token_ids == ref
    for o in outs:
        seq = torch.tensor([o.prompt_token_ids + o.outputs[0].token_ids])
        with torch.no_grad():
            logits = hf(seq).logits[0]
        n = len(o.prompt_token_ids)
        assert logits[n - 1:-1].argmax(-1).tolist() == o.outputs[0].token_ids
    return [o.outputs[0].token_ids for o in outs]


def test_one_request_greedy_matches_transformers(oracle_greedy):
    assert all(len(t) == NEW for t in oracle_greedy)


@pytest.mark.parametrize("mode", ["batched", "chunked", "preempted"])
def test_greedy_generation_matches_transformers(tiny_model, prompts, oracle_greedy, mode):
    """Batched, chunked (7-token budget) and preempted (40 pages) greedy runs give transformers' greedy
    tokens exactly, and return every page."""
    d, _ = tiny_model
    kw = {"batched": dict(max_num_tokens=1024), "chunked": dict(max_num_tokens=7),
          "preempted": dict(max_num_tokens=64, num_pages=40)}[mode]
    llm = LLM(d, device="cpu", page_size=4, max_model_len=128, **kw)
    counters = Counters(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    llm.engine.check_integrity()
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable
    assert (counters.preempted > 0) == (mode == "preempted")
    assert [o.outputs[0].token_ids for o in outs] == oracle_greedy
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
