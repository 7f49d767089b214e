"""Tensor / expert parallelism on CPU (gloo, 2 ranks): a sharded run equals one process token for token.

One rank-0 LLM lives in this process at a time (torch.distributed holds one default group per process), so
the TP engines are built once per model (`tp_llm`) and each test reuses the live one; the single-process
references are computed once. Covered: GQA with 2 KV heads (split) and MQA with 1 (replicated, and its
indexer head too), MSA sparse layers active (contexts well past top-k x block), Eagle3 K=3, overlap off and
on, forced preemption, seeded sampling, the deterministic mode (its rank-order sums), a worker killed mid-run,
and a torchrun-style (env://) launch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from m3eagle import LLM, SamplingParams
from m3eagle.distributed.layers import param_shards
from m3eagle.distributed.parallel_state import TPError, TPGroup
from m3eagle.engine.executor import WorkerError
from tests.helpers.engine_utils import Counters, assert_clean, greedy

REPO = Path(__file__).resolve().parents[2]
KW = dict(device="cpu", page_size=4, max_model_len=128, max_num_tokens=48, graph_shapes=True)
NEW = 12


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 90, (n,), generator=g).tolist() for n in (37, 22, 5)]


def tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]


# The tests of one model sit together in the file (the fault test, which breaks its LLM, last): a worker
# running them in order builds each live LLM (a spawned rank and its model, seconds) once.
_live: dict[str, LLM] = {}


def tp_llm(name: str, *args, **kw) -> LLM:
    """The live 2-rank LLM for `name`, built on first use (the previous one is shut down first)."""
    if name not in _live:
        _release()
        _live[name] = LLM(*args, tensor_parallel_size=2, **KW, **kw)
    return _live[name]


def _release() -> None:
    for llm in _live.values():
        llm.shutdown()
    _live.clear()


@pytest.fixture(scope="module", autouse=True)
def _shutdown_at_end():
    yield
    _release()


@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory):
    """A tiny target with one KV head (and one index head): both are replicated on the two ranks. Its odd
    vocabulary (95) leaves the last rank's embedding / lm_head shard zero-padded, cut after the gather."""
    from tests.helpers.hf_utils import random_hf_model, tiny_hf_config

    d = tmp_path_factory.mktemp("tiny_mqa")
    random_hf_model(tiny_hf_config(seed=1, kv_heads=1, vocab=95), seed=1).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def reference(model_dir, head_dir):
    """Single-process outputs: greedy and seeded-sampled, Eagle3 K=3."""
    llm = LLM(model_dir, head_dir, num_draft_tokens=3, **KW)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NEW, seed=7, ignore_eos=True)
    return {"greedy": tokens(llm, greedy(NEW)), "sampled": tokens(llm, sampled), "sampled_params": sampled,
            "penalized": all_samples(llm, PENALIZED)}


# Penalties, min_tokens (with stop ids: the flat stop-id list travels in the broadcast), min_p and n = 2.
PENALIZED = SamplingParams(temperature=0.8, max_tokens=NEW, seed=11, n=2, repetition_penalty=1.3,
                           presence_penalty=0.5, frequency_penalty=0.3, min_tokens=6, min_p=0.05,
                           stop_token_ids=[5, 6, 7])


def all_samples(llm: LLM, params: SamplingParams) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts(), params, use_tqdm=False)]


# ---- shards, without processes --------------------------------------------------------------------


def test_loader_and_dummy_shards_are_slices(model_dir, tmp_path):
    """Each rank reads exactly its slices of the checkpoint -- transformers' layout (fused gate_up, stacked
    experts) and the public release's (gate / up halves, per-expert w1 / w2 / w3) -- and of the TP-invariant
    random weights."""
    from m3eagle.bench import geometries
    from m3eagle.loader.checkpoint import load_target, save_target
    from m3eagle.loader.dummy import dummy_target

    cfg, _ = geometries.tiny()
    save_target(load_target(model_dir), tmp_path, layout="public")
    odd = replace(cfg, vocab_size=cfg.vocab_size - 1)  # the last rank's vocabulary shard is zero-padded
    for build in (lambda tp: load_target(model_dir, tp=tp), lambda tp: load_target(tmp_path, tp=tp),
                  lambda tp: dummy_target(cfg, torch.float32, "cpu", tp=tp),
                  lambda tp: dummy_target(odd, torch.float32, "cpu", tp=tp)):
        full = build(TPGroup()).state_dict()
        for rank in range(2):
            part = build(TPGroup(rank=rank, size=2))
            shards = param_shards(part)
            assert shards  # heads, MLP halves, experts, vocabulary
            for name, t in part.state_dict().items():
                want = shards[name].read(full[name].__getitem__) if name in shards else full[name]
                assert torch.equal(t, want), name


