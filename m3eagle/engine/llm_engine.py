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
from dataclasses import dataclass

import torch

from ..kvcache.page_pool import PagePool
from ..sampling.params import SamplingParams
from .input_builder import build_step_input
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

    def resolved_num_pages(self) -> int:
        if self.num_pages:
            return self.num_pages
        per_seq = -(-(self.max_model_len + 2 * (self.num_draft_tokens + 1)) // self.page_size)
        return 1 + per_seq * min(self.max_num_seqs, 16)


class LLMEngine:
    def __init__(self, target, draft, tokenizer, cfg: EngineConfig, dtype: torch.dtype, device: torch.device):
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
        self.runner = ModelRunner(target, draft, k, num_pages, cfg.page_size, cfg.max_num_seqs, dtype, device)
        self.eos_ids = set(target.cfg.eos_token_ids)
        self._ids = itertools.count()
        self._pending: tuple[ScheduledBatch, StepOutput] | None = None
        self.finished: list[Request] = []
        self.num_steps = 0
        self.sync_debug = False  # on CUDA: run execute() under torch.cuda.set_sync_debug_mode("error")

    # ---- requests -----------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if len(prompt_ids) == 0:
            raise RequestError("the prompt is empty; give at least one token")
        if len(prompt_ids) >= self.cfg.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens but max_model_len="
                               f"{self.cfg.max_model_len} leaves no room to generate; shorten the prompt or "
                               "raise max_model_len")
        v = self.target_cfg.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or t < 0 or t >= v]
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
        self.validate(prompt_ids, params)
        n = next(self._ids)
        seed = params.seed if params.seed is not None else random.getrandbits(31)
        req = Request(request_id or f"req-{n}", list(prompt_ids), params, seed, n, prompt)
        req.proj_known = req.num_known
        req.accepted_per_position = [0] * self.k
        req.drafted_per_position = [0] * self.k
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        for req in list(self.scheduler.waiting) + list(self.scheduler.running):
            if req.request_id == request_id and not req.finished:
                self.scheduler.finish(req, "abort")
                self.finished.append(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._pending is not None

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One iteration; returns requests finished by it."""
        done_before = len(self.finished)
        try:
            batch = self.scheduler.schedule()
        except NeedSync:
            self._drain()
            batch = self.scheduler.schedule()
        if not batch.rows:
            if self._pending is not None:
                self._drain()
                return self.finished[done_before:]
            if self.scheduler.waiting:
                req = self.scheduler.waiting[0]
                raise RuntimeError(f"request {req.request_id} ({req.num_known} tokens) cannot be scheduled: "
                                   f"the KV pool has {self.pool.num_usable} pages of {self.cfg.page_size}; "
                                   "raise num_pages")
            return []
        inp = build_step_input(batch, self.cfg.page_size, self.table_width, self.device)
        self.scheduler.commit(batch)
        out = self._execute(inp)
        self.num_steps += 1
        if self.cfg.overlap:
            if self._pending is not None:
                self._process(*self._pending)
            self._pending = (batch, out)
        else:
            self._process(batch, out)
        return self.finished[done_before:]

    def _execute(self, inp) -> StepOutput:
        if self.sync_debug and self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
            try:
                return self.runner.execute(inp)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return self.runner.execute(inp)

    def _drain(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._process(*pending)

    def run(self) -> None:
        while self.has_work():
            self.step()
        self._drain()

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
            start = req.num_computed
            if not row.samples:
                req.num_computed = start + row.num_tokens
            else:
                a = num_new[i] - 1
                req.num_computed = start + row.num_tokens - row.num_drafts + a
                if row.num_drafts:
                    req.num_verify_steps += 1
                    req.num_drafted += row.num_drafts
                    req.num_accepted += a
                    for j in range(row.num_drafts):
                        req.drafted_per_position[j] += 1
                        req.accepted_per_position[j] += int(j < a)
                self._append(req, new_tokens[i][: num_new[i]], logprobs[i][: num_new[i]] if logprobs else None)
            req.reproject()

    def _append(self, req: Request, tokens: list[int], lps: list[float] | None) -> None:
        p = req.params
        for n, t in enumerate(tokens):
            req.output_token_ids.append(t)
            if lps is not None:
                req.logprobs.append(lps[n])
            reason = None
            if (t in self.eos_ids and not p.ignore_eos) or t in p.stop_token_ids:
                reason = "stop"
            elif len(req.output_token_ids) >= p.max_tokens or req.num_known >= self.cfg.max_model_len:
                reason = "length"
            if p.stop and self.tokenizer is not None:
                text = self.tokenizer.decode(req.output_token_ids)
                hit = [text.find(s) for s in p.stop if s in text]
                if hit:
                    req.text = text[: min(hit)]
                    self._finish(req, "stop", keep_text=True)
                    return
            if reason:
                self._finish(req, reason)
                return

    def _finish(self, req: Request, reason: str, keep_text: bool = False) -> None:
        if not keep_text:
            req.text = self.tokenizer.decode(req.output_token_ids) if self.tokenizer is not None else None
        self.scheduler.finish(req, reason)
        self.finished.append(req)

    # ---- checks -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """No page leaked or owned twice (tests call this after every run)."""
        tables = self.scheduler.table_snapshot()
        for r in self.finished:
            if r.pages:
                tables[r.request_id] = r.pages
        self.pool.check_integrity(tables)

    def is_idle_and_clean(self) -> bool:
        return (not self.has_work() and self.pool.num_free == self.pool.num_usable
                and all(r.status is Status.FINISHED for r in self.finished))
