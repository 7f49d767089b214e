"""Draft trees' prompt and mixed steps on prefill graphs, on CPU (`graph_shapes=True, prefill_graphs=True` pads
them as a CUDA replay would; tests/helpers/cpu_graphs.py replays padding-only captures over the real steps'
buffers, as a graph does):

- prompt chunks (one row, several rows, chunked by a small token budget, reading prefix-cache hits) and mixed
  steps (prompt chunks beside tree rows, full and narrow) take prefill buckets and give the unpadded engine's
  tokens and logprobs; greedy ones are plain greedy decoding, also with scripted trees that accept paths;
- replaying captures of those buckets gives the bucketed eager engine's tokens, accepted drafts and logprobs,
  and every replayed step has its capture's host ints -- a narrow step's verify width included, which a
  capture on padding rows alone does not know: narrow prefill steps take buckets (PREFILL, rows, tokens, D);
- the warm-up warms every bucket such a workload steps through."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (see test_triton_attention.py)

import pytest  # noqa: E402
import torch  # noqa: E402

from m3eagle import LLM, SamplingParams  # noqa: E402
from m3eagle.bench.geometries import tiny  # noqa: E402
from m3eagle.engine.graph_runner import NARROW, PREFILL, GraphRunner  # noqa: E402
from tests.engine.test_draft_tree import scripted_trees  # noqa: E402
from tests.helpers.cpu_graphs import cpu_replays  # noqa: E402
from tests.helpers.engine_utils import assert_clean  # noqa: E402

SPEC = "3,3,8"


@pytest.fixture(scope="module")
def geometry():
    return tiny()


def _tree(geometry, **kw) -> LLM:
    t, h = geometry
    kw = dict(device="cpu", load_format="dummy", max_model_len=160, page_size=8, max_num_tokens=24, **kw)
    return LLM(t, draft=h, draft_tree=SPEC, **kw)


def _prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts (13..45 tokens: chunked by a 24-token budget, past the tiny geometry's MSA threshold), and
    two more that share 16 and 32 token prefixes (2 and 4 full pages) with them: prefix-cache hits once the
    first three have run."""
    g = torch.Generator().manual_seed(21)
    first = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (26, 45, 13)]
    tails = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (9, 5)]
    return first, [first[0][:16] + tails[0], first[1][:32] + tails[1]]


def _params(sampled: bool, n: int) -> list[SamplingParams]:
    if sampled:
        return [SamplingParams(temperature=0.9, top_p=0.9, seed=60 + i, max_tokens=6 + 2 * i, ignore_eos=True,
                               logprobs=2) for i in range(n)]
    return [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(n)]