def test_sizes_that_do_not_divide_are_refused(model_dir):
    with pytest.raises(TPError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        LLM(model_dir, tensor_parallel_size=3, num_draft_tokens=0, **KW)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model_dir, tensor_parallel_size=0, num_draft_tokens=0, **KW)


# ---- GQA (2 KV heads split over 2 ranks), Eagle3 K=3 ---------------------------------------------


@pytest.mark.slow
def test_greedy_equals_one_process(model_dir, head_dir, reference):
    llm = tp_llm("gqa", model_dir, head_dir, num_draft_tokens=3)
    assert llm.target.layers[0].self_attn.n_kv == 1 and llm.engine.runner.caches[0].k.shape[1] == 1
    assert tokens(llm, greedy(NEW)) == reference["greedy"]
    assert llm.stats()["num_drafted"] > 0
    assert_clean(llm)


@pytest.mark.slow
def test_overlap_and_preemption(model_dir, head_dir, reference):
    """Overlap on (rank 0's scheduling alone: the workers just run what they are sent) with a preemption
    forced every few plans, some of them of requests with a step in flight (NeedSync, drain, re-plan)."""
    llm = tp_llm("gqa", model_dir, head_dir, num_draft_tokens=3)
    eng = llm.engine
    plan, preempt = eng.scheduler.schedule, eng.scheduler._preempt
    eng.cfg = replace(eng.cfg, overlap=True)
    c = Counters(llm, force_every=4)
    try:
        assert tokens(llm, greedy(NEW)) == reference["greedy"]
    finally:
        eng.cfg = replace(eng.cfg, overlap=False)
        eng.scheduler.schedule, eng.scheduler._preempt = plan, preempt  # undo Counters' patch
    assert c.preempted > 0
    assert_clean(llm)


@pytest.mark.slow
def test_sampled_equals_one_process(model_dir, head_dir, reference):
    """Counter-based sampling: every rank draws the same tokens from the gathered logits."""
    llm = tp_llm("gqa", model_dir, head_dir, num_draft_tokens=3)
    assert tokens(llm, reference["sampled_params"]) == reference["sampled"]


@pytest.mark.slow
def test_penalties_min_tokens_and_n_equal_one_process(model_dir, head_dir, reference):
    """The penalty inputs (per-row parameters, the reset flags, the min_tokens stop ids) and the step's mode
    bits reach the workers, whose device-side penalty state then matches rank 0's."""
    llm = tp_llm("gqa", model_dir, head_dir, num_draft_tokens=3)
    got = all_samples(llm, PENALIZED)
    assert got == reference["penalized"]
    assert all(len(o) == 2 for o in got) and any(a != b for a, b in got)
    assert_clean(llm)


@pytest.mark.slow
def test_fault_on_rank0_stops_the_group(model_dir, head_dir):
    """An exception inside a step on rank 0 leaves the workers in a collective: the group is shut down and
    the LLM says so on every later call (it does not hang)."""
    llm = tp_llm("gqa", model_dir, head_dir, num_draft_tokens=3)

    def boom(inp):
        raise RuntimeError("boom")

    llm.engine.runner.execute = boom
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(prompts(), greedy(NEW), use_tqdm=False)
    with pytest.raises(WorkerError, match="no longer in step"):
        llm.generate(prompts(), greedy(NEW), use_tqdm=False)
    assert all(p.exitcode is not None for p in llm._driver.workers.procs)


def _mx_model(path: Path, shared_inter: int) -> Path:
    """A tiny target whose projections all have input dims that are multiples of 32 (MXFP8 blocks)."""
    from tests.helpers.hf_utils import random_hf_model, tiny_hf_config

    cfg = tiny_hf_config(seed=3, hidden=64, head_dim=16, inter=32, dense_inter=64, shared_inter=shared_inter,
                         index_head_dim=32)
    random_hf_model(cfg, seed=3).save_pretrained(path)
    return path


def test_fp8_online_quantization_equals_one_process(tmp_path):
    """Each rank quantizes its own slices, block for block as one process quantizes the whole weights: the
    same tokens (column-parallel rows, row-parallel columns in whole 32-blocks, whole experts)."""
    d = _mx_model(tmp_path, shared_inter=64)  # 32 columns per rank of the shared expert's down_proj
    want = tokens(LLM(d, num_draft_tokens=0, quantization="fp8", **KW), greedy(NEW))
    llm = tp_llm("fp8", d, num_draft_tokens=0, quantization="fp8")
    assert llm.target.layers[0].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert tokens(llm, greedy(NEW)) == want
    assert_clean(llm)


