"""The graph-ready engine on CPU: per-engine ops, plain-tensor step inputs in
preallocated buffers, and the bucketing / padding that CUDA-graph steps use.

- two LLMs with different attention and MoE backends live side by side in one process, and a failed
  construction leaves a working LLM alone (the backend used to be a module global);
- bucket sizes, the bucket of a step, which steps are graph-shaped;
- padding rows read and write only the trash page and the dump slot, and a padded, fixed-KV-bound step
  gives the real rows exactly the tokens of an unpadded one (greedy and seeded sampling, K = 0 and 3,
  overlap on and off) -- graph_shapes=True forces on CPU what CUDA does;
- step inputs are views of the engine's buffers: two steps of one shape read the same addresses;
- prefill graphs (opt-in): which steps qualify, the padding row's trash-only footprint, and the same
  tokens as unpadded prompt steps.
GPU capture and replay are tested in test_cuda_graphs.py (marker gpu).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` (see test_triton_attention.py)

import pytest  # noqa: E402

from m3eagle import LLM, SamplingParams  # noqa: E402
from m3eagle.engine.graph_runner import (  # noqa: E402
    PREFILL,
    bucket_for,
    bucket_sizes,
    is_graph_shaped,
    is_prefill_shaped,
    prefill_bucket_sizes,
)
from m3eagle.engine.scheduler import ScheduledBatch, ScheduledRow  # noqa: E402
from m3eagle.kernels.attention.metadata import TRASH_PAGE  # noqa: E402
from tests.helpers.engine_utils import assert_clean  # noqa: E402

PROMPTS = [[9, 21, 33, 4], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59], [7, 8], [60, 61, 62, 63, 64, 65, 66],
           [12, 13, 14]]


def llm_for(model_dir, head_dir, k: int, **kw) -> LLM:
    kw = {"device": "cpu", "page_size": 4, "max_model_len": 64, "max_num_tokens": 64, "max_num_seqs": 8, **kw}
    return LLM(model_dir, draft=head_dir if k else None, num_draft_tokens=k, **kw)


# ------------------------------------------------------------------------------------------------
# ops belong to an engine
# ------------------------------------------------------------------------------------------------


def test_two_llms_with_different_backends_coexist(model_dir):
    pytest.importorskip("triton")
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ref = llm_for(model_dir, None, 0, attention_backend="reference", moe_backend="reference")
    fast = llm_for(model_dir, None, 0, attention_backend="triton", moe_backend="triton")
    assert ref.engine.ops.names == {"attention": "reference", "moe": "reference"}
    assert fast.engine.ops.names == {"attention": "triton", "moe": "triton"}
    a = [o.outputs[0].token_ids for o in ref.generate(PROMPTS[:2], sp)]
    b = [o.outputs[0].token_ids for o in fast.generate(PROMPTS[:2], sp)]
    assert a == b
    # the first LLM still runs its own backends after the second was built and used
    assert ref.engine.ops.names == {"attention": "reference", "moe": "reference"}
    used = []
    orig = ref.engine.ops.attention.attention

    def spy(*args, **kw):
        used.append(True)
        return orig(*args, **kw)

    object.__setattr__(ref.engine.ops.attention, "attention", spy)
    assert [o.outputs[0].token_ids for o in ref.generate(PROMPTS[:2], sp)] == a and used
    with pytest.raises(ValueError, match="attention_backend='nope'"):
        llm_for(model_dir, None, 0, attention_backend="nope")
    assert [o.outputs[0].token_ids for o in fast.generate(PROMPTS[:2], sp)] == b  # a failed construction broke nothing
    assert_clean(ref)
    assert_clean(fast)


# ------------------------------------------------------------------------------------------------
# buckets
# ------------------------------------------------------------------------------------------------


def test_bucket_sizes():
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert bucket_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(1) == [1]
    b = bucket_sizes(64)
    assert [bucket_for(n, b) for n in (1, 3, 5, 9, 17, 25, 33, 49, 64)] == [1, 4, 8, 16, 24, 32, 48, 64, 64]
    assert bucket_for(65, b) is None


class _Req:
    def __init__(self, slot: int, pages: list[int], params=None):
        self.slot, self.pages, self.seed = slot, pages, 0
        self.params = params or SamplingParams(temperature=0)


def _row(k: int, gather=True, samples=True, num_drafts=None, tokens=None) -> ScheduledRow:
    nd = k if num_drafts is None else num_drafts
    return ScheduledRow(_Req(0, [3]), 5, [0] * (tokens or (1 + nd)), nd, samples, gather, False, 0)


def test_which_steps_are_graph_shaped():
    k = 3
    assert is_graph_shaped(ScheduledBatch([_row(k), _row(k)], []), k)
    assert not is_graph_shaped(ScheduledBatch([], []), k)
    assert not is_graph_shaped(ScheduledBatch([_row(k), _row(k, gather=False)], []), k)  # a prompt's last chunk
    assert not is_graph_shaped(ScheduledBatch([_row(k), _row(k, num_drafts=0)], []), k)  # budget took drafts
    assert not is_graph_shaped(ScheduledBatch([_row(k, samples=False, gather=False, tokens=4)], []), k)
    assert is_graph_shaped(ScheduledBatch([_row(0)], []), 0)


def test_padding_rows_touch_only_trash_and_dump(model_dir, head_dir):
    llm = llm_for(model_dir, head_dir, 3, graph_shapes=True)
    eng = llm.engine
    rows = [ScheduledRow(_Req(i, [2 + i]), 2, [0] * 4, 3, True, True, False, 0) for i in range(3)]
    batch = ScheduledBatch(rows, [])
    bucket = eng.graphs.bucket(batch)
    assert bucket == 4
    inp = eng.graphs.build(batch, bucket)
    assert inp.num_rows == 4 and inp.num_tokens == 16 and inp.meta.max_kv == eng.table_width * 4
    assert inp.row_slot.tolist() == [0, 1, 2, eng.runner.dump_slot]
    assert inp.meta.page_table[3].tolist() == [TRASH_PAGE] * eng.table_width
    assert inp.row_samples.tolist() == [True, True, True, False]
    assert inp.sampling.greedy[3] and not inp.row_gather[3] and not inp.row_correct[3]
    meta = inp.meta.with_lengths(inp.meta.kv_lens)
    assert (meta.slot_mapping[12:] // 4 == TRASH_PAGE).all()
    # inputs are views of the engine's buffers, at the same addresses for every step of this shape
    again = eng.graphs.build(batch, bucket)
    assert again.input_ids.data_ptr() == inp.input_ids.data_ptr()
    assert again.meta.page_table.data_ptr() == inp.meta.page_table.data_ptr()
    assert again.sampling.temperature.data_ptr() == inp.sampling.temperature.data_ptr()
    assert inp.input_ids.untyped_storage().data_ptr() == eng.buffers.d_bytes.untyped_storage().data_ptr()


@pytest.mark.parametrize("k, overlap", [(0, False), (3, False), (3, True)])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_graph_shaped_steps_give_the_same_tokens(model_dir, head_dir, k, overlap, sampled):
    """Padding to buckets and the fixed KV bound (what every CUDA step does) change no real row's tokens,
    with requests of different lengths joining and leaving (so buckets change between steps)."""
    if sampled:
        params = [SamplingParams(temperature=0.9, top_k=20, max_tokens=6 + 3 * i, seed=100 + i, ignore_eos=True)
                  for i in range(len(PROMPTS))]
    else:
        params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    plain = llm_for(model_dir, head_dir, k, overlap=overlap)
    padded = llm_for(model_dir, head_dir, k, overlap=overlap, graph_shapes=True)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    seen = []
    build = padded.engine.graphs.build

    def spy(batch, bucket, *args):
        seen.append((len(batch.rows), bucket))
        return build(batch, bucket, *args)

    padded.engine.graphs.build = spy
    assert [o.outputs[0].token_ids for o in padded.generate(PROMPTS, params)] == want
    padded_steps = [(n, b) for n, b in seen if b is not None]
    assert any(b > n for n, b in padded_steps)  # some step really ran with padding rows
    assert len({b for _, b in padded_steps}) >= 2  # and the bucket changed as requests finished
    assert_clean(padded)


def test_page_table_cache_equals_a_fresh_table_through_every_kind_of_change():
    """StepBuffers.page_table rewrites a row only when its page list is another list, and only the new tail
    when the same list grew; after any sequence of growth in place, replacement, row reordering and fewer
    rows it must equal the table built from scratch (each row's pages, then the trash page; padding rows
    trash only)."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from m3eagle.engine.input_builder import StepBuffers

    width = 6
    bufs = StepBuffers(max_tokens=16, max_rows=4, table_width=width, device=torch.device("cpu"))

    def fresh(reqs, n_rows):
        t = np.full((n_rows, width), TRASH_PAGE, dtype=np.int64)
        for i, r in enumerate(reqs):
            t[i, :len(r.pages)] = r.pages
        return t.reshape(-1)

    a, b, c = (SimpleNamespace(pages=p) for p in ([1, 2], [3], [4, 5, 6]))
    steps = [
        ([a, b, c], 4, None),
        ([a, b, c], 4, lambda: a.pages.append(7)),  # grown in place
        ([a, b, c], 4, lambda: setattr(b, "pages", [8, 9])),  # replaced (preemption, a fork)
        ([c, a, b], 4, None),  # rows reordered
        ([b], 2, None),  # fewer rows: the old rows must become padding
        ([b], 2, lambda: setattr(b, "pages", [])),  # replaced by an empty list
        ([a, c], 3, None),
        ([a, c], 3, lambda: a.pages.extend([10, 11])),  # grown by two in place: only the tail is written
        ([a, c], 3, lambda: a.pages.append(12)),
        ([c, a], 3, lambda: c.pages.append(13)),  # grown and moved to another row
        ([c, a], 3, lambda: a.pages.pop()),  # shrunk in place (the engine never does): the whole row
    ]
    for reqs, n_rows, change in steps:
        if change:
            change()
        rows = [SimpleNamespace(req=r) for r in reqs]
        assert bufs.page_table(rows, n_rows).tolist() == fresh(reqs, n_rows).tolist()


