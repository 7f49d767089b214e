"""Stream a text through a fresh ChatOutputParser in given chunks and assemble the message from the deltas."""

from __future__ import annotations

import itertools
from typing import Any

from m3eagle.entrypoints.parsers import ChatOutputParser, ParsedMessage, ReasoningParser


def make(tools: list[dict[str, Any]] | None, reasoning: ReasoningParser | None = None,
         prompt: str | None = None, with_reasoning: bool = True) -> ChatOutputParser:
    ids = (f"call_{i}" for i in itertools.count())
    r = (reasoning or ReasoningParser.for_prompt(prompt)) if with_reasoning else None
    return ChatOutputParser(r, tools, lambda: next(ids))


def streamed(chunks: list[str], tools: list[dict[str, Any]] | None, **kw) -> ParsedMessage:
    p = make(tools, **kw)
    ds = [p.feed(c) for c in chunks] + [p.finish()]
    calls: dict[int, dict[str, Any]] = {}
    for d in ds:
        for c in d.tool_calls:
            if c.id is not None:
                assert c.index not in calls, "a call's header comes once"
                calls[c.index] = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
            calls[c.index]["function"]["arguments"] += c.arguments
    return ParsedMessage("".join(d.content for d in ds) or None,
                         "".join(d.reasoning_content for d in ds) or None, [calls[i] for i in sorted(calls)])


def whole(text: str, tools: list[dict[str, Any]] | None, **kw) -> ParsedMessage:
    return make(tools, **kw).parse(text)


def assert_every_split(text: str, tools: list[dict[str, Any]] | None, **kw) -> ParsedMessage:
    """Two chunks split at every position, and one character at a time, all equal the whole parse."""
    want = whole(text, tools, **kw)
    for i in range(len(text) + 1):
        assert streamed([text[:i], text[i:]], tools, **kw) == want, f"split at {i}: {text[:i]!r} | {text[i:]!r}"
    assert streamed(list(text), tools, **kw) == want
    return want
