"""Warm-up before ready: what `LLMEngine.warmup` covers and how the server waits for it.

- every (graph bucket, mode) a serving step takes -- decode / verify buckets in the 8 modes and each of them
  constrained (masked), prefill buckets in the 4 -- is warmed at startup: graph_shapes=True and
  prefill_graphs=True force the CUDA bucketing on CPU, where `GraphRunner.warm` runs each one eagerly instead of
  capturing it; a mixed workload afterwards (greedy, sampled, logprobs, penalties, n = 2, prompt logprobs,
  grammar-constrained greedy and sampled, staggered arrivals) steps only through keys the warm-up warmed;
- `OpenAIServer(warmup=True)` listens at once but answers /health and every request 503 ("warming up")
  until the engine thread's warm-up has finished, then 200; a failed warm-up stops the server with an error;
- `m3eagle serve` warms up by default on CUDA only; --warmup / --no-warmup decide.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any `import triton` (graph_shapes on CPU)

import gc  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

from m3eagle import LLM, SamplingParams  # noqa: E402
from m3eagle.engine.graph_runner import PREFILL, GraphRunner  # noqa: E402
from m3eagle.entrypoints.server import OpenAIServer, ServerThread  # noqa: E402
from m3eagle.sampling.params import StructuredOutputsParams  # noqa: E402
from tests.entrypoints.test_server import http  # noqa: E402
from tests.helpers.engine_utils import assert_clean  # noqa: E402


def test_warmup_covers_every_bucket_serving_steps_take(one_thread, monkeypatch):
    llm = LLM(device="cpu", max_num_tokens=64, max_model_len=128, max_num_seqs=4, graph_shapes=True,
              prefill_graphs=True, max_prefill_graph_tokens=32)
    eng, gr = llm.engine, llm.engine.graphs
    warmed, stepped, planned = [], set(), []
    real_warm, real_ensure, real_bucket = GraphRunner.warm, GraphRunner.ensure, GraphRunner.bucket

    def warm(self, bucket, mode):
        warmed.append((bucket, mode))
        return real_warm(self, bucket, mode)

    def ensure(self, batch, bucket, masked=False):
        if bucket is not None:
            stepped.add((bucket, (*self.bufs.step_mode(batch.rows), masked)))
        return real_ensure(self, batch, bucket, masked)

    def bucket(self, batch, masked=False):
        out = real_bucket(self, batch, masked)
        planned.append((self.eager_prefill, any(r.num_tokens > 1 + r.num_drafts for r in batch.rows), out))
        return out

    monkeypatch.setattr(GraphRunner, "warm", warm)
    monkeypatch.setattr(GraphRunner, "ensure", ensure)
    monkeypatch.setattr(GraphRunner, "bucket", bucket)
    info = eng.warmup()
    # The prompt shapes ran eagerly, unpadded (the variants of steps no prefill graph takes), though prefill
    # graphs would have taken some of them; afterwards prompt steps take prefill graphs again.
    prompt_steps = [out for eager, prompt, out in planned if eager and prompt]
    assert len(prompt_steps) >= len(info["shapes"]) and all(out is None for out in prompt_steps)
    assert not gr.eager_prefill and any(isinstance(out, tuple) and out[0] == PREFILL
                                        for eager, prompt, out in planned if not eager and prompt)
    n_prefill = sum(1 for t in gr.prefill_buckets for r in gr.prefill_rows if 2 <= r <= t)
    assert gr.masked_modes  # a tokenizer, one rank, the chain: constrained decode steps replay masked graphs
    assert len(warmed) == len(set(warmed)) == info["graphs"] == 16 * len(gr.buckets) + 4 * n_prefill
    assert {b for b, _ in warmed} >= set(gr.buckets) | {(PREFILL, r, t) for t in gr.prefill_buckets
                                                         for r in gr.prefill_rows if 2 <= r <= t}
    assert set(info["variants"]) >= {"sampled", "logprobs", "penalties", "prompt_logprobs", "n=2"}
    # past the sparse layers' selection bound (a block past top-k x block keys), then a burst of hits on it
    c, page = eng.target_cfg, eng.cfg.page_size
    length = (c.index_topk_blocks + 1) * c.index_block_size
    long = info["long_context"]
    assert (long["prompt"], long["rows"]) == (length, 4)
    # each row found the long prompt's pages but (at most) the last, whose KV was final when it was cached
    assert long["hit_tokens"] % (4 * page) == 0 and long["hit_tokens"] >= 4 * (length // page - 1) * page
    assert eng.scheduler.prefix_cache_hits == 0  # the warm-up's hits are not counted
    assert eng.num_steps == 0 and eng.counters.num_drafts == 0
    assert_clean(llm)
    # A mixed workload: every keyed step it takes was warmed.
    stepped.clear()
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, logprobs=2, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=5, seed=1, logprobs=1, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, presence_penalty=0.4, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=2, n=2, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9]{6}")),
              SamplingParams(temperature=0.9, seed=4, logprobs=1, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(json_object=True))]
    for i in range(12):
        eng.add_request([3 + (i * 13 + j) % 90 for j in range(5 + 9 * i % 50)], params[i % len(params)])
        for _ in range(i % 3):
            eng.step()
    eng.run()
    assert stepped and stepped <= set(warmed), sorted(map(str, stepped - set(warmed)))
    assert any(isinstance(b, tuple) for b, _ in stepped) and any(isinstance(b, int) for b, _ in stepped)
    assert any(m[3] for _, m in stepped)  # constrained steps replayed masked decode keys
    assert_clean(llm)


@pytest.fixture(scope="module")
def small_llm(one_thread):
    return LLM(device="cpu", max_num_seqs=4, max_model_len=128, max_num_tokens=64)


def test_health_is_503_until_warmup_finishes(small_llm, monkeypatch):
    """Requests arriving during the warm-up get a 503 rather than waiting: the warm-up may take minutes,
    it needs an idle engine, and a load balancer or client reads /health to know when to send."""
    release, started = threading.Event(), threading.Event()
    real = small_llm.engine.warmup

    def blocked_warmup(**kw):
        started.set()
        assert release.wait(30)
        return real(graphs=False)

    monkeypatch.setattr(small_llm.engine, "warmup", blocked_warmup)
    with ServerThread(OpenAIServer(small_llm, log_interval=0, warmup=True)) as st:
        assert started.wait(30)
        status, body = http(st, "GET", "/health")
        assert status == 503 and "warming up" in body["error"]["message"]
        status, body = http(st, "POST", "/v1/completions", {"prompt": "def f(", "max_tokens": 2})
        assert status == 503 and "warming up" in body["error"]["message"]
        assert small_llm.engine.is_idle_and_clean()  # nothing reached the engine
        release.set()
        t_end = time.monotonic() + 30
        while http(st, "GET", "/health")[0] != 200:
            assert time.monotonic() < t_end, "not ready after the warm-up"
            time.sleep(0.02)
        status, body = http(st, "POST", "/v1/completions", {"prompt": "def f(", "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        # the startup heap is out of the collector's reach while serving (a full collection stalls the GIL)
        assert gc.get_freeze_count() > 1000
    assert small_llm.engine.num_steps > 0 and small_llm.engine.owner is None
    assert gc.get_freeze_count() == 0  # and given back when the server stops


def test_a_failed_warmup_stops_the_server(small_llm, monkeypatch):
    def broken(**kw):
        raise RuntimeError("no memory for graphs")

    monkeypatch.setattr(small_llm.engine, "warmup", broken)
    server = OpenAIServer(small_llm, log_interval=0, warmup=True)
    st = ServerThread(server).start()
    st._thread.join(20)
    assert not st._thread.is_alive()
    assert server.failed is not None and "no memory for graphs" in server.failed


def test_serve_warms_up_by_default_on_cuda_only(monkeypatch):
    from m3eagle.entrypoints import cli
    from m3eagle.entrypoints import server as server_pkg

    seen, device = [], ["cuda"]

    class FakeServer:
        def __init__(self, llm, **kw):
            seen.append(kw["warmup"])

    class FakeLLM:
        def __init__(self, warmup: bool = False, **kw):
            assert warmup is False  # the server warms up once it listens
            self.device = type("D", (), {"type": device[0]})()  # the device the LLM resolved

    monkeypatch.setattr("m3eagle.entrypoints.llm.LLM", FakeLLM)
    monkeypatch.setattr(server_pkg, "OpenAIServer", FakeServer)
    monkeypatch.setattr(server_pkg, "run_server", lambda *a, **kw: None)
    for dev, flags in (("cuda", []), ("cpu", []), ("cuda", ["--no-warmup"]), ("cpu", ["--warmup"])):
        device[0] = dev
        assert cli.main(["serve", "--port", "0", *flags]) == 0
    assert seen == [True, False, False, True]


def test_warmup_compiles_the_index_merge_variants_on_cuda(monkeypatch):
    """On CUDA the warm-up asks the attention backend for every indexer merge variant up to max_model_len, with
    this rank's index heads and the model's block shape (`TritonBackend.warm_index_merges`, held equal to what
    eager steps launch in tests/kernels/test_index_merge_warm.py); off CUDA, or with a backend that has no such
    variants, it asks for nothing."""
    llm = LLM(device="cpu", max_model_len=128, attention_backend="triton")
    eng, c = llm.engine, llm.engine.target_cfg
    calls = []
    monkeypatch.setattr(eng.ops.attention, "warm_index_merges", lambda *a: calls.append(a) or 11, raising=False)
    assert eng._warm_index_merges() == 0 and calls == []  # CPU: nothing compiles
    monkeypatch.setattr(eng, "device", SimpleNamespace(type="cuda"))
    assert eng._warm_index_merges() == 11
    assert calls == [(c.index_n_heads, c.index_block_size, c.index_topk_blocks, c.index_local_blocks, 128, eng.device)]
    monkeypatch.setattr(eng, "ops", SimpleNamespace(attention=SimpleNamespace()))  # a backend without merge variants
    assert eng._warm_index_merges() == 0


FIRST_STREAM_SCRIPT = r"""
import http.client, json, sys, time
from m3eagle import LLM
from m3eagle.entrypoints.server import OpenAIServer, ServerThread

