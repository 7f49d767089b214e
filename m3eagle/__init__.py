"""m3eagle: a compact inference engine for MiniMax-M3-family models with one-model Eagle3 speculative
decoding that stays exact under an overlap scheduler."""

from .engine.request import RequestOutput
from .entrypoints.llm import LLM
from .sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
