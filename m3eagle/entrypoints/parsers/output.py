"""A chat reply's text as an OpenAI message: content, reasoning_content and tool_calls, whole or streamed.

The reasoning parser runs first (a call written inside the reasoning is reasoning); the tool-call parser
reads what it leaves as content. Reasoning is trimmed of the whitespace around it, content of the whitespace
next to the markup taken out of it (the model writes newlines beside its tags); a stream holds such
whitespace back until text follows, so the concatenated deltas equal the whole reply's message for any
split into chunks. `parse` is the stream fed in one piece.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from m3eagle.entrypoints.parsers.reasoning import ReasoningParser
from m3eagle.entrypoints.parsers.tool_calls import ToolCallDelta, ToolCallParser, new_tool_call_id


@dataclass
class MessageDelta:
    """What a chunk of output added to the message (empty strings / list: nothing)."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)

    def to_openai(self) -> dict[str, Any]:
        """The streamed `delta` shape (keys only for what is there)."""
        out: dict[str, Any] = {}
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [t.to_openai() for t in self.tool_calls]
        return out


@dataclass
class ParsedMessage:
    """A whole reply. tool_calls in the OpenAI shape: {id, type: "function", function: {name, arguments}}."""

    content: str | None
    reasoning_content: str | None
    tool_calls: list[dict[str, Any]]


class _Trim:
    """A text channel streamed without its leading and trailing whitespace."""

    def __init__(self) -> None:
        self._started, self._pending = False, ""

    def feed(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        body = text.rstrip()
        if not body:
            self._pending += text
            return ""
        out = self._pending + body
        self._pending = text[len(body):]
        return out


def _merge(calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive pieces of one call joined, so a chunk carries one entry per call."""
    out: list[ToolCallDelta] = []
    for c in calls:
        if out and out[-1].index == c.index and c.id is None:
            out[-1].arguments += c.arguments
        else:
            out.append(ToolCallDelta(c.index, c.id, c.name, c.arguments))
    return out


class ChatOutputParser:
    """One reply's parser: `feed` text chunks, then `finish`; each returns a MessageDelta.

    reasoning: a ReasoningParser, or None to keep reasoning in the content. tools: the request's tools
    (None: tool calls are not parsed, markup stays content, as with tool_choice "none")."""

    def __init__(self, reasoning: ReasoningParser | None = None, tools: list[dict[str, Any]] | None = None,
                 id_factory: Callable[[], str] = new_tool_call_id):
        self.reasoning = reasoning
        self.tools = ToolCallParser(tools, id_factory) if tools is not None else None
        self._thought = _Trim()

    @property
    def called(self) -> bool:
        """A tool call was found."""
        return self.tools is not None and self.tools.called

    def finish(self) -> MessageDelta:
        return self.feed("", final=True)

    def feed(self, text: str, final: bool = False) -> MessageDelta:
        """The next chunk; final: it is the last (what was held back for an unfinished marker comes out)."""
        thought, content = "", text
        if self.reasoning is not None:
            r = self.reasoning.feed(text)
            if final:
                end = self.reasoning.finish()
                r.reasoning, r.content = r.reasoning + end.reasoning, r.content + end.content
            thought, content = r.reasoning, r.content
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            t = self.tools.feed(content)
            if final:
                end = self.tools.finish()
                t.content, t.tool_calls = t.content + end.content, t.tool_calls + end.tool_calls
            content, calls = t.content, _merge(t.tool_calls)
        return MessageDelta(content, self._thought.feed(thought), calls)

    def parse(self, text: str) -> ParsedMessage:
        """A whole reply (call on a fresh parser)."""
        a, b = self.feed(text), self.finish()
        calls = _merge(a.tool_calls + b.tool_calls)
        return ParsedMessage(content=(a.content + b.content) or None,
                             reasoning_content=(a.reasoning_content + b.reasoning_content) or None,
                             tool_calls=[{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}} for c in calls])


def parse_output(text: str, tools: list[dict[str, Any]] | None = None, prompt: str | None = None,
                 reasoning: bool = True) -> ParsedMessage:
    """MiniMax-M3 output as an OpenAI message (offline use: `LLM.chat` returns the raw text).
    tools: the tools the prompt offered (their schemas type the arguments; None: calls are not parsed).
    prompt: the rendered prompt, which tells whether the output starts inside its reasoning."""
    return ChatOutputParser(ReasoningParser.for_prompt(prompt) if reasoning else None, tools).parse(text)
