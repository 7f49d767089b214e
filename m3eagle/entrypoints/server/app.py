"""`m3eagle serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one LLMEngine.

Routes: GET /health (200 once ready, 503 while starting or draining), GET /v1/models,
POST /v1/completions, POST /v1/chat/completions (stream: true answers in server-sent events ending in
`data: [DONE]`), GET /metrics (Prometheus text; see metrics.py).

Errors are OpenAI-shaped JSON, {"error": {"message", "type", "param", "code"}}: 400 for invalid
parameters, malformed bodies and over-long prompts, 404 for an unknown model or route, 503 while not
ready, 500 when a request fails inside the engine. A body is validated in full before anything reaches
the engine.

Threads (async_engine.py): uvicorn's event loop serves HTTP; one background thread runs the engine loop.
A client that disconnects -- mid-stream or while waiting for a non-streamed answer -- has its request
aborted at once, which frees its KV pages (immediately, or when the step running now returns).

Shutdown: SIGTERM (or Ctrl-C) marks the server draining (/health answers 503), uvicorn stops accepting
connections and waits up to --shutdown-timeout seconds for the requests in flight to finish; whatever is
left is then cancelled, which aborts it in the engine; the engine thread stops and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from m3eagle.engine.llm_engine import RequestError
from m3eagle.engine.request import PositionLogprobs, RequestDelta
from m3eagle.entrypoints.chat import ChatTemplate, ChatTemplateError
from m3eagle.entrypoints.llm import LLM
from m3eagle.entrypoints.server.async_engine import AsyncEngine, RequestStream
from m3eagle.entrypoints.server.metrics import ServerMetrics
from m3eagle.entrypoints.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    refuse_unsupported,
)
from m3eagle.sampling.params import SamplingParams, SamplingParamsError

log = logging.getLogger("m3eagle")

EMBEDDED_MODEL_NAME = "m3eagle-default"
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request looks for its client having left


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _delta_logprobs(deltas: list[RequestDelta]) -> tuple[list[int], list[PositionLogprobs]]:
    """The new token ids and their logprobs across a run of streamed deltas (of one completion)."""
    return [t for d in deltas for t in d.token_ids], [x for d in deltas for x in (d.logprobs or [])]


def _token_entries(ids: list[int], lps: list[PositionLogprobs | None], n_top: int,
                   ) -> list[tuple[str, float | None, list[tuple[str, float]]]]:
    """Per token: (text, logprob, top n_top (text, logprob) by rank) from vLLM-shaped logprob dicts."""
    out = []
    for t, d in zip(ids, lps):
        if d is None:  # the first prompt token (echo)
            out.append((str(t), None, []))
            continue
        top = sorted(((x.rank, x.decoded_token or str(tid), x.logprob) for tid, x in d.items()
                      if x.rank is not None and x.rank <= n_top), key=lambda e: e[0])
        own = d[t]
        out.append((own.decoded_token if own.decoded_token is not None else str(t), own.logprob,
                    [(txt, lp) for _, txt, lp in top]))
    return out


async def _next_deltas(queue: asyncio.Queue[RequestDelta]) -> list[RequestDelta]:
    """The next delta plus any queued behind it: a client that fell behind gets them as one event, so a
    slow reader costs the event loop one chunk per wake-up, not one per engine step."""
    out = [await queue.get()]
    while not out[-1].finished and not queue.empty():
        out.append(queue.get_nowait())
    return out


class _ClientGone(Exception):
    """The client disconnected before its (non-streamed) answer was ready."""


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


class OpenAIServer:
    """The app and its state: one LLM, its engine thread, metrics and chat template."""

    def __init__(self, llm: LLM, served_model_name: str | None = None, log_interval: float = 10.0):
        self.llm, self.engine = llm, llm.engine
        if served_model_name is None:
            served_model_name = str(llm.model_path) if llm.model_path is not None and not _is_embedded(llm) \
                else EMBEDDED_MODEL_NAME
        self.model_name = served_model_name
        self.max_model_len = self.engine.cfg.max_model_len
        self.metrics = ServerMetrics(self.engine, self.model_name, self.max_model_len)
        self.engine_loop = AsyncEngine(self.engine, self.metrics)
        self.chat_template = ChatTemplate.from_model_dir(llm.model_path)
        self.log_interval = log_interval
        self.created = int(time.time())
        self.ready = False
        self.draining = False
        self.app = self._build_app()

    # ---- lifecycle ----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.engine_loop.start()
        logger = asyncio.create_task(self._log_stats())
        self.ready = True
        log.info("m3eagle serving %s (max_model_len=%d, K=%d, device=%s)", self.model_name, self.max_model_len,
                 self.engine.k, self.engine.device)
        try:
            yield
        finally:
            self.ready, self.draining = False, True
            logger.cancel()
            await self.engine_loop.stop()
            log.info("m3eagle server stopped")

    def begin_drain(self) -> None:
        """Shutdown started (SIGTERM): answer 503 to new requests while those in flight finish."""
        self.draining = True

    async def _log_stats(self) -> None:
        if self.log_interval <= 0:
            return
        while True:
            await asyncio.sleep(self.log_interval)
            line = self.metrics.log_line()
            if line:
                log.info("%s", line)

    def _check_ready(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry on another replica")
        if not self.ready or not self.engine_loop.alive:
            raise ApiError(503, "the server is not ready yet; retry when GET /health answers 200")

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r} "
                           "(GET /v1/models)", "model")

    # ---- the app ------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="m3eagle", lifespan=self.lifespan, docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def api_error(_request: Request, e: ApiError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.status)

        @app.exception_handler(RequestValidationError)
        async def invalid_body(_request: Request, e: RequestValidationError) -> JSONResponse:
            err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request body"}
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            if err.get("type") == "json_invalid":
                message, param = f"the request body is not valid JSON: {err.get('msg')}", None
            else:
                param = loc[0] if loc else None
                message = f"{'.'.join(loc) or 'body'}: {err.get('msg')}"
            return JSONResponse(error_body(400, message, param), status_code=400)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_request: Request, e: StarletteHTTPException) -> JSONResponse:
            return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)

        @app.get("/health")
        async def health() -> Response:
            self._check_ready()
            return Response(status_code=200)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "m3eagle",
                    "root": str(self.llm.model_path) if self.llm.model_path else None,
                    "max_model_len": self.max_model_len}
            return {"object": "list", "data": [card]}

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request) -> Response:
            return await self._completions(body, request)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
            return await self._chat(body, request)

        return app

    # ---- shared request plumbing ----------------------------------------------------------------
    def _sampling_params(self, body: CompletionRequest | ChatCompletionRequest, prompt_len: int,
                         max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        mml = self.max_model_len
        if prompt_len >= mml:
            raise ApiError(400, f"the prompt has {prompt_len} tokens, but this model's maximum context length is "
                           f"{mml} tokens (prompt + output); shorten the prompt", "prompt")
        if max_tokens is None:
            max_tokens = mml - prompt_len
        elif prompt_len + max_tokens > mml:
            raise ApiError(400, f"this model's maximum context length is {mml} tokens, but the prompt has "
                           f"{prompt_len} tokens and max_tokens={max_tokens} asks for {prompt_len + max_tokens}; "
                           "lower max_tokens or shorten the prompt", "max_tokens")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            return SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                                  top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                                  max_tokens=max_tokens, seed=body.seed, stop=stop,
                                  stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
                                  logprobs=logprobs, n=body.n, presence_penalty=body.presence_penalty,
                                  frequency_penalty=body.frequency_penalty,
                                  repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
                                  min_p=body.min_p, include_stop_str_in_output=body.include_stop_str_in_output,
                                  prompt_logprobs=prompt_logprobs if prompt_logprobs is not None
                                  else body.prompt_logprobs)
        except SamplingParamsError as e:
            raise ApiError(400, str(e), str(e).split("=", 1)[0]) from None

    def _add(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None, prefix: str,
             stream_text: bool) -> RequestStream:
        """stream_text=False (a non-streamed response reads only the finished output): the engine may decode
        the text once at the end (LLMEngine.add_request)."""
        try:
            return self.engine_loop.add(prompt_ids, params, prompt, prefix, stream_text)
        except RequestError as e:
            msg = str(e)
            raise ApiError(400, msg, "stop" if msg.startswith(("stop=", "stop_token_ids")) else "prompt") from None

    async def _collect(self, stream: RequestStream, request: Request) -> list[RequestDelta]:
        """Every delta of a non-streamed request; aborts it if the client leaves (or we are cancelled)."""
        out: list[RequestDelta] = []
        checked = time.monotonic()
        try:
            while True:
                try:
                    d = await asyncio.wait_for(stream.queue.get(), timeout=DISCONNECT_POLL_S)
                except TimeoutError:
                    d = None
                if d is not None:
                    out.append(d)
                    if d.finished:
                        return out
                # Deltas may arrive faster than any timeout, so look for a disconnect by the clock.
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        raise _ClientGone()
        finally:
            if not (out and out[-1].finished):
                self.engine_loop.abort(stream.request_id)

    @staticmethod
    def _usage(prompt: int, completion: int) -> dict[str, int]:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _final_error(self, d: RequestDelta) -> ApiError:
        if d.finish_reason == "abort" and self.draining:
            return ApiError(503, "the server shut down before this request finished")
        return ApiError(500, f"the request failed in the engine: {d.error or d.finish_reason}")

    # ---- /v1/completions ----------------------------------------------------------------------
    def _completion_prompt(self, body: CompletionRequest) -> tuple[list[int], str | None]:
        p: Any = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, f"prompt holds {len(p)} prompts; send one prompt per request", "prompt")
            p = p[0]
        if isinstance(p, str):
            if self.llm.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer.json: send the prompt as a list of token ids",
                               "prompt")
            return self.llm.encode(p), p
        return list(p), None

    async def _finished(self, stream: RequestStream, request: Request):
        """A non-streamed request's RequestOutput (all n completions) once it has finished; a 499 Response if
        the client left first; a completion's failure as an ApiError."""
        try:
            deltas = await self._collect(stream, request)
        except _ClientGone:
            return Response(status_code=499)
        out = deltas[-1].output
        assert out is not None, "the request's finishing delta carries its RequestOutput"
        for d in deltas:
            if d.finish_reason is not None and d.finish_reason not in ("stop", "length"):
                raise self._final_error(d)
        return out

    async def _completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_ready()
        self._check_model(body.model)
        refuse_unsupported(body)
        ids, text = self._completion_prompt(body)
        if not ids:
            raise ApiError(400, "the prompt is empty; give at least one token", "prompt")
        want_lp = body.logprobs is not None
        # echo with logprobs: the prompt's logprobs come first (vLLM: prompt_logprobs = logprobs)
        params = self._sampling_params(body, len(ids), 16 if body.max_tokens is None else body.max_tokens,
                                       body.logprobs, body.logprobs if body.echo and want_lp else None)
        stream = self._add(ids, params, text, "cmpl", bool(body.stream))
        echo = (text if text is not None else self.llm.tokenizer.decode(ids) if self.llm.tokenizer else "") \
            if body.echo else ""
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return SSEResponse(self._completion_events(stream, usage, body.logprobs, body.n, echo))
        out = await self._finished(stream, request)
        if isinstance(out, Response):
            return out
        choices = []
        for c in out.outputs:
            lp = None
            if want_lp:
                p_ids, p_lps = (ids, out.prompt_logprobs or [None] * len(ids)) if body.echo else ([], [])
                lp = self._completion_logprobs(p_ids + c.token_ids, p_lps + (c.logprobs or []), 0, body.logprobs)
            choices.append({"index": c.index, "text": echo + (c.text or ""), "finish_reason": c.finish_reason,
                            "logprobs": lp})
        return JSONResponse({"id": stream.request_id, "object": "text_completion", "created": int(time.time()),
                             "model": self.model_name, "choices": choices,
                             "usage": self._usage(len(ids), sum(len(c.token_ids) for c in out.outputs))})

    @staticmethod
    def _completion_logprobs(ids: list[int], lps: list[PositionLogprobs | None], offset: int,
                             n_top: int) -> dict[str, Any]:
        """The legacy completions shape: tokens, token_logprobs, top_logprobs (text -> logprob), text_offset."""
        entries = _token_entries(ids, lps, n_top)
        offsets = []
        for text, _, _ in entries:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [dict(e[2]) if e[1] is not None else None for e in entries] if n_top else None,
                "text_offset": offsets}

    def _completion_events(self, stream: RequestStream, include_usage: bool, n_top: int | None, n: int,
                           echo: str) -> AsyncIterator[str]:
        head = {"id": stream.request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        offset = [len(echo)] * n  # characters streamed so far per completion: the logprobs' text_offset

        def chunk(ds: list, text: str, finish_reason: str | None, index: int) -> dict[str, Any]:
            lp = self._completion_logprobs(*_delta_logprobs(ds), offset[index], n_top) if n_top is not None else None
            if lp:
                offset[index] += sum(len(t) for t in lp["tokens"])
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}

        opening = [{"index": i, "text": echo, "logprobs": None, "finish_reason": None} for i in range(n)] \
            if echo else None
        return self._stream_events(stream, include_usage, n_top is not None, head, chunk, opening)

    async def _stream_events(self, stream: RequestStream, include_usage: bool, want_lp: bool, head: dict[str, Any],
                             chunk, opening: list[dict[str, Any]] | None = None) -> AsyncIterator[str]:
        """The SSE loop both endpoints share: each batch of deltas becomes one chunk with a choice per
        completion that changed (`chunk(deltas, text, finish_reason, index)` builds it); a failed completion
        ends the stream with an error event; then the usage chunk when asked for, and [DONE]. A stream that
        ends early (client gone, cancelled) aborts its request."""
        done, n_out = False, 0
        try:
            if opening is not None:
                yield _sse({**head, "choices": opening})
            while not done:
                ds = await _next_deltas(stream.queue)
                done = ds[-1].finished
                n_out += sum(len(d.token_ids) for d in ds)
                failed = next((d for d in ds if d.finish_reason == "error"), None)
                if failed is not None:
                    yield _sse(self._final_error(failed).body())
                    include_usage = False
                    break
                choices = []
                for index in sorted({d.index for d in ds}):
                    di = [d for d in ds if d.index == index]
                    text, finish = "".join(d.text for d in di), di[-1].finish_reason
                    if text or finish or (want_lp and any(d.token_ids for d in di)):
                        choices.append(chunk(di, text, finish, index))
                if choices:  # else nothing a client can see yet (text held back for a stop string)
                    yield _sse({**head, "choices": choices})
            if include_usage and done:
                yield _sse({**head, "choices": [], "usage": self._usage(stream.num_prompt_tokens, n_out)})
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                self.engine_loop.abort(stream.request_id)

    # ---- /v1/chat/completions -------------------------------------------------------------------
    def _chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], str]:
        if self.chat_template is None:
            raise ApiError(400, "this model has no chat_template (tokenizer_config.json or chat_template.jinja); "
                           "use /v1/completions", "messages")
        if self.llm.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer.json, which chat needs; use /v1/completions with "
                           "token ids", "messages")
        messages = []
        for m in body.messages:
            d = m.model_dump()
            c = m.content
            d["content"] = c if isinstance(c, str) else "".join(part.text for part in c or [])
            messages.append(d)
        try:
            text = self.chat_template.render(messages, body.add_generation_prompt, **(body.chat_template_kwargs or {}))
        except ChatTemplateError as e:
            raise ApiError(400, str(e), "messages") from None
        return self.llm.encode(text), text

    async def _chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_ready()
        self._check_model(body.model)
        refuse_unsupported(body)
        ids, text = self._chat_prompt(body)
        if not ids:
            raise ApiError(400, "the rendered chat prompt is empty", "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        n_top = (body.top_logprobs or 0) if body.logprobs else None
        params = self._sampling_params(body, len(ids), max_tokens, n_top)
        stream = self._add(ids, params, text, "chatcmpl", bool(body.stream))
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return SSEResponse(self._chat_events(stream, usage, n_top, body.n))
        out = await self._finished(stream, request)
        if isinstance(out, Response):
            return out
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text or ""},
                    "logprobs": self._chat_logprobs(c.token_ids, c.logprobs or [], n_top) if n_top is not None
                    else None, "finish_reason": c.finish_reason} for c in out.outputs]
        return JSONResponse({"id": stream.request_id, "object": "chat.completion", "created": int(time.time()),
                             "model": self.model_name, "choices": choices,
                             "usage": self._usage(len(ids), sum(len(c.token_ids) for c in out.outputs))})

    @staticmethod
    def _chat_logprobs(ids: list[int], lps: list[PositionLogprobs], n_top: int) -> dict[str, Any]:
        """The chat shape: per token {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}."""
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": x, "logprob": v, "bytes": list(x.encode())} for x, v in top]}
                            for t, lp, top in _token_entries(ids, lps, n_top)]}

    def _chat_events(self, stream: RequestStream, include_usage: bool, n_top: int | None, n: int,
                     ) -> AsyncIterator[str]:
        head = {"id": stream.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}

        def chunk(ds: list, text: str, finish_reason: str | None, index: int) -> dict[str, Any]:
            return {"index": index, "delta": {"content": text} if text else {},
                    "logprobs": self._chat_logprobs(*_delta_logprobs(ds), n_top) if n_top is not None else None,
                    "finish_reason": finish_reason}

        opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                   for i in range(n)]
        return self._stream_events(stream, include_usage, n_top is not None, head, chunk, opening)


