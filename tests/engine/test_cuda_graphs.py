"""CUDA-graph replay of whole speculative steps equals eager execution, token for token. GPU only:
run through the device tool with `python -m pytest -q -m gpu tests/engine/test_cuda_graphs.py`.

The eager engine (enforce_eager=True) pads graph-shaped steps to the same buckets with the same fixed KV
bound, so both launch identical kernels on identical shapes; any difference would be a capture bug
(a stale input view, a host value baked into the graph, a padding row that writes a live slot).
Covered: greedy and seeded sampling, K = 0, 1, 3, 5, overlap on and off, requests joining and leaving
between replays, and forced preemption churn; the steady state runs under
torch.cuda.set_sync_debug_mode("error"), grammar-constrained (masked) steps included.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from m3eagle import LLM, SamplingParams
from tests.helpers.engine_utils import Counters, assert_clean

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TEXTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):",
         "for i in range(10):", "# parse a csv file\n", "def add(a, b):\n    return", "x = [", "while True:"]


def make(k: int, overlap: bool, eager: bool, **kw) -> LLM:
    kw = {"max_num_seqs": 16, "max_num_tokens": 256, "max_model_len": 512, **kw}
    return LLM(device="cuda", num_draft_tokens=k, overlap=overlap, enforce_eager=eager, **kw)


def params(sampled: bool | str) -> list[SamplingParams]:
    if sampled == "penalized":  # penalties + min_tokens + min_p: the device-side penalty state in the graph
        return [SamplingParams(temperature=0.7 if i % 2 else 0.0, max_tokens=12 + 5 * i, seed=3 + i,
                               repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                               min_tokens=4, min_p=0.05, ignore_eos=True) for i in range(len(TEXTS))]
    if sampled:
        return [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12 + 5 * i, seed=7 + i, ignore_eos=True)
                for i in range(len(TEXTS))]
    return [SamplingParams(temperature=0, max_tokens=12 + 5 * i, ignore_eos=True) for i in range(len(TEXTS))]


def run_with_arrivals(llm: LLM, sps: list[SamplingParams]) -> list[list[int]]:
    """Half the prompts start, the rest join between steps; max_tokens differ, so rows leave too."""
    eng = llm.engine
    reqs = [eng.add_request(llm.encode(t), sp) for t, sp in zip(TEXTS[:4], sps[:4])]
    for _ in range(6):
        eng.step()
    reqs += [eng.add_request(llm.encode(t), sp) for t, sp in zip(TEXTS[4:], sps[4:])]
    eng.run()
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("k", [0, 1, 3, 5])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("sampled", [False, True, "penalized"], ids=["greedy", "seeded", "penalized"])
def test_graph_replay_equals_eager(k, overlap, sampled):
    sps = params(sampled)
    eager = make(k, overlap, True)
    graph = make(k, overlap, False)
    assert graph.engine.graphs.use_graphs and not eager.engine.graphs.use_graphs
    want = run_with_arrivals(eager, sps)
    got = run_with_arrivals(graph, sps)
    assert got == want
    assert graph.engine.graphs.num_replays > 0
    assert_clean(graph)
    assert_clean(eager)


def first_tokens(llm: LLM, sps: list[SamplingParams], n: int = 48) -> list[list[int]]:
    """Every prompt at once, run until each request has n tokens (none finishes: max_tokens is raised), then
    aborted: the first n tokens of each, computed in steps whose batch never changed."""
    from dataclasses import replace

    eng = llm.engine
    reqs = [eng.add_request(llm.encode(t), replace(sp, max_tokens=400)) for t, sp in zip(TEXTS, sps)]
    while min(len(r.output_token_ids) for r in reqs) < n:
        eng.step()
    out = [r.output_token_ids[:n] for r in reqs]
    for r in reqs:
        eng.abort(r.request_id)
    eng.run()
    return out


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("sampled", [False, True, "penalized"], ids=["greedy", "seeded", "penalized"])
def test_multi_step_replays_equal_one_step_at_a_time(k, sampled):
    """num_scheduler_steps=4: each iteration replays its graph four times, the device advancing the rows'
    lengths in the captured input buffer between replays (the Triton commit kernel's chain). Over a batch
    that never changes the tokens equal one replay per host plan's. (Arrivals and finishes do change it
    differently: a multi-step iteration admits new requests and drops finished ones only at its end, and
    in bf16 a step's rounding depends on its batch -- on the H200 seeded K=0 flipped a draw at a mixed
    step that only the one-step engine had. The CPU tests (fp32) compare those cases token for token.)"""
    sps = params(sampled)
    one = make(k, True, False)
    multi = make(k, True, False, num_scheduler_steps=4)
    want = first_tokens(one, sps)
    assert first_tokens(multi, sps) == want
    eng = multi.engine
    assert eng.graphs.num_replays > 0 and eng.num_iterations < eng.num_steps
    for llm in (one, multi):
        assert_clean(llm)


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("sampled", [False, True, "penalized"], ids=["greedy", "seeded", "penalized"])
def test_multi_step_replay_equals_eager_with_arrivals(k, sampled):
    """Multi-step iterations with requests joining and leaving: graph replay equals the eager engine
    (enforce_eager, the same iterations, the same batches) token for token."""
    sps = params(sampled)
    graph = make(k, True, False, num_scheduler_steps=4)
    eager = make(k, True, True, num_scheduler_steps=4)
    assert run_with_arrivals(graph, sps) == run_with_arrivals(eager, sps)
    eng = graph.engine
    assert eng.graphs.num_replays > 0 and eng.num_iterations < eng.num_steps
    for llm in (graph, eager):
        assert_clean(llm)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_auto_runs_eight_sub_steps_equal_to_eager(sampled):
    """num_scheduler_steps='auto' gives the embedded pair (24 MB of weights) 8 sub-steps per iteration with
    graphs (1 eagerly); with arrivals and leaves it equals the eager engine taking the same iterations
    (num_scheduler_steps=8) token for token."""
    sps = params(sampled)
    graph = make(3, True, False, num_scheduler_steps="auto")
    eager = make(3, True, True, num_scheduler_steps=8)
    assert graph.engine.cfg.num_scheduler_steps == 8
    assert make(3, True, True, num_scheduler_steps="auto").engine.cfg.num_scheduler_steps == 1  # eager: 1
    assert run_with_arrivals(graph, sps) == run_with_arrivals(eager, sps)
    eng = graph.engine
    assert eng.graphs.num_replays > 0 and eng.num_iterations < eng.num_steps
    for llm in (graph, eager):
        assert_clean(llm)


@pytest.mark.parametrize("k", [0, 3])
def test_graph_replay_under_preemption_churn(k):
    """A preemption forced every 5th plan (recompute, NeedSync under overlap) between replays."""
    sps = params(False)
    ref = make(k, True, True).generate(TEXTS, sps)
    llm = make(k, True, False)
    c = Counters(llm, force_every=5)
    got = llm.generate(TEXTS, sps)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert c.preempted > 0 and llm.engine.graphs.num_replays > 0
    assert_clean(llm)


def assert_steady_state_sync_free(llm: LLM, steps: int = 1) -> None:
    """Ten steady steps of 8 seeded sampled requests under torch's sync debug mode (a host sync raises), each
    replaying its graphs; then the requests finish and the engine is clean."""
    eng = llm.engine
    sp = SamplingParams(temperature=0.7, max_tokens=200, seed=1, ignore_eos=True)
    for t in TEXTS:
        eng.add_request(llm.encode(t), sp)
    for _ in range(4):  # prompts done, graphs for this mode captured
        eng.step()
    replays = eng.graphs.num_replays
    eng.sync_debug = True
    for _ in range(10):
        eng.step()
    eng.sync_debug = False
    assert eng.graphs.num_replays >= replays + 8 * steps
    eng.run()
    assert_clean(llm)


@pytest.mark.parametrize("steps", [1, 4])
def test_steady_state_makes_no_host_sync(steps):
    assert_steady_state_sync_free(make(3, True, False, num_scheduler_steps=steps), steps)


def run_constrained(llm: LLM, sync_debug: bool) -> tuple[list[list[int]], int]:
    """Structured-output requests (test_structured_engine's schemas, choices and regexes; greedy, two seeded and a
    greedy n=2) beside two unconstrained ones, all added at once. After four steps (every prompt done) the next
    ten run under sync_debug when asked: a host sync inside a step raises. -> (the tokens of every sample, the
    replays of those ten steps)."""
    from tests.engine.test_structured_engine import _so_cases

    eng = llm.engine
    cases = _so_cases()[::2]
    sps = [SamplingParams(temperature=0.8 if i % 5 == 1 else 0.0, seed=3 + i, max_tokens=40, n=2 if i == 2 else 1,
                          structured_outputs=so) for i, (_, so) in enumerate(cases)]
    reqs = [eng.add_request(llm.encode(p), sp) for (p, _), sp in zip(cases, sps)]
    reqs += [eng.add_request(llm.encode(t), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
             for t in TEXTS[:2]]
    for _ in range(4):
        eng.step()
    replays = eng.graphs.num_replays
    eng.sync_debug = sync_debug
    try:
        for _ in range(10):
            eng.step()
    finally:
        eng.sync_debug = False
    replays = eng.graphs.num_replays - replays
    eng.run()
    groups = [r.group.members if r.group is not None else [r] for r in reqs]
    return [m.output_token_ids for g in groups for m in g], replays


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("draft_masks", [False, True], ids=["unmasked", "draft_masks"])
def test_constrained_graph_replay_equals_eager_without_host_sync(k, draft_masks):
    """Grammar-constrained requests with graphs on (overlap, the default buckets): the steady constrained steps
    replay masked graph pairs -- the target forward, then (the previous step processed and this step's verify
    masks uploaded into their static buffer meanwhile) the finish; drafts proposed unmasked -- under
    torch.cuda.set_sync_debug_mode("error"), and every token equals the eager engine's
    (enforce_eager: the same padded shapes). With structured_draft_masks the constrained steps run eagerly and
    read back by design (exempt from sync_debug); their tokens equal the eager engine's too."""
    graph = make(k, True, False, structured_draft_masks=draft_masks)
    eager = make(k, True, True, structured_draft_masks=draft_masks)
    got, replays = run_constrained(graph, sync_debug=True)
    want, _ = run_constrained(eager, sync_debug=False)
    assert got == want
    from m3eagle.engine.graph_runner import SplitGraph

    masked = {key: g for key, (g, _) in graph.engine.graphs.graphs.items() if key[1][3]}
    if draft_masks and k:
        assert not masked  # constrained steps ran eagerly
    else:  # each masked key: the forward and the finish, the masks uploaded in between
        assert masked and all(isinstance(g, SplitGraph) for g in masked.values()) and replays >= 5, (masked, replays)
    for llm in (graph, eager):
        assert_clean(llm)


