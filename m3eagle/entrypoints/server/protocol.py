"""The OpenAI wire format: request bodies as pydantic models, and the error shape.

Bodies are validated strictly (no "1" for a number, no true for an int) before anything reaches the
engine; ranges that pydantic can check are checked here, the rest by SamplingParams. Fields of the OpenAI
API that m3eagle does not implement are accepted only at their neutral value (n=1, echo=false, penalties
0, ...) and refused otherwise, never silently ignored. Unknown fields are ignored, as OpenAI does.
vLLM's extra sampling fields that the engine supports (top_k, ignore_eos, stop_token_ids) are accepted.

Responses are plain dicts built in app.py: cheaper per streamed chunk than pydantic models.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT63 = 2**63


class ApiError(Exception):
    """An error answered as OpenAI-shaped JSON: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
             503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ApiError.TYPES.get(status, "Error"), "param": param,
                      "code": status}}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1, lt=INT63)
    temperature: float | None = Field(None, ge=0)  # None: 1.0, as OpenAI
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=INT63)  # vLLM's extra; 0 or -1: off
    seed: int | None = Field(None, ge=0, lt=INT63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extra
    ignore_eos: bool = False  # vLLM's extra (benchmarks use it to fix output lengths)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    model_config = ConfigDict(strict=True, extra="allow")  # tool calls, names...: passed to the template

    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, lt=INT63)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True  # vLLM's extra
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra: more variables for the template


def refuse_unsupported(body: _Sampling) -> None:
    """Raise ApiError(400) for an OpenAI field set to a value m3eagle does not implement."""
    checks: list[tuple[bool, str, str]] = [
        (body.n != 1, "n", f"n={body.n}: only n=1 is supported; send n requests"),
        (body.presence_penalty != 0, "presence_penalty", "presence_penalty is not supported; leave it at 0"),
        (body.frequency_penalty != 0, "frequency_penalty", "frequency_penalty is not supported; leave it at 0"),
        (bool(body.logit_bias), "logit_bias", "logit_bias is not supported"),
        (body.stream_options is not None and not body.stream, "stream_options",
         "stream_options is only allowed with stream=true"),
    ]
    if isinstance(body, CompletionRequest):
        checks += [
            (body.echo, "echo", "echo=true is not supported; the prompt is in your request"),
            (body.suffix is not None, "suffix", "suffix is not supported"),
            (body.best_of not in (None, 1), "best_of", f"best_of={body.best_of}: only best_of=1 is supported"),
            (bool(body.logprobs), "logprobs", f"logprobs={body.logprobs}: only the sampled token's logprob is "
             "returned (logprobs=0); top alternatives are not supported yet"),
        ]
    else:
        checks += [
            (bool(body.top_logprobs), "top_logprobs", f"top_logprobs={body.top_logprobs}: only the sampled "
             "token's logprob is returned (top_logprobs=0); top alternatives are not supported yet"),
            (bool(body.tools), "tools", "tools are not supported"),
        ]
    for bad, param, message in checks:
        if bad:
            raise ApiError(400, message, param)
