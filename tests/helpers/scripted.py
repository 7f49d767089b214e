"""Scripted replies for a served model: the server's engine loop is replaced so that each request is answered
with given text chunks (one delta per chunk), so a test controls exactly what the model "writes" and where
the stream splits it -- a trained model is never relied on to emit tool-call markup."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterator

from m3eagle.engine.request import CompletionOutput, RequestDelta, RequestOutput
from m3eagle.entrypoints.server import OpenAIServer
from m3eagle.entrypoints.server.async_engine import RequestStream
from m3eagle.sampling.params import SamplingParams


class ScriptedReplies:
    """Each request gets the next reply (a list of chunks, or (chunks, finish_reason)); every one of its n
    completions writes it. `prompts` / `params` record what each request was rendered and sampled with."""

    def __init__(self, replies: list[list[str] | tuple[list[str], str]]):
        self.replies = list(replies)
        self.prompts: list[str | None] = []
        self.params: list[SamplingParams] = []
        self._ids = itertools.count()

    def add(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None, prefix: str,
            stream_text: bool = True, queue: asyncio.Queue[RequestDelta] | None = None) -> RequestStream:
        reply = self.replies.pop(0)
        chunks, finish = reply if isinstance(reply, tuple) else (reply, "stop")
        self.prompts.append(prompt)
        self.params.append(params)
        rid = f"{prefix}-scripted-{next(self._ids)}"
        stream = RequestStream(rid, len(prompt_ids), queue if queue is not None else asyncio.Queue())
        text = "".join(chunks)
        output = RequestOutput(rid, prompt, prompt_ids, None, [
            CompletionOutput(i, text, [0] * len(chunks), None, None, finish) for i in range(params.n)], True)
        deltas = [RequestDelta(rid, [0], c, None, finish if j == len(chunks) - 1 else None, len(prompt_ids), j + 1,
                               index=i) for i in range(params.n) for j, c in enumerate(chunks)]
        deltas[-1].output = output
        asyncio.get_running_loop().call_soon(lambda: [stream.queue.put_nowait(d) for d in deltas])
        return stream


@contextlib.contextmanager
def scripted(server: OpenAIServer, *replies: list[str] | tuple[list[str], str]) -> Iterator[ScriptedReplies]:
    """`with scripted(server, ["chunk", ...], ...) as s:` the server answers with these replies, in order."""
    s = ScriptedReplies(list(replies))
    real = server.engine_loop.add
    server.engine_loop.add = s.add
    try:
        yield s
    finally:
        server.engine_loop.add = real


def chunked(text: str, size: int) -> list[str]:
    """`text` in pieces of `size` characters (markers end up split across pieces)."""
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]
