"""`m3eagle bench-serve`: a load generator for any OpenAI-compatible server (m3eagle, vLLM, SGLang).

A run, in order:
  1. Prompts of exactly `--input-len` tokens: seeded random token ids, or windows of held-out text (the
     stdlib's top-level modules, which the embedded model never trained on), tokenized with --tokenizer
     (default: the embedded model's). /v1/completions receives them as token ids, so the server sees the
     set length; /v1/chat/completions receives their text. Two chat workloads send the stdlib windows to
     /v1/chat/completions with more than text: `tools` (a `tools` list the model may call, tool_choice
     auto) and `json` (a `response_format` json_schema the reply must match).
  2. `--warmup` requests one at a time (not measured), then a /metrics scrape.
  3. `--num-prompts` streaming requests: arrivals Poisson at `--request-rate` (inf: all at once), at most
     `--max-concurrency` in flight. Every request asks for `--output-len` tokens with EOS ignored
     (`ignore_eos`, an extra field vLLM and SGLang accept too), so output lengths are set.
  4. A second /metrics scrape: the speculative acceptance, the prefix-cache hit rate and the server's own TTFT
     histogram of the measured window, when the server exports vLLM-style `*spec_decode_*` / `*prefix_cache_*`
     counters and `*time_to_first_token_seconds` (the gap to the client's TTFT is HTTP, the event loop and
     the client itself).
  5. A table (stderr) and a JSON document (stdout or --json FILE); `DEFINITIONS` travels inside it.

Each client process runs one `httpx.AsyncClient` (a connection pool sized to its most requests in flight, per-
operation timeouts and a per-request deadline, TLS for https), its connections opened before the measured window
(`open_connections`); server-sent events are read line by line as they arrive and timed on arrival.
`--client-processes` spreads the measured requests over spawned processes (by default one per REQUESTS_PER_PROCESS
requests in flight, up to half the cores), since one Python process parsing events saturates its core before a fast
server does. /metrics is parsed with prometheus_client's text parser, percentiles
with numpy. The command's options are defined by the CLI (`m3eagle.entrypoints.cli`); this module reads them from
the argparse namespace it is given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import queue
import random
import ssl
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

SCHEMA = "m3eagle.bench_serve/1"
EMBEDDED_TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "default" / "target"

DEFINITIONS = {
    "ttft_ms": "time to first token: request sent -> first streamed event carrying output (text; in chat also "
               "reasoning_content or tool_calls)",
    "tpot_ms": "time per output token after the first, per request: (e2e - ttft) / (output tokens - 1)",
    "itl_ms": "inter-token latency: gaps between consecutive text-carrying events of a request (one event may "
              "carry several tokens under speculation), pooled over requests",
    "e2e_ms": "request sent -> stream finished",
    "request_throughput": "completed requests / duration (first request sent -> last one finished)",
    "output_throughput": "output tokens (the server's usage.completion_tokens, else one per event) / duration",
    "total_token_throughput": "(prompt tokens, the server's usage.prompt_tokens when given, + output tokens) / "
                              "duration",
    "acceptance": "from the server's /metrics counters over the measured window: rate = accepted / drafted "
                  "tokens, mean_acceptance_length = 1 + accepted / drafts (verify steps), per_position = accepted "
                  "at draft position i / drafts; null when the server exports no spec_decode counters",
    "requests": "each measured request in the order sent: sent_ms after the measured run began, its TTFT and e2e, "
                "prompt and output tokens (where a tail comes from: a burst of arrivals, the first requests)",
    "prefix_cache": "from the server's /metrics prefix_cache_queries / _hits counters over the measured window: "
                    "prompt tokens looked up in the prefix cache, those found, hit_rate = found / looked up; null "
                    "when the server exports neither counter",
    "server_ttft": "the server's time_to_first_token_seconds histogram over the measured window (its own clock: "
                   "request queued after tokenizing -> the step that made the first token): count, counts per "
                   "bucket upper bound in ms, and p50 / p90 / p99 interpolated within buckets as Prometheus' "
                   "histogram_quantile does; null when the server exports no such histogram",
    "server_queue": "as server_ttft, from request_queue_time_seconds: queued -> the first step that scheduled the "
                    "request (it waited for room)",
    "server_prefill": "as server_ttft, from request_prefill_time_seconds: the first step that scheduled the "
                      "request -> its first token. server_queue + server_prefill is the TTFT inside the engine",
    "client": "the load generator: processes (client processes that sent the measured requests), cpu_s (their user + "
              "system seconds over the measured run) and utilization = the busiest process's cpu_s / duration; near "
              "1.0 a client process saturates its core and its latencies include its own queueing",
}


# ------------------------------------------------------------------------------------------------
# Prompts (tokenizers only: the client needs no torch)
# ------------------------------------------------------------------------------------------------


def load_tokenizer(directory: str | Path | None):
    from tokenizers import Tokenizer

    d = Path(directory) if directory else EMBEDDED_TOKENIZER
    f = d / "tokenizer.json"
    if not f.is_file():
        raise ValueError(f"--tokenizer {d}: no tokenizer.json there; give the served model's directory")
    return Tokenizer.from_file(str(f))


CHAT_ENDPOINT = "/v1/chat/completions"
BENCH_TOOLS = [
    {"type": "function", "function": {"name": "run_tests", "description": "Run a module's unit tests",
                                      "parameters": {"type": "object", "properties": {
                                          "module": {"type": "string"}, "verbose": {"type": "boolean"}},
                                          "required": ["module"]}}},
    {"type": "function", "function": {"name": "search_docs", "description": "Search the documentation",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string"}, "limit": {"type": "integer"}},
                                          "required": ["query"]}}},
]
BENCH_SCHEMA = {"type": "object", "properties": {"summary": {"type": "string"},
                                                 "functions": {"type": "array", "items": {"type": "string"}},
                                                 "lines": {"type": "integer"}},
                "required": ["summary", "functions", "lines"], "additionalProperties": False}
# The workloads that only chat carries, and the instruction each puts before its code window.
CHAT_DATASETS = {"tools": "Check this code with the tools you have:\n",
                 "json": "Describe this code as JSON (summary, functions, lines):\n",
                 "multiturn": "Go on with this code:\n"}


def endpoint_of(a: argparse.Namespace) -> str:
    """The endpoint a run uses: the tools / json workloads are chat requests whatever --endpoint says."""
    return CHAT_ENDPOINT if a.dataset in CHAT_DATASETS else a.endpoint


def make_prompts(tok, dataset: str, n: int, length: int, seed: int, prefix_len: int = 0) -> list[list[int]]:
    """n prompts of exactly `length` token ids; dataset "prefix": each is one shared `prefix_len`-token stdlib
    window followed by its own `length`-token window (prefix_len + length ids), the shape of agents' and chat's
    repeated system prompt + tool definitions + conversation."""
    if dataset == "multiturn":  # one stdlib window per user turn (bench-serve chains them into conversations)
        dataset = "stdlib"
    if dataset == "prefix":
        if prefix_len < 1:
            raise ValueError("--dataset prefix needs --prefix-len N (the shared prefix's tokens), N >= 1")
        shared = make_prompts(tok, "stdlib", 1, prefix_len, seed + 7919)[0]
        return [shared + p for p in make_prompts(tok, "stdlib", n, length, seed)]
    rng = random.Random(seed)
    if dataset == "random":
        special = set(tok.get_added_tokens_decoder())
        ids = [i for i in range(tok.get_vocab_size()) if i not in special]
        return [rng.choices(ids, k=length) for _ in range(n)]
    files = [f for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")) if f.stat().st_size >= length + 8]
    rng.shuffle(files)
    pool: list[list[int]] = []
    for f in files:
        if len(pool) >= n:
            break
        ids = tok.encode(f.read_text(errors="ignore"), add_special_tokens=False).ids
        if len(ids) >= length + 8:
            pool.append(ids)
    if not pool:
        raise ValueError(f"--input-len {length} is longer than any stdlib module; lower it or use --dataset random")
    out = []
    for i in range(n):
        ids = pool[i] if i < len(pool) else rng.choice(pool)
        s = rng.randrange(0, len(ids) - length)
        out.append(ids[s:s + length])
    return out


# ------------------------------------------------------------------------------------------------
# The HTTP client (httpx)
# ------------------------------------------------------------------------------------------------


def base_url(url: str) -> str:
    """--base-url checked and normalised to scheme://host:port[/prefix] (a prefix: behind a proxy, say)."""
    try:
        u = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        u = None
    if u is None or u.scheme not in ("http", "https") or not u.host:
        raise ValueError(f"--base-url {url!r}: give http://HOST:PORT (or https://)")
    host = f"[{u.host}]" if ":" in u.host else u.host
    return f"{u.scheme}://{host}:{u.port or (443 if u.scheme == 'https' else 80)}{u.path.rstrip('/')}"


