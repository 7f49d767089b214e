"""Command line: `m3eagle generate`, `m3eagle serve`, `m3eagle bench`, `m3eagle bench-serve`, and the training /
eval stages.

Exit status: 0 on success; 2 for a usage error (argparse names the option) or a library error, which is
printed as one line on stderr (`m3eagle: error: ...`, no traceback; set M3EAGLE_TRACEBACK=1 to see it);
1 when stdout is closed early (`m3eagle generate ... | head -1`), quietly; 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

INT64_MAX = 2**63 - 1
MAX_BATCH = 1024


# ------------------------------------------------------------------------------------------------
# Option types: each checks its range, so argparse names the option in the error ("argument --seed: ...")
# ------------------------------------------------------------------------------------------------


def steps_arg(text: str) -> int | str:
    """--num-scheduler-steps: 'auto' or an integer from 1 to 64."""
    return "auto" if text == "auto" else int_in(1, 64)(text)


def int_in(lo: int, hi: int = INT64_MAX) -> Callable[[str], int]:
    """An argparse type: a base-10 integer in [lo, hi] (hi defaults to the int64 maximum the engine holds)."""

    def parse(text: str) -> int:
        try:
            v = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= v <= hi:
            top = "2**63 - 1" if hi == INT64_MAX else str(hi)
            raise argparse.ArgumentTypeError(f"{text} is out of range: give an integer from {lo} to {top}")
        return v

    return parse


def float_in(lo: float, hi: float = math.inf, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float in [lo, hi] ((lo, hi] when lo_open)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
            span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{']' if math.isfinite(hi) else ')'}"
            raise argparse.ArgumentTypeError(f"{text} is out of range: give a finite number in {span}")
        return v

    return parse


def batch_sizes(text: str) -> list[int]:
    """An argparse type: comma-separated batch sizes, each 1..MAX_BATCH ("1,8,32")."""
    parse = int_in(1, MAX_BATCH)
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated batch sizes such as 1,8,32")
    return [parse(p) for p in parts]


def device(text: str) -> str:
    """An argparse type: a torch device string that exists here (cpu, cuda, cuda:N)."""
    import torch

    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: torch sees no CUDA device here; use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text}: there are {torch.cuda.device_count()} CUDA devices "
                                             f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    elif dev.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text}: m3eagle runs on cpu or cuda")
    return text


DTYPES = ["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in every option's help; descriptions keep their line breaks."""


# ------------------------------------------------------------------------------------------------
# generate
# ------------------------------------------------------------------------------------------------


def _device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=device, default=None, help="cpu, cuda or cuda:N; none: cuda when available")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="weights and KV dtype; auto: bf16 on CUDA, "
                   "fp32 on CPU")
    p.add_argument("--max-num-tokens", type=int_in(1), default=2048,
                   help="token budget per step: the prompt chunk size of chunked prefill")
    p.add_argument("--page-size", type=int_in(1), default=16, help="KV page size in tokens")
    p.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                   help="overlap scheduler; auto: on for CUDA")
    p.add_argument("--attention-backend", choices=["auto", "reference", "triton", "triton_sparse_prefill",
                                                   "batch_invariant"], default="auto",
                   help="auto: triton on CUDA (batch_invariant under --deterministic), reference on CPU; "
                        "triton_sparse_prefill: triton with sparse prompt rows on the tiled kernel (not yet timed)")
    p.add_argument("--moe-backend", choices=["auto", "reference", "triton", "batch_invariant"], default="auto",
                   help="routed experts; auto: triton (chosen experts only) on CUDA (batch_invariant under "
                        "--deterministic), the dense reference on CPU")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: a request's output is the same alone or in any batch, chunking "
                        "or speculation, in bf16 on the GPU too (slower steps; not with MXFP8 weights)")
    p.add_argument("--structured-draft-masks", action="store_true",
                   help="structured output: mask the draft head with the grammar too (higher acceptance for a weak "
                        "head; each constrained step then reads back K+1 times and runs eagerly); default: drafts "
                        "unmasked, rejected by the masked target, constrained steps on CUDA graphs")
    p.add_argument("--quantization", "-q", choices=["fp8"], default=None,
                   help="fp8: quantize a bf16 target to MXFP8 at load (W8A16 kernels); none: the checkpoint's own "
                        "weights (the MXFP8 release stays MXFP8)")
    p.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="at startup, capture every CUDA-graph bucket and run dummy prompts of every chunk size and "
                        "sampling path once (Triton compiles and captures then, not on a request's first use); "
                        "default: on for `serve` on CUDA (/health answers 503 until it is done), else off")
    p.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="prompt and mixed steps of up to --max-prefill-graph-tokens replay CUDA graphs too "
                        "(row and token buckets, each captured on first use); default: on for one CUDA device")
    p.add_argument("--max-prefill-graph-tokens", type=int_in(16), default=2048,
                   help="the largest prompt / mixed step replayed as a CUDA graph (default: the default step "
                        "budget); larger ones run eagerly")
    p.add_argument("--num-scheduler-steps", type=steps_arg, default=1,
                   help="steady decode / verify steps run N at a time per host iteration (one plan, N graph "
                        "replays): for host-bound batches; same tokens, streamed N steps at a time. auto: 8 "
                        "for models of up to 1 GiB replaying CUDA graphs, else 1")
    p.add_argument("--tensor-parallel-size", "-tp", type=int_in(1, 1024), default=1,
                   help="split the target over N ranks (one per GPU; see docs/design/parallel.md)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="automatic prefix caching: a prompt whose leading full KV pages are cached from an "
                        "earlier request skips computing them")


