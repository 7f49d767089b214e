"""Prometheus metrics with vLLM's meanings under the `m3eagle:` prefix, and the periodic stats log line.

Each server owns a CollectorRegistry (never the process-global default), so several servers can live in
one process (tests). Every counter and histogram is updated on the asyncio thread, from the per-step
deltas the engine thread hands over (`observe_step`); the gauges are read at scrape time from the engine's
lock-free load snapshot. So a scrape never waits for a step and never sees half of one.

Meanings (as vLLM's):
- num_requests_running / _waiting: requests in the running batch / queued (intake included);
- kv_cache_usage_perc: fraction of usable KV pages held, 0..1 (0 when idle);
- prompt_tokens_total: prompt tokens of requests that produced their first token;
- generation_tokens_total: output tokens handed out;
- request_success_total{finished_reason}: finished requests (stop, length, abort, error);
- prefix_cache_queries_total / prefix_cache_hits_total: prompt tokens looked up in the prefix cache when
  requests were admitted / of those, tokens found cached (their ratio is the hit rate);
- spec_decode_num_drafts_total: verify rows (one per request per speculative step);
  spec_decode_num_draft_tokens_total: draft tokens proposed; ..._num_accepted_tokens_total: accepted;
  ..._num_accepted_tokens_per_pos_total{position}: accepted at draft position i (0-based);
- time_to_first_token_seconds: arrival to the step that produced the first token;
- inter_token_latency_seconds: between consecutive steps that produced tokens for a request (one
  observation per step, which may carry several tokens under speculation);
- e2e_request_latency_seconds: arrival to finish; request_prompt_tokens / request_generation_tokens:
  per finished request;
- request_queue_time_seconds: arrival to the first step that scheduled the request (it waited for room);
  request_prefill_time_seconds: that step to its first token (its prompt's steps, and under overlap the step
  that hands the token over); request_decode_time_seconds: first token to finish;
  request_inference_time_seconds: first scheduled to finish. Queue + prefill is the TTFT the engine sees, so a
  TTFT far above both is time outside the engine (HTTP, the event loop).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from m3eagle.engine.llm_engine import LLMEngine, SpecCounters
    from m3eagle.engine.request import RequestDelta

log = logging.getLogger("m3eagle")

PREFIX = "m3eagle:"
# vLLM's TTFT buckets, with 2, 3, 4 and 7.5 ms added: a small model's first tokens on a GPU take 2-10 ms, where
# vLLM's 5 ms steps leave p50 and p99 in one or two buckets (`bench-serve` interpolates its quantiles from these).
TTFT_BUCKETS = [0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]


def one_two_five(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (token-count buckets, as vLLM's)."""
    out, mag = [], 1
    while True:
        for m in (1, 2, 5):
            if m * mag > limit:
                return out
            out.append(float(m * mag))
        mag *= 10


@dataclass
class RequestTimes:
    """What the metrics need to remember about one request in flight (monotonic seconds)."""

    arrival: float
    first: float | None = None
    last: float | None = None
    scheduled: float | None = None  # the engine's first scheduling of it (RequestDelta.first_scheduled_time)


class PrefixCacheCounts(NamedTuple):
    """The engine's cumulative prefix-cache counters (LLMEngine.prefix_cache_queries / _hits) after a step."""

    queries: int
    hits: int

    @classmethod
    def of(cls, engine: LLMEngine) -> PrefixCacheCounts:
        return cls(engine.prefix_cache_queries, engine.prefix_cache_hits)


@dataclass
class _Window:
    """Sums since the last stats log line."""

    t0: float = field(default_factory=time.monotonic)
    prompt: int = 0
    generation: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    cache_queries: int = 0
    cache_hits: int = 0


