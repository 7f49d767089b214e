"""`m3eagle bench`: throughput, per-step cost and the roofline of one geometry, measured in one process.

A run, in order:
  1. The target and its Eagle3 head: random weights built on the device for named geometries, or a
     checkpoint. Plain decoding runs a second engine over the same weights (no copy).
  2. HBM copy bandwidth: a device-to-device copy of a several-GB buffer (the roofline's denominator).
  3. For each batch size, plain then speculative:
     a. throughput -- the prefix cache emptied, a warm-up batch, then `--repeats` timed batches of fresh
        prompts (prefill plus `--max-tokens` greedy tokens each); tok/s = generated tokens / wall time;
        median, min, max; the prefix-cache hit rate of the timed batches;
     b. a steady decode state (every row decoding or verifying): the router's choices in one step give
        the experts actually read; `--decode-steps` steps are timed (wall, host); the profiler watches
        `--profile-steps` more (kernels per step, GPU busy time). Bytes per step, MBU and the roofline
        follow from the config (roofline.py).
  4. `--compare-hf`: transformers' `generate` at batch 1 on the very same tensors.
  5. A table (stderr) and a JSON document (stdout or `--json FILE`); `DEFINITIONS` travels inside it.

Prompts are held-out text when the model has a tokenizer (stdlib modules, which the embedded model never
trained on), else seeded random token ids. All decoding is greedy with EOS ignored, so every request
emits exactly `--max-tokens` tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
import re
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from m3eagle.bench import geometries, roofline
from m3eagle.engine.draft_tree import TreeSpec
from m3eagle.engine.llm_engine import LLMEngine, max_scheduler_steps
from m3eagle.engine.request import Request
from m3eagle.loader.dummy import target_config
from m3eagle.models.layers import Router
from m3eagle.sampling.params import SamplingParams

SCHEMA = "m3eagle.bench/1"
STEADY_STEPS = 2  # samples every row has taken before a steady-state measurement starts

DEFINITIONS = {
    "tok_s": "generated tokens / wall time of one whole batch (prefill + decode), one sample per repeat, after "
             "a warm-up batch; median, min and max over --repeats",
    "first_token_ms": "per repeat, wall time from the batch's submission until every request has its first "
                      "output token (the prompt steps; under overlap, one step late): median over --repeats",
    "prefix_cache_hit_rate": "prompt tokens found in the prefix cache / prompt tokens looked up, over the timed "
                             "repeats (null with --no-enable-prefix-caching). Each configuration starts with an "
                             "empty cache and its repeats use fresh prompts, so this stays near 0",
    "steps": "device steps per repeat (prompt, mixed and decode steps, the sub-steps of a multi-step "
             "iteration counted one each; a batch's slowest request decides): median over --repeats",
    "step_ms": "wall time per device step (with --num-scheduler-steps N, an engine step's N sub-steps count "
               "one each) in a steady decode state (plain: 1 token per row; spec: verify 1+K "
               "tokens and draft K per row), over --decode-steps steps between device synchronizations",
    "host_ms": "step_ms minus the time the host thread is blocked waiting for the device (StepOutput.wait): "
               "scheduling, input building, kernel launches and output processing. host_ms close to step_ms "
               "means the step is host/launch-bound. On a CPU device the host does all the work",
    "graph_launch_ms": "host time per step inside CUDA-graph replay (the driver's graph launch), part of "
                       "host_ms; null when no timed step replayed a graph",
    "gpu_busy_ms": "union of GPU kernel and copy intervals per step, from torch.profiler over --profile-steps "
                   "steps; gpu_busy_frac = gpu_busy_ms / step_ms (null off CUDA)",
    "kernels_per_step": "GPU kernels per step from the profiler; memcpy/memset counted apart (null off CUDA)",
    "torch_ops_per_step": "top-level aten ops dispatched per step (profiler; triton launches not included)",
    "context": "mean KV length per row over the timed steps",
    "bytes_per_step": "bytes an ideal engine reads per step at this batch and context: every non-expert weight "
                      "once, the routed experts the router chose (distinct over the step's tokens), full-attention "
                      "KV, MSA selected-block KV plus all index keys; spec adds the Eagle3 head's K draft passes",
    "mbu": "bytes_per_step / (step_ms / 1000) / (bandwidth.bytes_per_s x tensor_parallel_size): the ranks read "
           "their shards in parallel, each at the copy bandwidth measured on rank 0's device",
    "roofline_tok_s": "tokens a step emits (batch; spec: batch x mean acceptance length) / (bytes_per_step / "
                      "(bandwidth x tensor_parallel_size))",
    "comm_ms": "tensor parallel: rank 0's time per step in collectives -- on CUDA the union of NCCL kernel "
               "intervals from the profiler (all-reduces, logits all-gather, step broadcast; waiting for a slower "
               "peer included), on CPU the host time in the all-reduce / all-gather calls (gloo blocks); "
               "comm_frac = comm_ms / step_ms; null with one rank",
    "bandwidth": "device-to-device copy of a buffer of bandwidth.buffer_bytes: 2 x bytes (read + write) / time; "
                 "buffer_bytes is the size actually used (--bandwidth-gib, capped at 64 MiB off CUDA)",
    "draft_params": "the Eagle3 head's parameters: every tensor its forward uses, counted once, including the "
                    "embedding it shares with the target when it has none of its own -- the count `m3eagle "
                    "generate` logs when it loads the head; draft_own_params leaves the shared tensors out",
}


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------


def run_bench(a: argparse.Namespace) -> dict[str, Any]:
    """Run the whole benchmark described by the parsed `m3eagle bench` arguments; return the JSON document."""
    from m3eagle.engine.runtime import Runtime

    say = Progress()
    geo = geometries.resolve(a.geometry, a.draft, a.load_format, getattr(a, "num_layers", None))
    dev = _device(a.device)
    tree = TreeSpec.parse(a.draft_tree) if getattr(a, "draft_tree", None) is not None else None
    if tree is not None and a.num_draft_tokens is not None:
        raise ValueError(f"--num-draft-tokens {a.num_draft_tokens} and --draft-tree {tree}: give one (a tree "
                         "verifies its N nodes per step)")
    k = tree.nodes if tree is not None else (
        a.num_draft_tokens if a.num_draft_tokens is not None else (3 if geo.draft is not None else 0))
    if k and geo.draft is None:
        raise ValueError(f"--num-draft-tokens {k} needs an Eagle3 head: give --draft DIR, or --num-draft-tokens 0")
    tcfg = target_config(geo.model)
    max_b = max(a.batch_sizes)
    # The steady-state measurement keeps every row alive through all its steps (K+1 tokens a step at most).
    step_len = ((STEADY_STEPS + 2 + a.decode_steps + a.profile_steps + 2) * (k + 1)
                * max_scheduler_steps(getattr(a, "num_scheduler_steps", 1)))  # N steps per engine step
    mml = a.prompt_len + max(a.max_tokens, step_len) + 2 * (k + 1) + 1
    if mml > tcfg.max_position_embeddings:
        raise ValueError(f"--prompt-len {a.prompt_len} + --max-tokens {a.max_tokens} (and {step_len} tokens of "
                         f"steady-state steps) exceed the model's max_position_embeddings="
                         f"{tcfg.max_position_embeddings}; lower --prompt-len or --max-tokens")
    pages_per_seq = -(-(mml + 2 * (k + 1)) // a.page_size) + 1
    overlap = None if a.overlap == "auto" else a.overlap == "on"
    # a tree replays decode graphs; Runtime leaves overlap off for it unless asked (--overlap on)
    spec_kw: dict[str, Any] = {"draft_tree": str(tree)} if tree is not None else {"num_draft_tokens": k}
    if getattr(a, "tree_max_batch", None) is not None:  # without a tree the engine refuses it by name
        spec_kw["tree_max_batch"] = a.tree_max_batch
    tp = getattr(a, "tensor_parallel_size", 1)
    if a.compare_hf and tp > 1:
        raise ValueError("--compare-hf runs transformers on rank 0's weights, which are a shard under "
                         f"--tensor-parallel-size {tp}; compare with --tensor-parallel-size 1")

    say(f"building {geo.description}")
    t0 = time.perf_counter()
    llm = Runtime(geo.model, geo.draft if k else None, **spec_kw, dtype=a.dtype, device=str(dev),
              page_size=a.page_size, max_num_tokens=a.max_num_tokens, max_model_len=mml, max_num_seqs=max_b,
              num_pages=1 + max_b * pages_per_seq, overlap=overlap, attention_backend=a.attention_backend,
              moe_backend=a.moe_backend, enforce_eager=a.enforce_eager,
              load_format=geo.load_format, tensor_parallel_size=tp,
              # None: the engine's default (on for one CUDA device, trees included)
              prefill_graphs=getattr(a, "prefill_graphs", None),
              max_prefill_graph_tokens=getattr(a, "max_prefill_graph_tokens", 2048),
              num_scheduler_steps=getattr(a, "num_scheduler_steps", 1),
              quantization=getattr(a, "quantization", None),
              enable_prefix_caching=getattr(a, "enable_prefix_caching", True),
              deterministic=getattr(a, "deterministic", False))
    try:  # the measurements, then the workers stop (tensor parallel) whatever happened
        return _measure(a, llm, geo, dev, k, say, t0)
    finally:
        llm.shutdown()


def _measure(a: argparse.Namespace, llm, geo: geometries.Geometry, dev: torch.device, k: int, say: Progress,
             t0: float) -> dict[str, Any]:
    """Steps 2-5 of the module docstring on a built LLM; t0: when its build started."""
    tcfg, max_b = llm.target.cfg, max(a.batch_sizes)
    _sync(dev)
    build_s = time.perf_counter() - t0
    say(f"  built in {build_s:.1f}s")
    engines = {"plain": _plain_engine(llm) if k else llm.engine}
    if k:
        engines["spec"] = llm.engine
    prompts, prompt_source = make_prompts(llm.tokenizer, tcfg.vocab_size, max_b * (a.repeats + 1), a.prompt_len,
                                          a.seed)
    if llm.draft is not None:
        say(f"Eagle3 head: {_draft_params(llm.draft) / 1e6:.2f}M parameters (shared embedding included; "
            f"{_own_numel(llm.draft, llm.target) / 1e6:.2f}M its own)")
    say(f"HBM copy bandwidth on {dev}")
    bw = roofline.measure_copy_bandwidth(dev, int(a.bandwidth_gib * roofline.GiB))
    capped = f" (--bandwidth-gib {a.bandwidth_gib:g} capped off CUDA)" \
        if bw["buffer_bytes"] < int(a.bandwidth_gib * roofline.GiB) else ""
    say(f"  {bw['bytes_per_s'] / 1e12:.3f} TB/s, {bw['buffer_bytes'] / roofline.GiB:g} GiB buffer{capped}")
    dtype_bytes = torch.empty((), dtype=llm.dtype).element_size()

    rows: list[dict[str, Any]] = []
    first_tokens: dict[int, list[int]] = {}
    for b in a.batch_sizes:
        for mode, eng in engines.items():
            km = k if mode == "spec" else 0
            say(f"batch {b} {mode}: throughput, {a.repeats} repeats of {a.max_tokens} tokens")
            thr = throughput(eng, prompts, b, a.max_tokens, a.repeats, km, dev)
            say(f"batch {b} {mode}: {thr['tok_s']['median']:.1f} tok/s; steady-state steps")
            st = step_profile(eng, llm.target, prompts[:b], km, a.decode_steps, a.profile_steps, dev)
            rows.append(_row(b, mode, km, thr, st, llm, dtype_bytes, bw["bytes_per_s"] * llm.tp.size))
            if mode == "plain":
                first_tokens[b] = thr["first_tokens"]
            launch = f", graph launch {st['graph_launch_ms']:.3f} ms" if st["graph_launch_ms"] is not None else ""
            say(f"batch {b} {mode}: step {st['step_ms']:.2f} ms, host {st['host_ms']:.2f} ms{launch}")

    hf = None
    if a.compare_hf:
        if 1 not in first_tokens:
            say("batch 1 plain (for --compare-hf)")
            thr = throughput(engines["plain"], prompts, 1, a.max_tokens, a.repeats, 0, dev)
            first_tokens[1], m3_b1 = thr["first_tokens"], thr["tok_s"]["median"]
        else:
            m3_b1 = next(r["tok_s"]["median"] for r in rows if r["batch"] == 1 and r["mode"] == "plain")
        say("transformers generate, batch 1, same weights")
        hf = compare_hf(llm, prompts, a.max_tokens, a.repeats, m3_b1, first_tokens[1], dev, say)

    spec = {r["batch"]: r for r in rows if r["mode"] == "spec"}
    speedup = [{"batch": r["batch"], "spec_over_plain": spec[r["batch"]]["tok_s"]["median"] / r["tok_s"]["median"]}
               for r in rows if r["mode"] == "plain" and r["batch"] in spec]
    counts = roofline.param_counts(llm.target.cfg)
    return {
        "schema": SCHEMA,
        "command": "m3eagle " + " ".join(getattr(a, "argv", None) or ["bench"]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(time.time() - say.elapsed())),
        "geometry": {"name": geo.name, "description": geo.description, "load_format": geo.load_format,
                     **counts, "draft_params": _draft_params(llm.draft) if llm.draft is not None else None,
                     "draft_own_params": _own_numel(llm.draft, llm.target) if llm.draft is not None else None,
                     "target": llm.target.cfg.to_hf_text_dict(),
                     "draft": llm.draft.cfg.to_dict() if llm.draft is not None else None},
        "env": _env(llm, dev),
        "settings": {"batch_sizes": list(a.batch_sizes), "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
                     "repeats": a.repeats, "decode_steps": a.decode_steps, "profile_steps": a.profile_steps,
                     "kernel_table": getattr(a, "kernel_table", 0),
                     "prefill_graphs": llm.engine.cfg.prefill_graphs,
                     "plain_prefill_graphs": engines["plain"].cfg.prefill_graphs,
                     "max_prefill_graph_tokens": llm.engine.cfg.max_prefill_graph_tokens,
                     "num_scheduler_steps": llm.engine.cfg.num_scheduler_steps, "num_draft_tokens": k,
                     "draft_tree": str(llm.engine.cfg.draft_tree) if llm.engine.cfg.draft_tree is not None else None,
                     "tree_max_batch": llm.engine.cfg.tree_max_batch,
                     "enable_prefix_caching": llm.engine.cfg.enable_prefix_caching,
                     "deterministic": llm.deterministic, "prompts": prompt_source, "seed": a.seed},
        "bandwidth": bw,
        "build_s": build_s,
        "results": rows,
        "speedup": speedup,
        "compare_hf": hf,
        "definitions": DEFINITIONS,
        "wall_s": say.elapsed(),
    }


def _plain_engine(llm) -> LLMEngine:
    """A second engine over the same target weights, speculation off (its own KV pool, sized alike)."""
    return llm.plain_engine()


def _row(b: int, mode: str, k: int, thr: dict, st: dict, llm, dtype_bytes: int, bw: float) -> dict[str, Any]:
    cfg = llm.target.cfg
    experts = st["experts_per_moe_layer"]
    qb = roofline.MXFP8_BYTES if _weights_format(llm) == "mxfp8" else None
    target = roofline.decode_step_bytes(cfg, b, st["context"], dtype_bytes, tokens=st["tokens"], experts=experts,
                                        quant_bytes=qb)
    draft = roofline.draft_step_bytes(llm.draft.cfg, b, st["context"], k, dtype_bytes) if k else None
    total = target["total"] + (draft["total"] if draft else 0.0)
    acc = thr["acceptance"]
    emitted = b * (acc["mean_acceptance_length"] if acc else 1.0)
    return {
        "batch": b, "mode": mode, "num_draft_tokens": k, "tok_s": thr["tok_s"],
        "first_token_ms": thr["first_token_ms"], "steps": thr["steps"],
        "prefix_cache_hit_rate": thr["prefix_cache_hit_rate"],
        "acceptance": ({key: acc[key] for key in ("mean_acceptance_length", "acceptance_rate", "per_position_rates")}
                       if acc else None),
        "step": {key: v for key, v in st.items() if key != "experts_per_moe_layer"},
        "roofline": {
            "bytes_per_step": total, "bytes": target, "draft_bytes": draft,
            "experts_per_moe_layer": experts,
            "experts_source": "measured" if experts is not None else "expected",
            "expected_experts": roofline.expected_distinct_experts(cfg.num_local_experts, cfg.num_experts_per_tok,
                                                                   st["tokens"]),
            "mbu": total / (st["step_ms"] / 1e3) / bw,
            "roofline_tok_s": emitted / (total / bw),
        },
    }


# ------------------------------------------------------------------------------------------------
# Prompts
# ------------------------------------------------------------------------------------------------


def held_out_files() -> list[Path]:
    """Text the embedded model never trained on: the stdlib's top-level modules."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def make_prompts(tokenizer, vocab: int, n: int, length: int, seed: int) -> tuple[list[list[int]], str]:
    """n prompts of exactly `length` tokens: windows of held-out text, or random ids without a tokenizer."""
    rng = random.Random(seed)
    if tokenizer is None:
        return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)], "random token ids"
    # A token covers at least one byte, so smaller files cannot hold a window; skip them untokenized.
    files = [f for f in held_out_files() if f.stat().st_size >= length + 8]
    rng.shuffle(files)
    pool: list[list[int]] = []
    longest = 0
    for f in files:
        if len(pool) >= n:
            break
        ids = tokenizer.encode(f.read_text(errors="ignore"))
        longest = max(longest, len(ids))
        if len(ids) >= length + 8:
            pool.append(ids)
    if not pool:
        have = f"the longest holds {longest} tokens" if longest else f"none has even {length + 8} bytes"
        raise ValueError(f"--prompt-len {length} is longer than any held-out text ({len(held_out_files())} stdlib "
                         f"modules; {have}); lower --prompt-len")

    def window(ids: list[int]) -> list[int]:
        s = rng.randrange(0, len(ids) - length)
        return ids[s:s + length]

    out = [window(ids) for ids in pool[:n]]
    while len(out) < n:  # fewer long-enough modules than prompts: more windows of the same ones
        out.append(window(rng.choice(pool)))
    return out, "stdlib text"