def _is_embedded(llm: LLM) -> bool:
    from m3eagle.loader.assets import ASSETS

    return llm.model_path is not None and Path(llm.model_path).resolve() == (ASSETS / "target").resolve()


# ------------------------------------------------------------------------------------------------
# Running it
# ------------------------------------------------------------------------------------------------


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before uvicorn starts, so a taken port is an OSError naming it (and port 0 picks a free one)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port") from None
    sock.set_inheritable(True)
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn, telling the app when a shutdown signal arrives (so /health turns 503 while draining)."""

    def __init__(self, config: uvicorn.Config, server: OpenAIServer):
        super().__init__(config)
        self.m3 = server

    def handle_exit(self, sig: int, frame) -> None:
        if not self.m3.draining:
            log.info("signal %d: draining (in-flight requests finish, new ones get 503)", sig)
        self.m3.begin_drain()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        # uvicorn re-raises the signal that stopped it once it has shut down, so the process dies of
        # SIGTERM after all; a completed drain is a clean exit (status 0) instead.
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


def _uvicorn_config(server: OpenAIServer, shutdown_timeout: float, log_level: str, access_log: bool) -> uvicorn.Config:
    return uvicorn.Config(server.app, log_level=log_level, access_log=access_log, lifespan="on",
                          timeout_graceful_shutdown=shutdown_timeout, timeout_keep_alive=30)


def run_server(server: OpenAIServer, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
               log_level: str = "info", access_log: bool = False, switch_interval: float = 0.001) -> None:
    """Serve until SIGTERM / Ctrl-C (blocking; call from the main thread, which owns the signals).

    switch_interval: the GIL switch interval for this process (seconds; 0 keeps Python's 5 ms). The event
    loop and the engine thread share one GIL; when the engine thread wants it back (after a wait on the
    device, say) it can wait a whole interval for the event loop to let go -- longer than a decode step
    on a GPU. A shorter interval bounds that wait."""
    if switch_interval > 0:
        sys.setswitchinterval(switch_interval)
    sock = bind_socket(host, port)
    log.info("m3eagle listening on http://%s:%d", host, sock.getsockname()[1])
    _Uvicorn(_uvicorn_config(server, shutdown_timeout, log_level, access_log), server).run(sockets=[sock])


class ServerThread:
    """A server on a background thread (tests, notebooks): `with ServerThread(server) as s: s.url`."""

    def __init__(self, server: OpenAIServer, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 5.0,
                 log_level: str = "warning"):
        self.server, self.host = server, host
        self._sock = bind_socket(host, port)
        self.port = self._sock.getsockname()[1]
        self._uv = _Uvicorn(_uvicorn_config(server, shutdown_timeout, log_level, False), server)
        self._thread = threading.Thread(target=self._uv.run, kwargs={"sockets": [self._sock]}, daemon=True,
                                        name="m3eagle-uvicorn")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        t_end = time.monotonic() + timeout
        while not self._uv.started:
            if not self._thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.begin_drain()
        self._uv.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