# ------------------------------------------------------------------------------------------------
# prefill graphs (opt-in): one-row prompt chunks padded to token buckets
# ------------------------------------------------------------------------------------------------


def test_prefill_buckets_and_which_steps_qualify():
    assert prefill_bucket_sizes(2048) == [16, 32, 64, 96, 128, 160, 192, 224, 256, 384, 512, 768, 1024, 1536, 2048]
    assert prefill_bucket_sizes(2112)[-3:] == [1536, 2048, 2112]  # the buffers' width itself is the last bucket
    assert prefill_bucket_sizes(100) == [16, 32, 64, 96, 100] and prefill_bucket_sizes(8) == []
    prompt = ScheduledRow(_Req(0, [1, 2, 3, 4, 5]), 0, [1] * 20, 0, True, False, False, 0)
    assert is_prefill_shaped(ScheduledBatch([prompt], []))
    assert is_prefill_shaped(ScheduledBatch([prompt, prompt], []))  # several prompt rows
    assert is_prefill_shaped(ScheduledBatch([_row(0), prompt], []))  # a mixed step: decode rows and a prompt
    assert not is_prefill_shaped(ScheduledBatch([], []))
    for extra in ({"repetition_penalty": 1.2}, {"min_tokens": 2}, {"prompt_logprobs": 1}):
        req = _Req(0, [1, 2, 3, 4, 5], SamplingParams(**extra))
        odd = ScheduledRow(req, 0, [1] * 20, 0, True, False, False, 0)
        assert not is_prefill_shaped(ScheduledBatch([odd], []))
        assert not is_prefill_shaped(ScheduledBatch([prompt, odd], []))  # one such row keeps the step eager