def post(port, path, body):
    c = http.client.HTTPConnection("127.0.0.1", port)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    c.close()
    return r.status

llm = LLM(device="cpu", max_num_tokens=64, max_model_len=128, max_num_seqs=2)
with ServerThread(OpenAIServer(llm)) as s:
    while post(s.port, "/v1/completions", {"prompt": [5], "max_tokens": -1}) != 400:  # the server answers
        time.sleep(0.05)
    before = set(sys.modules)
    status = [post(s.port, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "stream": True}),
              post(s.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2, "stream": True})]
    print(json.dumps({"status": status, "imported": sorted(set(sys.modules) - before)}))
"""


@pytest.mark.slow
def test_the_first_streamed_request_imports_nothing():
    """A fresh server's first streamed answers import no module on the event loop: Starlette streams through an
    anyio task group, whose asyncio backend anyio imports on first use (tens of ms, the first requests' TTFT)
    unless the server's startup has. A subprocess: the test process may have imported it already."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FIRST_STREAM_SCRIPT], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["status"] == [200, 200]
    assert doc["imported"] == [], f"the first streamed requests imported {doc['imported']}"


def test_warmup_stops_between_items_and_leaves_the_engine_clean(small_llm):
    """`should_stop` is asked before each warm-up item: answering True after the second one ends the warm-up
    with WarmupStopped, the engine idle, clean and with its counters as before."""
    from m3eagle.engine.warmup import WarmupStopped

    eng = small_llm.engine
    asked, steps = [], eng.num_steps
    with pytest.raises(WarmupStopped):
        eng.warmup(graphs=False, should_stop=lambda: asked.append(1) or len(asked) > 2)
    assert len(asked) == 3  # two prompt batches ran, the third item was not started
    assert eng.is_idle_and_clean() and eng.num_steps == steps
    assert_clean(small_llm)


def test_a_server_stopped_during_its_warmup_ends_its_engine_thread(small_llm, monkeypatch):
    """Stopping a server that is still warming up ends the engine thread after its current item (a process that
    exits under a running compile or capture is aborted by the C++ runtime), and the engine is reusable."""
    real, started, items = small_llm.engine.warmup, threading.Event(), []

    def slow_warmup(graphs: bool = True, should_stop=None):
        def stop_after_start() -> bool:
            items.append(1)
            started.set()
            time.sleep(0.05)  # an item that takes a while: the stop arrives while the warm-up runs
            return should_stop()
        return real(graphs=False, should_stop=stop_after_start)

    monkeypatch.setattr(small_llm.engine, "warmup", slow_warmup)
    server = OpenAIServer(small_llm, log_interval=0, warmup=True)
    st = ServerThread(server).start()
    assert started.wait(30)
    loop = server.engine_loop
    st.stop()
    assert not loop.alive and loop.warmup_error == "stopped during the warm-up"
    assert not loop.warmed.is_set() and len(items) < 20
    assert small_llm.engine.is_idle_and_clean() and small_llm.engine.owner is None