# ------------------------------------------------------------------------------------------------
# Throughput
# ------------------------------------------------------------------------------------------------


def throughput(engine: LLMEngine, prompts: list[list[int]], batch: int, max_tokens: int, repeats: int, k: int,
               dev: torch.device) -> dict[str, Any]:
    """Warm-up batch, then `repeats` timed batches of fresh prompts. Returns tok/s stats, the speculative
    acceptance and the prefix-cache hit rate over the timed batches, and the first timed request's tokens (for
    --compare-hf)."""
    from m3eagle.engine.runtime import aggregate_stats

    caching = engine.cfg.enable_prefix_caching
    if caching:
        # Start cold: earlier configurations ran some of these prompts, and a hit would skip prompt steps (the
        # warm-up's shapes too, leaving them to compile inside a timed repeat).
        engine.reset_prefix_cache()
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    _generate(engine, prompts[:batch], sp)  # compilation, autotuning, allocator growth
    q0, h0 = engine.prefix_cache_queries, engine.prefix_cache_hits
    samples, outs, first, steps = [], [], [], []
    for r in range(repeats):
        chunk = prompts[(r + 1) * batch:(r + 2) * batch]
        _sync(dev)
        t0 = time.perf_counter()
        n0 = engine.num_steps
        reqs = _generate(engine, chunk, sp, first)
        _sync(dev)
        dt = time.perf_counter() - t0
        samples.append(sum(len(q.output_token_ids) for q in reqs) / dt)
        first[-1] -= t0
        steps.append(engine.num_steps - n0)
        outs += [q.to_output() for q in reqs]
    hit_rate = None
    if caching:
        queries = engine.prefix_cache_queries - q0
        hit_rate = (engine.prefix_cache_hits - h0) / queries if queries else 0.0
    return {"tok_s": summarize(samples), "acceptance": aggregate_stats(outs, k) if k else None,
            "prefix_cache_hit_rate": hit_rate,
            "first_token_ms": statistics.median(first) * 1e3, "steps": statistics.median(steps),
            "first_tokens": list(outs[0].outputs[0].token_ids)}