def _make_llm(a: argparse.Namespace, warmup: bool | None = None):
    """The LLM of an engine command's flags; `warmup` overrides --warmup (None: the flag, off when unset)."""
    from m3eagle.entrypoints.llm import LLM

    overlap = None if a.overlap == "auto" else a.overlap == "on"
    extra = {k: getattr(a, k) for k in ("max_num_seqs", "num_pages", "gpu_memory_utilization")
             if getattr(a, k, None) is not None}
    model, draft, tokenizer = _model_of(a)
    if getattr(a, "draft_tree", None) is not None:
        extra["draft_tree"] = a.draft_tree
    if getattr(a, "tree_max_batch", None) is not None:
        extra["tree_max_batch"] = a.tree_max_batch
    return LLM(model=model, draft=draft, num_draft_tokens=a.num_draft_tokens, device=a.device,
               dtype=a.dtype, max_model_len=a.max_model_len, max_num_tokens=a.max_num_tokens,
               page_size=a.page_size, overlap=overlap, attention_backend=a.attention_backend,
               moe_backend=a.moe_backend, enforce_eager=a.enforce_eager,
               warmup=bool(a.warmup) if warmup is None else warmup,
               prefill_graphs=a.prefill_graphs, max_prefill_graph_tokens=a.max_prefill_graph_tokens,
               num_scheduler_steps=a.num_scheduler_steps, tensor_parallel_size=a.tensor_parallel_size,
               quantization=a.quantization, enable_prefix_caching=a.enable_prefix_caching,
               load_format=a.load_format, tokenizer=tokenizer, deterministic=a.deterministic,
               structured_draft_masks=a.structured_draft_masks, **extra)


