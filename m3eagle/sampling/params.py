"""SamplingParams: what a request asks for, validated when it is made.

Every field is checked for its type and range here, before a request can reach the engine: a value
that would only fail inside a step (an int64 overflow on the device, say) is refused up front with
a `SamplingParamsError` naming the field. The checks run at construction and again (`validate()`) when
a request is submitted, so fields assigned in between are checked too.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are greedy (vLLM's rule): 1/T overflows fp32 long before T reaches 0, and a
# temperature of 1e-40 would otherwise turn every logit into inf and the distribution into NaN.
GREEDY_EPS = 1e-5
# Seeds feed an int64 hash on the device; a top_k at or above this is "no limit" (no vocab is larger).
_INT63 = 2**63
_TOPK_NO_LIMIT = 2**31
# The engine computes this many top candidates per sampled position whenever some row wants logprobs (a fixed
# width keeps the step's shapes static for CUDA graphs); vLLM's default max_logprobs is the same 20.
MAX_LOGPROBS = 20
# min_tokens holds stop_token_ids back on the device; their ids travel in the step's fixed-size packed input
# buffers (what a CUDA graph or another rank reads), which hold this many per request.
MAX_MIN_TOKENS_STOP_IDS = 64


class SamplingParamsError(ValueError):
    pass


def _is_int(x: object) -> bool:
    """A real integer: int or numpy/torch integer scalars, never bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and type(x).__name__ != "bool_"


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and type(x).__name__ != "bool_"


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's StructuredOutputsParams): exactly one of a JSON schema (`json`, a
    dict or its JSON text), a regular expression, a list of choices, an EBNF grammar (xgrammar's dialect,
    rule `root`) or `json_object=True` (any JSON object). The engine compiles it with xgrammar
    (sampling/structured.py) and masks every sampled position with it, speculation included."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """The one field that is set: json, regex, choice, grammar or json_object."""
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        """Exactly one constraint, of the right type; SamplingParamsError names the field."""
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError(f"structured_outputs sets {given or 'nothing'}: set exactly one of "
                                      f"{', '.join(_STRUCTURED_KINDS)}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise SamplingParamsError(f"structured_outputs.json is not valid JSON ({e}); give a JSON schema "
                                          "as a dict or its JSON text") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise SamplingParamsError(f"structured_outputs.json={self.json!r} must be a JSON schema: a dict (or "
                                      "its JSON text)")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise SamplingParamsError(f"structured_outputs.{name}={v!r} must be a non-empty string")
        c = self.choice
        if c is not None and (not isinstance(c, (list, tuple)) or not c
                              or any(not isinstance(x, str) or not x for x in c)):
            raise SamplingParamsError(f"structured_outputs.choice={c!r} must be a non-empty list of non-empty "
                                      "strings")
        if c is not None:
            self.choice = list(c)
        if self.json_object not in (None, True, False):
            raise SamplingParamsError(f"structured_outputs.json_object={self.json_object!r} must be True or None")


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or below GREEDY_EPS) means greedy
    top_k: int = 0  # 0 or -1: off; values >= 2**31 also mean no limit
    top_p: float = 1.0  # in (0, 1]
    max_tokens: int = 16
    seed: int | None = None  # in [0, 2**63); a per-request seed reproduces the same output
    stop: list[str] = field(default_factory=list)  # stop strings (excluded from .text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # vLLM's meaning: None = no logprobs; N >= 0 = per output token a dict token_id -> Logprob holding the top N
    # candidates plus the sampled token (so N = 0 gives the sampled token's alone).
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (raw model logits)
    n: int = 1  # independent samples of the prompt (they share its KV pages)
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from the logit of every token already output
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0: logits of prompt or output tokens: > 0 divided, <= 0 multiplied
    min_tokens: int = 0  # EOS and stop tokens are held back until this many tokens are out
    min_p: float = 0.0  # in [0, 1]: drop tokens whose probability is below min_p x the top probability
    include_stop_str_in_output: bool = False  # keep the stop string that ended the output in .text
    # The output must match a JSON schema / regex / choice / grammar (a dict with those keys is accepted too)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check (and normalise) every field, raising SamplingParamsError naming the first bad one. The
        constructor calls it, and LLM.generate calls it again for every request it submits, since a field
        assigned after construction (`sp.n = 0`) would otherwise skip the checks."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise SamplingParamsError(f"temperature={t!r} must be a finite number >= 0 (0 means greedy)")
        self.temperature = float(t)
        if self.top_k is None or (_is_int(self.top_k) and self.top_k == -1):
            self.top_k = 0
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SamplingParamsError(f"top_k={self.top_k!r} must be a non-negative int (0 or -1 disables it)")
        self.top_k = int(self.top_k) if self.top_k < _TOPK_NO_LIMIT else 0
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise SamplingParamsError(f"top_p={self.top_p!r} must be a number in (0, 1]")
        self.top_p = float(self.top_p)
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens < _INT63:
            raise SamplingParamsError(f"max_tokens={self.max_tokens!r} must be an int in [1, 2**63)")
        self.max_tokens = int(self.max_tokens)
        if self.seed is not None:
            if not _is_int(self.seed) or not 0 <= self.seed < _INT63:
                raise SamplingParamsError(f"seed={self.seed!r} must be an int in [0, 2**63) or None")
            self.seed = int(self.seed)
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or s == "" for s in self.stop):
            raise SamplingParamsError(f"stop={self.stop!r} must be a string or a list of non-empty strings")
        self.stop = list(self.stop)
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or any(not _is_int(t) or not 0 <= t < _INT63 for t in ids):
            raise SamplingParamsError(f"stop_token_ids={ids!r} must be a list of non-negative ints")
        self.stop_token_ids = [int(t) for t in ids]
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name}={getattr(self, name)!r} must be True or False")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if isinstance(v, bool):  # the old boolean `logprobs` meant the sampled token's logprob only
                raise SamplingParamsError(f"{name}={v!r}: {name} is an int or None (vLLM's meaning): the number of "
                                          f"top candidates per token; {name}=0 returns the sampled token's alone")
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise SamplingParamsError(f"{name}={v!r} must be None or an int in [0, {MAX_LOGPROBS}]")
            setattr(self, name, None if v is None else int(v))
        if not _is_int(self.n) or not 1 <= self.n <= 1024:
            raise SamplingParamsError(f"n={self.n!r} must be an int in [1, 1024]")
        self.n = int(self.n)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                raise SamplingParamsError(f"{name}={v!r} must be a number in [-2, 2] (0 disables it)")
            setattr(self, name, float(v))
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(r) or r <= 0:
            raise SamplingParamsError(f"repetition_penalty={r!r} must be a finite number > 0 (1 disables it)")
        self.repetition_penalty = float(r)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError(f"min_tokens={self.min_tokens!r} must be an int in [0, max_tokens="
                                      f"{self.max_tokens}]")
        self.min_tokens = int(self.min_tokens)
        if self.min_tokens and len(self.stop_token_ids) > MAX_MIN_TOKENS_STOP_IDS:
            raise SamplingParamsError(f"min_tokens={self.min_tokens} with {len(self.stop_token_ids)} stop_token_ids: "
                                      f"at most {MAX_MIN_TOKENS_STOP_IDS} stop ids can be held back")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p={self.min_p!r} must be a number in [0, 1] (0 disables it)")
        self.min_p = float(self.min_p)
        so = self.structured_outputs
        if isinstance(so, dict):
            bad = sorted(set(so) - set(_STRUCTURED_KINDS))
            if bad:
                raise SamplingParamsError(f"structured_outputs has unknown keys {bad}; the keys are "
                                          f"{', '.join(_STRUCTURED_KINDS)}")
            so = self.structured_outputs = StructuredOutputsParams(**so)
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise SamplingParamsError(f"structured_outputs={so!r} must be a StructuredOutputsParams, a dict "
                                          "of its fields, or None")
            so.validate()
            if self.min_tokens:
                # a grammar that is complete allows only EOS, which min_tokens holds back: nothing would be left
                raise SamplingParamsError(f"min_tokens={self.min_tokens} cannot be combined with "
                                          "structured_outputs; leave min_tokens at 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether the target distribution depends on the request's token history (sampling/penalties.py)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0)
