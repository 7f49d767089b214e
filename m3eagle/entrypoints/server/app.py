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

from ...engine.llm_engine import RequestError
from ...engine.request import CompletionOutput, RequestDelta
from ...sampling.params import SamplingParams, SamplingParamsError
from ..chat import ChatTemplate, ChatTemplateError
from ..llm import LLM
from .async_engine import AsyncEngine, RequestStream
from .metrics import ServerMetrics
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest, error_body, refuse_unsupported

log = logging.getLogger("m3eagle")

EMBEDDED_MODEL_NAME = "m3eagle-default"
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request looks for its client having left


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _completion(last: RequestDelta) -> CompletionOutput:
    """The finished request's one completion: a non-streamed response is built from the RequestOutput that
    the finishing delta carries, as LLM.generate() returns it."""
    assert last.output is not None, "the finishing delta carries the RequestOutput"
    return last.output.outputs[0]


def _delta_logprobs(deltas: list[RequestDelta]) -> tuple[list[int], list[float]]:
    """The new token ids and their logprobs across a run of streamed deltas."""
    return [t for d in deltas for t in d.token_ids], [x for d in deltas for x in (d.logprobs or [])]


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
                         max_tokens: int | None, logprobs: bool) -> SamplingParams:
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
                                  logprobs=logprobs)
        except SamplingParamsError as e:
            raise ApiError(400, str(e), str(e).split("=", 1)[0]) from None

    def _add(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None, prefix: str) -> RequestStream:
        try:
            return self.engine_loop.add(prompt_ids, params, prompt, prefix)
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

    def _token_texts(self, ids: list[int]) -> list[str]:
        tok = self.llm.tokenizer
        return [tok.decode([i]) for i in ids] if tok is not None else [str(i) for i in ids]

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
        """A non-streamed request's CompletionOutput once it has finished; a 499 Response if the client
        left first; the request's failure as an ApiError."""
        try:
            deltas = await self._collect(stream, request)
        except _ClientGone:
            return Response(status_code=499)
        last = deltas[-1]
        if last.finish_reason not in ("stop", "length"):
            raise self._final_error(last)
        return _completion(last)

    async def _completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_ready()
        self._check_model(body.model)
        refuse_unsupported(body)
        ids, text = self._completion_prompt(body)
        if not ids:
            raise ApiError(400, "the prompt is empty; give at least one token", "prompt")
        want_lp = body.logprobs is not None
        params = self._sampling_params(body, len(ids), 16 if body.max_tokens is None else body.max_tokens, want_lp)
        stream = self._add(ids, params, text, "cmpl")
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return SSEResponse(self._completion_events(stream, usage, want_lp))
        out = await self._finished(stream, request)
        if isinstance(out, Response):
            return out
        choice = {"index": out.index, "text": out.text or "", "finish_reason": out.finish_reason,
                  "logprobs": self._completion_logprobs(out.token_ids, out.logprobs, 0) if want_lp else None}
        return JSONResponse({"id": stream.request_id, "object": "text_completion", "created": int(time.time()),
                             "model": self.model_name, "choices": [choice],
                             "usage": self._usage(len(ids), len(out.token_ids))})

    def _completion_logprobs(self, ids: list[int], lps: list[float] | None, offset: int) -> dict[str, Any]:
        tokens = self._token_texts(ids)
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": list(lps or []), "top_logprobs": None, "text_offset": offsets}

    def _completion_events(self, stream: RequestStream, include_usage: bool, want_lp: bool) -> AsyncIterator[str]:
        head = {"id": stream.request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        offset = 0  # characters streamed so far: the logprobs' text_offset

        def chunk(ds: list, text: str, last) -> dict[str, Any]:
            nonlocal offset
            lp = self._completion_logprobs(*_delta_logprobs(ds), offset) if want_lp else None
            if lp:
                offset += sum(len(t) for t in lp["tokens"])
            return {"index": 0, "text": text, "logprobs": lp, "finish_reason": last.finish_reason}

        return self._stream_events(stream, include_usage, want_lp, head, chunk)

    async def _stream_events(self, stream: RequestStream, include_usage: bool, want_lp: bool, head: dict[str, Any],
                             chunk, opening: dict[str, Any] | None = None) -> AsyncIterator[str]:
        """The SSE loop both endpoints share: each batch of deltas becomes one chunk (`chunk(deltas, text,
        last)` builds its choice); a failed request ends with an error event; then the usage chunk when
        asked for, and [DONE]. A stream that ends early (client gone, cancelled) aborts its request."""
        done, n_out = False, 0
        try:
            if opening is not None:
                yield _sse({**head, "choices": [opening]})
            while not done:
                ds = await _next_deltas(stream.queue)
                last, text = ds[-1], "".join(d.text for d in ds)
                done, n_out = last.finished, last.num_output_tokens
                if last.finish_reason == "error":
                    yield _sse(self._final_error(last).body())
                    include_usage = False
                    break
                if not (text or done or (want_lp and any(d.token_ids for d in ds))):
                    continue  # nothing a client can see yet (text held back for a stop string)
                yield _sse({**head, "choices": [chunk(ds, text, last)]})
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
        params = self._sampling_params(body, len(ids), max_tokens, body.logprobs)
        stream = self._add(ids, params, text, "chatcmpl")
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return SSEResponse(self._chat_events(stream, usage, body.logprobs))
        out = await self._finished(stream, request)
        if isinstance(out, Response):
            return out
        choice = {"index": out.index, "message": {"role": "assistant", "content": out.text or ""},
                  "logprobs": self._chat_logprobs(out.token_ids, out.logprobs) if body.logprobs else None,
                  "finish_reason": out.finish_reason}
        return JSONResponse({"id": stream.request_id, "object": "chat.completion", "created": int(time.time()),
                             "model": self.model_name, "choices": [choice],
                             "usage": self._usage(len(ids), len(out.token_ids))})

    def _chat_logprobs(self, ids: list[int], lps: list[float] | None) -> dict[str, Any]:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(self._token_texts(ids), lps or [])]}

    def _chat_events(self, stream: RequestStream, include_usage: bool, want_lp: bool) -> AsyncIterator[str]:
        head = {"id": stream.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}

        def chunk(ds: list, text: str, last) -> dict[str, Any]:
            return {"index": 0, "delta": {"content": text} if text else {},
                    "logprobs": self._chat_logprobs(*_delta_logprobs(ds)) if want_lp else None,
                    "finish_reason": last.finish_reason}

        opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._stream_events(stream, include_usage, want_lp, head, chunk, opening)


def _is_embedded(llm: LLM) -> bool:
    from ..llm import ASSETS

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