def _generate(engine: LLMEngine, prompts: list[list[int]], sp: SamplingParams,
              first: list[float] | None = None) -> list[Request]:
    """Run `prompts` to the end; `first` gets the perf_counter time when every request had a token."""
    reqs = [engine.add_request(list(p), sp, stream_text=False) for p in prompts]
    waiting = first is not None
    while engine.has_work():
        engine.step()
        if waiting and all(q.output_token_ids for q in reqs):
            first.append(time.perf_counter())
            waiting = False
    if waiting:
        first.append(time.perf_counter())
    failed = [q for q in reqs if q.finish_reason not in ("length", "stop")]
    if failed:
        q = failed[0]
        raise RuntimeError(f"bench request {q.request_id} ended with {q.finish_reason!r}: {getattr(q, 'error', '')}")
    return reqs


def summarize(samples: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "samples": samples}


# ------------------------------------------------------------------------------------------------
# One steady decode state: experts, step time, host time, profile
# ------------------------------------------------------------------------------------------------


def step_profile(engine: LLMEngine, target: torch.nn.Module, prompts: list[list[int]], k: int, steps: int,
                 profile_steps: int, dev: torch.device) -> dict[str, Any]:
    """Bring `prompts` to a steady decode state, then measure (see DEFINITIONS). Aborts them at the end."""
    # Rows stay alive through every step (K+1 tokens a step at most; N steps per engine.step() with
    # num_scheduler_steps).
    need = (STEADY_STEPS + 2 + steps + profile_steps + 2) * (k + 1) * engine.cfg.num_scheduler_steps
    sp = SamplingParams(temperature=0.0, max_tokens=need, ignore_eos=True)
    reqs = [engine.add_request(list(p), sp, stream_text=False) for p in prompts]
    try:
        while min(len(q.output_token_ids) for q in reqs) < STEADY_STEPS:  # prefill, first samples
            if not engine.has_work():
                raise RuntimeError("bench: requests finished before reaching a steady decode state")
            engine.step()
        engine.step()
        with capture_router_choices(target) as routed:
            engine.step()
        experts, tokens = routed.result()  # syncs: outside every timed window
        ctx0 = _mean_context(reqs)
        _sync(dev)
        tp = engine.tp
        tp.timed, tp.comm_seconds = tp.size > 1 and dev.type != "cuda", 0.0  # CPU: gloo collectives block
        try:
            graphs = engine.graphs
            replays0, launch0, n0 = graphs.num_replays, graphs.launch_seconds, engine.num_steps
            with device_wait_timer() as waited:
                t0 = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                _sync(dev)
                wall = time.perf_counter() - t0
            dsteps = engine.num_steps - n0  # device steps: more than `steps` with num_scheduler_steps > 1
            launch_ms = ((graphs.launch_seconds - launch0) / dsteps * 1e3
                         if graphs.num_replays > replays0 else None)
        finally:
            tp.timed = False
        ctx = (ctx0 + _mean_context(reqs)) / 2
        prof = profile_window(engine, profile_steps, dev)
    finally:
        for q in reqs:
            engine.abort(q.request_id)
        engine.run()
    step_ms = wall / dsteps * 1e3
    busy = prof["gpu_busy_ms"]
    comm = prof["comm_ms"] if prof["comm_ms"] is not None else (
        tp.comm_seconds * 1e3 / dsteps if tp.size > 1 else None)
    return {"context": ctx, "tokens": tokens if tokens is not None else len(prompts) * (k + 1),
            "step_ms": step_ms, "host_ms": step_ms - waited[0] / dsteps * 1e3,
            "device_wait_ms": waited[0] / dsteps * 1e3, "graph_launch_ms": launch_ms, **prof,
            "gpu_busy_frac": busy / step_ms if busy is not None else None,
            "comm_ms": comm, "comm_frac": comm / step_ms if comm is not None else None,
            "experts_per_moe_layer": experts}