def _compiled_variants() -> dict[str, int]:
    """Compiled variants per Triton kernel of the engine (attention, fused ops, MoE), from the JIT caches."""
    import triton

    from m3eagle.engine import step_kernels
    from m3eagle.kernels.attention import triton_kernels
    from m3eagle.kernels.fused import activation, norm, rope
    from m3eagle.kernels.fused import argmax as fused_argmax
    from m3eagle.kernels.moe import align, direct, router, triton_moe

    out = {}
    for mod in (triton_kernels, norm, rope, activation, fused_argmax, router, step_kernels, triton_moe, align, direct):
        for name, fn in vars(mod).items():
            if isinstance(fn, triton.runtime.jit.JITFunction):
                caches = getattr(fn, "device_caches", None)
                out[f"{mod.__name__}.{name}"] = (sum(len(c[0]) for c in caches.values()) if caches is not None
                                                 else sum(len(c) for c in fn.cache.values()))
    return out


def test_indexer_and_attention_do_not_specialize_on_lengths():
    """At fixed launch choices (splits, tiles), steps that differ only in rows, token counts and lengths
    reuse one compiled variant of every attention kernel: per-step ints are not specialized on, so a new
    prompt shape never compiles (a compile stalls serving for hundreds of ms). Tile sizes are constexprs
    chosen from powers of two of the step shape -- a bounded set, outside this test."""
    from m3eagle.kernels.attention import triton_kernels as tk
    from m3eagle.kernels.attention.metadata import build_metadata

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(0)
    hq, hkv, d, hi, di, block, page = 8, 2, 64, 2, 64, 64, 16
    counts = []
    # The KV bound stays fixed (a graph's is; an eager step's picks the indexer's candidate-list tile by its
    # power of two); rows, token counts and lengths change.
    for rows, q_len, max_kv in [(2, 3, 2049), (3, 3, 2049), (5, 3, 2049), (7, 3, 2049), (2, 3, 2049)]:
        width = -(-max_kv // page) + 1
        table = (torch.randperm(rows * width, generator=gen) + 1).view(rows, width)
        kv = torch.randint(max_kv // 2, max_kv, (rows,), generator=gen)
        meta = build_metadata([q_len] * rows, kv, table, page, dev, max_kv=max_kv)
        slots, t = (rows * width + 1) * page, rows * q_len
        q = torch.randn(t, hq, d, generator=gen).to(dev, torch.bfloat16)
        k, v = (torch.randn(slots, hkv, d, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
        iq = torch.randn(t, hi, di, generator=gen).to(dev, torch.bfloat16)
        ik = torch.randn(slots, di, generator=gen).to(dev, torch.bfloat16)
        sel = tk.select_blocks(iq, ik, meta, block, 4, 1, num_splits=4, min_blocks_per_split=2)
        tk.sparse_attention(q, k, v, meta, 0.1, sel, block, num_splits=4)
        tk.dense_attention(q, k, v, meta, 0.1, num_splits=4, block_n=32)
        torch.cuda.synchronize()
        counts.append({n: c for n, c in _compiled_variants().items() if "triton_kernels" in n})
    assert all(c == counts[0] for c in counts[1:]), counts


def test_released_graphs_recapture_and_still_equal_eager():
    """GraphRunner.release (tensor parallel's shutdown needs it: NCCL cannot tear down a communicator that a
    live graph holds) destroys the graphs; the next graph-shaped step captures afresh, same tokens."""
    sps = params(False)
    want = run_with_arrivals(make(3, True, True), sps)
    llm = make(3, True, False)
    assert llm.engine.graphs.graphs
    llm.engine.graphs.release()
    assert not llm.engine.graphs.graphs and llm.engine.graphs.pool is None
    assert run_with_arrivals(llm, sps) == want
    assert llm.engine.graphs.graphs and llm.engine.graphs.num_replays > 0
    assert_clean(llm)


@pytest.mark.parametrize("k", [0, 3, 5])
def test_fused_step_inputs_equal_reference_on_cuda(k):
    """The step-input kernels (overlap correction + positions + slots; sampled positions and drafts; the
    slot writes and the drafter's inputs; greedy acceptance) compiled for the GPU, bit-equal to the reference ops (the CPU
    tests run them under the interpreter only)."""
    from dataclasses import replace

    from m3eagle.engine.step_ops import ReferenceStepOps, TritonStepOps
    from m3eagle.kernels.attention.metadata import derive_positions_and_slots
    from m3eagle.kernels.ops import make_ops
    from tests.helpers.step_cases import chain_case, commit_case, sample_case, step_case

    ref, fast = make_ops(device="cuda", fused="reference"), make_ops(device="cuda")
    assert fast.fused.name == "triton"
    for seed in range(3):
        meta, (ids, *rest) = step_case(seed, k, 16, device="cuda")
        want_ids, want = ReferenceStepOps().overlap_inputs(ids, replace(meta, ops=ref), *rest)
        got_ids, got = TritonStepOps().overlap_inputs(ids, replace(meta, ops=fast), *rest)
        assert torch.equal(got_ids, want_ids) and torch.equal(got.kv_lens, want.kv_lens)
        assert torch.equal(got.positions, want.positions) and torch.equal(got.slot_mapping, want.slot_mapping)
        kv = meta.kv_lens.clone()
        kv[0], kv[1] = 500, 0  # past the table's width; below zero
        args = (kv, meta.q_lens, meta.tok_row, meta.tok_col, meta.page_table, 16)
        for a, b in zip(TritonStepOps().positions_slots(*args), derive_positions_and_slots(*args)):
            assert torch.equal(a, b)
        case = sample_case(seed, k, device="cuda")
        for a, b in zip(TritonStepOps().sample_positions(*case), ReferenceStepOps().sample_positions(*case)):
            assert a.shape == b.shape and torch.equal(a, b)
        for draft in (False, True):
            args, tok_row = commit_case(seed, k, draft, device="cuda")
            bufs = [[x.clone() for x in args[11:14]] for _ in range(2)]
            chained, kv, kv_in, _ = chain_case(seed, args[1].shape[0], device="cuda")
            chains = [(c := chained.clone(), kv, kv_in.clone(), c) for _ in range(2)]
            pt = torch.randint(0, 50, (args[1].shape[0], 20), device="cuda")
            want = ReferenceStepOps().commit_outputs(*args[:11], *bufs[0], *args[14:], chain=chains[0], pages=(pt, 16))
            got = TritonStepOps().commit_outputs(*args[:11], *bufs[1], *args[14:], tok_row=tok_row, chain=chains[1],
                                            pages=(pt, 16))
            for a, b in zip(got, want):
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
            for a, b in zip(bufs[1], bufs[0]):
                assert torch.equal(a[:-1], b[:-1])  # the dump row has several writers
            assert torch.equal(chains[1][0], chains[0][0]) and torch.equal(chains[1][2], chains[0][2])
        greedy_tok = torch.randint(0, 4, (300, k + 1), device="cuda")  # 4 ids: many matches
        drafts = torch.randint(0, 4, (300, k), device="cuda")
        nd = torch.randint(0, k + 1, (300,), device="cuda")
        assert torch.equal(TritonStepOps().greedy_accept(greedy_tok, drafts, nd),
                           ReferenceStepOps().greedy_accept(greedy_tok, drafts, nd))


@pytest.mark.parametrize("k, overlap", [(0, False), (3, True)])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_prefill_graph_replay_equals_eager(k, overlap, sampled):
    """Prefill graphs (opt-in): prompt and mixed steps replay a graph of their (rows, tokens) bucket, with
    the same tokens and the same accepted drafts as the eager engine padding them alike; prompts one at a
    time (one-row prompt steps, several token buckets, and a prompt longer than the chunk budget: its last
    chunk reads a cached prefix), then all at once (several prompt rows, then prompt chunks beside verify
    rows). (Against unpadded steps bf16 GEMMs of another width may round differently -- on the H200 one of
    six 128-token prompts took another greedy path; the CPU tests hold padded == unpadded in fp32.)"""
    from m3eagle.engine.graph_runner import PREFILL

    prompts = [*TEXTS[:4], "\n".join(TEXTS) * 12]  # the last one: > 256 tokens, so chunked
    sps = params(sampled)[:len(prompts)]
    kw = dict(max_num_tokens=256, max_model_len=1024)
    eager = make(k, overlap, True, prefill_graphs=True, **kw)
    graph = make(k, overlap, False, prefill_graphs=True, **kw)
    outs = {}
    for name, llm in (("eager", eager), ("graph", graph)):
        alone = [llm.generate([p], sp)[0] for p, sp in zip(prompts, sps)]
        together = llm.generate(prompts, sps)
        outs[name] = [(o.outputs[0].token_ids, o.metrics.num_accepted) for o in alone + together]
    assert outs["graph"] == outs["eager"]
    keys = {b for b, _ in graph.engine.graphs.graphs if isinstance(b, tuple)}
    assert {b[0] for b in keys} == {PREFILL} and len(keys) >= 3 and any(b[1] > 2 for b in keys), keys
    for llm in (eager, graph):
        assert_clean(llm)


def test_gemv_on_gpu_equals_cublas_within_bf16_and_repeats_bit_for_bit():
    """fused/gemv.py compiled for the GPU (the CPU tests run it under the interpreter only): every tuned
    config and the engine's preferred shapes, in bf16, within bf16 error of cuBLAS (F.linear), and
    bit-equal from run to run (the split-K configs' last-program reduction has a fixed order); its split-K
    counters end at zero."""
    from m3eagle.kernels.fused import gemv

    g = torch.Generator(device="cuda").manual_seed(0)
    counters = gemv.SplitCounters()
    cases = {(n, k, t) for (n, k, bt) in gemv.TUNED for t in (bt, max(1, bt - 1))}
    cases |= {(n, k, t) for (n, k), most in gemv.PREFERRED.items() for t in range(1, most + 1)}
    for n, k, t in sorted(cases):
        w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16()
        x = torch.randn(t, k, generator=g, device="cuda").bfloat16()
        want = torch.nn.functional.linear(x.float(), w.float())
        got = gemv.linear(x, w, counters=counters)
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-2, (n, k, t, err)
        for _ in range(5):
            assert torch.equal(gemv.linear(x, w, counters=counters), got), (n, k, t)
    torch.cuda.synchronize()
    c = counters.get(torch.device("cuda"))
    assert c is not None and not c.any()


def test_gemv_weight_preload_on_gpu_is_bit_equal_under_pdl_graphs():
    """Weight preloading on the GPU: the GEMV with its first weight tile read before the PDL wait, replayed in a
    PDL-captured graph behind a producer of x (a norm launch), equals the launch without PDL -- the first
    replay, and after 9 more replays with new inputs and no sync."""
    from m3eagle.kernels import pdl
    from m3eagle.kernels.fused import gemv, triton_backend

    g = torch.Generator(device="cuda").manual_seed(1)
    counters = gemv.SplitCounters()
    fused = triton_backend.TritonFused()
    for n, k, t in ((256, 1280, 1), (256, 1280, 2), (2560, 256, 1), (6144, 256, 1), (96, 4096, 1)):
        w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16()
        x0 = (torch.randn(t, k, generator=g, device="cuda") * 2).bfloat16()
        nw = torch.randn(k, generator=g, device="cuda").bfloat16()
        if gemv.pick_config(t, n, k, torch.bfloat16, x0.device).use_dot:
            continue
        src = x0.clone()

        def step(src=src, nw=nw, w=w):  # a norm writes the GEMV's input, the GEMV reads it (PDL: starts early)
            return gemv.linear(fused.rms_norm(src, nw, 1e-6), w, counters=counters)

        want = step().clone()  # eager, without PDL
        with pdl.scope(True):
            assert torch.equal(step(), want)  # eager with PDL: the preload in its launch
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), (n, k, t)
        for i in range(1, 10):  # new inputs between replays, no sync (the stream orders copy and replay)
            src.copy_(x0 * (1 + i))
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step()), (n, k, t)  # the last input, eagerly without PDL
    c = counters.get(torch.device("cuda"))
    assert c is not None and not c.any()


def test_draft_step_folds_on_gpu_are_bit_equal_to_their_separate_launches():
    """The draft step's folds on the real compiler (libdevice exp / cos / sin, FMA contraction), also
    replayed in a PDL-captured graph: the gate_up GEMV's activation epilogue == the GEMV then silu_mul /
    swiglu_oai (the embedded head's and target's shapes at T = 1 and 4); the q/k/v launch's own RoPE ==
    the same launch reading rope_cos_sin's tables; add_rms_norm's row gather == the gather after it."""
    from m3eagle.kernels import pdl
    from m3eagle.kernels.fused import activation, gemv, triton_backend

    g = torch.Generator(device="cuda").manual_seed(2)
    f = triton_backend.TritonFused()
    for n, k, t in ((2560, 256, 1), (2560, 256, 4), (1280, 256, 1), (1280, 256, 4), (4096, 2048, 1)):
        w = (torch.randn(n, k, generator=g, device="cuda") * 0.05).bfloat16()
        x = (torch.randn(t, k, generator=g, device="cuda") * 2).bfloat16()
        cfg = gemv.act_config(t, w, x.dtype, x.device)
        assert cfg is not None, (n, k, t)
        y = gemv.linear(x, w, cfg)
        for act, want in (("silu", activation.silu_mul(*y.chunk(2, -1))),
                          ("swiglu_oai", activation.swiglu_oai(y, 1.702, 7.0))):
            assert torch.equal(gemv.linear_act(x, w, act, 1.702, 7.0, cfg), want), (act, n, k, t)
            with pdl.scope(True):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = gemv.linear_act(f.rms_norm(x, w[0], 1e-6), w, act, 1.702, 7.0, cfg)
            graph.replay()
            torch.cuda.synchronize()
            y2 = gemv.linear(f.rms_norm(x, w[0], 1e-6), w, cfg)
            ref = activation.silu_mul(*y2.chunk(2, -1)) if act == "silu" else activation.swiglu_oai(y2, 1.702, 7.0)
            assert torch.equal(out, ref), (act, n, k, t, "graph")
    pos = torch.tensor([0, 1, 17, 130, 4095, 70000], device="cuda")
    q, kk, v = (torch.randn(6, h, 64, generator=g, device="cuda").bfloat16() for h in (4, 2, 2))
    pools = [torch.zeros(64, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.arange(6, device="cuda") * 3
    got = f.rope_qkv_store(q, kk, v, pos, 64, 10000.0, pools[0], pools[1], slots)
    cos, sin = f.rope_cos_sin(pos, 64, 10000.0, torch.bfloat16)
    want = f.qkv_rope_store(q, kk, v, None, None, 0.0, cos, sin, pools[2], pools[3], slots)
    assert torch.equal(got, want) and torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    xs, res = (torch.randn(7, 256, generator=g, device="cuda").bfloat16() for _ in range(2))
    nw = torch.randn(256, generator=g, device="cuda").bfloat16()
    rows = torch.tensor([6, 0, 3], device="cuda")
    y_all, r_all = f.add_rms_norm(xs, res, nw, 1e-6, gemma=False)
    y_r, r_r = f.add_rms_norm(xs, res, nw, 1e-6, gemma=False, rows=rows)
    assert torch.equal(y_r, y_all[rows]) and torch.equal(r_r, r_all[rows])


def test_gemv_argmax_epilogue_on_gpu():
    """ARGMAX compiled for the GPU at the embedded lm_heads' shapes (draft 6144 x 256, target 8192 x 256; T = 1
    and 4): the picks bit-equal to the GEMV then the argmax launch, ties across tiles (a duplicated maximum
    row: the lower column) and NaN among infinities (the first NaN) forced; replayed 50 times in a
    PDL-captured graph, each replay's picks equal and the counter zero after."""
    from m3eagle.kernels import pdl
    from m3eagle.kernels.fused import argmax as fused_argmax
    from m3eagle.kernels.fused import gemv

    g = torch.Generator(device="cuda").manual_seed(6)
    counters = gemv.SplitCounters().get("cuda")
    for n in (6144, 8192):
        for t in (1, 4):
            x = torch.randn(t, 256, generator=g, device="cuda").bfloat16()
            w = (torch.randn(n, 256, generator=g, device="cuda") * 0.05).bfloat16()
            w[100] = x[0] * 0.05  # ~13 against a random row's ~0.8 sd
            w[n - 7] = w[100]  # tied with row 0's maximum, in the last tiles
            if t > 1:
                x[1, 0] = float("inf")
                w[3000, 0] = w[3001, 0] = 0.0  # row 1: NaN at 3000 and 3001, +-inf elsewhere
            off = torch.randint(-5, 5, (n,), generator=g, device="cuda")
            # the engine's config where the fold runs (T = 1); at T = 4 its pick is tl.dot, so the GEMV's
            cfg = gemv.act_config(t, w, w.dtype, w.device) or gemv.GemvConfig(block_n=16, block_k=256)
            want = fused_argmax.argmax(gemv.linear(x, w, cfg), off)
            assert want[0] == 100 + off[100] and (t == 1 or want[1] == 3000 + off[3000])
            assert torch.equal(gemv.linear_argmax(x, w, counters, off, config=cfg)[1], want), (n, t)
            with pdl.scope(True):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = gemv.linear_argmax(x, w, counters, off, config=cfg)[1]
            for _ in range(50):
                graph.replay()
                assert torch.equal(out, want), (n, t, "graph")
            assert int(counters.abs().sum()) == 0


def test_gemv_norm_prologue_and_residual_epilogue_on_gpu():
    """The GEMV's norm / residual folds compiled for the GPU, at the embedded head's shapes (T = 1 and 4): norm_linear
    (gate_up with silu, Llama scaling; a Gemma-scaled plain GEMV) within the norm's fp32 sum order of the
    norm launch followed by the GEMV (the GPU's reduction trees differ); linear_add bit-equal to the GEMV
    then add_residual; each replayed in a PDL-captured graph equal to its eager launch, bit for bit."""
    from m3eagle.kernels import pdl
    from m3eagle.kernels.fused import gemv, triton_backend

    g = torch.Generator(device="cuda").manual_seed(5)
    f = triton_backend.TritonFused()

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * s).bfloat16()

    for t in (1, 4):
        h, nw = rnd(t, 256, s=3.0), rnd(256)
        for w, act, gemma in ((rnd(1280, 256, s=0.05), "silu", False), (rnd(512, 256, s=0.05), None, True)):
            cfg = gemv.act_config(t, w, w.dtype, w.device)
            assert cfg is not None, (t, w.shape)
            xn = f.rms_norm(h, nw, 1e-6, gemma)
            want = gemv.linear_act(xn, w, act, config=cfg) if act else gemv.linear(xn, w, cfg)
            got = gemv.norm_linear(h, nw, 1e-6, w, gemma, act, cfg)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            assert err < 2e-2, (t, w.shape, act, err)
            with pdl.scope(True):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = gemv.norm_linear(h, nw, 1e-6, w, gemma, act, cfg)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, got), (t, w.shape, act, "graph")
        for n, k in ((256, 256), (256, 640)):
            w, x, res = rnd(n, k, s=0.05), rnd(t, k), rnd(t, n, s=2.0)
            cfg = gemv.act_config(t, w, w.dtype, w.device)
            want = f.add_residual(gemv.linear(x, w, cfg), res)
            assert torch.equal(gemv.linear_add(x, w, res, cfg), want), (t, n, k)
            with pdl.scope(True):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = gemv.linear_add(f.rms_norm(x, x[0], 1e-6), w, res, cfg)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, f.add_residual(gemv.linear(f.rms_norm(x, x[0], 1e-6), w, cfg), res)), (t, n, k)


@pytest.mark.parametrize("t", [1, 4])
def test_direct_moe_on_gpu_within_bf16_and_graph_replay_equals_eager(t):
    """moe/direct.py compiled for the GPU: m3-mini's layer shape in bf16 (shared expert fused) within bf16
    error of the fp32 reference, and a CUDA graph of it replayed on new routing equal to eager, bit for bit."""
    from m3eagle.kernels.moe import reference, triton_moe
    from m3eagle.kernels.moe.tuning import MoEConfig

    g = torch.Generator(device="cuda").manual_seed(t)
    e, h, i, k = 32, 2048, 1024, 4
    w13 = (torch.randn(e, 2 * i, h, generator=g, device="cuda") * 0.03).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g, device="cuda") * 0.03).bfloat16()
    s13 = (torch.randn(2 * i, h, generator=g, device="cuda") * 0.03).bfloat16()
    s2 = (torch.randn(h, i, generator=g, device="cuda") * 0.03).bfloat16()
    cfg = MoEConfig(16, 16, 256, direct=1, down_block_n=16, down_block_k=128)

    def inputs():
        x = torch.randn(t, h, generator=g, device="cuda").bfloat16()
        idx = torch.argsort(torch.rand(t, e, generator=g, device="cuda"), dim=1)[:, :k]
        w = torch.rand(t, k, generator=g, device="cuda") + 0.05
        return x, w / w.sum(-1, keepdim=True), idx

    def run(x, w, idx):
        return triton_moe.fused_experts(x, w, idx, w13, w2, 1.702, 7.0, config=cfg, shared=(s13, s2),
                                        routed_scale=2.0)

    x, w, idx = inputs()
    want = (reference.experts(x.float(), w, idx, w13.float(), w2.float(), 1.702, 7.0) * 2.0
            + reference.experts(x.float(), torch.ones(t, 1, device="cuda"), torch.zeros(t, 1, dtype=torch.long,
                                device="cuda"), s13[None].float(), s2[None].float(), 1.702, 7.0))
    got = run(x, w, idx)
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < 1e-2, err
    bufs = [x.clone(), w.clone(), idx.clone()]
    graph = torch.cuda.CUDAGraph()
    run(*bufs)  # compile before capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = run(*bufs)
    for _ in range(3):
        new = inputs()
        for b, v in zip(bufs, new):
            b.copy_(v)
        graph.replay()
        assert torch.equal(out, run(*new))