def _model_of(a: argparse.Namespace) -> tuple[Any, Any, str | None]:
    """(model, draft, tokenizer) of --model / --draft / --tokenizer / --load-format: with --load-format dummy,
    --model may name a bench geometry (its config and random Eagle3 head; text through the embedded model's
    tokenizer where the geometry's vocabulary covers it, else token ids only). A geometry served with the
    embedded tokenizer takes that tokenizer's vocabulary: random weights sample every id alike, and ids past
    the tokenizer's would decode to no text (no stream events: TTFT would wait for an id it knows)."""
    from m3eagle.bench import geometries
    from m3eagle.loader.assets import ASSETS
    from m3eagle.loader.tokenizer import load_tokenizer

    if a.load_format != "dummy" or a.model not in geometries.NAMED:
        return a.model, a.draft, a.tokenizer
    if a.draft is not None:
        raise ValueError(f"--draft: the named geometry {a.model!r} brings its own random Eagle3 head; drop --draft")
    geo = geometries.resolve(a.model)
    if a.tokenizer is not None:
        return geo.model, geo.draft, a.tokenizer
    embedded = load_tokenizer(ASSETS / "target")
    v = embedded.tok.get_vocab_size() if embedded is not None else None
    if v is None or v > geo.model.vocab_size:
        return geo.model, geo.draft, None
    head = replace(geo.draft, vocab_size=v, draft_vocab_size=v) if geo.draft is not None else None
    return replace(geo.model, vocab_size=v), head, str(ASSETS / "target")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory or Hugging Face id (org/name); none: the "
                   "embedded model")
    p.add_argument("--draft", default=None, help="Eagle3 head directory; none: the embedded head when --model "
                   "is not given")
    p.add_argument("--num-draft-tokens", type=int_in(0, 8), default=None,
                   help="K drafts per step (0 disables speculation); none: 3 with a draft head")
    p.add_argument("--draft-tree", default=None, metavar="D,K,N",
                   help="draft a dynamic tree instead of the chain: depth D, the K best children per expanded node, "
                        "N nodes verified per step (e.g. 3,4,16; decode and prompt steps replay CUDA graphs; overlap "
                        "off unless --overlap on)")
    p.add_argument("--tree-max-batch", type=int_in(0), default=None, metavar="B",
                   help="with --draft-tree: steps of up to B rows verify the full tree, larger ones its first D "
                        "nodes (0: always the first D); none: chosen at startup from measured step costs")
    p.add_argument("--max-model-len", type=int_in(1), default=None,
                   help="longest prompt + output; none: min(model limit, 2048)")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="auto reads the weights; dummy builds random ones from the config alone (benchmarks); "
                        "then --model may also name a geometry: m3-mini, m3-8b, m3, tiny")
    p.add_argument("--tokenizer", default=None, help="a directory holding tokenizer.json to use instead of the "
                   "model's own")


def cmd_generate(a: argparse.Namespace) -> int:
    import logging

    from m3eagle.sampling.params import SamplingParams

    llm = _make_llm(a)
    if a.max_tokens > llm.config.max_model_len:
        # Not an error: each prompt simply ends at max_model_len ("length"); say so once rather than surprise.
        logging.getLogger("m3eagle").warning(
            "--max-tokens %d exceeds max_model_len=%d: outputs stop at max_model_len - prompt length tokens",
            a.max_tokens, llm.config.max_model_len)
    sp = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                        seed=a.seed, stop=a.stop or [], ignore_eos=a.ignore_eos, n=a.n, min_p=a.min_p,
                        presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                        repetition_penalty=a.repetition_penalty, min_tokens=min(a.min_tokens, a.max_tokens))
    t0 = time.perf_counter()
    outs = llm.generate(list(a.prompts), sp, use_tqdm=len(a.prompts) > 4 and not a.json)
    dt = time.perf_counter() - t0
    n = sum(len(c.token_ids) for o in outs for c in o.outputs)
    stats = llm.stats()
    if a.json:
        for o in outs:
            for c in o.outputs:  # one line per completion (n per prompt)
                print(json.dumps({"prompt": o.prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}))
        print(json.dumps({"tokens": n, "seconds": round(dt, 4), "tokens_per_s": round(n / dt, 2), **stats}))
        return 0
    for o in outs:
        for c in o.outputs:
            print(f"{o.prompt}{c.text}")
            print("-" * 40)
    print(f"{n} tokens in {dt:.2f}s: {n / dt:.1f} tokens/s", file=sys.stderr)
    if llm.config.num_draft_tokens:
        print(f"speculation K={llm.config.num_draft_tokens}: acceptance rate {stats['acceptance_rate']:.3f}, "
              f"mean acceptance length {stats['mean_acceptance_length']:.3f}, per position "
              f"{[round(x, 3) for x in stats['per_position_rates']]}", file=sys.stderr)
    return 0


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompts", nargs="+", help="prompt texts")
    _model_args(g)
    _device_args(g)
    g.add_argument("--max-tokens", type=int_in(1), default=64, help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float_in(0.0), default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float_in(0.0, 1.0, lo_open=True), default=1.0, help="nucleus mass")
    g.add_argument("--top-k", type=int_in(-1), default=0, help="keep the k likeliest tokens; 0 or -1: off")
    g.add_argument("--seed", type=int_in(0), default=None, help="per-request seed; none: random")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g.add_argument("--n", type=int_in(1, 64), default=1, help="samples per prompt (they share its KV pages)")
    g.add_argument("--min-p", type=float_in(0.0, 1.0), default=0.0,
                   help="drop tokens below min_p x the top token's probability; 0: off")
    g.add_argument("--repetition-penalty", type=float_in(0.0, lo_open=True), default=1.0,
                   help="divide positive / multiply negative logits of prompt and output tokens; 1: off")
    g.add_argument("--presence-penalty", type=float_in(-2.0, 2.0), default=0.0,
                   help="subtract from the logit of every token already output; 0: off")
    g.add_argument("--frequency-penalty", type=float_in(-2.0, 2.0), default=0.0,
                   help="subtract per occurrence in the output; 0: off")
    g.add_argument("--min-tokens", type=int_in(0), default=0, help="hold EOS and stop tokens back this long")
    g.add_argument("--json", action="store_true", help="one JSON line per output, then a summary line")
    g.set_defaults(func=cmd_generate)