def test_prefill_padding_rows_touch_only_trash_and_dump(model_dir, head_dir):
    """A 20-token prompt chunk takes (2 rows, 32 tokens): one padding row of 12 tokens on the trash page and
    the dump slot, verifying nothing, sampling nothing; max_q fixed at the bucket; the real row's values as
    unpadded. Three rows of 20 + 4 + 1 tokens (a prompt, a verify row, a prompt) take (4 rows, 32 tokens):
    one padding row of 32 - 25 = 7 tokens. A step of all 8 sequences takes the buffers' ninth row. Off by
    default on a CPU (on by default only on one CUDA device)."""
    llm = llm_for(model_dir, head_dir, 3, graph_shapes=True, prefill_graphs=True)
    eng = llm.engine
    row = ScheduledRow(_Req(1, [5, 6, 7, 8, 9]), 0, list(range(3, 23)), 0, True, False, False, 0)
    batch = ScheduledBatch([row], [])
    assert eng.graphs.bucket(batch) == (PREFILL, 2, 32)
    inp = eng.graphs.build(batch, (PREFILL, 2, 32))
    assert inp.num_rows == 2 and inp.num_tokens == 32 and inp.meta.max_q == 32
    assert inp.meta.max_kv == eng.table_width * 4
    assert inp.row_qlen.tolist() == [20, 12] and inp.row_num_drafts.tolist() == [0, 0]
    assert inp.row_slot.tolist() == [1, eng.runner.dump_slot]
    assert inp.row_samples.tolist() == [True, False] and not inp.row_gather.any()
    assert inp.meta.page_table[1].tolist() == [TRASH_PAGE] * eng.table_width
    assert inp.input_ids[:20].tolist() == list(range(3, 23))
    meta = inp.meta.with_lengths(inp.meta.kv_lens)
    assert (meta.slot_mapping[20:] // 4 == TRASH_PAGE).all() and not (meta.slot_mapping[:20] // 4 == TRASH_PAGE).any()

    short = ScheduledRow(_Req(3, [1, 2]), 2, [40], 0, True, False, False, 0)
    mixed = ScheduledBatch([row, _row(3), short], [])
    assert eng.graphs.bucket(mixed) == (PREFILL, 4, 32)
    inp = eng.graphs.build(mixed, (PREFILL, 4, 32))
    assert inp.row_qlen.tolist() == [20, 4, 1, 7] and inp.row_num_drafts.tolist() == [0, 3, 0, 0]
    assert inp.row_slot.tolist()[3] == eng.runner.dump_slot and inp.meta.max_q == 32
    assert inp.row_gather.tolist() == [False, True, False, False]
    assert inp.meta.page_table[3].tolist() == [TRASH_PAGE] * eng.table_width
    meta = inp.meta.with_lengths(inp.meta.kv_lens)
    assert (meta.slot_mapping[25:] // 4 == TRASH_PAGE).all()

    # every sequence in one step (max_num_seqs = 8): the buffers hold one row more, for the padding row
    assert eng.buffers.max_rows == 9 and eng.graphs.bucket(ScheduledBatch([short] * 8, [])) == (PREFILL, 9, 16)
    inp = eng.graphs.build(ScheduledBatch([short] * 8, []), (PREFILL, 9, 16))
    assert inp.num_rows == 9 and inp.row_qlen.tolist() == [1] * 8 + [8]
    plain = llm_for(model_dir, head_dir, 3, graph_shapes=True).engine
    assert plain.graphs.bucket(batch) is None and plain.buffers.max_rows == 8  # the CPU default: off
    assert plain.cfg.prefill_graphs is False  # the resolved choice is the engine's config


def test_prefill_graphs_stop_at_max_prefill_graph_tokens(model_dir, head_dir):
    """Steps of more than max_prefill_graph_tokens real tokens run eagerly (bucket None); a step of exactly
    that many replays, its padding rows in a last bucket of cap + (buffer rows) tokens; a cap under the
    smallest bucket is refused, naming the option and the way to turn prefill graphs off."""
    assert prefill_bucket_sizes(2048, 512)[-3:] == [256, 384, 512]
    assert prefill_bucket_sizes(2048, 512, 33)[-3:] == [384, 512, 545]
    assert prefill_bucket_sizes(2081, 2048, 33)[-2:] == [2048, 2081]  # a full 2048-token budget's step fits
    assert prefill_bucket_sizes(530, 512, 33)[-2:] == [512, 530]  # never past the buffers
    llm = llm_for(model_dir, head_dir, 3, graph_shapes=True, prefill_graphs=True, max_prefill_graph_tokens=32)
    eng = llm.engine
    slack = eng.buffers.max_rows
    assert eng.graphs.prefill_buckets == [16, 32, 32 + slack]
    fits = ScheduledRow(_Req(1, [5, 6, 7, 8, 9]), 0, list(range(3, 23)), 0, True, False, False, 0)
    assert eng.graphs.bucket(ScheduledBatch([fits], [])) == (PREFILL, 2, 32)
    full = ScheduledRow(_Req(2, [5, 6, 7, 8, 9]), 0, list(range(3, 35)), 0, True, False, False, 0)
    assert eng.graphs.bucket(ScheduledBatch([full], [])) == (PREFILL, 2, 32 + slack)  # 32 + a padding row
    big = ScheduledRow(_Req(2, [5, 6, 7, 8, 9]), 0, list(range(3, 36)), 0, True, False, False, 0)
    assert eng.graphs.bucket(ScheduledBatch([big], [])) is None  # 33 real tokens > 32
    with pytest.raises(ValueError, match="max_prefill_graph_tokens=8 .*prefill_graphs=False"):
        llm_for(model_dir, head_dir, 3, prefill_graphs=True, max_prefill_graph_tokens=8)


@pytest.mark.parametrize("k, overlap", [(0, False), (3, False), (3, True)])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_prefill_graph_shaped_steps_give_the_same_tokens(model_dir, head_dir, k, overlap, sampled):
    """Prompts of several lengths, one request at a time (so every prompt step has one row) and then all at
    once (prompt steps of several rows, and mixed steps of prompt chunks and decode rows): padding them to
    row and token buckets changes no token, and several buckets of one and of more rows were really used.
    A 70-token prompt is chunked (64 + 6): its second chunk reads a cached prefix."""
    prompts = [[9, 21, 33, 4], list(range(50, 70)), list(range(3, 73)), [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    if sampled:
        params = [SamplingParams(temperature=0.9, top_k=20, max_tokens=5 + 2 * i, seed=40 + i, ignore_eos=True)
                  for i in range(len(prompts))]
    else:
        params = [SamplingParams(temperature=0, max_tokens=5 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
    plain = llm_for(model_dir, head_dir, k, overlap=overlap, max_model_len=96)
    padded = llm_for(model_dir, head_dir, k, overlap=overlap, max_model_len=96, graph_shapes=True,
                     prefill_graphs=True)
    seen = []
    build = padded.engine.graphs.build

    def spy(batch, bucket, *args):
        seen.append(bucket)
        return build(batch, bucket, *args)

    padded.engine.graphs.build = spy
    for p, sp in zip(prompts, params):
        want = plain.generate([p], sp)[0].outputs[0].token_ids
        assert padded.generate([p], sp)[0].outputs[0].token_ids == want, p
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in padded.generate(prompts, params)] == want
    used = {b[1:] for b in seen if isinstance(b, tuple)}
    assert len({t for r, t in used if r == 2}) >= 2 and any(r > 2 for r, _ in used), used
    assert_clean(padded)


def test_replay_launch_time_is_accounted_per_replay():
    """GraphRunner sums the host time spent inside graph.replay() (the bench's graph_launch_ms) for every
    replay, and only for replays: a fake graph that sleeps is timed, an eager step adds nothing."""
    import time as _time
    from types import SimpleNamespace

    from m3eagle.engine.graph_runner import GraphRunner

    class SlowGraph:
        def replay(self):
            _time.sleep(0.002)

    static = SimpleNamespace(fresh=lambda: "out")
    runner = SimpleNamespace(execute=lambda inp: "eager")
    gr = GraphRunner.__new__(GraphRunner)  # only the replay path's state
    gr.runner, gr.use_graphs, gr.num_replays, gr.launch_seconds = runner, True, 0, 0.0
    gr.graphs = {(4, "m"): (SlowGraph(), static)}
    inp = SimpleNamespace(mode="m")
    assert gr._run(inp, 4) == "out" and gr._run(inp, 4) == "out"
    assert gr.num_replays == 2 and gr.launch_seconds >= 0.004
    before = gr.launch_seconds
    assert gr._run(inp, None) == "eager" and gr.launch_seconds == before
