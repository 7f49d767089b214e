"""Request state (host side), the per-step RequestDelta the engine hands out, and the RequestOutput users get
back. A delta is the streaming unit: `LLM.generate()` and the HTTP server both consume the deltas of
`LLMEngine.step()`; the finishing delta carries the whole RequestOutput."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from m3eagle.sampling.params import SamplingParams


class RequestError(ValueError):
    """A request the engine refuses; the engine keeps serving the others."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    """vLLM's Logprob: one candidate token at one position."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token at that position
    decoded_token: str | None = None  # the token's text (None without a tokenizer)


# Per position: token id -> Logprob, holding the top-N candidates and the sampled (or prompt) token.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's CompletionOutput). `index` is its place among the request's
    n completions (SamplingParams.n)."""

    index: int
    text: str | None  # None when the model has no tokenizer
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs; None unless logprobs were requested
    logprobs: list[PositionLogprobs] | None  # one dict per token; None unless requested
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS
    error: str | None = None  # why, when finish_reason is "error"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Per-request speculation counts (what the draft proposed and what the target kept) and timeline (vLLM's
    RequestMetrics times, in time.monotonic() seconds: differences are what mean something)."""

    num_drafted: int = 0  # draft tokens proposed to the target
    num_accepted: int = 0  # of those, accepted
    num_verify_steps: int = 0  # steps in which this request verified drafts
    accepted_per_position: list[int] = field(default_factory=list)  # accepted count at draft position i
    drafted_per_position: list[int] = field(default_factory=list)
    # (compare=False: two runs of the same requests give equal outputs whatever the clock said)
    arrival_time: float | None = field(default=None, compare=False)  # add_request queued it
    first_scheduled_time: float | None = field(default=None, compare=False)  # first scheduled (after any wait)
    first_token_time: float | None = field(default=None, compare=False)  # the step that handed out its first token
    last_token_time: float | None = field(default=None, compare=False)  # the step that handed out its latest

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from arrival to the first step that scheduled it (vLLM's meaning)."""
        if self.arrival_time is None or self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    """What a request produced, shaped like vLLM's RequestOutput."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None  # None for the first prompt token; None unless requested
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # Prompt tokens whose KV came from the prefix cache (vLLM's meaning); None with prefix caching off.
    num_cached_tokens: int | None = None


@dataclass
class RequestDelta:
    """What one step changed for one request: tokens and text new since the request's previous delta.

    Text is held back while a stop string could still cut it (see detokenizer.py), so the concatenated
    `text` of a completion's deltas is exactly its final text. A delta belongs to completion `index` of the
    request (0..n-1); each completion gets exactly one delta with `finish_reason` set, and the request's
    last one (`finished`) carries `output`, with all n completions."""

    request_id: str
    token_ids: list[int]  # new tokens
    text: str  # new text ("" without a tokenizer, or while held back)
    logprobs: list[PositionLogprobs] | None  # one per new token when the request asked for logprobs
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" when this completion ended
    num_prompt_tokens: int
    num_output_tokens: int  # this completion's output tokens so far, these included
    error: str | None = None
    output: RequestOutput | None = None  # the whole result, on the request's finishing delta only
    index: int = 0  # which of the request's n completions
    first_scheduled_time: float | None = field(default=None, compare=False)  # RequestMetrics' of this completion

    @property
    def finished(self) -> bool:
        """The whole request (all n completions) is finished."""
        return self.output is not None


@dataclass(frozen=True, slots=True)
class StopConditions:
    """What can end a request's output, read once from its params when it is added (`of`), so that output
    processing reads one object instead of five params fields and a length per row per step. NOTE: as for
    the sampling constants (input_builder.SlotParams), params changed in place after add_request are not seen.
    """

    limit: int  # the output ends ("length") at this many tokens: max_tokens, or what max_model_len leaves
    min_tokens: int  # no stop id, EOS or stop string ends the output before this many tokens are out
    stop_ids: frozenset[int]  # stop_token_ids: they end it with stop_reason = the id
    eos: frozenset[int]  # EOS ids (empty with ignore_eos): they end it with stop_reason None
    any_id: frozenset[int]  # stop_ids | eos: one disjointness test tells that no id ends a step's tokens
    strings: bool  # stop strings or a grammar: only a check of every token can see those

    @classmethod
    def of(cls, params: SamplingParams, prompt_len: int, max_model_len: int, eos_ids: set[int] | frozenset[int],
           strings: bool) -> StopConditions:
        stop_ids, eos = frozenset(params.stop_token_ids), frozenset(() if params.ignore_eos else eos_ids)
        return cls(min(params.max_tokens, max_model_len - prompt_len), params.min_tokens, stop_ids, eos,
                   stop_ids | eos, strings)


def per_position_counts(hist: list[int]) -> list[int]:
    """Counts per draft position from a histogram of per-step counts: entry j counts the steps whose count
    exceeded j (hist[i]: steps of count i), a suffix sum of hist[1:]."""
    out, run = [], 0
    for h in reversed(hist[1:]):
        run += h
        out.append(run)
    return out[::-1]


# eq=False: a request is its identity. The generated __eq__ compares every field (token lists included),
# and queues test membership with it: that was half of the host's time per step at batch 32.
@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)  # filled while prefilling
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that finished it
    error: str | None = None
    # KV bookkeeping (host truth as of the last processed step)
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)
    slot: int = -1  # persistent device-buffer index while running
    # Projection while a step is in flight: the host assumes every draft is accepted.
    proj_computed: int = 0
    proj_known: int = 0
    inflight_rows: list = field(default_factory=list)  # rows launched, outputs not yet processed
    slot_valid: bool = False  # device slot buffers hold this request's latest sampled token + drafts
    pending_free: bool = False
    # Output text: committed together with output_token_ids (None when the model has no tokenizer).
    text: str | None = ""
    detok: Any = None  # IncrementalDetokenizer (detokenizer.py) of the committed tokens; None without tokenizer
    # What the deltas have handed out so far.
    num_tokens_sent: int = 0
    num_text_sent: int = 0
    # speculative metrics: per verify step one increment of each histogram, by the step's number of drafts and
    # of accepted drafts (K + 1 entries each; the per-position counts and totals are derived from them)
    num_accepted: int = 0
    draft_hist: list[int] = field(default_factory=list)
    accept_hist: list[int] = field(default_factory=list)
    stops: StopConditions | None = None  # set by LLMEngine.add_request
    # n samples: completion `index` of the request `group` (SamplingParams.n); the group's id is the user's.
    index: int = 0
    group: RequestGroup | None = None
    # A sample that shares its parent's prompt pages: the parent, and the first position it computes itself
    # (0 when it computes everything). Reset by preemption and recovery.
    fork_src: Request | None = None
    fork_len: int = 0
    # Structured output: this sequence's grammar matcher (sampling/structured.RequestGrammar), or None.
    grammar: Any = None
    # Prefix caching: the keys of its full pages so far (engine/prefix_keys.py), how many of its table's
    # pages are registered in the cache (reset with its pages), and the prompt tokens its first admission
    # found cached (None until admitted; RequestOutput.num_cached_tokens).
    page_keys: list[bytes] = field(default_factory=list)
    num_registered: int = 0
    num_cached_tokens: int | None = None
    # Timeline (time.monotonic() seconds; RequestMetrics): made by add_request, set at the first admission (kept across
    # preemptions) and by the steps whose deltas hand out its first / latest output tokens (every output path).
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def num_verify_steps(self) -> int:
        """Steps in which this request verified drafts."""
        return sum(self.draft_hist[1:])

    @property
    def num_drafted(self) -> int:
        """Draft tokens proposed to the target."""
        return sum(i * h for i, h in enumerate(self.draft_hist))

    @property
    def drafted_per_position(self) -> list[int]:
        """Draft tokens proposed at draft position j (0-based), per j: a fresh list."""
        return per_position_counts(self.draft_hist)

    @property
    def accepted_per_position(self) -> list[int]:
        """Draft tokens accepted at draft position j (0-based), per j: a fresh list."""
        return per_position_counts(self.accept_hist)

    @property
    def inflight(self) -> int:
        return len(self.inflight_rows)

    def reproject(self) -> None:
        """Projected lengths = host truth + the effect of every row still in flight, assuming all of
        its drafts are accepted (an upper bound the device corrects)."""
        self.proj_computed, self.proj_known = self.num_computed, len(self.prompt_token_ids) + len(self.output_token_ids)
        for row in self.inflight_rows:
            self._fold(row)

    def retract(self, n: int) -> None:
        """Host truth just moved n tokens less than the projection had assumed (drafts rejected by rows
        now processed). The projection is host truth + the folds of the rows in flight, and gather rows'
        folds are additive, so it moves back by exactly n; a prompt chunk in flight (its fold sets the
        length) makes it recompute instead. n = 0 (all accepted): it stands as it is."""
        if not n:
            return
        if any(not r.gather for r in self.inflight_rows):
            self.reproject()
        else:
            self.proj_computed -= n
            self.proj_known -= n

    def project(self, row) -> None:
        """A row was launched: put it in flight and fold it into the projection, as reproject() would.
        The projection is current whenever a row is planned (every change of host truth reprojects), so
        this one fold step is all that changes."""
        self.inflight_rows.append(row)
        self._fold(row)

    def _fold(self, row) -> None:
        """One in-flight row's effect on the projection (all its drafts accepted)."""
        self.proj_computed = (self.proj_computed if row.gather else row.start) + row.num_tokens
        if row.samples:
            self.proj_known += 1 + row.num_drafts

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_known(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def group_id(self) -> str:
        """The id the user knows: the group's for a sample of n, else the request's own."""
        return self.group.request_id if self.group is not None else self.request_id

    def completion(self) -> CompletionOutput:
        lps = list(self.logprobs) if self.params.logprobs is not None else None
        cum = sum(d[t].logprob for t, d in zip(self.output_token_ids, lps)) if lps is not None else None
        return CompletionOutput(self.index, self.text, list(self.output_token_ids), cum, lps, self.finish_reason,
                                self.stop_reason, self.error)

    def to_output(self) -> RequestOutput:
        members = self.group.members if self.group is not None else [self]
        metrics = RequestMetrics(sum(r.num_drafted for r in members), sum(r.num_accepted for r in members),
                                 sum(r.num_verify_steps for r in members),
                                 [sum(x) for x in zip(*(r.accepted_per_position for r in members))],
                                 [sum(x) for x in zip(*(r.drafted_per_position for r in members))],
                                 min(r.arrival_time for r in members), _earliest(r.first_scheduled_time for r in members),
                                 _earliest(r.first_token_time for r in members),
                                 max((r.last_token_time for r in members if r.last_token_time is not None),
                                     default=None))
        first = members[0]
        plp = list(first.prompt_logprobs) if self.params.prompt_logprobs is not None else None
        return RequestOutput(self.group_id, self.prompt, list(self.prompt_token_ids), plp,
                             [r.completion() for r in members], all(r.finished for r in members), metrics,
                             first.num_cached_tokens)


def _earliest(times) -> float | None:
    """The earliest of the times that are set, or None."""
    return min((t for t in times if t is not None), default=None)


@dataclass(eq=False)
class RequestGroup:
    """The n samples of one prompt (SamplingParams.n): member i is completion i; member 0 prefills the prompt
    and the others share its full prompt pages (Scheduler._fork)."""

    request_id: str
    members: list[Request] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.members)