# ------------------------------------------------------------------------------------------------
# bench
# ------------------------------------------------------------------------------------------------


def _report(a: argparse.Namespace, run, format_table) -> int:
    """The benchmarks' output contract: a table on stderr, the JSON document on stdout or in --json FILE."""
    if a.json and not Path(a.json).resolve().parent.is_dir():
        raise ValueError(f"--json {a.json}: directory {Path(a.json).resolve().parent} does not exist")
    doc = run(a)
    print("\n" + format_table(doc), file=sys.stderr)
    text = json.dumps(doc, indent=1)
    if a.json:
        Path(a.json).write_text(text + "\n")
        print(f"wrote {a.json}", file=sys.stderr)
    else:
        print(text)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from m3eagle.bench.offline import format_table, run_bench

    return _report(a, run_bench, format_table)


def _add_bench(sub) -> None:
    b = sub.add_parser(
        "bench", help="throughput, per-step cost and the memory roofline, plain and speculative",
        description="Benchmark one model geometry in one process: HBM copy bandwidth; tok/s plain and with\n"
                    "speculation per batch size (median of --repeats); the cost of one steady decode step (wall,\n"
                    "host, GPU busy, kernels); bytes per step, MBU and the roofline; optionally transformers'\n"
                    "generate on the same weights. Progress and a table go to stderr, the JSON document to\n"
                    "stdout (or --json FILE).\n\n"
                    "Geometries: embedded (the trained 9M model + Eagle3 head), m3-mini (2.38B params, 0.62B\n"
                    "active), m3-8b (~10B, ~4.1B active), m3 (MiniMax-M3's real layer shapes, --num-layers N of\n"
                    "its 60), tiny (a CPU smoke test), or a checkpoint DIR. Named\n"
                    "geometries get random seeded weights built on the device; nothing touches the disk.")
    b.add_argument("--geometry", "--model", default="embedded", metavar="NAME|DIR",
                   help="embedded | m3-mini | m3-8b | m3 | tiny | a checkpoint directory")
    b.add_argument("--num-layers", type=int_in(4, 60), default=None,
                   help="for --geometry m3: keep its first N layers (3 dense, then MoE)")
    b.add_argument("--draft", default=None, help="Eagle3 head directory for --geometry DIR")
    b.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="for embedded / DIR: auto reads the weights, dummy uses random ones (named geometries are "
                        "always random)")
    b.add_argument("--num-draft-tokens", type=int_in(0, 8), default=None,
                   help="K for the speculative runs (0: plain only); none: 3 when there is a head")
    b.add_argument("--draft-tree", default=None, metavar="D,K,N",
                   help="the speculative runs draft a dynamic tree (depth D, K children per expanded node, N nodes "
                        "verified) instead of the chain; trees run without overlap unless --overlap on")
    b.add_argument("--tree-max-batch", type=int_in(0), default=None, metavar="B",
                   help="with --draft-tree: steps of up to B rows verify the full tree, larger ones its first D nodes "
                        "(0: always the first D); none: chosen at startup from measured step costs")
    _device_args(b)
    b.add_argument("--batch-sizes", type=batch_sizes, default="1,8,32", help="comma-separated batch sizes")
    b.add_argument("--prompt-len", type=int_in(1), default=128, help="prompt tokens per request")
    b.add_argument("--max-tokens", "--output-len", type=int_in(1), default=32, help="generated tokens per request")
    b.add_argument("--repeats", "--num-batches", type=int_in(1), default=5,
                   help="timed batches per configuration, after one warm-up batch")
    b.add_argument("--decode-steps", type=int_in(1), default=10, help="steady-state steps timed per configuration")
    b.add_argument("--profile-steps", type=int_in(1), default=3, help="steady-state steps under the profiler")
    b.add_argument("--kernel-table", type=int_in(0), default=0, metavar="N",
                   help="print the N kernels with the most GPU time per steady step (the JSON always holds 40)")
    b.add_argument("--compare-hf", action="store_true",
                   help="also time transformers' generate at batch 1 on the same weights")
    b.add_argument("--bandwidth-gib", type=float_in(0.0, 64.0, lo_open=True), default=4.0,
                   help="buffer size of the HBM copy-bandwidth measurement (GiB; capped at 1/16 on CPU)")
    b.add_argument("--seed", type=int_in(0), default=0, help="prompt sampling seed")
    b.add_argument("--json", metavar="FILE", default=None, help="write the JSON document here instead of stdout")
    b.set_defaults(func=cmd_bench)


