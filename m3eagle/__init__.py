"""m3eagle: a compact inference engine for MiniMax-M3-family models with one-model Eagle3 speculative
decoding that stays exact under an overlap scheduler."""

from .logging_utils import init_logging

init_logging()  # before anything logs: one handler, level from M3EAGLE_LOGGING_LEVEL

from .engine.request import CompletionOutput, Logprob, RequestMetrics, RequestOutput  # noqa: E402
from .entrypoints.llm import LLM  # noqa: E402
from .sampling.params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "Logprob"]
__version__ = "0.1.0"
