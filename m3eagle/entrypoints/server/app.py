"""`m3eagle serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one LLMEngine.

Routes: GET /health (200 once ready, 503 while starting or draining), GET /v1/models,
POST /v1/completions (a prompt or a list of them: choice index = prompt index x n + sample index),
POST /v1/chat/completions (stream: true answers in server-sent events ending in `data: [DONE]`),
GET /metrics (Prometheus text; see metrics.py), POST /tokenize, POST /detokenize, GET /version,
POST /reset_prefix_cache (vLLM's). Choices carry vLLM's `stop_reason` (the stop string or token id that ended
them, else null); with prefix caching on, usage carries `prompt_tokens_details.cached_tokens`.

Errors are OpenAI-shaped JSON, {"error": {"message", "type", "param", "code"}}: 400 for invalid
parameters, malformed bodies (invalid UTF-8, lone surrogates) and over-long prompts, 401 without the
--api-key (every /v1 route and /reset_prefix_cache; /health, /metrics, /version stay open), 404 for an
unknown model or route, 409 when the prefix cache cannot be reset, 413 for a body over
--max-request-body-bytes (refused before it is parsed), 503 while not ready or draining, 500 when a request
fails inside the engine. A body is validated in full before anything reaches the engine.

Prompts are tokenized (and chat templates rendered) on a thread pool, not on the event loop: a huge
prompt never stalls /health or the other streams.

Threads (async_engine.py): uvicorn's event loop serves HTTP; one background thread runs the engine loop.
A client that disconnects -- mid-stream or while waiting for a non-streamed answer -- has its request
aborted at once, which frees its KV pages (immediately, or when the step running now returns).

Shutdown: SIGTERM (or Ctrl-C) marks the server draining: it keeps listening, /health and every new request
get a 503, and the requests in flight get up to --shutdown-timeout seconds to finish. Whatever is left is
then aborted in the engine and answered: a 503 for a non-streamed request, a final `data: {"error": ...}`
event then `data: [DONE]` for a stream. Then uvicorn closes its connections, the engine thread stops and
the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from m3eagle.engine.llm_engine import RequestError
from m3eagle.engine.request import PositionLogprobs, RequestDelta, RequestOutput
from m3eagle.engine.runtime import check_text
from m3eagle.entrypoints.chat import ChatTemplate
from m3eagle.entrypoints.llm import LLM
from m3eagle.entrypoints.parsers.registry import DEFAULT_PARSER, check_parser_name
from m3eagle.entrypoints.server.async_engine import AsyncEngine
from m3eagle.entrypoints.server.metrics import ServerMetrics
from m3eagle.entrypoints.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    refuse_unsupported,
)
from m3eagle.entrypoints.server.serving_chat import ChatServing
from m3eagle.entrypoints.server.streams import (
    Call,
    SSEResponse,
    delta_logprobs,
    next_deltas,
    sse_event,
    token_entries,
)
from m3eagle.sampling.params import SamplingParams, SamplingParamsError

log = logging.getLogger("m3eagle")

EMBEDDED_MODEL_NAME = "m3eagle-default"
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request looks for its client having left
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 2**20
API_KEY_ENV = "M3EAGLE_API_KEY"  # vLLM's is VLLM_API_KEY
ABORT_ANSWER_S = 5.0  # after the shutdown timeout: time for the aborted requests' answers to be written
# Routes outside /v1 that change the server's state: the API key guards them as it guards /v1.
KEYED_ROUTES = frozenset({"/reset_prefix_cache"})


def resolve_api_key(flag: str | None) -> str | None:
    """--api-key, else $M3EAGLE_API_KEY, else None (no key: every route open)."""
    key = flag if flag else os.environ.get(API_KEY_ENV)
    return key or None


class _ClientGone(Exception):
    """The client disconnected before its (non-streamed) answer was ready."""


class _Guard:
    """ASGI middleware in front of every route: the API key on /v1 and KEYED_ROUTES (401), then the body limit (413)
    -- checked against Content-Length, else counted as the body arrives, before anything parses it -- and
    the body's UTF-8 (400). The body it read is handed on to the app unchanged."""

    def __init__(self, app, server: OpenAIServer):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        srv = self.server
        path: str = scope.get("path", "")
        if srv.api_key is not None and (path == "/v1" or path.startswith("/v1/") or path in KEYED_ROUTES):
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), srv.api_key.encode()):
                return await _send_json(send, 401, error_body(
                    401, "invalid or missing API key: send it as 'Authorization: Bearer <key>'", None,
                    "invalid_api_key"), [(b"www-authenticate", b"Bearer")])
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = srv.max_request_body_bytes
        too_big = error_body(413, f"the request body is larger than this server's limit of {limit} bytes "
                             "(--max-request-body-bytes)", None)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _send_json(send, 413, too_big, [(b"connection", b"close")])
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            body = msg.get("body", b"")
            size += len(body)
            if size > limit:
                return await _send_json(send, 413, too_big, [(b"connection", b"close")])
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as e:
            return await _send_json(send, 400, error_body(
                400, f"the request body is not valid UTF-8 (byte {e.start}: {body[e.start:e.start + 1]!r})", None))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


