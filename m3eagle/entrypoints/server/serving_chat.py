"""/v1/chat/completions: render the conversation with the model's chat template, run it, and answer in the
chat shape (a message, or `chat.completion.chunk` events). A mixin of OpenAIServer, whose request plumbing
(readiness, tokenizing off the event loop, sampling parameters, queueing, collecting) it uses.

Tools and reasoning: `tools` are checked and rendered by the template; each reply goes through the server's
reasoning parser and, unless tool_choice is "none", its tool-call parser (entrypoints/parsers), giving
`reasoning_content`, `content` and `tool_calls` (finish_reason "tool_calls" when a reply that stopped by
itself called tools), streamed as `delta.reasoning_content` / `delta.content` / `delta.tool_calls`.
`required` and a named tool_choice are enforced with a grammar (tools.tool_call_grammar), which the request
carries as its structured output; the parsed reply is still checked (a miss is logged) as a safety net."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from m3eagle.engine.request import PositionLogprobs
from m3eagle.entrypoints.chat import ChatTemplateError, find_invalid_text
from m3eagle.entrypoints.parsers import ChatOutputParser
from m3eagle.entrypoints.parsers.reasoning import prompt_position
from m3eagle.entrypoints.parsers.registry import REASONING_PARSERS
from m3eagle.entrypoints.server.protocol import ApiError, ChatCompletionRequest, TokenizeRequest, refuse_unsupported
from m3eagle.entrypoints.server.streams import Call, SSEResponse, delta_logprobs, token_entries
from m3eagle.entrypoints.tools import (
    ToolChoice,
    ToolsError,
    check_tools,
    prepare_tool_calls,
    resolve_tool_choice,
    tool_call_grammar,
)

log = logging.getLogger("m3eagle")


class ChatServing:
    """The chat completions endpoint, mixed into OpenAIServer."""

    def _chat_tools(self, body: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, ToolChoice]:
        """The request's checked tools and tool choice (a 400 naming the field)."""
        try:
            tools = check_tools(body.tools) if body.tools is not None else None
            choice = resolve_tool_choice(body.tool_choice, tools)
        except ToolsError as e:
            raise ApiError(400, str(e), e.param) from None
        if choice.parses_calls and self.tool_call_parser is None:
            raise ApiError(400, f"tool_choice {choice.mode!r} needs a tool-call parser: this server runs with "
                           "--tool-call-parser none; send tool_choice 'none' or restart it with --tool-call-parser "
                           "minimax_m3", "tool_choice")
        if choice.mode == "auto" and not self.enable_auto_tool_choice:
            raise ApiError(400, "tool_choice 'auto' needs --enable-auto-tool-choice on the server; send 'none', "
                           "'required' or a named function", "tool_choice")
        return tools, choice

    def _reply_parser(self, prompt: str, tools: list[dict[str, Any]] | None,
                      choice: ToolChoice) -> ChatOutputParser | None:
        """A parser for one reply (None: the text is the content, as written)."""
        reasoning = REASONING_PARSERS[self.reasoning_parser].for_prompt(prompt) if self.reasoning_parser else None
        tools = tools if choice.parses_calls else None
        return ChatOutputParser(reasoning, tools) if reasoning is not None or tools is not None else None

    def _tool_grammar(self, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None, choice: ToolChoice,
                      prompt: str) -> None:
        """Give `required` / a named tool_choice its grammar (the request's structured output from here on),
        with the reasoning segment the reply parser expects before the call."""
        reasoning = prompt_position(prompt) if self.reasoning_parser else None
        body._tool_grammar = tool_call_grammar(choice, tools, reasoning)

    @staticmethod
    def _check_tool_choice(choice: ToolChoice, names: list[str], request_id: str) -> None:
        """required / named, checked on the parsed reply as well as enforced by the grammar: a reply cut by
        max_tokens (or a parser and grammar that disagree) is logged and returned as written."""
        if choice.mode == "required" and not names:
            log.warning("%s: tool_choice 'required' but the reply calls no tool", request_id)
        elif choice.mode == "named" and (not names or set(names) != {choice.name}):
            log.warning("%s: tool_choice names %r but the reply calls %s", request_id, choice.name,
                        names or "no tool")

    def _chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest,
                     tools: list[dict[str, Any]] | None = None) -> tuple[list[int], str]:
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
            try:
                messages.append(prepare_tool_calls(d, f"messages[{i}]"))
            except ToolsError as e:
                raise ApiError(400, str(e), e.param) from None
        kwargs = dict(body.chat_template_kwargs or {})
        bad = find_invalid_text(kwargs)
        if bad is not None:
            raise ApiError(400, f"chat_template_kwargs.{bad} is not valid Unicode (a lone surrogate)",
                           "chat_template_kwargs")
        try:
            text = self.chat_template.render(messages, body.add_generation_prompt, body.continue_final_message,
                                             tools, **kwargs)
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
        tools, choice = self._chat_tools(body)
        ids, text = await self._off_loop(self._chat_prompt, body, tools)
        if not ids:
            raise ApiError(400, "the rendered chat prompt is empty", "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        n_top = (body.top_logprobs or 0) if body.logprobs else None
        self._tool_grammar(body, tools, choice, text)
        params = self._sampling_params(body, len(ids), max_tokens, n_top)
        await self._compile_grammar(body, params)
        call = self._add([(ids, params, text)], "chatcmpl", bool(body.stream), body.n)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return SSEResponse(self._chat_events(call, usage, n_top, lambda: self._reply_parser(text, tools, choice),
                                                 choice))
        outs = await self._finished(call, request)
        if isinstance(outs, Response):
            return outs
        out = outs[0]
        choices = []
        for c in out.outputs:
            message, finish = self._message(c.text or "", self._reply_parser(text, tools, choice), c.finish_reason)
            self._check_tool_choice(choice, [t["function"]["name"] for t in message.get("tool_calls", [])],
                                    call.request_id)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._chat_logprobs(c.token_ids, c.logprobs or [], n_top) if n_top is not None
                            else None, "finish_reason": finish, "stop_reason": c.stop_reason})
        return JSONResponse({"id": call.request_id, "object": "chat.completion", "created": int(time.time()),
                             "model": self.model_name, "choices": choices,
                             "usage": self._usage(len(ids), sum(len(c.token_ids) for c in out.outputs), [out])})

    @staticmethod
    def _message(text: str, parser: ChatOutputParser | None, finish_reason: str | None,
                 ) -> tuple[dict[str, Any], str | None]:
        """A whole reply as the assistant message, and its finish_reason ("tool_calls" for a reply that
        stopped by itself after calling tools)."""
        if parser is None:
            return {"role": "assistant", "content": text}, finish_reason
        m = parser.parse(text)
        message: dict[str, Any] = {"role": "assistant", "content": m.content if m.tool_calls else m.content or ""}
        if parser.reasoning is not None:
            message["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return message, finish_reason

    @staticmethod
    def _chat_logprobs(ids: list[int], lps: list[PositionLogprobs], n_top: int) -> dict[str, Any]:
        """The chat shape: per token {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}."""
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": x, "logprob": v, "bytes": list(x.encode())} for x, v in top]}
                            for t, lp, top in token_entries(ids, lps, n_top)]}

    def _chat_events(self, call: Call, include_usage: bool, n_top: int | None,
                     new_parser: Callable[[], ChatOutputParser | None], choice: ToolChoice) -> AsyncIterator[str]:
        head = {"id": call.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}
        parsers: dict[int, ChatOutputParser | None] = {}
        called: dict[int, list[str]] = {}

        def chunk(ds: list, text: str, finish_reason: str | None, index: int, stop_reason) -> dict[str, Any] | None:
            """One choice's chunk; None when the parser holds all of this text back (a marker may be starting)."""
            if index not in parsers:
                parsers[index] = new_parser()
            p = parsers[index]
            if p is None:
                delta: dict[str, Any] = {"content": text} if text else {}
            else:
                d = p.feed(text, final=finish_reason is not None)
                called.setdefault(index, []).extend(t.name for t in d.tool_calls if t.name is not None)
                delta = d.to_openai()
                if finish_reason is not None:
                    self._check_tool_choice(choice, called.get(index, []), call.request_id)
                    if finish_reason == "stop" and p.called:
                        finish_reason = "tool_calls"
            lp = self._chat_logprobs(*delta_logprobs(ds), n_top) if n_top is not None else None
            if not delta and finish_reason is None and lp is None:
                return None
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason,
                    "stop_reason": stop_reason}

        opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                   for i in range(call.n)]
        return self._stream_events(call, include_usage, n_top is not None, head, chunk, opening)