def _mean_context(reqs: list[Request]) -> float:
    return sum(len(q.prompt_token_ids) + len(q.output_token_ids) for q in reqs) / len(reqs)


class _RouterChoices:
    def __init__(self) -> None:
        self.idx: dict[int, torch.Tensor] = {}  # MoE layer order -> expert ids [T, k] of the last call

    def result(self) -> tuple[list[int] | None, int | None]:
        """(distinct experts per MoE layer, tokens routed); (None, None) when no router ran as a module."""
        if not self.idx:
            return None, None
        ids = [self.idx[i] for i in sorted(self.idx)]
        return [int(t.unique().numel()) for t in ids], int(ids[0].shape[0])


@contextmanager
def capture_router_choices(target: torch.nn.Module) -> Iterator[_RouterChoices]:
    """Record the expert ids every Router module of `target` picks while the block runs (forward hooks)."""
    out = _RouterChoices()
    routers = [m for m in target.modules() if isinstance(m, Router)]

    def hook(i: int):
        def fn(_module, _inputs, result) -> None:
            out.idx[i] = result[1]  # (weights [T, k], idx [T, k])
        return fn

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(routers)]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


@contextmanager
def device_wait_timer() -> Iterator[list[float]]:
    """Seconds the host spends blocked in StepOutput.wait() (the engine's only wait on the device) while
    the block runs, accumulated into the yielded one-element list."""
    from m3eagle.engine import model_runner

    cls = model_runner.StepOutput
    orig = cls.wait
    acc = [0.0]

    def wait(self):
        t = time.perf_counter()
        try:
            return orig(self)
        finally:
            acc[0] += time.perf_counter() - t

    cls.wait = wait
    try:
        yield acc
    finally:
        cls.wait = orig


