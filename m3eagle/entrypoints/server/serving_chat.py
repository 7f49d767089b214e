"""/v1/chat/completions: render the conversation with the model's chat template, run it, and answer in the
chat shape (a message, or `chat.completion.chunk` events). A mixin of OpenAIServer, whose request plumbing
(readiness, tokenizing off the event loop, sampling parameters, queueing, collecting) it uses."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from m3eagle.engine.request import PositionLogprobs
from m3eagle.entrypoints.chat import ChatTemplateError, find_invalid_text
from m3eagle.entrypoints.server.protocol import ApiError, ChatCompletionRequest, TokenizeRequest, refuse_unsupported
from m3eagle.entrypoints.server.streams import Call, SSEResponse, delta_logprobs, token_entries


class ChatServing:
    """The chat completions endpoint, mixed into OpenAIServer."""

    def _chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest) -> tuple[list[int], str]:
        """Render and tokenize; runs on the tokenizer pool."""
        if self.chat_template is None:
            raise ApiError(400, "this model has no chat_template (tokenizer_config.json or chat_template.jinja); "
                           "use /v1/completions", "messages")
        if self.llm.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer.json, which chat needs; use /v1/completions with "
                           "token ids", "messages")
        messages = []
        for i, m in enumerate(body.messages):
            d = m.model_dump()
            c = m.content
            d["content"] = c if isinstance(c, str) else "".join(part.text for part in c or [])
            bad = find_invalid_text({k: v for k, v in d.items()})
            if bad is not None:
                raise ApiError(400, f"messages[{i}].{bad} is not valid Unicode: it holds a lone surrogate (text "
                               "must encode as UTF-8)", f"messages[{i}].{bad}")
            messages.append(d)
        kwargs = dict(body.chat_template_kwargs or {})
        bad = find_invalid_text(kwargs)
        if bad is not None:
            raise ApiError(400, f"chat_template_kwargs.{bad} is not valid Unicode (a lone surrogate)",
                           "chat_template_kwargs")
        try:
            text = self.chat_template.render(messages, body.add_generation_prompt, body.continue_final_message,
                                             **kwargs)
        except ChatTemplateError as e:
            msg = str(e)
            param = "chat_template_kwargs" if msg.startswith("chat_template_kwargs") or any(
                k in msg for k in kwargs) else "messages"
            raise ApiError(400, msg, param) from None
        return self._encode(text, "messages"), text

    async def _chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_ready()
        self._check_model(body.model)
        refuse_unsupported(body)
        ids, text = await self._off_loop(self._chat_prompt, body)
        if not ids:
            raise ApiError(400, "the rendered chat prompt is empty", "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        n_top = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling_params(body, len(ids), max_tokens, n_top)
        call = self._add([(ids, params, text)], "chatcmpl", bool(body.stream), body.n)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return SSEResponse(self._chat_events(call, usage, n_top))
        outs = await self._finished(call, request)
        if isinstance(outs, Response):
            return outs
        out = outs[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text or ""},
                    "logprobs": self._chat_logprobs(c.token_ids, c.logprobs or [], n_top) if n_top is not None
                    else None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
        return JSONResponse({"id": call.request_id, "object": "chat.completion", "created": int(time.time()),
                             "model": self.model_name, "choices": choices,
                             "usage": self._usage(len(ids), sum(len(c.token_ids) for c in out.outputs))})

    @staticmethod
    def _chat_logprobs(ids: list[int], lps: list[PositionLogprobs], n_top: int) -> dict[str, Any]:
        """The chat shape: per token {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}."""
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": x, "logprob": v, "bytes": list(x.encode())} for x, v in top]}
                            for t, lp, top in token_entries(ids, lps, n_top)]}

    def _chat_events(self, call: Call, include_usage: bool, n_top: int | None) -> AsyncIterator[str]:
        head = {"id": call.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}

        def chunk(ds: list, text: str, finish_reason: str | None, index: int, stop_reason) -> dict[str, Any]:
            return {"index": index, "delta": {"content": text} if text else {},
                    "logprobs": self._chat_logprobs(*delta_logprobs(ds), n_top) if n_top is not None else None,
                    "finish_reason": finish_reason, "stop_reason": stop_reason}

        opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                   for i in range(call.n)]
        return self._stream_events(call, include_usage, n_top is not None, head, chunk, opening)