VARIANTS = {"one_tile": {}, "down_rows": {"down_rows": 4}, "gate_and_down_rows": {"down_rows": 4, "gate_rows": 2},
            "shared_down": {"shared_down": 2, "down_rows": 2},
            "shared_down_rows": {"shared_down": 4, "down_rows": 2, "gate_rows": 2},
            # m3-8b's router (H 4096) runs 8 warps, so the launch it shares needs them; its table entry
            "shared_down_8_warps": {"shared_down": 2, "down_rows": 4, "gate_rows": 2, "num_warps": 8,
                                    "block_n": 2, "down_block_k": 2048}}
MINI, EMBEDDED, M3_8B = (32, 2048, 1024, 1024, 4), (4, 256, 160, 128, 2), (16, 4096, 1536, 1536, 4)


@pytest.mark.parametrize("e,h,i,s_i,k,variant", [(*shape, v) for shape in (MINI, EMBEDDED) for v in VARIANTS
                                                 if v != "shared_down_8_warps"] + [(*M3_8B, "shared_down_8_warps")])
def test_moe_route_shared_and_down_preload_under_pdl_graphs_equal_the_separate_launches(e, h, i, s_i, k,
                                                                                         variant):
    """The decode MoE's router + shared-expert launch and down's weight preload (moe/direct.py), with one
    or four down column tiles per program (and two gate_up tiles) and the shared expert's down in the
    gate_up launch (shared_down), at m3-mini's, the embedded target's (its shared expert narrower than the
    routed ones) and m3-8b's shapes (8 warps) in bf16: two layers captured in one CUDA graph with
    programmatic dependent launch, replayed on new inputs without a sync between replays, equal bit for bit
    to the separate launches (fused router, then the direct path without preload) run eagerly without PDL
    -- so the routing that down reads before its wait is the current one."""
    from m3eagle.kernels import pdl
    from m3eagle.kernels.fused import registry as fused_backend
    from m3eagle.kernels.moe import backend as moe_backend
    from m3eagle.kernels.moe import direct
    from m3eagle.kernels.moe.tuning import MoEConfig
    from m3eagle.kernels.ops import Ops
    from m3eagle.models.layers import SparseMoE

    torch.manual_seed(0)
    layers = []
    for _ in range(2):
        moe = SparseMoE(h, i, s_i, e, k, scaling=2.5, alpha=1.702, limit=7.0).cuda()
        with torch.no_grad():
            for p in moe.parameters():
                p.copy_(torch.randn_like(p) * 0.03)
            moe.gate.e_score_correction_bias.copy_(torch.randn(e, device="cuda") * 0.01)
        moe.experts.bfloat16()
        moe.shared_experts.bfloat16()
        layers.append(moe)
    fused = fused_backend.create("triton")
    on = dataclasses.replace(MoEConfig(16, 4, 512, num_stages=1, direct=1, down_block_n=1, down_block_k=1024,
                                       down_preload=1, route_shared=1), **VARIANTS[variant])
    # the same tiles and warps (a reduction's order follows them), one tile a program, launches apart
    off = dataclasses.replace(on, down_preload=0, route_shared=0, down_rows=0, gate_rows=0, shared_down=0)
    ops_on = Ops(attention=None, moe=moe_backend.create("triton", config=on), fused=fused)
    ops_off = Ops(attention=None, moe=moe_backend.create("triton", config=off), fused=fused)
    assert pdl._capable(torch.cuda.current_device())

    def run(x, ops):
        outs = []
        for moe in layers:
            a, _, _ = moe.forward_parts(x, ops)
            outs.append(a)
            x = a
        return outs

    calls: list[int] = []
    real = direct.route_direct_experts

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    for t in (1, 2):
        x = torch.randn(t, h, device="cuda").bfloat16()
        calls.clear()
        direct.route_direct_experts = spy
        try:
            with torch.no_grad():
                run(x, ops_on)  # eager: compiles, makes the counters
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with pdl.scope(True), torch.cuda.graph(graph):
                    outs = run(x, ops_on)
                assert len(calls) == 4  # two layers, eager and captured: the launch is used
                news = [torch.randn(t, h, device="cuda").bfloat16() for _ in range(12)]
                got = []
                for new in news:
                    x.copy_(new)
                    graph.replay()
                    got.append([o.clone() for o in outs])
                torch.cuda.synchronize()
                for new, g in zip(news, got):
                    want = run(new, ops_off)
                    assert all(torch.equal(a, b) for a, b in zip(g, want))
                assert not ops_on.moe._route_counters.get(x.device).any()  # the router's, reset
        finally:
            direct.route_direct_experts = real
