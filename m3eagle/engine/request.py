"""Request state (host side), the per-step RequestDelta the engine hands out, and the RequestOutput users get
back. A delta is the streaming unit: `LLM.generate()` and the HTTP server both consume the deltas of
`LLMEngine.step()`; the finishing delta carries the whole RequestOutput."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ..sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's CompletionOutput). `index` is its place among the request's
    completions (always 0: one completion per request for now)."""

    index: int
    text: str | None  # None when the model has no tokenizer
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of `logprobs`; None unless logprobs were requested
    logprobs: list[float] | None  # the chosen token's logprob, one per token; None unless requested
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS
    error: str | None = None  # why, when finish_reason is "error"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Per-request speculation counts: what the draft proposed and what the target kept."""

    num_drafted: int = 0  # draft tokens proposed to the target
    num_accepted: int = 0  # of those, accepted
    num_verify_steps: int = 0  # steps in which this request verified drafts
    accepted_per_position: list[int] = field(default_factory=list)  # accepted count at draft position i
    drafted_per_position: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What a request produced, shaped like vLLM's RequestOutput."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: None  # not computed (yet); kept for vLLM's shape
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=RequestMetrics)


@dataclass
class RequestDelta:
    """What one step changed for one request: tokens and text new since the request's previous delta.

    Text is held back while a stop string could still cut it (see detokenizer.py), so the concatenated
    `text` of a request's deltas is exactly its final text. Every request gets exactly one delta with
    `finish_reason` set, and that one carries `output`."""

    request_id: str
    token_ids: list[int]  # new tokens
    text: str  # new text ("" without a tokenizer, or while held back)
    logprobs: list[float] | None  # one per new token when the request asked for logprobs
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" on the last delta
    num_prompt_tokens: int
    num_output_tokens: int  # output tokens so far, these included
    error: str | None = None
    output: RequestOutput | None = None  # the whole result, on the finishing delta only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
    logprobs: list[float] = field(default_factory=list)
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
    # speculative metrics
    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    @property
    def inflight(self) -> int:
        return len(self.inflight_rows)

    def reproject(self) -> None:
        """Projected lengths = host truth + the effect of every row still in flight, assuming all of
        its drafts are accepted (an upper bound the device corrects)."""
        c, k = self.num_computed, self.num_known
        for row in self.inflight_rows:
            c = (c if row.gather else row.start) + row.num_tokens
            if row.samples:
                k += 1 + row.num_drafts
        self.proj_computed, self.proj_known = c, k

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_known(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def to_output(self) -> RequestOutput:
        lps = list(self.logprobs) if self.params.logprobs else None
        out = CompletionOutput(0, self.text, list(self.output_token_ids), sum(lps) if lps is not None else None,
                               lps, self.finish_reason, self.stop_reason, self.error)
        metrics = RequestMetrics(self.num_drafted, self.num_accepted, self.num_verify_steps,
                                 list(self.accepted_per_position), list(self.drafted_per_position))
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), None, [out], self.finished,
                             metrics)