def test_fp8_split_cutting_a_block_is_refused(tmp_path):
    d = _mx_model(tmp_path, shared_inter=32)  # 16 columns per rank: half a block
    _release()  # one tensor-parallel LLM per process
    with pytest.raises(ValueError, match=r"quantization='fp8': the tensor-parallel split of "
                                         r"layers\.\d+\.mlp\.shared_experts\.down_proj\.weight .*tensor_parallel_size"):
        LLM(d, tensor_parallel_size=2, num_draft_tokens=0, quantization="fp8", **KW)
    llm = tp_llm("after", d, num_draft_tokens=0)  # the refused LLM left no group behind
    assert len(tokens(llm, greedy(2))) == 3


@pytest.mark.slow
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_multi_step_iterations_equal_one_process(model_dir, head_dir, reference, sampled):
    """num_scheduler_steps=4 with overlap: rank 0 broadcasts each sub-step (its device buffer, which its own
    commit advanced; the workers' commits advance theirs alike) and the workers replay it; the tokens of one
    process, one step at a time. Iterations of several sub-steps ran (asserted)."""
    llm = tp_llm("gqa-multistep", model_dir, head_dir, num_draft_tokens=3, overlap=True, num_scheduler_steps=4)
    params = reference["sampled_params"] if sampled else greedy(NEW)
    assert tokens(llm, params) == reference["sampled" if sampled else "greedy"]
    eng = llm.engine
    assert eng.num_iterations < eng.num_steps
    assert_clean(llm)


@pytest.mark.slow
def test_torchrun_style_launch(tmp_path, model_dir, reference):
    """One process per rank, rendezvous through RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (env://), as
    torchrun starts them: rank 0's LLM() returns and generates, rank 1 serves inside LLM() and exits 0.
    (Plain decoding here: greedy with speculation is lossless, so the reference is the same.)"""
    script = tmp_path / "run.py"
    script.write_text(
        "import json, sys, torch\n"
        "from m3eagle import LLM, SamplingParams\n"
        "torch.set_num_threads(1)\n"
        f"llm = LLM({str(model_dir)!r}, num_draft_tokens=0, tensor_parallel_size=2, **{KW!r})\n"
        f"outs = llm.generate({prompts()!r}, SamplingParams(temperature=0.0, max_tokens={NEW}, ignore_eos=True),"
        " use_tqdm=False)\n"
        "print(json.dumps([o.outputs[0].token_ids for o in outs]))\n"
        "llm.shutdown()\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "M3EAGLE_TP_TIMEOUT": "60"}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert json.loads(outs[0][0].strip().splitlines()[-1]) == reference["greedy"]


# ---- the deterministic mode: cross-rank sums in rank order ------------------------------------------


@pytest.mark.slow
def test_deterministic_alone_equals_batch_equals_one_process(model_dir, head_dir, monkeypatch):
    """deterministic=True with tensor_parallel_size=2, Eagle3 K=3: every floating cross-rank sum on rank 0 is the
    fixed-order one (no float all-reduce reaches the backend), and a request's tokens, greedy and seeded, are the
    same alone as inside the batch, and the same as one process's deterministic tokens.

    What the tokens can and cannot show here: the bit-level property (a row's sum has the same bits whatever the
    rows beside it, in rank order) is tests/distributed/test_deterministic_reduce.py's, over three ranks (with two,
    a + b == b + a and any order gives the same bits). On the CPU the reference ops' matmuls are not
    bit-invariant in the row count even in one process, and TP=2 splits o_proj / down_proj's K into two partial
    sums that one process adds in one GEMM, so neither the alone == batch nor the TP == one-process comparison
    can be bit-exact on CPU: they are token equalities, which fp32's margins give on these prompts."""
    from m3eagle.distributed import parallel_state

    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=7, ignore_eos=True)
    one = LLM(model_dir, head_dir, num_draft_tokens=3, deterministic=True, **KW)
    want = {"greedy": tokens(one, greedy(8)), "sampled": tokens(one, sampled)}

    calls = {"fixed": 0, "float_all_reduce": 0}
    fixed, backend = parallel_state.fixed_order_all_reduce, parallel_state.dist.all_reduce

    def count_fixed(*a, **k):
        calls["fixed"] += 1
        return fixed(*a, **k)

    def count_backend(t, *a, **k):
        calls["float_all_reduce"] += t.is_floating_point()
        return backend(t, *a, **k)

    monkeypatch.setattr(parallel_state, "fixed_order_all_reduce", count_fixed)
    monkeypatch.setattr(parallel_state.dist, "all_reduce", count_backend)
    llm = tp_llm("gqa-deterministic", model_dir, head_dir, num_draft_tokens=3, deterministic=True)
    assert llm.tp.deterministic and llm.engine.cfg.deterministic
    for name, params, lone in (("greedy", greedy(8), (1, 2)), ("sampled", sampled, (1,))):
        batch = tokens(llm, params)
        alone = [llm.generate([prompts()[i]], params, use_tqdm=False)[0].outputs[0].token_ids for i in lone]
        assert batch == want[name] and alone == [batch[i] for i in lone], name
    assert calls["fixed"] > 0 and calls["float_all_reduce"] == 0, calls
    assert llm.stats()["num_drafted"] > 0
    assert_clean(llm)