# ------------------------------------------------------------------------------------------------
# serve
# ------------------------------------------------------------------------------------------------


def cmd_serve(a: argparse.Namespace) -> int:
    from m3eagle.entrypoints.server import OpenAIServer, run_server
    from m3eagle.entrypoints.server.app import bind_socket, resolve_api_key

    bind_socket(a.host, a.port).close()  # a taken port fails now, in one line, not after the model loads
    template = None
    if a.chat_template is not None:
        try:
            template = Path(a.chat_template).read_text()
        except OSError as e:
            raise ValueError(f"--chat-template {a.chat_template}: cannot read it ({e.strerror})") from None
    llm = _make_llm(a, warmup=False)  # the server warms up once it listens, so /health can say 503 meanwhile
    # On by default on CUDA: a fresh server's first steps of each graph bucket otherwise pay Triton compiles
    # and captures (a p99 TTFT of 0.9-2 s at concurrency 8-32); a CPU has neither.
    warmup = a.warmup if a.warmup is not None else llm.device.type == "cuda"
    server = OpenAIServer(llm, served_model_name=a.served_model_name, log_interval=a.log_interval,
                          api_key=resolve_api_key(a.api_key), max_request_body_bytes=a.max_request_body_bytes,
                          tool_call_parser=a.tool_call_parser, reasoning_parser=a.reasoning_parser,
                          enable_auto_tool_choice=a.enable_auto_tool_choice, chat_template=template, warmup=warmup)
    run_server(server, a.host, a.port, shutdown_timeout=a.shutdown_timeout, log_level=a.uvicorn_log_level,
               access_log=a.access_log, switch_interval=a.switch_interval)
    return 0


