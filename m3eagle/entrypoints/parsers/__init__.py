"""Parsers of MiniMax-M3's chat output: reasoning (`<mm:think>`), tool calls (`]<]minimax[>[<tool_call>`), and
the two together as an OpenAI message, whole or streamed."""

from m3eagle.entrypoints.parsers.output import ChatOutputParser, MessageDelta, ParsedMessage, parse_output
from m3eagle.entrypoints.parsers.reasoning import ReasoningParser
from m3eagle.entrypoints.parsers.tool_calls import ToolCallDelta, ToolCallParser

__all__ = ["ChatOutputParser", "MessageDelta", "ParsedMessage", "ReasoningParser", "ToolCallDelta",
           "ToolCallParser", "parse_output"]