async def _send_json(send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] = ()) -> None:
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": raw})


class OpenAIServer(ChatServing):
    """The app and its state: one LLM, its engine thread, metrics and chat template.

    api_key: required as `Authorization: Bearer <key>` on every /v1 route (None: open; see resolve_api_key).
    tool_call_parser / reasoning_parser: parser names (entrypoints/parsers/registry.py; None or "none": off).
    enable_auto_tool_choice: tool_choice "auto" allowed. chat_template: a template source replacing the model's.
    max_request_body_bytes: larger bodies get a 413 before they are parsed. Both may be changed while
    serving (they are read per request). warmup: the engine thread runs `LLMEngine.warmup` once the server
    listens; /health and every request get a 503 until it has finished (a failed warm-up stops the server)."""

    def __init__(self, llm: LLM, served_model_name: str | None = None, log_interval: float = 10.0,
                 api_key: str | None = None, max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 tool_call_parser: str | None = DEFAULT_PARSER, reasoning_parser: str | None = DEFAULT_PARSER,
                 enable_auto_tool_choice: bool = True, chat_template: str | None = None, warmup: bool = False):
        self.llm, self.engine = llm, llm.engine
        self.tool_call_parser = check_parser_name("tool-call", tool_call_parser)
        self.reasoning_parser = check_parser_name("reasoning", reasoning_parser)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        if served_model_name is None:
            served_model_name = str(llm.model_path) if llm.model_path is not None and not _is_embedded(llm) \
                else EMBEDDED_MODEL_NAME
        self.model_name = served_model_name
        self.max_model_len = self.engine.cfg.max_model_len
        self.metrics = ServerMetrics(self.engine, self.model_name, self.max_model_len)
        self.engine_loop = AsyncEngine(self.engine, self.metrics, warmup=warmup)
        self.chat_template = ChatTemplate.from_model_dir(llm.tokenizer_path)
        if chat_template is not None:  # --chat-template: this source, with the model's special tokens
            self.chat_template = ChatTemplate(chat_template, self.chat_template.variables if self.chat_template else {})
        self.log_interval = log_interval
        self.api_key = api_key or None
        if not isinstance(max_request_body_bytes, int) or max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes={max_request_body_bytes!r} must be an int >= 1")
        self.max_request_body_bytes = max_request_body_bytes
        # Tokenizing and rendering off the event loop (the tokenizer's batch call releases the GIL).
        self._prep_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="m3eagle-tokenize")
        self.created = int(time.time())
        self.ready = False
        self.draining = False
        self.failed: str | None = None  # why the server cannot serve (a failed warm-up): it stops
        self.app = self._build_app()

    # ---- lifecycle ----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        # Starlette streams through an anyio task group, and anyio imports its asyncio backend on the first one:
        # tens of ms on the event loop, paid by the first streamed request of a fresh server. Pay it here.
        async with anyio.create_task_group():
            pass
        self.engine_loop.start()
        logger = asyncio.create_task(self._log_stats())
        watcher = asyncio.create_task(self._await_warmup())
        self.ready = True
        try:
            yield
        finally:
            self.ready, self.draining = False, True
            logger.cancel()
            watcher.cancel()
            await self.engine_loop.stop()
            log.info("m3eagle server stopped")

    async def _await_warmup(self) -> None:
        """Say when the engine thread is ready to serve (after its warm-up), or mark the server failed."""
        loop, t0 = self.engine_loop, time.monotonic()
        while not loop.warmed.is_set() and loop.alive:
            await asyncio.sleep(0.05)
        if not loop.warmed.is_set():
            self.failed = f"the engine's warm-up failed ({loop.warmup_error or 'the engine thread ended'})"
            log.error("%s: stopping the server", self.failed)
            return
        info = loop.warmup_info
        log.info("m3eagle serving %s (max_model_len=%d, K=%d, device=%s)%s", self.model_name, self.max_model_len,
                 self.engine.k, self.engine.device, f"; ready after a {time.monotonic() - t0:.1f} s warm-up "
                 f"({info['graphs']} graph buckets x modes, {len(info['shapes'])} prompt shapes, sampling "
                 f"variants: {', '.join(info['variants'])})" if info else "")

    def begin_drain(self) -> None:
        """Shutdown started (SIGTERM): answer 503 to new requests while those in flight finish."""
        self.draining = True

    async def drain(self, timeout: float, give_up: Callable[[], bool] = lambda: False) -> None:
        """While still listening (new requests get 503): wait up to `timeout` s for the requests in flight to
        finish, then abort the rest -- each is answered (503, or an error event ending its stream) -- and
        give those answers a moment to go out. give_up(): a second signal, stop waiting."""
        self.begin_drain()
        t_end = time.monotonic() + timeout
        while self.engine_loop.num_in_flight and time.monotonic() < t_end and not give_up():
            await asyncio.sleep(0.02)
        if self.engine_loop.num_in_flight and self.engine_loop.alive:
            n = self.engine_loop.abort_all()
            log.warning("shutdown: %d request(s) still in flight after %.1fs: aborted (503 / an error event)", n,
                        timeout)
            t_end = time.monotonic() + ABORT_ANSWER_S
            while self.engine_loop.num_in_flight and time.monotonic() < t_end and self.engine_loop.alive:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the handlers write their last bytes

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
        if not self.engine_loop.warmed.is_set():
            raise ApiError(503, "the server is warming up (compiling kernels, capturing CUDA graphs); retry when "
                           "GET /health answers 200")

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r} "
                           "(GET /v1/models)", "model")

    async def _off_loop(self, fn, *args):
        """fn(*args) on the tokenizer pool (the event loop serves on meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self._prep_pool, fn, *args)

    def _encode(self, text: str, param: str) -> list[int]:
        """Text -> ids, for the pool's threads: the batch call of `tokenizers` releases the GIL (its
        single-text call does not), so a long prompt does not stall the event loop either."""
        try:
            check_text(text, param)
        except RequestError:
            raise ApiError(400, f"{param} is not valid Unicode: it holds a lone surrogate (text must encode as "
                           "UTF-8)", param) from None
        tok = self.llm.tokenizer
        if tok is None:
            raise ApiError(400, "this model has no tokenizer.json: send the prompt as a list of token ids", param)
        return tok.encode_releasing_gil(text)

    # ---- the app ------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="m3eagle", lifespan=self.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(_Guard, server=self)

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

        @app.exception_handler(Exception)
        async def unexpected(_request: Request, e: Exception) -> JSONResponse:  # a bug: still OpenAI-shaped
            log.error("unexpected error in a request handler", exc_info=e)
            return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), status_code=500)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_request: Request, e: StarletteHTTPException) -> JSONResponse:
            return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)

        @app.get("/health")
        async def health() -> Response:
            self._check_ready()
            return Response(status_code=200)

        @app.get("/version")
        async def version() -> dict[str, str]:
            from m3eagle.version import __version__

            return {"version": __version__}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "m3eagle",
                    "root": str(self.llm.model_path) if self.llm.model_path else None,
                    "max_model_len": self.max_model_len}
            return {"object": "list", "data": [card]}

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            self._check_ready()
            log.info("resetting the prefix cache")
            # Off the event loop: the reset waits for the step the engine thread is running.
            if not await asyncio.get_running_loop().run_in_executor(None, self.engine.reset_prefix_cache):
                raise ApiError(409, "the prefix cache could not be reset")
            return Response(status_code=200)

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request) -> Response:
            return await self._completions(body, request)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
            return await self._chat(body, request)

        @app.post("/tokenize")
        async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
            self._check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise ApiError(400, "give either prompt (text) or messages (a chat), not both or neither", "prompt")
            if body.prompt is not None:
                ids = await self._off_loop(self._encode, body.prompt, "prompt")
            else:
                ids, _ = await self._off_loop(self._chat_prompt, body)
            return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

        @app.post("/detokenize")
        async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
            self._check_model(body.model)
            if self.llm.tokenizer is None:
                raise ApiError(400, "this model has no tokenizer.json to detokenize with", "tokens")
            v = self.engine.target_cfg.vocab_size
            bad = [t for t in body.tokens if not 0 <= t < v]
            if bad:
                raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {v})", "tokens")
            return {"prompt": await self._off_loop(self.llm.tokenizer.decode, body.tokens)}

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
        structured, field = body.structured_request()
        try:
            params = SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                                  top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0,
                                  max_tokens=max_tokens, seed=body.seed, stop=stop,
                                  stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
                                  logprobs=logprobs, n=body.n, presence_penalty=body.presence_penalty,
                                  frequency_penalty=body.frequency_penalty,
                                  repetition_penalty=body.repetition_penalty, min_tokens=body.min_tokens,
                                  min_p=body.min_p, include_stop_str_in_output=body.include_stop_str_in_output,
                                  prompt_logprobs=prompt_logprobs if prompt_logprobs is not None
                                  else body.prompt_logprobs, structured_outputs=structured)
        except SamplingParamsError as e:
            msg = str(e)
            raise ApiError(400, msg, field if msg.startswith("structured_outputs") else msg.split("=", 1)[0]) from None
        return params

    async def _compile_grammar(self, body: CompletionRequest | ChatCompletionRequest, params: SamplingParams) -> None:
        """Compile (and cache) the request's grammar before it is queued, so that one xgrammar refuses is a 400
        naming its field. Off the event loop: a new schema can take a second to compile, and every stream the
        loop serves would stall for it."""
        if params.structured_outputs is None:
            return
        field = body.structured_request()[1]
        try:
            await self._off_loop(self.engine.compile_grammar, params)
        except RequestError as e:
            raise ApiError(400, f"{field}: {e}", field) from None

    def _add(self, prompts: list[tuple[list[int], SamplingParams, str | None]], prefix: str, stream_text: bool,
             n: int) -> Call:
        """Queue one engine request per prompt, all validated first (nothing is queued if one is refused).
        stream_text=False (a non-streamed response reads only the finished output): the engine may decode
        the text once at the end (LLMEngine.add_request)."""
        self._check_ready()  # the server may have begun draining while the prompts were tokenized

        def refused(e: RequestError) -> ApiError:
            msg = str(e)
            return ApiError(400, msg, "stop" if msg.startswith(("stop=", "stop_token_ids")) else "prompt")

        try:
            for ids, params, _ in prompts:
                self.engine.validate(ids, params)
        except RequestError as e:
            raise refused(e) from None
        call = Call([], n)
        try:
            for ids, params, text in prompts:
                call.streams.append(self.engine_loop.add(ids, params, text, prefix, stream_text, call.queue))
        except RequestError as e:
            for st in call.streams:
                self.engine_loop.abort(st.request_id)
            raise refused(e) from None
        call.index_streams()
        return call

    async def _collect(self, call: Call, request: Request) -> dict[str, list[RequestDelta]]:
        """Every delta of a non-streamed call, per request; aborts its requests if the client leaves (or we
        are cancelled)."""
        out: dict[str, list[RequestDelta]] = {st.request_id: [] for st in call.streams}
        left = set(out)
        checked = time.monotonic()
        try:
            while left:
                try:
                    d = await asyncio.wait_for(call.queue.get(), timeout=DISCONNECT_POLL_S)
                except TimeoutError:
                    d = None
                if d is not None:
                    out[d.request_id].append(d)
                    if d.finished:
                        left.discard(d.request_id)
                        continue
                # Deltas may arrive faster than any timeout, so look for a disconnect by the clock.
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        raise _ClientGone()
            return out
        finally:
            for rid in left:
                self.engine_loop.abort(rid)

    def _usage(self, prompt: int, completion: int, outputs: list[RequestOutput]) -> dict[str, Any]:
        """OpenAI's usage object. With prefix caching on, `prompt_tokens_details.cached_tokens` too: the prompt
        tokens of `outputs` (one per prompt) that the cache served on their first admission."""
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
        if self.engine.cfg.enable_prefix_caching:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens or 0 for o in outputs)}
        return usage

    def _final_error(self, d: RequestDelta) -> ApiError:
        if d.finish_reason == "abort" and self.draining:
            return ApiError(503, "the server shut down before this request finished (--shutdown-timeout passed)")
        return ApiError(500, f"the request failed in the engine: {d.error or d.finish_reason}")

    # ---- /v1/completions ----------------------------------------------------------------------
    def _completion_prompts(self, body: CompletionRequest) -> list[tuple[list[int], str | None]]:
        """(ids, text or None) per prompt; runs on the tokenizer pool."""
        p: Any = body.prompt
        many = isinstance(p, list) and bool(p) and isinstance(p[0], (str, list))
        out = []
        for i, one in enumerate(p if many else [p]):
            if isinstance(one, str):
                out.append((self._encode(one, "prompt"), one))
            else:
                out.append((list(one), None))
            if not out[-1][0]:
                which = f"prompt {i} of the list" if many else "the prompt"
                raise ApiError(400, f"{which} is empty; give at least one token", "prompt")
        return out

    async def _finished(self, call: Call, request: Request) -> list[RequestOutput] | Response:
        """A non-streamed call's RequestOutputs (all n completions each, in prompt order) once every one has
        finished; a 499 Response if the client left first; a completion's failure as an ApiError."""
        try:
            deltas = await self._collect(call, request)
        except _ClientGone:
            return Response(status_code=499)
        outs = []
        for st in call.streams:
            ds = deltas[st.request_id]
            for d in ds:
                if d.finish_reason is not None and d.finish_reason not in ("stop", "length"):
                    raise self._final_error(d)
            assert ds[-1].output is not None, "the request's finishing delta carries its RequestOutput"
            outs.append(ds[-1].output)
        return outs

    def _decode(self, ids: list[int]) -> str:
        return self.llm.tokenizer.decode(ids) if self.llm.tokenizer is not None else ""

    async def _completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_ready()
        self._check_model(body.model)
        refuse_unsupported(body)
        prompts = await self._off_loop(self._completion_prompts, body)
        want_lp = body.logprobs is not None
        # echo with logprobs: the prompt's logprobs come first (vLLM: prompt_logprobs = logprobs)
        reqs = [(ids, self._sampling_params(body, len(ids), 16 if body.max_tokens is None else body.max_tokens,
                                            body.logprobs, body.logprobs if body.echo and want_lp else None), text)
                for ids, text in prompts]
        if reqs:  # one spec for every prompt of the request
            await self._compile_grammar(body, reqs[0][1])
        echoes = [(text if text is not None else self._decode(ids)) if body.echo else "" for ids, text in prompts]
        call = self._add(reqs, "cmpl", bool(body.stream), body.n)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return SSEResponse(self._completion_events(call, usage, body.logprobs, echoes))
        outs = await self._finished(call, request)
        if isinstance(outs, Response):
            return outs
        choices = []
        for pi, ((ids, _), out) in enumerate(zip(prompts, outs)):
            for c in out.outputs:
                lp = None
                if want_lp:
                    p_ids, p_lps = (ids, out.prompt_logprobs or [None] * len(ids)) if body.echo else ([], [])
                    lp = self._completion_logprobs(p_ids + c.token_ids, p_lps + (c.logprobs or []), 0,
                                                   body.logprobs)
                choices.append({"index": pi * body.n + c.index, "text": echoes[pi] + (c.text or ""),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "logprobs": lp})
        n_prompt = sum(len(ids) for ids, _ in prompts)
        return JSONResponse({"id": call.request_id, "object": "text_completion", "created": int(time.time()),
                             "model": self.model_name, "choices": choices,
                             "usage": self._usage(n_prompt, sum(len(c.token_ids) for o in outs for c in o.outputs),
                                                  outs)})

    def _completion_logprobs(self, ids: list[int], lps: list[PositionLogprobs | None], offset: int,
                             n_top: int) -> dict[str, Any]:
        """The legacy completions shape: tokens, token_logprobs, top_logprobs (text -> logprob), text_offset."""
        entries = token_entries(ids, lps, n_top, self._decode)
        offsets = []
        for text, _, _ in entries:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [dict(e[2]) if e[1] is not None else None for e in entries] if n_top else None,
                "text_offset": offsets}

    def _completion_events(self, call: Call, include_usage: bool, n_top: int | None,
                           echoes: list[str]) -> AsyncIterator[str]:
        head = {"id": call.request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        n = call.n
        offset = [len(echoes[i // n]) for i in range(len(echoes) * n)]  # per choice: the logprobs' text_offset

        def chunk(ds: list, text: str, finish_reason: str | None, index: int, stop_reason) -> dict[str, Any]:
            lp = self._completion_logprobs(*delta_logprobs(ds), offset[index], n_top) if n_top is not None else None
            if lp:
                offset[index] += sum(len(t) for t in lp["tokens"])
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason,
                    "stop_reason": stop_reason}

        opening = [{"index": i, "text": echoes[i // n], "logprobs": None, "finish_reason": None}
                   for i in range(len(echoes) * n)] if any(echoes) else None
        return self._stream_events(call, include_usage, n_top is not None, head, chunk, opening)

    async def _stream_events(self, call: Call, include_usage: bool, want_lp: bool, head: dict[str, Any],
                             chunk, opening: list[dict[str, Any]] | None = None) -> AsyncIterator[str]:
        """The SSE loop both endpoints share: each batch of deltas becomes one chunk with a choice per
        completion that changed (`chunk(deltas, text, finish_reason, index, stop_reason)` builds it); a failed
        completion (an engine error, or an abort at shutdown) ends the stream with an error event, then
        [DONE]; the usage chunk when asked for, and [DONE]. A completion's finish_reason goes out once its
        request's output (which holds the stop_reason) is in. A stream that ends early (client gone,
        cancelled) aborts its requests."""
        left = {st.request_id for st in call.streams}
        n_out = 0
        finished: list[RequestOutput] = []  # for the usage chunk's cached_tokens
        pending: dict[tuple[str, int], str] = {}  # a finished completion waiting for its request's output
        try:
            if opening is not None:
                yield sse_event({**head, "choices": opening})
            while left:
                ds = await next_deltas(call.queue)
                n_out += sum(len(d.token_ids) for d in ds)
                failed = next((d for d in ds if d.finish_reason in ("error", "abort")), None)
                if failed is not None:
                    yield sse_event(self._final_error(failed).body())
                    include_usage = False
                    break
                outputs = {d.request_id: d.output for d in ds if d.output is not None}
                choices = []
                for key in sorted({(call.choice(d), d.request_id, d.index) for d in ds}):
                    index, rid, sub = key
                    di = [d for d in ds if d.request_id == rid and d.index == sub]
                    text, finish = "".join(d.text for d in di), di[-1].finish_reason
                    stop_reason = None
                    if finish is not None and rid not in outputs:
                        pending[(rid, sub)], finish = finish, None
                    elif finish is not None:
                        stop_reason = outputs[rid].outputs[sub].stop_reason
                    if text or finish or (want_lp and any(d.token_ids for d in di)):
                        c = chunk(di, text, finish, index, stop_reason)
                        if c is not None:  # None: all of it held back (chat: a marker may be starting)
                            choices.append(c)
                for rid, out in outputs.items():
                    left.discard(rid)
                    finished.append(out)
                    for (prid, sub), finish in list(pending.items()):
                        if prid == rid:
                            del pending[(prid, sub)]
                            choices.append(chunk([], "", finish, call.prompt_index[rid] * call.n + sub,
                                                 out.outputs[sub].stop_reason))
                if choices:  # else nothing a client can see yet (text held back for a stop string)
                    yield sse_event({**head, "choices": choices})
            if include_usage and not left:
                yield sse_event({**head, "choices": [], "usage": self._usage(call.num_prompt_tokens, n_out,
                                                                             finished)})
            yield "data: [DONE]\n\n"
        finally:
            for rid in left:
                self.engine_loop.abort(rid)


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
    """uvicorn, telling the app when a shutdown signal arrives (so /health and new requests get 503 while
    draining), and draining before uvicorn closes its sockets: uvicorn's own shutdown stops listening at
    once (new connections would be refused, not answered 503) and cancels what is left at its timeout
    (a plain-text 500, a stream cut without an error event); OpenAIServer.drain answers them instead."""

    def __init__(self, config: uvicorn.Config, server: OpenAIServer, shutdown_timeout: float):
        super().__init__(config)
        self.m3, self.shutdown_timeout = server, shutdown_timeout

    async def on_tick(self, counter: int) -> bool:
        if self.m3.failed:  # a failed warm-up: nothing will serve, so stop rather than answer 503 forever
            return True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame) -> None:
        if not self.m3.draining:
            log.info("signal %d: draining (in-flight requests finish, new ones get 503)", sig)
        self.m3.begin_drain()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        await self.m3.drain(self.shutdown_timeout, lambda: self.force_exit)
        await super().shutdown(sockets)
        # uvicorn re-raises the signal that stopped it once it has shut down, so the process dies of
        # SIGTERM after all; a completed drain is a clean exit (status 0) instead.
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


def _uvicorn(server: OpenAIServer, shutdown_timeout: float, log_level: str, access_log: bool) -> _Uvicorn:
    # uvicorn's own graceful timeout only covers writing the answers after OpenAIServer.drain.
    config = uvicorn.Config(server.app, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=ABORT_ANSWER_S, timeout_keep_alive=30)
    return _Uvicorn(config, server, shutdown_timeout)


def loop_and_parser() -> str:
    """What uvicorn's "auto" picks: uvloop and httptools where installed (the package's dependencies), else
    asyncio's loop and h11. Every SSE event and request goes through them on the thread the engine's host work
    shares the GIL with, so the slower pair shows up as serving latency under load."""
    loop = "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    return f"event loop {loop}, HTTP parser {http}"


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
    log.info("m3eagle listening on http://%s:%d (%s)", host, sock.getsockname()[1], loop_and_parser())
    _uvicorn(server, shutdown_timeout, log_level, access_log).run(sockets=[sock])
    if server.failed:
        raise RuntimeError(server.failed)


class ServerThread:
    """A server on a background thread (tests, notebooks): `with ServerThread(server) as s: s.url`."""

    def __init__(self, server: OpenAIServer, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 5.0,
                 log_level: str = "warning"):
        self.server, self.host = server, host
        self._sock = bind_socket(host, port)
        self.port = self._sock.getsockname()[1]
        self._uv = _uvicorn(server, shutdown_timeout, log_level, False)
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