def _add_serve(sub) -> None:
    s = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
        description="Serve one model over HTTP: GET /health, GET /v1/models, POST /v1/completions, POST\n"
                    "/v1/chat/completions (stream: true for server-sent events), GET /metrics (Prometheus),\n"
                    "POST /tokenize, POST /detokenize, GET /version, POST /reset_prefix_cache.\n"
                    "SIGTERM drains: new requests get 503, in-flight ones finish (up to --shutdown-timeout; then\n"
                    "they are answered 503 / an error event), then the process exits.")
    _model_args(s)
    _device_args(s)
    s.add_argument("--max-num-seqs", type=int_in(1, MAX_BATCH), default=64, help="requests in the running batch")
    s.add_argument("--num-pages", type=int_in(0), default=0,
                   help="KV pages; 0: sized from device memory on a GPU (--gpu-memory-utilization), else from "
                        "--max-num-seqs and --max-model-len")
    s.add_argument("--gpu-memory-utilization", type=float_in(0.0, 1.0, lo_open=True), default=0.9,
                   help="share of the GPU's memory this process may use; the KV pool gets what the weights and "
                        "the activation reserve leave of it")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int_in(0, 65535), default=8000, help="port to listen on (0: a free one)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1 route and /reset_prefix_cache (401 "
                        "otherwise; /health, /metrics and /version stay open); none: $M3EAGLE_API_KEY, else no key")
    s.add_argument("--max-request-body-bytes", type=int_in(1), default=16 * 2**20,
                   help="larger request bodies get a 413 before they are parsed")
    s.add_argument("--tool-call-parser", choices=["minimax_m3", "none"], default="minimax_m3",
                   help="parse tool calls in chat replies into tool_calls (MiniMax-M3's format); none: off")
    s.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                   help="allow tool_choice 'auto' (the model decides whether to call a tool)")
    s.add_argument("--reasoning-parser", choices=["minimax_m3", "none"], default="minimax_m3",
                   help="return <mm:think> reasoning as reasoning_content, apart from content; none: off")
    s.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a jinja chat template to use instead of the model's")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send; none: --model as given, or m3eagle-default")
    s.add_argument("--log-interval", type=float_in(0.0), default=10.0,
                   help="seconds between stats log lines (throughput, queue, KV usage, acceptance); 0: off")
    s.add_argument("--shutdown-timeout", type=float_in(0.0), default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before aborting them (503, or an "
                        "error event ending a stream)")
    s.add_argument("--uvicorn-log-level", choices=["critical", "error", "warning", "info", "debug"],
                   default="info", help="uvicorn's own log level")
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    s.add_argument("--switch-interval", type=float_in(0.0, 0.1), default=0.001,
                   help="GIL switch interval in seconds (HTTP and the engine thread share one process); 0: "
                        "Python's default (5 ms)")
    s.set_defaults(func=cmd_serve)


# ------------------------------------------------------------------------------------------------
# bench-serve
# ------------------------------------------------------------------------------------------------


def cmd_bench_serve(a: argparse.Namespace) -> int:
    from m3eagle.bench.serve import format_table, run_bench_serve

    return _report(a, run_bench_serve, format_table)


def _add_bench_serve(sub) -> None:
    b = sub.add_parser(
        "bench-serve", help="load-test an OpenAI-compatible server (m3eagle, vLLM, SGLang): TTFT, TPOT, ITL",
        description="Send --num-prompts streaming requests to an OpenAI-compatible server, Poisson at\n"
                    "--request-rate or at most --max-concurrency at a time, with set input and output lengths\n"
                    "(random token ids or held-out stdlib code). Reports TTFT, TPOT and ITL (mean, p50, p90,\n"
                    "p99), request and token throughput, and the server's speculative acceptance read from its\n"
                    "/metrics. A table goes to stderr, the JSON document to stdout (or --json FILE).")
    b.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL")
    b.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"],
                   help="completions get token-id prompts (exact lengths); chat gets their text")
    b.add_argument("--model", default=None, help="model name to send; none: the first of GET /v1/models")
    b.add_argument("--dataset", choices=["random", "stdlib", "tools", "json", "prefix", "multiturn"],
                   default="stdlib",
                   help="random token ids, or windows of held-out stdlib code; tools / json: those windows as chat "
                        "requests with a tools list / a response_format json_schema; prefix: one shared "
                        "--prefix-len window before each request's own --input-len window; multiturn: chat "
                        "conversations of --turns turns, each turn resending the conversation so far (the "
                        "server's replies included) plus a new window")
    b.add_argument("--turns", type=int_in(1), default=4, help="for --dataset multiturn: requests per conversation")
    b.add_argument("--prefix-len", type=int_in(0), default=0,
                   help="for --dataset prefix: the tokens every prompt shares before its own --input-len")
    b.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory with the served model's tokenizer.json; none: the embedded model's")
    b.add_argument("--input-len", type=int_in(1), default=128, help="prompt tokens per request")
    b.add_argument("--output-len", type=int_in(1), default=64, help="generated tokens per request")
    b.add_argument("--num-prompts", type=int_in(1), default=100, help="measured requests")
    b.add_argument("--request-rate", type=float_in(0.0, lo_open=True), default=math.inf,
                   help="Poisson arrival rate (requests/s); inf: send all at once")
    b.add_argument("--max-concurrency", type=int_in(1), default=None, help="most requests in flight; none: no limit")
    b.add_argument("--client-processes", type=int_in(0), default=0,
                   help="client processes sending the measured requests (each its own event loop and connections); "
                        "0: one per 4 requests in flight, up to half the cores")
    b.add_argument("--temperature", type=float_in(0.0), default=0.0, help="sampling temperature (0: greedy)")
    b.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (output lengths then vary)")
    b.add_argument("--warmup", type=int_in(0), default=2, help="unmeasured requests sent first, one at a time")
    b.add_argument("--timeout", type=float_in(0.0, lo_open=True), default=600.0, help="seconds per request")
    b.add_argument("--seed", type=int_in(0), default=0, help="prompt and arrival seed")
    b.add_argument("--label", default=None, help="free text stored in the JSON (e.g. the server's settings)")
    b.add_argument("--json", metavar="FILE", default=None, help="write the JSON document here instead of stdout")
    b.set_defaults(func=cmd_bench_serve)


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from m3eagle.entrypoints.logging_setup import ENV_LEVEL, LEVELS
    from m3eagle.version import __version__

    p = argparse.ArgumentParser(prog="m3eagle", description=__doc__, formatter_class=_Formatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--log-level", type=str.upper, choices=LEVELS, default=None,
                   help=f"the m3eagle logger's level; none: ${ENV_LEVEL} or INFO")
    sub = p.add_subparsers(dest="cmd", required=True,
                           parser_class=functools.partial(argparse.ArgumentParser, formatter_class=_Formatter))
    _add_generate(sub)
    _add_serve(sub)
    _add_bench(sub)
    _add_bench_serve(sub)
    try:
        from m3eagle.training.cli import add_training_subcommands

        add_training_subcommands(sub)
    except ImportError:  # training extras are optional
        pass
    return p


