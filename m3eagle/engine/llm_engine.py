"""The engine loop: schedule, run, process -- with overlap, process step N while step N+1 runs.

Without overlap:  schedule N -> execute N -> wait for N's copy -> process N
With overlap:     schedule N+1 (projected lengths) -> execute N+1 -> process N (host work overlaps
                  the device running N+1)

Processing a step appends tokens, checks stops (EOS, stop ids, stop strings, max_tokens,
max_model_len), detokenizes, records speculative metrics, and finishes requests. A request finished
while a later step that includes it is in flight keeps its pages until that step is processed; that
step's tokens for it are dropped, so nothing past a stop is ever returned.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
from dataclasses import dataclass

import torch

from ..kvcache.page_pool import PagePool
from ..ops import Ops, make_ops
from ..sampling.params import SamplingParams
from .graph_runner import GraphRunner
from .input_builder import StepBuffers
from .model_runner import ModelRunner, StepOutput
from .request import Request, Status
from .scheduler import NeedSync, ScheduledBatch, Scheduler

log = logging.getLogger("m3eagle")


class RequestError(ValueError):
    """A request the engine refuses; the engine keeps serving the others."""


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    num_pages: int = 0  # 0: sized from max_num_seqs and max_model_len
    max_num_tokens: int = 512  # token budget per step
    max_num_seqs: int = 64
    max_model_len: int = 2048
    num_draft_tokens: int = 0
    overlap: bool = False
    enforce_eager: bool = False  # never capture CUDA graphs (vLLM's option)
    # Pad steady decode / verify steps to graph buckets with a fixed KV bound (graph_runner.py). None: on
    # for CUDA, where replay and eager must launch identical shapes; tests turn it on for CPU.
    graph_shapes: bool | None = None

    def resolved_num_pages(self) -> int:
        if self.num_pages:
            return self.num_pages
        per_seq = -(-(self.max_model_len + 2 * (self.num_draft_tokens + 1)) // self.page_size)
        return 1 + per_seq * min(self.max_num_seqs, 16)


class LLMEngine:
    """Owns the scheduler, the page pool and the model runner; `step()` is the whole loop body.

    Thread-safety: every public method takes the engine's lock, so calls from several threads are
    serialised (never interleaved inside a step). Fault tolerance: an exception raised while one
    request's output is processed (detokenization, say) finishes that request with finish_reason
    "error"; anything else raised inside `step()` -- KeyboardInterrupt included -- rolls the engine back
    to host truth (`_recover`) before it propagates, so the next call works."""

    def __init__(self, target, draft, tokenizer, cfg: EngineConfig, dtype: torch.dtype, device: torch.device,
                 ops: Ops | None = None):
        for name in ("max_num_tokens", "max_num_seqs", "max_model_len", "page_size"):
            if getattr(cfg, name) < 1:
                raise ValueError(f"{name}={getattr(cfg, name)} must be >= 1")
        k = cfg.num_draft_tokens if draft is not None else 0
        if k and cfg.max_num_tokens < k + 1:
            raise ValueError(f"max_num_tokens={cfg.max_num_tokens} cannot hold one verify row of 1 + "
                             f"num_draft_tokens={k} tokens; raise max_num_tokens")
        self.cfg, self.k, self.tokenizer = cfg, k, tokenizer
        self.target_cfg = target.cfg
        self.device = device
        num_pages = cfg.resolved_num_pages()
        self.pool = PagePool(num_pages, cfg.page_size)
        self.table_width = -(-(cfg.max_model_len + 2 * (k + 1)) // cfg.page_size) + 1
        if self.table_width - 1 > self.pool.num_usable:
            raise ValueError(f"num_pages={num_pages} cannot hold one sequence of max_model_len="
                             f"{cfg.max_model_len} (needs {self.table_width - 1} pages of {cfg.page_size}); "
                             "raise num_pages or lower max_model_len")
        self.scheduler = Scheduler(self.pool, cfg.max_num_tokens, cfg.max_num_seqs, k, self.table_width - 1)
        self.ops = ops if ops is not None else make_ops("auto", "auto", device)
        # Step buffers hold the widest step: the token budget, or every sequence padded to 1 + K tokens.
        max_tokens = max(cfg.max_num_tokens, cfg.max_num_seqs * (k + 1))
        self.runner = ModelRunner(target, draft, k, num_pages, cfg.page_size, cfg.max_num_seqs, dtype, device,
                                  max_num_tokens=max_tokens)
        self.buffers = StepBuffers(max_tokens, cfg.max_num_seqs, self.table_width, device)
        graph_shapes = cfg.graph_shapes if cfg.graph_shapes is not None else device.type == "cuda"
        self.graphs = GraphRunner(self.runner, self.buffers, k, cfg.max_num_seqs, cfg.page_size, self.table_width,
                                  graphs=not cfg.enforce_eager, ops=self.ops)
        self.graph_shapes = graph_shapes
        self.graphs.capture_startup()
        self.eos_ids = set(target.cfg.eos_token_ids)
        self._ids = itertools.count()
        self._pending: tuple[ScheduledBatch, StepOutput] | None = None
        # Unfinished requests by id (bounded by what callers submit and have not collected); finished
        # requests are handed back by step() and forgotten, so nothing grows in a long-lived process.
        self._live: dict[str, Request] = {}
        self._lock = threading.RLock()
        self._done: list[Request] = []  # finished since the last step() returned (aborts included)
        self.num_steps = 0
        self.sync_debug = False  # on CUDA: run execute() under torch.cuda.set_sync_debug_mode("error")

    # ---- requests -----------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt_ids, list) or any(type(t) is not int for t in prompt_ids):
            raise RequestError("prompt token ids must be a list of int (use prompt_token_ids() to convert "
                               f"numpy or torch ids), got {type(prompt_ids).__name__}")
        if len(prompt_ids) == 0:
            raise RequestError("the prompt is empty; give at least one token")
        if len(prompt_ids) >= self.cfg.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens but max_model_len="
                               f"{self.cfg.max_model_len} leaves no room to generate; shorten the prompt or "
                               "raise max_model_len")
        v = self.target_cfg.vocab_size
        bad = [t for t in prompt_ids if t < 0 or t >= v]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {v})")
        if params.stop and self.tokenizer is None:
            raise RequestError(f"stop={params.stop!r} needs a tokenizer to detokenize, and this model directory has "
                               "no tokenizer.json; add one or use stop_token_ids")
        bad = [t for t in params.stop_token_ids if t >= v]
        if bad:
            raise RequestError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {v})")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None) -> Request:
        """Validate, then queue. Nothing is admitted before every check has passed."""
        with self._lock:
            self.validate(prompt_ids, params)
            if request_id is not None and not isinstance(request_id, str):
                raise RequestError(f"request_id={request_id!r} must be a str")
            if request_id in self._live:
                raise RequestError(f"request_id={request_id!r} is already in use by an unfinished request; "
                                   "give a unique id or None")
            n = next(self._ids)
            seed = params.seed if params.seed is not None else random.getrandbits(31)
            req = Request(request_id or f"req-{n}", list(prompt_ids), params, seed, n, prompt)
            while req.request_id in self._live:  # an auto id taken by a caller's explicit id
                req.request_id = f"req-{n}-{next(self._ids)}"
            req.proj_known = req.num_known
            req.accepted_per_position = [0] * self.k
            req.drafted_per_position = [0] * self.k
            self._live[req.request_id] = req
            self.scheduler.add(req)
            return req

    def abort(self, request_id: str) -> None:
        with self._lock:
            req = self._live.get(request_id)
            if req is not None and not req.finished:
                self._finish(req, "abort")

    def has_work(self) -> bool:
        with self._lock:
            return self.scheduler.has_work() or self._pending is not None

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One iteration; returns the requests it finished (each exactly once, then forgotten)."""
        with self._lock:
            try:
                self._step()
            except BaseException:
                self._recover()
                raise
            done, self._done = self._done, []
            return done

    def _step(self) -> None:
        try:
            batch = self.scheduler.schedule()
        except NeedSync:
            self._drain()
            batch = self.scheduler.schedule()
        if not batch.rows:
            if self._pending is not None:
                self._drain()
            elif self.scheduler.waiting:
                # Nothing runs and the oldest waiting request still does not fit: it never will. Fail it
                # alone; the others keep their turn.
                req = self.scheduler.waiting[0]
                self._fail(req, f"request {req.request_id} ({req.num_known} tokens) cannot be scheduled: the KV "
                           f"pool has {self.pool.num_usable} pages of {self.cfg.page_size}; raise num_pages")
            return
        bucket = self.graphs.bucket(batch) if self.graph_shapes else None
        self.graphs.ensure(batch, bucket)
        inp = self.graphs.build(batch, bucket)
        self.scheduler.commit(batch)
        out = self.runner.to_host(self._execute(inp, bucket))
        self.num_steps += 1
        if self.cfg.overlap:
            pending, self._pending = self._pending, (batch, out)
            if pending is not None:
                self._process(*pending)
        else:
            self._process(batch, out)

    def _execute(self, inp, bucket: int | None) -> StepOutput:
        if self.sync_debug and self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
            try:
                return self.graphs.run(inp, bucket)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return self.graphs.run(inp, bucket)

    def _drain(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._process(*pending)

    def run(self) -> list[Request]:
        done: list[Request] = []
        while self.has_work():
            done += self.step()
        return done

    # ---- fault recovery -------------------------------------------------------------------------
    def _recover(self) -> None:
        """Roll back to host truth after a fault anywhere in a step.

        Host truth is each request's accepted tokens (prompt + output_token_ids); everything else -- KV
        pages, device slots, rows in flight, a half-made plan -- is derived and can be dropped. So every
        unfinished request goes back to waiting (FCFS by arrival) to be recomputed, exactly as a
        preemption would, every finished one lets go of what it held, and the pool and slot list start
        over. A step that was in flight on the device writes only pages that later steps overwrite
        (one stream, in order), so no device state needs undoing."""
        sched = self.scheduler
        reqs = {id(r): r for r in [*self._live.values(), *sched.running, *sched.waiting]}.values()
        for req in reqs:
            req.inflight_rows.clear()
            req.pages, req.slot, req.pending_free, req.slot_valid = [], -1, False, False
            req.num_computed = req.proj_computed = 0
            req.proj_known = req.num_known
            if not req.finished:
                req.status = Status.WAITING
        self._live = {r.request_id: r for r in sorted(reqs, key=lambda r: r.arrival) if not r.finished}
        sched.waiting.clear()
        sched.waiting.extend(self._live.values())
        sched.running.clear()
        sched.free_slots[:] = list(range(self.cfg.max_num_seqs))[::-1]
        self.pool.reset()
        self._pending = None
        log.warning("engine rolled back after a fault: %d unfinished requests will be recomputed", len(self._live))

    def _fail(self, req: Request, error: str) -> None:
        """Finish one request with finish_reason "error"; the engine and the other requests go on."""
        log.error("request %s failed: %s", req.request_id, error)
        req.error = error
        self._finish(req, "error", keep_text=True)

    # ---- processing (host) ----------------------------------------------------------------------
    def _process(self, batch: ScheduledBatch, out: StepOutput) -> None:
        host = out.wait()
        new_tokens, num_new = host["new_tokens"].tolist(), host["num_new"].tolist()
        logprobs = host["logprobs"].tolist() if "logprobs" in host else None
        for i, row in enumerate(batch.rows):
            req = row.req
            req.inflight_rows.remove(row)
            if req.finished:
                if req.pending_free and not req.inflight:
                    self.scheduler.release(req)
                continue
            try:
                self._process_row(req, row, new_tokens[i][: num_new[i]], logprobs[i][: num_new[i]] if logprobs else None)
            except Exception as e:  # this request's fault (a detokenizer error, say), not the engine's
                self._fail(req, f"{type(e).__name__}: {e}")
            req.reproject()

    def _process_row(self, req: Request, row, tokens: list[int], lps: list[float] | None) -> None:
        start = req.num_computed
        if not row.samples:
            req.num_computed = start + row.num_tokens
            return
        a = len(tokens) - 1
        if row.num_drafts:
            req.num_verify_steps += 1
            req.num_drafted += row.num_drafts
            req.num_accepted += a
            for j in range(row.num_drafts):
                req.drafted_per_position[j] += 1
                req.accepted_per_position[j] += int(j < a)
        self._append(req, tokens, lps)
        req.num_computed = start + row.num_tokens - row.num_drafts + a

    def _append(self, req: Request, tokens: list[int], lps: list[float] | None) -> None:
        """Decide first, then mutate: the kept tokens, the finish reason and the text are computed before
        the request changes, so an exception here (a tokenizer error) leaves it as it was."""
        p = req.params
        out = list(req.output_token_ids)
        reason, text = None, None
        for t in tokens:
            out.append(t)
            if (t in self.eos_ids and not p.ignore_eos) or t in p.stop_token_ids:
                reason = "stop"
            elif len(out) >= p.max_tokens or len(req.prompt_token_ids) + len(out) >= self.cfg.max_model_len:
                reason = "length"
            if p.stop and self.tokenizer is not None:
                full = self.tokenizer.decode(out)
                hit = [full.find(s) for s in p.stop if s in full]
                if hit:
                    reason, text = "stop", full[: min(hit)]
            if reason:
                break
        if reason and text is None:
            text = self.tokenizer.decode(out) if self.tokenizer is not None else None
        n_new = len(out) - len(req.output_token_ids)
        if lps is not None:
            req.logprobs += lps[:n_new]
        req.output_token_ids = out
        if reason:
            req.text = text
            self._finish(req, reason, keep_text=True)

    def _finish(self, req: Request, reason: str, keep_text: bool = False) -> None:
        if not keep_text:
            req.text = self.tokenizer.decode(req.output_token_ids) if self.tokenizer is not None else None
        self.scheduler.finish(req, reason)
        self._live.pop(req.request_id, None)
        self._done.append(req)

    # ---- checks -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every piece of engine state agrees with every other (tests call this after runs and faults):
        each unfinished request sits in exactly one queue with a status to match; waiting requests hold
        no pages, slot or rows in flight; slots are each held once or free; no page is leaked or owned
        twice; rows in flight exist only while a step is pending. Raises AssertionError naming the fault."""
        with self._lock:
            sched = self.scheduler
            waiting, running = list(sched.waiting), list(sched.running)
            ids = [id(r) for r in waiting + running]
            if len(ids) != len(set(ids)):
                raise AssertionError("a request is queued twice (waiting and/or running)")
            for rid, r in self._live.items():
                if r.finished or rid != r.request_id:
                    raise AssertionError(f"live table holds {rid!r} ({r.status}) wrongly")
                if id(r) not in set(ids):
                    raise AssertionError(f"request {rid!r} is unfinished but in no queue (lost)")
            for r in waiting:
                if r.status is not Status.WAITING or r.pages or r.slot >= 0 or r.inflight_rows:
                    raise AssertionError(f"waiting request {r.request_id!r} holds state: status={r.status}, "
                                         f"pages={r.pages}, slot={r.slot}, rows in flight={r.inflight}")
                if self._live.get(r.request_id) is not r:
                    raise AssertionError(f"waiting request {r.request_id!r} is not live")
            for r in running:
                if r.finished and not (r.pending_free and r.inflight):
                    raise AssertionError(f"finished request {r.request_id!r} still holds pages/slot with nothing "
                                         "in flight")
                if not r.finished and (r.status is not Status.RUNNING or self._live.get(r.request_id) is not r):
                    raise AssertionError(f"running request {r.request_id!r} has status {r.status} / not live")
                if r.slot < 0:
                    raise AssertionError(f"running request {r.request_id!r} has no slot")
            held = [r.slot for r in running]
            slots = held + list(sched.free_slots)
            if sorted(slots) != list(range(self.cfg.max_num_seqs)):
                raise AssertionError(f"slots held {sorted(held)} + free {sorted(sched.free_slots)} != "
                                     f"0..{self.cfg.max_num_seqs - 1} (leaked or doubled)")
            if self._pending is None and any(r.inflight_rows for r in running):
                raise AssertionError("rows in flight but no step pending")
            self.pool.check_integrity(sched.table_snapshot())

    def is_idle_and_clean(self) -> bool:
        return (not self.has_work() and not self._live and self.pool.num_free == self.pool.num_usable
                and len(self.scheduler.free_slots) == self.cfg.max_num_seqs)