def make_client(url: str, timeout: float, connections: int) -> httpx.AsyncClient:
    """One client for the run: a connection pool as large as the most requests in flight (so no request waits
    for a connection), `timeout` seconds for each connect / read / write, TLS for https against the system's
    CA store. Proxy settings of the environment are ignored: the load goes straight to the server."""
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout), trust_env=False,
                             verify=ssl.create_default_context() if url.startswith("https:") else True,
                             limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


async def get_text(client: httpx.AsyncClient, path: str) -> tuple[int, str]:
    try:
        r = await client.get(path)
    except httpx.TransportError as e:
        raise OSError(f"cannot reach {client.base_url} ({type(e).__name__}: {e}); is the server running?") from None
    return r.status_code, r.text


# Connections opened ahead of the measured window: past this many in flight, the rest open as they go.
MAX_PREOPENED = 256


async def open_connections(client: httpx.AsyncClient, n: int) -> None:
    """Leave `n` keep-alive connections in the client's pool before the measured window, each opened by a
    `GET /v1/models` (a route no engine step serves) whose body is read only once all of them have connected (a
    connection goes back to the pool when its body is read). Otherwise each client's first request pays its TCP
    connect and httpx's first-use imports (anyio's backend: tens of ms with the event loop blocked), and the
    requests queued behind it wait too: a TTFT tail the server never made."""
    async with contextlib.AsyncExitStack() as held:
        responses = [await held.enter_async_context(client.stream("GET", "/v1/models"))
                     for _ in range(min(n, MAX_PREOPENED))]
        for r in responses:
            await r.aread()