def _workload(llm: LLM, sampled: bool, vocab: int) -> list[tuple]:
    """Each first prompt alone (one-row prompt steps, chunked), then all five at once (several prompt rows,
    prefix-cache hits, prompt chunks beside tree rows) -> per request (tokens, accepted drafts, logprobs)."""
    first, shared = _prompts(vocab)
    sps = _params(sampled, len(first) + len(shared))
    outs = [llm.generate([p], sp)[0] for p, sp in zip(first, sps)]
    outs += llm.generate(first + shared, sps)
    return [(o.outputs[0].token_ids, o.metrics.num_accepted,
             [lp[tok].logprob for tok, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
             if sampled else None) for o in outs]


def _plain(geometry) -> list[list[int]]:
    """Plain greedy decoding of every prompt (the workload's all-at-once round)."""
    t, _ = geometry
    plain = LLM(t, num_draft_tokens=0, device="cpu", load_format="dummy", max_model_len=160, page_size=8)
    first, shared = _prompts(t.vocab_size)
    return [o.outputs[0].token_ids for o in plain.generate(first + shared, _params(False, len(first) + len(shared)))]


def _script(llm: LLM, vocab: int, ref: list[list[int]]) -> None:
    """Scripted trees over the plain greedy continuations `ref` (full, partial and rejected paths)."""
    first, shared = _prompts(vocab)
    scripted_trees(llm, {tuple(p): p + r for p, r in zip(first + shared, ref)}, vocab)


def _spy(llm: LLM) -> list[tuple[str, object]]:
    """Every step's kind (prompt: prompt chunks only; mixed: prompt chunks and tree rows; decode) and bucket."""
    seen: list[tuple[str, object]] = []
    build = llm.engine.graphs.build

    def spy(batch, bucket, *args):
        prompt = any(not r.gather for r in batch.rows)
        kind = "decode" if not prompt else "mixed" if any(r.num_drafts for r in batch.rows) else "prompt"
        seen.append((kind, bucket))
        return build(batch, bucket, *args)

    llm.engine.graphs.build = spy
    return seen


@pytest.mark.parametrize("tree_max_batch", [None, 1], ids=["full", "narrow"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_tree_prompt_and_mixed_steps_take_prefill_buckets_and_equal_unpadded(geometry, sampled, tree_max_batch):
    """Prompt and mixed steps of a tree engine pad to prefill buckets ((PREFILL, rows, tokens), and with narrow
    tree rows (PREFILL, rows, tokens, D)) and give the unpadded eager engine's tokens, accepted drafts and
    logprobs; greedy ones are plain greedy decoding. `narrow`: every step of two rows or more verifies the first
    D nodes of each tree. Greedy runs scripted trees, so paths are accepted."""
    t, _ = geometry
    vocab = t.vocab_size
    eager = _tree(geometry, tree_max_batch=tree_max_batch)
    padded = _tree(geometry, tree_max_batch=tree_max_batch, graph_shapes=True, prefill_graphs=True)
    assert eager.engine.cfg.prefill_graphs is False and padded.engine.cfg.prefill_graphs is True
    ref = _plain(geometry) if not sampled else None
    if ref is not None:
        for llm in (eager, padded):
            _script(llm, vocab, ref)
    seen = _spy(padded)
    want = _workload(eager, sampled, vocab)
    got = _workload(padded, sampled, vocab)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    if sampled:
        assert all(g[2] == pytest.approx(w[2], abs=1e-5) for g, w in zip(got, want))
    else:
        assert [g[0] for g in got[3:]] == ref and [g[0] for g in got[:3]] == ref[:3]
        assert sum(g[1] for g in got) > 0  # scripted paths were accepted
    assert padded.engine.prefix_cache_hits > 0
    # every step with a prompt chunk took a prefill bucket (the budget keeps them under the cap)
    assert all(isinstance(b, tuple) and b[0] == PREFILL for kind, b in seen if kind != "decode"), seen
    kinds = {kind for kind, _ in seen}
    assert kinds == {"prompt", "mixed", "decode"}, kinds
    rows = {b[1] for kind, b in seen if kind != "decode"}
    assert 2 in rows and max(rows) > 2, rows
    narrow = {b for _, b in seen if isinstance(b, tuple) and b[0] == PREFILL and len(b) == 4}
    assert {b[3] for b in narrow} == ({3} if tree_max_batch == 1 else set()), narrow
    assert_clean(padded)


@pytest.mark.parametrize("sampled, tree_max_batch, overlap", [(False, None, True), (False, 1, False),
                                                            (True, None, False), (True, 1, True)],
                         ids=["greedy-full-overlap", "greedy-narrow-sync", "seeded-full-sync", "seeded-narrow-overlap"])
def test_tree_prefill_replays_equal_eager_buckets(geometry, sampled, tree_max_batch, overlap):
    """Captures of padding rows replayed over real steps (cpu_replays) -- prompt, mixed and decode steps, full
    and narrow -- give the bucketed eager engine's tokens, accepted drafts and logprobs exactly, and every
    replayed step has its capture's host ints."""
    t, _ = geometry
    kw = dict(tree_max_batch=tree_max_batch, graph_shapes=True, prefill_graphs=True, overlap=overlap)
    eager, replayed = _tree(geometry, **kw), _tree(geometry, **kw)
    if not sampled:
        ref = _plain(geometry)
        for llm in (eager, replayed):
            _script(llm, t.vocab_size, ref)
    replays = cpu_replays(replayed)
    want = _workload(eager, sampled, t.vocab_size)
    assert _workload(replayed, sampled, t.vocab_size) == want
    prefill = {b for b in replays if isinstance(b, tuple) and b[0] == PREFILL}
    assert len({b[1] for b in prefill}) >= 2 and any(isinstance(b, int) for b in replays), replays
    if tree_max_batch == 1:
        assert any(len(b) == 4 for b in prefill) and any(isinstance(b, tuple) and b[0] == NARROW for b in replays)
    assert_clean(replayed)


def test_chain_prefill_replays_equal_eager_buckets(geometry):
    """The stand-in holds for the chain's prefill graphs too (K = 3, seeded, overlap): replays of padding-only
    captures give the bucketed eager engine's tokens, accepted drafts and logprobs."""
    t, h = geometry
    kw = dict(device="cpu", load_format="dummy", max_model_len=160, page_size=8, max_num_tokens=24,
              num_draft_tokens=3, graph_shapes=True, prefill_graphs=True, overlap=True)
    eager, replayed = LLM(t, draft=h, **kw), LLM(t, draft=h, **kw)
    replays = cpu_replays(replayed)
    assert _workload(replayed, True, t.vocab_size) == _workload(eager, True, t.vocab_size)
    assert any(isinstance(b, tuple) and b[1] > 2 for b in replays) and any(isinstance(b, int) for b in replays)


def test_a_capture_without_the_verify_width_is_caught(geometry, monkeypatch):
    """Why narrow prefill-shaped tree steps key their width: a capture of padding rows alone computes at the full
    width N, and a narrow mixed step replayed on it would verify and grow N-node trees where eager verifies D
    nodes and grows D-node chains. With the width dropped from the key, cpu_replays refuses the first such
    replay."""
    real = GraphRunner.bucket
    monkeypatch.setattr(GraphRunner, "bucket", lambda self, batch, *a: (
        b[:3] if isinstance(b := real(self, batch, *a), tuple) and b[0] == PREFILL else b))
    llm = _tree(geometry, tree_max_batch=1, graph_shapes=True, prefill_graphs=True)
    cpu_replays(llm)
    with pytest.raises(AssertionError, match="host ints"):
        _workload(llm, False, geometry[0].vocab_size)


def test_tree_warmup_covers_prefill_and_narrow_buckets(geometry):
    """warm_keys of a tree engine hold each prefill bucket at full width and, where its rows can exceed
    tree_max_batch, at the narrow width too; a mixed workload afterwards steps only through warmed keys."""
    llm = _tree(geometry, tree_max_batch=1, graph_shapes=True, prefill_graphs=True, max_num_seqs=4,
                max_prefill_graph_tokens=32)
    eng, gr = llm.engine, llm.engine.graphs
    keys = gr.warm_keys()
    assert len(keys) == len(set(keys))
    buckets = {b for b, _ in keys}
    full = {(PREFILL, r, t) for t in gr.prefill_buckets for r in gr.prefill_rows if 2 <= r <= t}
    assert buckets >= full | {(*b, 3) for b in full if b[1] > 2} and (PREFILL, 2, 16, 3) not in buckets
    stepped: set = set()
    ensure = gr.ensure

    def spy(batch, bucket, masked=False):
        if bucket is not None:
            stepped.add((bucket, (*gr.bufs.step_mode(batch.rows), masked)))
        return ensure(batch, bucket, masked)

    gr.ensure = spy
    _workload(llm, False, geometry[0].vocab_size)
    _workload(llm, True, geometry[0].vocab_size)
    assert stepped <= set(keys), sorted(map(str, stepped - set(keys)))
    assert any(isinstance(b, tuple) and len(b) == 4 for b, _ in stepped)
    assert eng.warmup()["graphs"] == len(keys)
    assert_clean(llm)
