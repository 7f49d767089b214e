"""SamplingParams: what a request asks for, validated when it is made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class SamplingParamsError(ValueError):
    pass


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0  # in (0, 1]
    max_tokens: int = 16
    seed: int | None = None  # a per-request seed reproduces the same output
    stop: list[str] = field(default_factory=list)  # stop strings (excluded from .text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # return the logprob of each chosen token

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 means greedy)")
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingParamsError(f"top_k={self.top_k!r} must be a non-negative int (0 or -1 disables it)")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingParamsError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens={self.max_tokens!r} must be an int >= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise SamplingParamsError(f"seed={self.seed!r} must be a non-negative int or None")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise SamplingParamsError(f"stop={self.stop!r} must be a list of non-empty strings")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError(f"stop_token_ids={self.stop_token_ids!r} must be non-negative ints")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
