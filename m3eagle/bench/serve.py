"""`m3eagle bench-serve`: a load generator for any OpenAI-compatible server (m3eagle, vLLM, SGLang).

A run, in order:
  1. Prompts of exactly `--input-len` tokens: seeded random token ids, or windows of held-out text (the
     stdlib's top-level modules, which the embedded model never trained on), tokenized with --tokenizer
     (default: the embedded model's). /v1/completions receives them as token ids, so the server sees the
     set length; /v1/chat/completions receives their text.
  2. `--warmup` requests one at a time (not measured), then a /metrics scrape.
  3. `--num-prompts` streaming requests: arrivals Poisson at `--request-rate` (inf: all at once), at most
     `--max-concurrency` in flight. Every request asks for `--output-len` tokens with EOS ignored
     (`ignore_eos`, an extra field vLLM and SGLang accept too), so output lengths are set.
  4. A second /metrics scrape: the speculative acceptance of the measured window, when the server exports
     vLLM-style `*spec_decode_*` counters.
  5. A table (stderr) and a JSON document (stdout or --json FILE); `DEFINITIONS` travels inside it.

The HTTP client is a small one on asyncio streams (HTTP/1.1, chunked or sized bodies, server-sent events):
it costs little per event, so the client is not what limits a fast server, and it needs no dependency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import ssl
import sys
import sysconfig
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

SCHEMA = "m3eagle.bench_serve/1"
EMBEDDED_TOKENIZER = Path(__file__).resolve().parent.parent / "assets" / "default" / "target"

DEFINITIONS = {
    "ttft_ms": "time to first token: request sent -> first streamed event carrying text",
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
}


# ------------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    from m3eagle.entrypoints.cli import float_in, int_in

    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"],
                   help="completions get token-id prompts (exact lengths); chat gets their text")
    p.add_argument("--model", default=None, help="model name to send; none: the first of GET /v1/models")
    p.add_argument("--dataset", choices=["random", "stdlib"], default="stdlib",
                   help="random token ids, or windows of held-out stdlib code")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory with the served model's tokenizer.json; none: the embedded model's")
    p.add_argument("--input-len", type=int_in(1), default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int_in(1), default=64, help="generated tokens per request")
    p.add_argument("--num-prompts", type=int_in(1), default=100, help="measured requests")
    p.add_argument("--request-rate", type=float_in(0.0, lo_open=True), default=math.inf,
                   help="Poisson arrival rate (requests/s); inf: send all at once")
    p.add_argument("--max-concurrency", type=int_in(1), default=None, help="most requests in flight; none: no limit")
    p.add_argument("--temperature", type=float_in(0.0), default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (output lengths then vary)")
    p.add_argument("--warmup", type=int_in(0), default=2, help="unmeasured requests sent first, one at a time")
    p.add_argument("--timeout", type=float_in(0.0, lo_open=True), default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int_in(0), default=0, help="prompt and arrival seed")
    p.add_argument("--label", default=None, help="free text stored in the JSON (e.g. the server's settings)")
    p.add_argument("--json", metavar="FILE", default=None, help="write the JSON document here instead of stdout")


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


def make_prompts(tok, dataset: str, n: int, length: int, seed: int) -> list[list[int]]:
    """n prompts of exactly `length` token ids."""
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
# A small HTTP/1.1 client on asyncio streams
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    scheme: str
    host: str
    port: int
    prefix: str  # a path the base URL carries (behind a proxy, say)

    @classmethod
    def parse(cls, url: str) -> Server:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"--base-url {url!r}: give http://HOST:PORT (or https://)")
        return cls(u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80), u.path.rstrip("/"))

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.prefix}"


class HttpResponse:
    def __init__(self, status: int, headers: dict[str, str], reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter):
        self.status, self.headers, self._reader, self._writer = status, headers, reader, writer

    async def chunks(self) -> AsyncIterator[bytes]:
        r = self._reader
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await r.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    return
                yield await r.readexactly(size)
                await r.readexactly(2)  # CRLF after each chunk
        elif "content-length" in self.headers:
            yield await r.readexactly(int(self.headers["content-length"]))
        else:
            while data := await r.read(65536):
                yield data

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    def close(self) -> None:
        self._writer.close()


async def request(server: Server, method: str, path: str, body: Any = None) -> HttpResponse:
    ctx = ssl.create_default_context() if server.scheme == "https" else None
    try:
        reader, writer = await asyncio.open_connection(server.host, server.port, ssl=ctx, limit=1 << 22)
    except OSError as e:
        raise OSError(f"cannot reach {server.url} ({e}); is the server running?") from None
    data = json.dumps(body).encode() if body is not None else b""
    head = (f"{method} {server.prefix}{path} HTTP/1.1\r\nHost: {server.host}:{server.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    writer.write(head.encode() + data)
    await writer.drain()
    status_line = await reader.readline()
    try:
        status = int(status_line.split()[1])
    except (IndexError, ValueError):
        writer.close()
        raise OSError(f"{server.url}{path}: not an HTTP response ({status_line[:80]!r})") from None
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return HttpResponse(status, headers, reader, writer)


async def get_text(server: Server, path: str) -> tuple[int, str]:
    r = await request(server, "GET", path)
    try:
        return r.status, (await r.read()).decode()
    finally:
        r.close()


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


def payload(endpoint: str, model: str, ids: list[int], text: str, a: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": a.output_len, "temperature": a.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if a.ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "/v1/completions":
        body["prompt"] = ids
    else:
        body["messages"] = [{"role": "user", "content": text}]
    return body


async def run_one(server: Server, endpoint: str, body: dict[str, Any], prompt_len: int, timeout: float) -> Result:
    res = Result(prompt_len)
    t0 = time.perf_counter()
    times: list[float] = []
    usage = None
    try:
        async with asyncio.timeout(timeout):
            r = await request(server, "POST", endpoint, body)
            try:
                if r.status != 200:
                    res.error = f"HTTP {r.status}: {(await r.read())[:300].decode(errors='replace')}"
                    return res
                buf = b""
                async for chunk in r.chunks():
                    buf += chunk.replace(b"\r\n", b"\n")
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        for line in event.split(b"\n"):
                            if not line.startswith(b"data:"):
                                continue
                            data = line[5:].strip()
                            if data == b"[DONE]":
                                continue
                            obj = json.loads(data)
                            if "error" in obj:
                                res.error = str(obj["error"].get("message", obj["error"]))
                                continue
                            if obj.get("usage"):
                                usage = obj["usage"]
                            for ch in obj.get("choices") or []:
                                piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                                if piece:
                                    times.append(time.perf_counter())
            finally:
                r.close()
    except TimeoutError:
        res.error = f"timed out after {timeout:g} s"
    except (OSError, ValueError, asyncio.IncompleteReadError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.e2e = time.perf_counter() - t0
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


def spec_counters(text: str) -> dict[str, Any] | None:
    """Sums of vLLM-style spec_decode counters (any prefix: m3eagle:, vllm:) in a Prometheus text page."""
    keys = {"spec_decode_num_drafts_total": "drafts", "spec_decode_num_draft_tokens_total": "draft_tokens",
            "spec_decode_num_accepted_tokens_total": "accepted"}
    out: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": {}}
    seen = False
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        try:
            v = float(value)
        except ValueError:
            continue
        for suffix, key in keys.items():
            if name.endswith(suffix):
                out[key] += v
                seen = True
        if name.endswith("spec_decode_num_accepted_tokens_per_pos_total"):
            pos = next((kv.split("=", 1)[1].strip('"') for kv in labels.rstrip("}").split(",")
                        if kv.startswith("position=")), None)
            if pos is not None:
                out["per_pos"][int(pos)] = out["per_pos"].get(int(pos), 0.0) + v
    return out if seen else None


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


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------


def percentiles(xs: list[float], scale: float = 1e3) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(xs)

    def q(p: float) -> float:
        r = p / 100 * (len(s) - 1)
        lo = int(r)
        hi = min(lo + 1, len(s) - 1)
        return (s[lo] + (s[hi] - s[lo]) * (r - lo)) * scale

    return {"mean": sum(s) / len(s) * scale, "p50": q(50), "p90": q(90), "p99": q(99)}


async def _bench(a: argparse.Namespace) -> dict[str, Any]:
    server = Server.parse(a.base_url)
    status, text = await get_text(server, "/v1/models")
    if status != 200:
        raise OSError(f"GET {server.url}/v1/models answered {status}: {text[:200]}")
    model = a.model or json.loads(text)["data"][0]["id"]
    tok = load_tokenizer(a.tokenizer)
    prompts = make_prompts(tok, a.dataset, a.warmup + a.num_prompts, a.input_len, a.seed)
    texts = [tok.decode(p) for p in prompts] if a.endpoint != "/v1/completions" else [""] * len(prompts)
    bodies = [payload(a.endpoint, model, p, t, a) for p, t in zip(prompts, texts)]

    for i in range(a.warmup):
        r = await run_one(server, a.endpoint, bodies[i], len(prompts[i]), a.timeout)
        if not r.ok:
            raise OSError(f"warm-up request failed: {r.error}")
        print(f"warm-up {i + 1}/{a.warmup}: {r.e2e * 1e3:.0f} ms", file=sys.stderr)
    before = spec_counters((await get_text(server, "/metrics"))[1])

    rng = random.Random(a.seed + 1)
    sem = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
    done = [0]

    async def limited(i: int) -> Result:
        if sem is None:
            r = await run_one(server, a.endpoint, bodies[i], len(prompts[i]), a.timeout)
        else:
            async with sem:
                r = await run_one(server, a.endpoint, bodies[i], len(prompts[i]), a.timeout)
        done[0] += 1
        if done[0] % max(1, a.num_prompts // 10) == 0:
            print(f"  {done[0]}/{a.num_prompts} done", file=sys.stderr)
        return r

    t0 = time.perf_counter()
    tasks = []
    for i in range(a.warmup, a.warmup + a.num_prompts):
        tasks.append(asyncio.create_task(limited(i)))
        if math.isfinite(a.request_rate):
            await asyncio.sleep(rng.expovariate(a.request_rate))  # Poisson arrivals
    results: list[Result] = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    after = spec_counters((await get_text(server, "/metrics"))[1])

    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1 and r.ttft is not None]
    return {
        "schema": SCHEMA,
        "settings": {"base_url": server.url, "endpoint": a.endpoint, "model": model, "dataset": a.dataset,
                     "tokenizer": str(a.tokenizer or EMBEDDED_TOKENIZER), "input_len": a.input_len,
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
        "acceptance": acceptance(before, after),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "definitions": DEFINITIONS,
    }


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
    for e in doc["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)