def _is_library_error(e: BaseException) -> bool:
    """Errors a user can cause with input, a file or the machine: shown as one line, not a traceback.

    ValueError covers m3eagle's own (RequestError, SamplingParamsError, ConfigError, CheckpointError);
    OSError files and pipes; RuntimeError torch's device errors (bad ordinal, out of memory);
    SafetensorError a damaged shard; ImportError a missing optional extra (`eval --plot` without
    matplotlib names the extra to install); a bare Exception is what the tokenizers library raises."""
    from safetensors import SafetensorError

    return isinstance(e, (ValueError, OSError, RuntimeError, OverflowError, ImportError, SafetensorError)) \
        or type(e) is Exception


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.log_level is not None:
        from m3eagle.entrypoints.logging_setup import set_level

        set_level(a.log_level)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        rc = a.func(a) or 0
        sys.stdout.flush()  # a closed pipe surfaces here, inside the handler, not at interpreter exit
        return rc
    except BrokenPipeError:
        # The reader went away (`| head -1`). As the Python docs recommend: point stdout at devnull so the
        # interpreter's final flush stays quiet, and exit 1 as Python does on EPIPE.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a real file (captured in tests)
            pass
        return 1
    except KeyboardInterrupt:
        print("m3eagle: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not _is_library_error(e) or os.environ.get("M3EAGLE_TRACEBACK"):
            raise
        msg = " ".join(str(e).split()) or type(e).__name__
        if not isinstance(e, (ValueError, ImportError)):  # m3eagle's own messages stand alone; others get their kind
            msg = f"{type(e).__name__}: {msg}"
        print(f"m3eagle: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
