"""Output processing: a step's sampled tokens become request state, finishes and deltas.

For each row of a processed step: count its speculation (accepted drafts), append its tokens, check the
stops (EOS, stop ids, stop strings, min_tokens, max_tokens, max_model_len), assemble logprobs, feed the
incremental detokenizer (detokenizer.py), and finish the request when something ended it. Then, once per
step(), `_deltas` turns every request changed since the last step() into a RequestDelta (new tokens, text
no stop can still cut, and on a request's last delta its RequestOutput).

`OutputProcessor` is a mixin of `LLMEngine`: its methods stay engine attributes, so a caller (or a test)
that replaces `engine._append` or `engine._process_plain` on an instance changes what the engine runs. The
engine provides `scheduler` (row releases and finishes), `tokenizer`, `counters`, `fast_paths`,
`_touched` (requests changed since the last step() returned, in order of change) and `_forget(req)` (drop
a finished request from its live tables); it calls `_process_iteration` for each iteration's outputs,
`_deltas` once per step(), and `_finish` / `_fail` to end a request.

A request finished while a later step that includes it is in flight keeps its pages until that step is
processed; that step's tokens for it are dropped, so nothing past a stop is ever returned.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from m3eagle.engine.model_runner import StepOutput
from m3eagle.engine.request import (
    Logprob,
    PositionLogprobs,
    Request,
    RequestDelta,
    Status,
    per_position_counts,
)
from m3eagle.engine.scheduler import ScheduledBatch, Scheduler
from m3eagle.engine.structured_step import keep_drafts

log = logging.getLogger("m3eagle")


@dataclass
class SpecCounters:
    """Running totals of speculation since the engine started (vLLM's spec_decode_* meanings): a verify
    row is one draft; its K tokens are draft tokens; accepted ones count overall and per position. Per
    position they are kept as a histogram of accepted drafts per verify row (one increment per row, not
    one per accepted position); `accepted_per_pos` derives the counts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accept_hist: list[int] = field(default_factory=list)  # [K + 1]: verify rows that accepted i drafts

    @property
    def accepted_per_pos(self) -> list[int]:
        """[K]: drafts accepted at draft position j (0-based) -- a fresh list, read-only in effect."""
        return per_position_counts(self.accept_hist)

    def snapshot(self) -> SpecCounters:
        return SpecCounters(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                            list(self.accept_hist))


class OutputProcessor:
    """Turns each step's outputs into request state, finishes and deltas (a mixin of `LLMEngine`; the
    module docstring lists what the engine provides). Not thread-safe on its own: the engine calls it
    under its step lock."""

    scheduler: Scheduler
    tokenizer: Any
    counters: SpecCounters
    fast_paths: bool  # False: every row takes the per-row path (tests hold the fast paths equal to it)
    _touched: dict[str, Request]

    def _forget(self, req: Request) -> None:
        """Drop a request that just finished from the engine's live tables (the engine implements it)."""
        raise NotImplementedError

    # ---- a step's outputs -----------------------------------------------------------------------
    def _process_iteration(self, batch: ScheduledBatch, outs: list[StepOutput]) -> None:
        """The outputs of one iteration's sub-steps, in order (a request finished by one skips the rest).
        Several sub-steps without logprobs take `_process_plain_steps` (with the fast paths on)."""
        if len(outs) > 1 and self.fast_paths:
            hosts = [out.wait() for out in outs]
            if not any(name.startswith(("lp_", "plp_")) for h in hosts for name in h):
                self._process_plain_steps(batch.rows, [h["new_tokens"].tolist() for h in hosts],
                                          [h["num_new"].tolist() for h in hosts])
                return
        for out in outs:
            self._process(batch, out)

    def _process_plain_steps(self, rows: list, new_tokens: list[list[list[int]]], num_new: list[list[int]]) -> None:
        """`_process_plain` of each sub-step of a multi-step iteration in turn (new_tokens [N][B][K+1], num_new
        [N][B]), with a steady row that nothing can stop inside the iteration's tokens taken once for all N:
        its tokens appended together, its counts and projection moved by their sums. Every other row is
        processed sub-step by sub-step, its first sub-step in row order among the others -- the order in
        which requests are first touched, hence of their deltas -- and the later ones in (sub-step, row)
        order, the order of finishes and page frees. The combined rows finish nothing and free nothing, and
        their counter updates are sums, so the result is `_process_plain` N times over, which
        tests/engine/test_host_fast_paths.py holds on random outputs."""
        finished, touched, count_verify = Status.FINISHED, self._touched, self._count_verify
        steps = len(num_new)
        later = []  # rows processed sub-step by sub-step after the first
        for i, row in enumerate(rows):
            req = row.req
            if row.gather and row.samples and req.status is not finished:
                counts = [nn[i] for nn in num_new]
                tokens = [t for s in range(steps) for t in new_tokens[s][i][:counts[s]]]
                st, out = req.stops, req.output_token_ids
                if len(out) + len(tokens) < st.limit and not st.strings and st.any_id.isdisjoint(tokens):
                    det = req.detok
                    if det is not None:
                        try:
                            det = det.extended(tokens)
                        except Exception:  # left to the sub-step path, which fails it at its own sub-step
                            det = False
                    if det is not False:
                        nd, emitted = row.num_drafts, len(tokens)
                        for _ in range(steps):
                            req.inflight_rows.remove(row)
                        if nd:
                            count_verify(req, nd, [n - 1 for n in counts])
                        req.num_computed += steps * (row.num_tokens - nd - 1) + emitted
                        moved = steps * (nd + 1) - emitted
                        if det is not None:
                            req.detok, req.text = det, det.text
                        out += tokens
                        touched[req.request_id] = req
                        if moved:
                            req.retract(moved)
                        continue
            self._process_plain([row], [new_tokens[0][i]], [num_new[0][i]])
            later.append(i)
        for s in range(1, steps):
            self._process_plain([rows[i] for i in later], [new_tokens[s][i] for i in later],
                                [num_new[s][i] for i in later])

    # ---- one step's rows ------------------------------------------------------------------------
    def _process(self, batch: ScheduledBatch, out: StepOutput) -> None:
        host = out.wait()
        if "draft_tokens" in host:  # a constrained step's drafts: what its rows' next verify masks walk
            keep_drafts(batch.rows, host["draft_tokens"].tolist())
        new_tokens, num_new = host["new_tokens"].tolist(), host["num_new"].tolist()
        lp = {name: host[name].tolist() for name in host if name.startswith("lp_")} or None
        plp = {name: host[name].tolist() for name in host if name.startswith("plp_")} or None
        if lp is None and plp is None and self.fast_paths:
            self._process_plain(batch.rows, new_tokens, num_new)
            return
        first, any_lp = 0, lp is not None or plp is not None
        finished = Status.FINISHED
        for i, (row, row_tokens, n_new) in enumerate(zip(batch.rows, new_tokens, num_new)):
            req = row.req
            req.inflight_rows.remove(row)
            first, row_first = first + row.num_tokens, first
            if req.status is finished:
                if req.pending_free and not req.inflight_rows:
                    self.scheduler.release(req)
                continue
            try:
                lps = None
                if any_lp:
                    if plp is not None and req.params.prompt_logprobs is not None and not row.gather:
                        self._record_prompt_logprobs(req, row, plp, row_first)
                    if lp is not None and req.params.logprobs is not None:
                        lps = [self._position_logprobs(row_tokens[j], lp, (i, j), req.params.logprobs, "lp_")
                               for j in range(n_new)]
                self._process_row(req, row, row_tokens[:n_new], lps)
            except Exception as e:  # this request's fault (a detokenizer error, say), not the engine's
                self._fail(req, f"{type(e).__name__}: {e}")
            req.reproject()

    def _process_plain(self, rows: list, new_tokens: list[list[int]], num_new: list[int]) -> None:
        """`_process` of a step without logprobs. A steady row -- it verified or sampled on the slot buffers
        (so it is past its prompt) and nothing can end its output inside this step's tokens -- takes a tight
        path: `_process_row` + `_extend` + `reproject` inlined, the projection adjusted instead of
        recomputed. Every other row takes `_process_row`, in row order (the order of finishes, frees and
        deltas is the per-row path's). tests/engine/test_host_fast_paths.py holds the two equal."""
        finished, release, touched = Status.FINISHED, self.scheduler.release, self._touched
        c = self.counters
        hist = c.accept_hist
        drafts = draft_tokens = accepted = 0  # the engine's totals of the tight rows, added once
        try:
            for row, row_tokens, n_new in zip(rows, new_tokens, num_new):
                req = row.req
                req.inflight_rows.remove(row)
                if req.status is finished:
                    if req.pending_free and not req.inflight_rows:
                        release(req)
                    continue
                if row.gather and row.samples:
                    tokens = row_tokens[:n_new]
                    st, out = req.stops, req.output_token_ids
                    # `_may_stop` with the request's stop conditions read once: no stop id or EOS among the
                    # tokens, the length limit out of reach, no stop strings.
                    if len(out) + n_new < st.limit and not st.strings and st.any_id.isdisjoint(tokens):
                        nd, a = row.num_drafts, n_new - 1
                        if nd:
                            acc = nd if a >= nd else (a if a > 0 else 0)
                            req.num_accepted += a
                            req.draft_hist[nd] += 1
                            req.accept_hist[acc] += 1
                            hist[acc] += 1
                            drafts += 1
                            draft_tokens += nd
                            accepted += a
                        det = req.detok
                        if det is not None:
                            try:  # the detokenizer first: a fault leaves the request as it was (`_extend`)
                                det = det.extended(tokens)
                            except Exception as e:  # this request's fault, not the engine's
                                self._fail(req, f"{type(e).__name__}: {e}")
                                req.reproject()
                                continue
                            req.detok, req.text = det, det.text
                        out += tokens
                        touched[req.request_id] = req
                        req.num_computed += row.num_tokens - nd + a
                        if a != nd:  # the projection assumed every draft accepted: `Request.retract`, inlined
                            for r in req.inflight_rows:  # (a call per row costs this hot loop ~2% of the step)
                                if not r.gather:
                                    req.reproject()
                                    break
                            else:
                                req.proj_computed -= nd - a
                                req.proj_known -= nd - a
                        continue
                try:
                    self._process_row(req, row, row_tokens[:n_new], None)
                except Exception as e:  # this request's fault (a detokenizer error, say), not the engine's
                    self._fail(req, f"{type(e).__name__}: {e}")
                req.reproject()
        finally:
            c.num_drafts += drafts
            c.num_draft_tokens += draft_tokens
            c.num_accepted_tokens += accepted

    def _decode_token(self, t: int) -> str | None:
        return self.tokenizer.decode([t]) if self.tokenizer is not None else None

    def _position_logprobs(self, token: int, lp: dict[str, list], at: tuple[int, ...], n: int,
                           prefix: str) -> PositionLogprobs:
        """vLLM's shape: the token itself first, then the top n candidates (ranks 1..n)."""
        def get(name: str):
            x = lp[prefix + name]
            for i in at:
                x = x[i]
            return x

        out = {token: Logprob(get("logprob"), get("rank"), self._decode_token(token))}
        for rank, (t, v) in enumerate(zip(get("top_ids")[:n], get("top_logprobs")[:n]), 1):
            out.setdefault(t, Logprob(v, rank, self._decode_token(t)))
        return out

    def _record_prompt_logprobs(self, req: Request, row, plp: dict[str, list], row_first: int) -> None:
        """Entries for prompt tokens this chunk predicted that are not recorded yet (a recompute after a
        preemption sees them again). Entry p is the logprob of prompt token p given tokens < p."""
        prompt = req.prompt_token_ids
        if not req.prompt_logprobs:
            req.prompt_logprobs.append(None)  # the first prompt token has no context
        for i in range(row.num_tokens):
            p = row.start + i + 1  # the token this position predicts
            if p >= len(prompt) or p != len(req.prompt_logprobs):
                continue
            req.prompt_logprobs.append(self._position_logprobs(prompt[p], plp, (row_first + i,),
                                                               req.params.prompt_logprobs, "plp_"))

    def _count_verify(self, req: Request, nd: int, accepted: list[int]) -> None:
        """Speculation counts of one request's verify rows of nd drafts each, the request's and the engine's
        (vLLM's meanings): per row a = accepted[i] (it emitted a + 1 tokens), one histogram entry, acc =
        min(a, nd) accepted positions 0..acc-1. (`_process_plain` inlines this for its rows.)"""
        c, hist, total = self.counters, self.counters.accept_hist, 0
        for a in accepted:
            acc = nd if a >= nd else (a if a > 0 else 0)
            req.accept_hist[acc] += 1
            hist[acc] += 1
            total += a
        n = len(accepted)
        req.num_accepted += total
        req.draft_hist[nd] += n
        c.num_drafts += n
        c.num_draft_tokens += n * nd
        c.num_accepted_tokens += total

    def _process_row(self, req: Request, row, tokens: list[int], lps: list[PositionLogprobs] | None) -> None:
        start = req.num_computed
        if not row.samples:
            req.num_computed = start + row.num_tokens
            return
        a, nd = len(tokens) - 1, row.num_drafts
        if nd:
            self._count_verify(req, nd, [a])
        # Before the tokens go in: a request they finish is released at once, and the prefix cache registers
        # its pages by this length (the positions past what it keeps have no key: their tokens are unknown).
        req.num_computed = start + row.num_tokens - nd + a
        if self._may_stop(req, tokens):
            self._append(req, tokens, lps)
        else:
            self._extend(req, tokens, lps)

    def _may_stop(self, req: Request, tokens: list[int]) -> bool:
        """Whether anything could end the output inside `tokens`: a stop id or EOS among them, the length
        limit within reach, or stop strings (which only the detokenizer can see). False is exact: then every
        token is kept and the request stays unfinished, which `_extend` does without the per-token checks."""
        st = req.stops
        return (len(req.output_token_ids) + len(tokens) >= st.limit or st.strings
                or not st.any_id.isdisjoint(tokens))

    def _extend(self, req: Request, tokens: list[int], lps: list[PositionLogprobs] | None) -> None:
        """`_append` for tokens that cannot end the output (`_may_stop` said so): all of them are kept, with
        their text, in one go. Transactional like `_append`: the detokenizer fork is fed first and the
        request changes only once that succeeded."""
        det = req.detok
        if det is not None:
            det = det.extended(tokens)
        req.output_token_ids += tokens
        if lps is not None:
            req.logprobs += lps
        if det is not None:
            req.detok, req.text = det, det.text
        self._touched[req.request_id] = req

    def _append(self, req: Request, tokens: list[int], lps: list[PositionLogprobs] | None) -> None:
        """Decide first, then mutate: the kept tokens, the finish reason and the text are computed on a fork
        of the request's detokenizer, and adopted together only once all of it succeeded. An exception here
        (a tokenizer error) leaves the request exactly as it was. Before min_tokens tokens are out nothing
        stops the output but its length (vLLM; the sampler already gave EOS and stop ids probability 0)."""
        out = req.output_token_ids  # appended in place (a copy per step made long outputs quadratic) ...
        n0 = len(out)
        det = req.detok.fork() if req.detok is not None else None
        reason, stop_reason = None, None
        st = req.stops  # read once per request (add_request)
        limit, min_tokens, stop_ids, eos = st.limit, st.min_tokens, st.stop_ids, st.eos
        grammar = req.grammar
        if grammar is not None:
            grammar.sync(out)
        n = n0
        try:
            for t in tokens:
                out.append(t)
                n += 1
                # A structured request's tokens were masked by its grammar, so each one is allowed; one that is
                # not is an engine fault, which fails this request alone.
                if grammar is not None and not grammar.accept(t):
                    raise RuntimeError(f"token {t} is outside the request's structured_outputs grammar")
                may_stop = n >= min_tokens  # vLLM: no stop check while fewer are out
                if may_stop and t in stop_ids:  # vLLM's stop_reason: the stop token id (EOS: None)
                    reason, stop_reason = "stop", t
                elif may_stop and t in eos:
                    reason = "stop"
                elif grammar is not None and grammar.terminated:  # its stop token (EOS under ignore_eos)
                    reason = "stop"
                elif n >= limit:
                    reason = "length"
                if det is not None and det.add(t, may_stop):  # a stop string completed: it wins, text cut
                    reason, stop_reason = "stop", det.stop_str
                if reason:
                    break
            if reason and det is not None:
                det.finish(out)
        except BaseException:
            del out[n0:]  # ... and cut back if anything failed, so the request is exactly as it was
            if grammar is not None:
                grammar.rollback_to(n0)
            raise
        if lps is not None:
            req.logprobs += lps[:n - n0]
        if det is not None:
            req.detok, req.text = det, det.text
        self._touched[req.request_id] = req
        if reason:
            req.stop_reason = stop_reason
            self._finish(req, reason)

    # ---- finishing ----------------------------------------------------------------------------
    def _finish(self, req: Request, reason: str) -> None:
        det = req.detok
        if det is not None and det.pending and (reason == "abort" or det.deferred):
            # flush a held-back partial character, as a finish by stop or length does (a deferred text: all
            # of it, also for an error)
            try:
                det = det.fork()
                det.finish(req.output_token_ids)
                req.detok, req.text = det, det.text
            except Exception as e:  # the request is over anyway: keep the text committed so far
                log.warning("request %s: final detokenization failed (%s): %s", req.request_id, reason, e)
        self.scheduler.finish(req, reason)
        self._forget(req)
        self._touched[req.request_id] = req

    def _fail(self, req: Request, error: str) -> None:
        """Finish one request with finish_reason "error"; the engine and the other requests go on. Its text
        stays what was committed (no final flush: the detokenizer may be what failed)."""
        log.error("request %s failed: %s", req.request_id, error)
        req.error = error
        self._finish(req, "error")

    # ---- deltas -------------------------------------------------------------------------------
    def _deltas(self, touched: list[Request]) -> list[RequestDelta]:
        """One delta per request in `touched` (the requests changed since the last step() returned, in order
        of change)."""
        deltas, last, finished = [], None, Status.FINISHED
        now = time.monotonic()  # the step's token times (RequestMetrics): one clock read per step, every path
        for i, req in enumerate(touched):
            if req.group is None and req.status is not finished and req.params.logprobs is None:
                # `_delta` of a running request of its own without logprobs (no output to build)
                det, text = req.detok, ""
                if det is not None and not det.deferred:  # a deferred text is "" until the request finishes
                    end = det.safe_length(False)
                    if end > req.num_text_sent:
                        text, req.num_text_sent = det.text[req.num_text_sent:end], end
                n0, out = req.num_tokens_sent, req.output_token_ids
                req.num_tokens_sent = n = len(out)
                if n > n0:
                    _stamp(req, now)
                deltas.append(RequestDelta(req.request_id, out[n0:], text, None, req.finish_reason,
                                           len(req.prompt_token_ids), n, req.error, None, req.index,
                                           req.first_scheduled_time))
                continue
            if last is None:  # a finished request's output rides on its last delta; only samples of n share an id
                last = {r.group_id: j for j, r in enumerate(touched) if r.group is not None}
            deltas.append(self._delta(req, req.group is None or i == last[req.group_id], now))
        return deltas

    def _delta(self, req: Request, last_of_request: bool = True, now: float | None = None) -> RequestDelta:
        """Everything new since the completion's previous delta; text only up to what no stop can still cut."""
        out, det, group = req.output_token_ids, req.detok, req.group
        n0, n, done = req.num_tokens_sent, len(out), req.status is Status.FINISHED
        lps = req.logprobs[n0:] if req.params.logprobs is not None else None
        text = ""
        if det is not None:  # req.text is req.detok.text: they are committed together
            end = det.safe_length(done)
            if end > req.num_text_sent:
                text, req.num_text_sent = det.text[req.num_text_sent:end], end
        req.num_tokens_sent = n
        if n > n0:
            _stamp(req, time.monotonic() if now is None else now)
        all_done = done and last_of_request and (group is None or group.finished)
        return RequestDelta(req.request_id if group is None else group.request_id, out[n0:], text, lps,
                            req.finish_reason, len(req.prompt_token_ids), n, req.error,
                            req.to_output() if all_done else None, req.index, req.first_scheduled_time)


def _stamp(req: Request, now: float) -> None:
    """req handed out new tokens in the step that ended at `now`: its latest (and maybe first) token time."""
    req.last_token_time = now
    if req.first_token_time is None:
        req.first_token_time = now