# ---- MQA (1 KV head, replicated), then a worker killed mid-run --------------------------------------


@pytest.mark.slow
def test_mqa_replicated_kv_head_odd_vocab(mqa_dir):
    ref = tokens(LLM(mqa_dir, num_draft_tokens=0, **KW), greedy(NEW))
    llm = tp_llm("mqa", mqa_dir, num_draft_tokens=0)
    attn = llm.target.layers[-1].self_attn
    assert (attn.n_q, attn.n_kv) == (2, 1) and any(l.self_attn.indexer for l in llm.target.layers)
    assert llm.target.lm_head.weight.shape[0] == 48  # ceil(95 / 2) rows, one of them padding
    assert tokens(llm, greedy(NEW)) == ref


@pytest.mark.slow
def test_worker_killed_mid_run_raises(mqa_dir):
    llm = tp_llm("mqa", mqa_dir, num_draft_tokens=0)
    pid = llm._driver.workers.procs[0].pid
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 \(exit code -9\) died"):
        llm.generate(prompts(), greedy(120), use_tqdm=False)
    assert time.monotonic() - t0 < 30
    with pytest.raises(WorkerError, match="died"):  # and it stays down, at once
        llm.generate(prompts(), greedy(NEW), use_tqdm=False)


# ---- the bench ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_reports_tp(one_thread):
    """`m3eagle bench --tensor-parallel-size 2`: plain and spec engines on both ranks (the spec-off engine
    is built on every rank), the TP size and the time in collectives reported."""
    import contextlib
    import io

    from m3eagle.entrypoints.cli import main

    _release()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["bench", "--geometry", "tiny", "--device", "cpu", "--prompt-len", "24", "--max-tokens", "3",
                   "--repeats", "1", "--decode-steps", "1", "--profile-steps", "1", "--bandwidth-gib", "0.01",
                   "--batch-sizes", "1", "--tensor-parallel-size", "2"])
    assert rc == 0, err.getvalue()
    doc = json.loads(out.getvalue())
    assert doc["env"]["tensor_parallel_size"] == 2
    assert [r["mode"] for r in doc["results"]] == ["plain", "spec"]
    for r in doc["results"]:
        assert r["step"]["comm_ms"] > 0 and 0 < r["step"]["comm_frac"] <= 1
    assert "comm ms (share)" in err.getvalue()


def test_stuck_group_teardown_is_abandoned_not_waited_on(monkeypatch):
    """NCCL's teardown can block on a stuck or dead peer (seen at shutdown on 2 x H200 with CUDA graphs):
    leave_group with a timeout must come back, say so, and not block the caller past the timeout."""
    from m3eagle.engine import executor as launch

    release = threading.Event()
    calls = []
    monkeypatch.setattr(launch.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(launch.dist, "destroy_process_group", lambda: (calls.append(1), release.wait(30)))
    t0 = time.monotonic()
    assert launch.leave_group(0.3) is False
    assert 0.25 < time.monotonic() - t0 < 5 and calls == [1]
    release.set()
    monkeypatch.setattr(launch.dist, "destroy_process_group", lambda: calls.append(2))
    assert launch.leave_group(5.0) is True and calls == [1, 2]  # a teardown that finishes reports it


def test_shutdown_releases_every_engines_graphs_before_leaving_the_group(monkeypatch):
    """ncclCommDestroy blocks while a live CUDA graph holds a captured collective (every TP=2 shutdown with
    graphs hung on 2 x H200): rank 0 must destroy all its engines' graphs (the spec engine's and the plain
    one's) after STOP and before leaving the group. A fault path (no STOP) must not wait for the device."""
    from types import SimpleNamespace

    from m3eagle.engine import executor as launch

    events = []

    class Runner:
        def __init__(self, name):
            self.name = name

        def release(self):
            events.append(("release", self.name))

    monkeypatch.setattr(launch.dist, "broadcast", lambda *a, **k: events.append(("broadcast",)))
    monkeypatch.setattr(launch, "leave_group", lambda timeout_s=None: events.append(("leave",)) or True)
    driver = launch.Driver(SimpleNamespace(control=None, group=None), None)
    driver.attach(Runner("spec"))
    driver.new_engine().attach(Runner("plain"))  # a copy: shares the runner list
    events.clear()
    driver.shutdown()
    assert events[:4] == [("broadcast",), ("release", "spec"), ("release", "plain"), ("leave",)]

    events.clear()
    faulty = launch.Driver(SimpleNamespace(control=None, group=None), None)
    faulty.attach(Runner("spec"))
    faulty.shutdown(send_stop=False)
    assert ("release", "spec") not in events and ("leave",) in events
