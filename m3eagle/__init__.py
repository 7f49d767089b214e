"""m3eagle: a compact inference engine for MiniMax-M3-family models with one-model Eagle3 speculative
decoding that stays exact under an overlap scheduler."""

from m3eagle.entrypoints.logging_setup import init_logging

init_logging()  # before anything logs: one handler, level from M3EAGLE_LOGGING_LEVEL

from m3eagle.engine.request import CompletionOutput, Logprob, RequestMetrics, RequestOutput  # noqa: E402
from m3eagle.entrypoints.llm import LLM  # noqa: E402
from m3eagle.sampling.params import SamplingParams, StructuredOutputsParams  # noqa: E402
from m3eagle.version import __version__  # noqa: E402

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "RequestMetrics",
           "Logprob", "__version__"]