class ServerMetrics:
    def __init__(self, engine: LLMEngine, model_name: str, max_model_len: int):
        self.engine = engine
        self.k = engine.k
        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]

        def gauge(name: str, doc: str, fn) -> None:
            Gauge(PREFIX + name, doc, lab, registry=r).labels(model_name).set_function(fn)

        gauge("num_requests_running", "Requests in the running batch.", lambda: engine.load().num_running)
        gauge("num_requests_waiting", "Requests waiting to be scheduled.", lambda: engine.load().num_waiting)
        gauge("kv_cache_usage_perc", "KV-cache usage: fraction of usable pages held (1 = full).",
              lambda: engine.load().kv_cache_usage)

        def counter(name: str, doc: str, labels: list[str] | None = None) -> Counter:
            return Counter(PREFIX + name, doc, lab + (labels or []), registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Generated tokens handed out.").labels(model_name)
        self._success = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.success = {reason: self._success.labels(model_name, reason) for reason in
                        ("stop", "length", "abort", "error")}
        self.num_drafts = counter("spec_decode_num_drafts", "Speculative verify rows.").labels(model_name)
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.").labels(model_name)
        self.num_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(model_name)
        per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted per draft position.",
                          ["position"])
        self.accepted_per_pos = [per_pos.labels(model_name, str(j)) for j in range(self.k)]
        self.cache_queries = counter("prefix_cache_queries",
                                     "Prefix cache queries, in prompt tokens looked up.").labels(model_name)
        self.cache_hits = counter("prefix_cache_hits",
                                  "Prefix cache hits, in prompt tokens found cached.").labels(model_name)
        self.prefix_caching = engine.cfg.enable_prefix_caching

        def histogram(name: str, doc: str, buckets: list[float]):
            return Histogram(PREFIX + name, doc, lab, buckets=buckets, registry=r).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between token-producing steps.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to the first step that scheduled the request.",
                               TTFT_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to the first token.", TTFT_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to finish.", E2E_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "First scheduled to finish.", E2E_BUCKETS)
        tok_buckets = one_two_five(max_model_len)
        self.req_prompt = histogram("request_prompt_tokens", "Prompt tokens per request.", tok_buckets)
        self.req_generation = histogram("request_generation_tokens", "Generated tokens per request.", tok_buckets)

        self._spec = engine.counters.snapshot()
        self._cache = PrefixCacheCounts.of(engine)
        self._win = _Window(accepted_per_pos=[0] * self.k)

    # ---- updates (asyncio thread) ---------------------------------------------------------------
    def observe(self, times: RequestTimes, d: RequestDelta, now: float) -> None:
        """One delta of one request, produced by a step that ended at `now`."""
        if d.token_ids:
            n = len(d.token_ids)
            if times.first is None:
                times.first = now
                self.ttft.observe(now - times.arrival)
                if d.first_scheduled_time is not None:  # the engine's clock is time.monotonic() too
                    times.scheduled = d.first_scheduled_time
                    self.queue.observe(max(0.0, times.scheduled - times.arrival))
                    self.prefill.observe(max(0.0, now - times.scheduled))
                self.prompt_tokens.inc(d.num_prompt_tokens)
                self._win.prompt += d.num_prompt_tokens
            else:
                self.itl.observe(now - times.last)
            times.last = now
            self.generation_tokens.inc(n)
            self._win.generation += n
        if d.finished:
            self.success.get(d.finish_reason, self.success["error"]).inc()
            self.e2e.observe(now - times.arrival)
            if times.first is not None:
                self.decode.observe(now - times.first)
            if times.scheduled is not None:
                self.inference.observe(now - times.scheduled)
            self.req_prompt.observe(d.num_prompt_tokens)
            self.req_generation.observe(sum(len(c.token_ids) for c in d.output.outputs))  # all n completions

    def observe_spec(self, cur: SpecCounters) -> None:
        """The engine's running speculation totals after a step: add what changed since the last call."""
        prev, w = self._spec, self._win
        dd, dt, da = (cur.num_drafts - prev.num_drafts, cur.num_draft_tokens - prev.num_draft_tokens,
                      cur.num_accepted_tokens - prev.num_accepted_tokens)
        if dd:
            self.num_drafts.inc(dd)
            self.num_draft_tokens.inc(dt)
            self.num_accepted.inc(da)
            w.drafts, w.draft_tokens, w.accepted = w.drafts + dd, w.draft_tokens + dt, w.accepted + da
            for j in range(self.k):
                x = cur.accepted_per_pos[j] - prev.accepted_per_pos[j]
                if x:
                    self.accepted_per_pos[j].inc(x)
                    w.accepted_per_pos[j] += x
        self._spec = cur

    def rebase_prefix_cache(self, cur: PrefixCacheCounts) -> None:
        """Count the engine's prefix-cache totals from `cur` on (after its warm-up, which restarts them)."""
        self._cache = cur

    def observe_prefix_cache(self, cur: PrefixCacheCounts) -> None:
        """The engine's prefix-cache totals after a step: add what changed since the last call."""
        prev = self._cache
        # Totals that went down were restarted by the engine: all of `cur` is new (a Counter cannot go down).
        dq = cur.queries - prev.queries if cur.queries >= prev.queries else cur.queries
        dh = cur.hits - prev.hits if cur.hits >= prev.hits else cur.hits
        if dq or dh:
            self.cache_queries.inc(dq)
            self.cache_hits.inc(dh)
            self._win.cache_queries += dq
            self._win.cache_hits += dh
        self._cache = cur

    # ---- output -------------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    def log_line(self) -> str | None:
        """vLLM-style periodic line (throughput, queue, KV usage, prefix cache hit rate, acceptance) over the
        window since the last call; None when nothing ran and nothing is queued (an idle server stays quiet)."""
        w, now, ld = self._win, time.monotonic(), self.engine.load()
        self._win = _Window(t0=now, accepted_per_pos=[0] * self.k)
        if not (w.prompt or w.generation or ld.num_running or ld.num_waiting):
            return None
        dt = max(now - w.t0, 1e-9)
        line = (f"Avg prompt throughput: {w.prompt / dt:.1f} tokens/s, Avg generation throughput: "
                f"{w.generation / dt:.1f} tokens/s, Running: {ld.num_running} reqs, Waiting: {ld.num_waiting} reqs, "
                f"KV cache usage: {ld.kv_cache_usage * 100:.1f}%")
        if self.prefix_caching:
            rate = w.cache_hits / w.cache_queries if w.cache_queries else 0.0
            line += f", Prefix cache hit rate: {rate * 100:.1f}%"
        if self.k and w.drafts:
            per_pos = ", ".join(f"{a / w.drafts:.3f}" for a in w.accepted_per_pos)
            line += (f" | SpecDecoding: mean acceptance length {1 + w.accepted / w.drafts:.2f}, accepted "
                     f"{w.accepted} / drafted {w.draft_tokens} tokens ({w.accepted / w.draft_tokens * 100:.1f}%), "
                     f"per-position acceptance rate: {per_pos}")
        return line