def profile_window(engine: LLMEngine, steps: int, dev: torch.device) -> dict[str, float | None]:
    """Kernels and GPU busy time per step over `steps` engine steps, from torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda, tp = dev.type == "cuda", engine.tp
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(dev)
    n0 = engine.num_steps
    with _without_native_lines(), profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
        _sync(dev)
    steps = engine.num_steps - n0  # per device step (an engine step runs N with num_scheduler_steps)
    events = prof.events()
    ops = sum(1 for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is None
              and e.name.startswith("aten::"))
    res: dict[str, float | None] = {"torch_ops_per_step": ops / steps, "kernels_per_step": None,
                                    "memcpy_per_step": None, "gpu_busy_ms": None,
                                    "comm_ms": None}
    if cuda:
        gpu = [e for e in events if e.device_type == DeviceType.CUDA]
        copies = sum(1 for e in gpu if e.name.startswith(("Memcpy", "Memset")))
        res.update(kernels_per_step=(len(gpu) - copies) / steps, memcpy_per_step=copies / steps,
                   gpu_busy_ms=_union_us([(e.time_range.start, e.time_range.end) for e in gpu]) / 1e3 / steps,
                   top_kernels=top_kernels([(e.name, e.time_range.end - e.time_range.start) for e in gpu], steps))
        if tp.size > 1:  # NCCL kernels (all-reduce, all-gather, broadcast): their union per step
            nccl = [(e.time_range.start, e.time_range.end) for e in gpu if "nccl" in e.name.lower()]
            res["comm_ms"] = _union_us(nccl) / 1e3 / steps
    return res


# What libkineto writes straight to file descriptor 2 (not through Python) when a CPU profile starts and stops:
# "USDT:2026-... SyncActivityProfilerHandler.cpp:52] profiler_start". It would land between the progress lines.
_NATIVE_NOISE = re.compile(rb"^USDT:.*profiler_(start|stop)\s*$")


@contextmanager
def _without_native_lines() -> Iterator[None]:
    """Run the block with file descriptor 2 sent to a temporary file, then pass on what was written there
    except the profiler's native USDT lines."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real stderr: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = b"".join(line for line in tmp.read().splitlines(keepends=True) if not _NATIVE_NOISE.match(line))
            if kept:
                os.write(2, kept)


