"""One HTTP call's engine requests on their way back: the call's shared queue of deltas, server-sent events,
and the per-token logprob entries both endpoints build their logprobs from."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi.responses import StreamingResponse

from m3eagle.engine.request import PositionLogprobs, RequestDelta
from m3eagle.entrypoints.server.async_engine import RequestStream


def sse_event(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def delta_logprobs(deltas: list[RequestDelta]) -> tuple[list[int], list[PositionLogprobs]]:
    """The new token ids and their logprobs across a run of streamed deltas (of one completion)."""
    return [t for d in deltas for t in d.token_ids], [x for d in deltas for x in (d.logprobs or [])]


def token_entries(ids: list[int], lps: list[PositionLogprobs | None], n_top: int,
                  decode: Callable[[list[int]], str] | None = None,
                  ) -> list[tuple[str, float | None, list[tuple[str, float]]]]:
    """Per token: (text, logprob, top n_top (text, logprob) by rank) from vLLM-shaped logprob dicts. A token
    without logprobs (the first prompt token, with echo) is decoded by `decode` (its id without one)."""
    out = []
    for t, d in zip(ids, lps):
        if d is None:  # the first prompt token (echo)
            out.append((decode([t]) if decode is not None else str(t), None, []))
            continue
        top = sorted(((x.rank, x.decoded_token or str(tid), x.logprob) for tid, x in d.items()
                      if x.rank is not None and x.rank <= n_top), key=lambda e: e[0])
        own = d[t]
        out.append((own.decoded_token if own.decoded_token is not None else str(t), own.logprob,
                    [(txt, lp) for _, txt, lp in top]))
    return out


async def next_deltas(queue: asyncio.Queue[RequestDelta]) -> list[RequestDelta]:
    """The next delta plus any queued behind it: a client that fell behind gets them as one event, so a
    slow reader costs the event loop one chunk per wake-up, not one per engine step."""
    out = [await queue.get()]
    while not out[-1].finished and not queue.empty():
        out.append(queue.get_nowait())
    return out


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its body generator when it ends -- finished, client gone
    (a disconnect message or a failed send) or cancelled at shutdown -- so the generator's `finally`
    (which aborts the request) runs now rather than whenever the generator is garbage-collected."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the socket closed under a send
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


@dataclass
class Call:
    """The engine requests of one HTTP call (one per prompt; a list of prompts makes several), sharing one
    queue. Choice index = prompt index x n + sample index."""

    streams: list[RequestStream]
    n: int
    queue: asyncio.Queue[RequestDelta] = field(default_factory=asyncio.Queue)

    def __post_init__(self) -> None:
        self.index_streams()

    def index_streams(self) -> None:
        self.prompt_index = {s.request_id: i for i, s in enumerate(self.streams)}

    @property
    def request_id(self) -> str:
        return self.streams[0].request_id

    @property
    def num_prompt_tokens(self) -> int:
        return sum(s.num_prompt_tokens for s in self.streams)

    def choice(self, d: RequestDelta) -> int:
        return self.prompt_index[d.request_id] * self.n + d.index