# ------------------------------------------------------------------------------------------------
# One request
# ------------------------------------------------------------------------------------------------


@dataclass
class Result:
    prompt_len: int
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    text: str = ""  # the streamed reply (a multi-turn conversation sends it back in its next turn)
    sent: float = 0.0  # time.perf_counter() when the request was sent


def payload(endpoint: str, model: str, ids: list[int], text: str, a: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": a.output_len, "temperature": a.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if a.ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "/v1/completions":
        body["prompt"] = ids
    else:
        body["messages"] = [{"role": "user", "content": CHAT_DATASETS.get(a.dataset, "") + text}]
    if a.dataset == "tools":
        body.update(tools=BENCH_TOOLS, tool_choice="auto")
    elif a.dataset == "json":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "code_summary", "schema": BENCH_SCHEMA, "strict": True}}
    return body


async def run_one(client: httpx.AsyncClient, endpoint: str, body: dict[str, Any], prompt_len: int,
                  timeout: float) -> Result:
    """One streamed request: every server-sent `data:` line is timed as it arrives; a line whose choices
    carry output (text, reasoning, a tool call) is a token event (TTFT is the first, ITL the gaps between them)."""
    res = Result(prompt_len)
    t0 = res.sent = time.perf_counter()
    times: list[float] = []
    pieces: list[str] = []
    usage = None
    try:
        async with asyncio.timeout(timeout), client.stream("POST", endpoint, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank lines end events; comments and other fields carry nothing timed
                data = line[5:].strip()
                if data == "[DONE]":
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message", obj["error"]))
                    continue
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or []:
                    if "text" in ch:
                        piece = ch["text"]
                        produced = bool(piece)
                    else:  # chat: reasoning and tool calls are output too, though only content is the reply's text
                        delta = ch.get("delta") or {}
                        piece = delta.get("content")
                        produced = bool(piece or delta.get("reasoning_content") or delta.get("tool_calls"))
                    if produced:
                        times.append(time.perf_counter())
                    if piece:
                        pieces.append(piece)
    except TimeoutError:
        res.error = f"timed out after {timeout:g} s"
    except httpx.TimeoutException as e:
        res.error = f"timed out ({type(e).__name__}, {timeout:g} s per read)"
    except (httpx.HTTPError, OSError, ValueError) as e:  # transport and protocol errors, a bad JSON event
        res.error = f"{type(e).__name__}: {e}"
    res.e2e = time.perf_counter() - t0
    res.text = "".join(pieces)
    if res.error is None and times:
        res.ok = True
        res.ttft = times[0] - t0
        res.itl = [b - a for a, b in zip(times, times[1:])]
        res.output_tokens = int(usage["completion_tokens"]) if usage else len(times)
        if usage and usage.get("prompt_tokens"):  # chat prompts grow by the template
            res.prompt_len = int(usage["prompt_tokens"])
    elif res.error is None:
        res.error = "the stream carried no text"
    return res


# ------------------------------------------------------------------------------------------------
# /metrics
# ------------------------------------------------------------------------------------------------


SPEC_COUNTERS = {"spec_decode_num_drafts_total": "drafts", "spec_decode_num_draft_tokens_total": "draft_tokens",
                 "spec_decode_num_accepted_tokens_total": "accepted"}
PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"


def _samples(text: str) -> list[Any] | None:
    """Every sample of a Prometheus text page; None when it is not Prometheus text (an HTML or JSON error page)."""
    try:
        return [s for family in text_string_to_metric_families(text) for s in family.samples]
    except ValueError:
        return None


def _sums(samples: list[Any], counters: dict[str, str]) -> tuple[dict[str, float], bool]:
    """Per key of `counters` (sample-name suffix -> key), the sum over all label sets; and whether any was seen."""
    out = dict.fromkeys(counters.values(), 0.0)
    seen = False
    for s in samples:
        key = next((k for suffix, k in counters.items() if s.name.endswith(suffix)), None)
        if key is not None:
            out[key] += s.value
            seen = True
    return out, seen


def spec_counters(text: str) -> dict[str, Any] | None:
    """Sums of vLLM-style spec_decode counters (any prefix: m3eagle:, vllm:) in a Prometheus text page,
    over all label sets; None when the page holds none (or is not Prometheus text)."""
    samples = _samples(text)
    if samples is None:
        return None
    sums, seen = _sums(samples, SPEC_COUNTERS)
    per_pos: dict[int, float] = {}
    for s in samples:
        if s.name.endswith(PER_POS) and "position" in s.labels:
            pos = int(s.labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + s.value
    return {**sums, "per_pos": per_pos} if seen else None


def acceptance(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    if d["drafts"] <= 0:
        return None
    per = [(after["per_pos"].get(j, 0.0) - before["per_pos"].get(j, 0.0)) / d["drafts"]
           for j in sorted(after["per_pos"])]
    return {"num_drafts": int(d["drafts"]), "num_draft_tokens": int(d["draft_tokens"]),
            "num_accepted_tokens": int(d["accepted"]), "acceptance_rate": d["accepted"] / max(d["draft_tokens"], 1),
            "mean_acceptance_length": 1 + d["accepted"] / d["drafts"], "per_position": per}


PREFIX_COUNTERS = {"prefix_cache_queries_total": "queries", "prefix_cache_hits_total": "hits"}


def prefix_counters(text: str) -> dict[str, float] | None:
    """Sums of vLLM-style prefix_cache_queries / _hits counters (prompt tokens looked up / found; any prefix) in a
    Prometheus text page; None when the page holds neither (a server without the cache, or not Prometheus)."""
    samples = _samples(text)
    if samples is None:
        return None
    sums, seen = _sums(samples, PREFIX_COUNTERS)
    return sums if seen else None


def prefix_cache(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """The measured window's prompt tokens looked up / found in the server's prefix cache, and their ratio."""
    if before is None or after is None:
        return None
    q, h = after["queries"] - before["queries"], after["hits"] - before["hits"]
    return {"queried_tokens": int(q), "hit_tokens": int(h), "hit_rate": h / q if q > 0 else None}


TTFT_HISTOGRAM = "time_to_first_token_seconds"
# The JSON's server-side latency entries and the server histograms they come from (vLLM's names, any prefix):
# TTFT, and its two parts inside the engine (waiting for room, then the prompt's steps to the first token).
SERVER_HISTOGRAMS = {"server_ttft": TTFT_HISTOGRAM, "server_queue": "request_queue_time_seconds",
                     "server_prefill": "request_prefill_time_seconds"}


def histogram_buckets(text: str, name: str) -> dict[float, float] | None:
    """The server's histogram `name` (any prefix): cumulative count per bucket upper bound in seconds (+inf
    included), summed over label sets; None when the page holds none (or is not Prometheus text)."""
    samples = _samples(text)
    if samples is None:
        return None
    out: dict[float, float] = {}
    for s in samples:
        if s.name.endswith(name + "_bucket") and "le" in s.labels:
            le = float(s.labels["le"])
            out[le] = out.get(le, 0.0) + s.value
    return out or None


def ttft_buckets(text: str) -> dict[float, float] | None:
    """The server's TTFT histogram (`histogram_buckets` of time_to_first_token_seconds)."""
    return histogram_buckets(text, TTFT_HISTOGRAM)


def histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: the q-quantile of a histogram given as sorted (upper bound, cumulative
    count) pairs, +inf last, interpolated linearly inside its bucket (the first bucket from 0); a quantile in
    the +inf bucket is the largest finite bound. None for an empty histogram."""
    total = cumulative[-1][1] if cumulative else 0.0
    if total <= 0:
        return None
    rank = q * total
    lo_bound, lo_count = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if math.isinf(bound):
                return lo_bound
            if count == lo_count:
                return bound
            return lo_bound + (bound - lo_bound) * (rank - lo_count) / (count - lo_count)
        lo_bound, lo_count = bound, count
    return lo_bound


def server_ttft(before: dict[float, float] | None, after: dict[float, float] | None) -> dict[str, Any] | None:
    """The measured window of a server-side latency histogram (after - before; TTFT, queue or prefill time):
    count, per-bucket counts (ms bound -> requests that fell in it) and interpolated p50 / p90 / p99 in ms; None
    without a histogram."""
    if after is None:
        return None
    before = before or {}
    cum = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    if not cum or cum[-1][1] <= 0:
        return None
    buckets, prev = {}, 0.0
    for le, c in cum:
        if c - prev > 0:
            buckets["inf" if math.isinf(le) else f"{le * 1e3:g}"] = int(round(c - prev))
        prev = c
    out: dict[str, Any] = {"count": int(round(cum[-1][1])), "buckets_ms": buckets}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        v = histogram_quantile(q, cum)
        out[name] = None if v is None else v * 1e3
    return out


async def scrape(client: httpx.AsyncClient) -> tuple[dict[str, Any] | None, dict[str, float] | None,
                                                     dict[str, dict[float, float] | None]]:
    """(spec_decode counters, prefix-cache counters, {SERVER_HISTOGRAMS key: histogram}) of the server's /metrics
    page, each None when absent."""
    status, text = await get_text(client, "/metrics")
    if status != 200:
        return None, None, dict.fromkeys(SERVER_HISTOGRAMS)
    return (spec_counters(text), prefix_counters(text),
            {key: histogram_buckets(text, name) for key, name in SERVER_HISTOGRAMS.items()})


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------


def percentiles(xs: list[float], scale: float = 1e3) -> dict[str, float | None]:
    """Mean, p50, p90 and p99 of xs x scale (linearly interpolated percentiles); None each when xs is empty."""
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = np.asarray(xs, dtype=np.float64) * scale
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


async def _bench(a: argparse.Namespace) -> dict[str, Any]:
    url = base_url(a.base_url)
    async with make_client(url, a.timeout, a.max_concurrency or a.num_prompts) as client:
        status, text = await get_text(client, "/v1/models")
        if status != 200:
            raise OSError(f"GET {url}/v1/models answered {status}: {text[:200]}")
        model = a.model or json.loads(text)["data"][0]["id"]
        tok = load_tokenizer(a.tokenizer)
        prompts = make_prompts(tok, a.dataset, a.warmup + a.num_prompts, a.input_len, a.seed,
                               getattr(a, "prefix_len", 0))
        endpoint = endpoint_of(a)
        texts = [tok.decode(p) for p in prompts] if endpoint != "/v1/completions" else [""] * len(prompts)
        bodies = [payload(endpoint, model, p, t, a) for p, t in zip(prompts, texts)]

        for i in range(a.warmup):
            r = await run_one(client, endpoint, bodies[i], len(prompts[i]), a.timeout)
            if not r.ok:
                raise OSError(f"warm-up request failed: {r.error}")
            print(f"warm-up {i + 1}/{a.warmup}: {r.e2e * 1e3:.0f} ms", file=sys.stderr)
        before = await scrape(client)

        turns = getattr(a, "turns", 1) if a.dataset == "multiturn" else 1
        firsts = list(range(a.warmup, a.warmup + a.num_prompts, turns))  # each conversation's first request
        procs = client_processes(a, len(firsts))
        job = {"url": url, "endpoint": endpoint, "timeout": a.timeout, "turns": turns,
               "n_total": a.warmup + a.num_prompts, "num_prompts": a.num_prompts}
        if procs == 1:
            await open_connections(client, a.max_concurrency or len(firsts))
            results, t0, duration, cpu = await run_requests(
                client, {**job, "bodies": dict(enumerate(bodies)), "lens": [len(p) for p in prompts],
                         "firsts": firsts, "concurrency": a.max_concurrency, "rate": a.request_rate,
                         "seed": a.seed + 1})
            cpus = [cpu]
        else:
            results, t0, duration, cpus = run_in_processes(job, bodies, [len(p) for p in prompts], firsts, procs,
                                                           a.max_concurrency, a.request_rate, a.seed)
        after = await scrape(client)

    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1 and r.ttft is not None]
    return {
        "schema": SCHEMA,
        "settings": {"base_url": url, "endpoint": endpoint, "model": model, "dataset": a.dataset,
                     "turns": getattr(a, "turns", 1) if a.dataset == "multiturn" else 1,
                     "tokenizer": str(a.tokenizer or EMBEDDED_TOKENIZER), "input_len": a.input_len,
                     "prefix_len": getattr(a, "prefix_len", 0),
                     "output_len": a.output_len, "num_prompts": a.num_prompts,
                     "request_rate": None if math.isinf(a.request_rate) else a.request_rate,
                     "max_concurrency": a.max_concurrency, "temperature": a.temperature, "ignore_eos": a.ignore_eos,
                     "warmup": a.warmup, "seed": a.seed, "label": a.label},
        "results": {
            "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
            "input_tokens": in_tok, "output_tokens": out_tok,
            "request_throughput": len(ok) / duration, "output_throughput": out_tok / duration,
            "total_token_throughput": (in_tok + out_tok) / duration,
            "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]), "tpot_ms": percentiles(tpot),
            "itl_ms": percentiles([x for r in ok for x in r.itl]), "e2e_ms": percentiles([r.e2e for r in ok]),
        },
        "acceptance": acceptance(before[0], after[0]),
        "prefix_cache": prefix_cache(before[1], after[1]),
        **{key: server_ttft(before[2][key], after[2][key]) for key in SERVER_HISTOGRAMS},
        "client": {"processes": len(cpus), "cpu_s": sum(cpus),
                   "utilization": max(cpus) / duration if duration > 0 else None},
        "errors": sorted({r.error for r in results if r.error})[:10],
        "requests": [{"sent_ms": round((r.sent - t0) * 1e3, 3),
                      "ttft_ms": None if r.ttft is None else round(r.ttft * 1e3, 3),
                      "e2e_ms": round(r.e2e * 1e3, 3), "prompt_tokens": r.prompt_len,
                      "output_tokens": r.output_tokens, "ok": r.ok}
                     for r in sorted(results, key=lambda r: r.sent)],
        "definitions": DEFINITIONS,
    }


# ------------------------------------------------------------------------------------------------
# The measured requests: in this process, or spread over client processes
# ------------------------------------------------------------------------------------------------

# Requests in flight one client process streams before a second one pays: one Python process parsing
# server-sent events saturates a core at a few thousand events a second (an H100 serving the embedded pair at
# concurrency 8 sends about that many), and a saturated client times its own queueing as the server's latency.
REQUESTS_PER_PROCESS = 4


def client_processes(a: argparse.Namespace, conversations: int) -> int:
    """--client-processes, or (0) one process per REQUESTS_PER_PROCESS requests in flight, at most half the cores
    (the server may share the machine) and at most one per conversation."""
    n = getattr(a, "client_processes", 1)
    if n == 0:
        in_flight = a.max_concurrency or a.num_prompts
        n = min(math.ceil(in_flight / REQUESTS_PER_PROCESS), max(1, (os.cpu_count() or 2) // 2))
    return max(1, min(n, conversations, a.max_concurrency or conversations))


async def run_requests(client: httpx.AsyncClient, job: dict[str, Any],
                       go: float | None = None) -> tuple[list[Result], float, float, float]:
    """The measured requests of `job` on one client: conversations starting at job["firsts"] (turns each),
    at most job["concurrency"] in flight, Poisson arrivals at job["rate"] (seeded by job["seed"]).
    -> (results, t0, duration, this process's CPU seconds). `go`: a time.perf_counter() value to start at
    (every client process of a run starts together; the clock is the system's monotonic one, shared by them)."""
    bodies, lens, turns = job["bodies"], job["lens"], job["turns"]
    rng = random.Random(job["seed"])
    sem = asyncio.Semaphore(job["concurrency"]) if job["concurrency"] else None
    done, every = [0], max(1, job["num_prompts"] // 10)

    async def limited(i: int) -> Result:
        if sem is None:
            r = await run_one(client, job["endpoint"], bodies[i], lens[i], job["timeout"])
        else:
            async with sem:
                r = await run_one(client, job["endpoint"], bodies[i], lens[i], job["timeout"])
        done[0] += 1
        if go is None and done[0] % every == 0:
            print(f"  {done[0]}/{job['num_prompts']} done", file=sys.stderr)
        return r

    async def conversation(first: int) -> list[Result]:
        """Requests first.. of one conversation, one turn at a time: each turn sends the whole conversation
        so far (earlier user windows and the server's replies) and then its own user window."""
        history: list[dict[str, str]] = []
        out = []
        for i in range(first, min(first + turns, job["n_total"])):
            if turns > 1:
                history.append(bodies[i]["messages"][-1])
                bodies[i]["messages"] = list(history)
            r = await limited(i)
            history.append({"role": "assistant", "content": r.text})
            out.append(r)
        return out

    if go is not None:
        await asyncio.sleep(max(0.0, go - time.perf_counter()))
    t0, cpu0 = time.perf_counter(), time.process_time()
    tasks = []
    for first in job["firsts"]:
        tasks.append(asyncio.create_task(conversation(first)))
        if math.isfinite(job["rate"]):
            await asyncio.sleep(rng.expovariate(job["rate"]))  # Poisson arrivals (of conversations)
    results = [r for conv in await asyncio.gather(*tasks) for r in conv]
    return results, t0, time.perf_counter() - t0, time.process_time() - cpu0


def _client_process(job: dict[str, Any], out: Any, go_event: Any, go_at: Any) -> None:
    """One client process (spawned): its share of the run on its own event loop and connection pool. It says
    "ready" once imported and connected, then starts at the instant the parent sets (go_at, after go_event)."""
    async def main() -> tuple[list[Result], float, float, float]:
        connections = job["concurrency"] or len(job["firsts"])
        async with make_client(job["url"], job["timeout"], connections) as client:
            await open_connections(client, connections)
            out.put(("ready", None))
            await asyncio.get_running_loop().run_in_executor(None, go_event.wait)
            return await run_requests(client, job, go_at.value)

    try:
        out.put(("ok", asyncio.run(main())))
    except BaseException as e:  # the parent reports it; a child's traceback alone would be lost
        out.put(("error", f"{type(e).__name__}: {e}"))


def _next_report(out: Any, children: list[Any]) -> tuple[str, Any]:
    """The next message of any client process; a process that died without one (it could not start: an import
    error, a signal) fails the run by name instead of leaving the parent waiting for ever."""
    while True:
        try:
            return out.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in children if p.exitcode not in (None, 0)]
            if dead:
                raise OSError(f"bench-serve client process {dead[0].name} exited with code {dead[0].exitcode} "
                              "before reporting (its error is on stderr above)") from None


def run_in_processes(job: dict[str, Any], bodies: list[dict[str, Any]], lens: list[int], firsts: list[int],
                     procs: int, concurrency: int | None, rate: float, seed: int
                     ) -> tuple[list[Result], float, float, list[float]]:
    """The measured requests over `procs` spawned client processes: conversation j goes to process j % procs, the
    concurrency is split as evenly as it goes (so the total in flight is the same), and each process draws Poisson
    arrivals at rate / procs (together a Poisson stream at `rate`). Once every process has started (interpreter,
    imports), they begin at one agreed instant. -> (results by send time, t0, duration, CPU seconds per process)."""
    ctx = multiprocessing.get_context("spawn")
    out, go_event, go_at = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    children = []
    for i in range(procs):
        mine = firsts[i::procs]
        need = {j for f in mine for j in range(f, min(f + job["turns"], job["n_total"]))}
        share = None if not concurrency else concurrency // procs + (1 if i < concurrency % procs else 0)
        child = {**job, "bodies": {j: bodies[j] for j in need}, "lens": {j: lens[j] for j in need}, "firsts": mine,
                 "concurrency": share, "rate": rate / procs, "seed": seed + 1 + 1000 * i}
        p = ctx.Process(target=_client_process, args=(child, out, go_event, go_at), daemon=True,
                        name=f"bench-serve-client-{i}")
        p.start()
        children.append(p)
    got, ready = [], 0
    try:
        while ready + len(got) < procs:  # a child that fails before "ready" reports its error instead
            kind, payload = _next_report(out, children)
            if kind == "ready":
                ready += 1
            else:
                got.append((kind, payload))
        go_at.value = time.perf_counter() + 0.05  # the system's monotonic clock: the same in every process
        go_event.set()
        while len(got) < procs:
            got.append(_next_report(out, children))
    finally:
        go_event.set()  # a child still waiting to start returns at once (its run is then abandoned)
        for p in children:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    errors = [msg for kind, msg in got if kind == "error"]
    if errors:
        raise OSError(f"a bench-serve client process failed: {errors[0]}")
    parts = [payload for _, payload in got]
    results = sorted((r for rs, *_ in parts for r in rs), key=lambda r: r.sent)
    t0 = min(t for _, t, _, _ in parts)
    end = max(t + d for _, t, d, _ in parts)
    print(f"  {len(results)}/{job['num_prompts']} done over {procs} client processes", file=sys.stderr)
    return results, t0, end - t0, [c for *_, c in parts]


def run_bench_serve(a: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_bench(a))


def format_table(doc: dict[str, Any]) -> str:
    s, r, acc = doc["settings"], doc["results"], doc["acceptance"]
    rate = "inf" if s["request_rate"] is None else f"{s['request_rate']:g}/s"
    lines = [f"m3eagle bench-serve: {s['base_url']} {s['endpoint']} model {s['model']}",
             f"{s['num_prompts']} prompts ({s['dataset']}, {s['input_len']} in / {s['output_len']} out), request rate "
             f"{rate}, max concurrency {s['max_concurrency'] or 'none'}",
             f"completed {r['completed']}, failed {r['failed']}, duration {r['duration_s']:.2f} s",
             f"request throughput     {r['request_throughput']:10.2f} req/s",
             f"output throughput      {r['output_throughput']:10.1f} tok/s",
             f"total token throughput {r['total_token_throughput']:10.1f} tok/s",
             f"{'':10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for key, name in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("itl_ms", "ITL ms"), ("e2e_ms", "E2E ms")):
        row = r[key]
        lines.append(f"{name:10}" + "".join(f"{row[q]:10.2f}" if row[q] is not None else f"{'-':>10}"
                                             for q in ("mean", "p50", "p90", "p99")))
    if acc:
        per = " ".join(f"{x:.3f}" for x in acc["per_position"])
        lines.append(f"acceptance: mean length {acc['mean_acceptance_length']:.3f}, rate {acc['acceptance_rate']:.3f}, "
                     f"per position {per}")
    else:
        lines.append("acceptance: - (the server's /metrics reports no speculative drafts in this window)")
    for key, what in (("server_ttft", "TTFT"), ("server_queue", "queue time"), ("server_prefill", "prefill time")):
        st = doc.get(key)
        if st:
            lines.append(f"server {what} ms (its histogram, {st['count']} requests): p50 {st['p50']:.2f}, p90 "
                         f"{st['p90']:.2f}, p99 {st['p99']:.2f}")
    cl = doc.get("client")
    if cl and cl["utilization"] is not None:
        busy = (" -- the client is saturated: its latencies include its own queueing (more --client-processes)"
                if cl["utilization"] > 0.9 else "")
        lines.append(f"client CPU: {cl['cpu_s']:.2f} s over {cl.get('processes', 1)} process(es), the busiest at "
                     f"{cl['utilization']:.0%} of a core{busy}")
    pc = doc.get("prefix_cache")
    if pc and pc["hit_rate"] is not None:
        lines.append(f"prefix cache: {pc['hit_tokens']} of {pc['queried_tokens']} prompt tokens found "
                     f"(hit rate {pc['hit_rate']:.3f})")
    for e in doc["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)