def top_kernels(spans: list[tuple[str, float]], steps: int, n: int = 40) -> list[dict[str, Any]]:
    """GPU time per step grouped by kernel name, largest first: where a step's device time goes (the
    profile to read before optimising). `spans` are (name, µs) of single kernel or copy executions."""
    acc: dict[str, list[float]] = {}
    for name, us in spans:
        a = acc.setdefault(_short_kernel_name(name), [0, 0.0])
        a[0] += 1
        a[1] += us
    rows = [{"name": k, "calls_per_step": c / steps, "us_per_step": t / steps} for k, (c, t) in acc.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])[:n]


def _short_kernel_name(name: str) -> str:
    """A kernel's name without template arguments and parameter lists (cuBLAS/CUTLASS names run to
    hundreds of characters)."""
    name = re.sub(r"\(.*", "", name)
    depth, out = 0, []
    for ch in name:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">" and depth > 0
    return "".join(out).replace("void ", "").strip()[:90]


def _union_us(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (µs): overlapping kernels count once."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


# ------------------------------------------------------------------------------------------------
# transformers on the same weights
# ------------------------------------------------------------------------------------------------


def hf_twin(target: torch.nn.Module) -> torch.nn.Module:
    """transformers' MiniMaxM3VLForCausalLM holding the very tensors of `target` (no copy, no disk).

    Names map as `save_target(layout="hf")` writes them: m3eagle's names under `model.`, lm_head as is. The
    module is built on the meta device and its parameters are then assigned, so nothing is allocated
    twice; the rotary tables (non-persistent buffers) are rebuilt on the device."""
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    p = next(target.parameters())
    cfg = MiniMaxM3VLTextConfig(**target.cfg.to_hf_text_dict())
    with torch.device("meta"):
        hf = MiniMaxM3VLForCausalLM(cfg)
    sd = {k if k == "lm_head.weight" else "model." + k: v for k, v in target.state_dict().items()}
    hf.load_state_dict(sd, strict=True, assign=True)
    if target.cfg.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    with torch.device(p.device):
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"hf_twin: tensors left on the meta device: {left[:3]}")
    return hf.eval()


def compare_hf(llm, prompts: list[list[int]], max_tokens: int, repeats: int, m3_tok_s: float,
               m3_tokens: list[int], dev: torch.device, say: Progress) -> dict[str, Any]:
    """transformers' greedy `generate` at batch 1 on the same prompts (warm-up, then `repeats` timed)."""
    from transformers import GenerationConfig

    hf = hf_twin(llm.target)
    gc = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)

    def run(p: list[int]) -> tuple[list[int], float]:
        ids = torch.tensor([p], device=dev)
        _sync(dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
        _sync(dev)
        return out[0, len(p):].tolist(), time.perf_counter() - t0

    run(prompts[0])
    samples, tokens = [], []
    for r in range(repeats):
        toks, dt = run(prompts[r + 1])  # the prompts m3eagle's batch-1 repeats used, in order
        samples.append(len(toks) / dt)
        tokens = tokens or toks
        say(f"  transformers repeat {r + 1}/{repeats}: {samples[-1]:.2f} tok/s")
    match = next((i for i, (x, y) in enumerate(zip(tokens, m3_tokens)) if x != y), min(len(tokens), len(m3_tokens)))
    tok_s = summarize(samples)
    res = {"batch": 1, "tok_s": tok_s, "m3eagle_tok_s": m3_tok_s, "ratio": m3_tok_s / tok_s["median"],
           "greedy_prefix_match": match, "max_tokens": max_tokens,
           "experts_implementation": getattr(hf.config, "_experts_implementation", None),
           "attn_implementation": getattr(hf.config, "_attn_implementation", None)}
    return res  # the twin owns no weights of its own: dropping it frees only its caches


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------


def format_table(doc: dict[str, Any]) -> str:
    """The human-readable summary of a bench document."""
    g, env, s, bw = doc["geometry"], doc["env"], doc["settings"], doc["bandwidth"]
    tp = env.get("tensor_parallel_size", 1)
    head = f"{_si(g['params'])} params ({_si(g['active_params'])} active)"
    if s["num_draft_tokens"]:
        head += f", Eagle3 head {_si(g['draft_params'])} params, K={s['num_draft_tokens']}"
    lines = [
        f"m3eagle bench: {g['description']}",
        f"  {head}",
        f"  {env['device_name']}{f' x {tp} (tensor parallel)' if tp > 1 else ''}, {env['dtype']}, "
        f"{env['attention_backend']} attention{', deterministic' if env.get('deterministic') else ''}, overlap "
        f"{'on' if env['overlap'] else 'off'}"
        f"{f', {ms} steps per iteration' if (ms := s.get('num_scheduler_steps', 1)) > 1 else ''}"
        f"; copy bandwidth {bw['bytes_per_s'] / 1e12:.3f} TB/s "
        f"({bw['buffer_bytes'] / roofline.GiB:g} GiB buffer)",
        f"  prompts: {s['prompt_len']} tokens of {s['prompts']}, {s['max_tokens']} new tokens, greedy; "
        f"{s['repeats']} repeats (median [min, max])",
        "",
        f"{'batch':>5} {'mode':<5} {'tok/s [min, max]':>26} {'step ms':>8} {'host ms':>8} {'GPU busy ms':>14} "
        f"{'kernels':>8} {'context':>7} {'GB/step':>8} {'MBU':>7} {'roofline tok/s':>14} {'accept':>6} "
        f"{'1st tok ms':>10} {'steps':>6}"
        f"{'  comm ms (share)' if tp > 1 else ''}"
        f"{'  prefix hits' if s.get('enable_prefix_caching') else ''}",
    ]
    for r in doc["results"]:
        t, st, rf = r["tok_s"], r["step"], r["roofline"]
        busy = (f"{st['gpu_busy_ms']:.2f} ({st['gpu_busy_frac']:.0%})" if st["gpu_busy_ms"] is not None else "-")
        kern = f"{st['kernels_per_step']:.0f}" if st["kernels_per_step"] is not None else "-"
        acc = f"{r['acceptance']['mean_acceptance_length']:.2f}" if r["acceptance"] else "-"
        rng = f"{_num(t['median'])} [{_num(t['min'])}, {_num(t['max'])}]"
        lines.append(f"{r['batch']:>5} {r['mode']:<5} {rng:>26} {st['step_ms']:>8.2f} {st['host_ms']:>8.2f} "
                     f"{busy:>14} {kern:>8} {st['context']:>7.0f} {rf['bytes_per_step'] / 1e9:>8.3f} "
                     f"{rf['mbu']:>7.2%} {rf['roofline_tok_s']:>14,.0f} {acc:>6} "
                     f"{r.get('first_token_ms', float('nan')):>10.1f} {r.get('steps', float('nan')):>6.0f}"
                     + (f"  {st['comm_ms']:.2f} ({st['comm_frac']:.0%})" if st.get("comm_ms") is not None else "")
                     + (f"  {hr:>11.1%}" if (hr := r.get("prefix_cache_hit_rate")) is not None else ""))
    if doc["speedup"]:
        lines.append("")
        lines.append("spec / plain tok/s: " + ", ".join(f"batch {x['batch']} {x['spec_over_plain']:.2f}x"
                                                        for x in doc["speedup"]))
    hf = doc["compare_hf"]
    if hf:
        t = hf["tok_s"]
        lines.append(f"transformers generate, batch 1: {_num(t['median'])} tok/s [{_num(t['min'])}, {_num(t['max'])}]; "
                     f"m3eagle plain batch 1 is {hf['ratio']:.2f}x (greedy tokens agree on the first "
                     f"{hf['greedy_prefix_match']} of {hf['max_tokens']})")
    if s.get("kernel_table"):
        for r in doc["results"]:
            top = r["step"].get("top_kernels") or []
            lines.append("")
            lines.append(f"batch {r['batch']} {r['mode']}: GPU time per step by kernel (top {s['kernel_table']})")
            for kr in top[: s["kernel_table"]]:
                lines.append(f"  {kr['us_per_step']:>9.1f} us {kr['calls_per_step']:>6.1f}x  {kr['name']}")
    lines.append("host ms: step time minus time blocked on the device; GPU busy: profiler kernel time per step; "
                 "MBU: bytes/step over step time and copy bandwidth; 1st tok ms: until every request of a repeat "
                 "has a token; steps: per repeat; prefix hits: cached / looked-up prompt tokens, timed repeats "
                 "(JSON 'definitions')")
    return "\n".join(lines)


def _weights_format(llm) -> str | None:
    """"mxfp8" when the target holds MXFP8 weights (the release, or --quantization fp8), else None."""
    return "mxfp8" if any(p.dtype == torch.float8_e4m3fn for p in llm.target.parameters()) else None


def _env(llm, dev: torch.device) -> dict[str, Any]:
    from m3eagle.version import __version__

    env: dict[str, Any] = {
        "device": str(dev), "dtype": str(llm.dtype).replace("torch.", ""),
        "device_name": (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                        else f"cpu ({platform.processor() or platform.machine()})"),
        "m3eagle": __version__, "torch": torch.__version__, "python": platform.python_version(),
        "attention_backend": llm.engine.ops.attention.name, "moe_backend": llm.engine.ops.moe.name,
        "fused_backend": llm.engine.ops.fused.name, "deterministic": llm.deterministic,
        "cuda_graphs": llm.engine.graphs.use_graphs, "overlap": llm.config.overlap,
        "tensor_parallel_size": llm.tp.size, "quantization": _weights_format(llm),
        "engine_config": asdict(llm.config),
    }
    for mod in ("transformers", "triton"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    return env


def _num(x: float) -> str:
    """Three significant figures or so, without scientific notation: 1234, 56.7, 0.0216."""
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}" if x >= 0.1 else f"{x:.3g}"


def _si(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _draft_params(m: torch.nn.Module) -> int:
    """DEFINITIONS["draft_params"]: every parameter the head uses, each counted once (Runtime's load log)."""
    return sum(p.numel() for p in m.parameters())


def _own_numel(m: torch.nn.Module, shared_with: torch.nn.Module) -> int:
    """Parameters of m that are not storage shared with `shared_with` (a head's borrowed embedding)."""
    theirs = {p.data_ptr() for p in shared_with.parameters()}
    return sum(p.numel() for p in {p.data_ptr(): p for p in m.parameters()}.values() if p.data_ptr() not in theirs)


def _device(name: str | None) -> torch.device:
    dev = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device; use --device cpu")
    return dev


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Progress:
    """Timestamped progress lines on stderr (stdout carries only the JSON)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {msg}", file=sys.stderr, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0
