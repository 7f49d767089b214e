"""The OpenAI wire format: request bodies as pydantic models, and the error shape.

Bodies are validated strictly (no "1" for a number, no true for an int) before anything reaches the
engine; ranges that pydantic can check are checked here, the rest by SamplingParams (and `tools` /
`tool_choice` by entrypoints/tools.py). Fields of the OpenAI API that m3eagle does not implement are
accepted only at their neutral value (logit_bias empty, best_of 1, no suffix) and refused otherwise, never
silently ignored. Unknown fields are ignored, as OpenAI
does. vLLM's extra sampling fields that the engine supports (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, include_stop_str_in_output, prompt_logprobs) are accepted.

Responses are plain dicts built in app.py: cheaper per streamed chunk than pydantic models.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

INT63 = 2**63


class ApiError(Exception):
    """An error answered as OpenAI-shaped JSON: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "BadRequestError", 401: "invalid_request_error", 404: "NotFoundError",
             409: "ConflictError", 413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ApiError.TYPES.get(status, "Error"), "param": param,
                      "code": status if code is None else code}}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    """response_format.json_schema: the schema the output must match (m3eagle enforces it whatever `strict`)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


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
    n: int = Field(1, ge=1, le=128)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)  # vLLM's extra
    min_tokens: int = Field(0, ge=0, lt=INT63)  # vLLM's extra
    min_p: float = Field(0.0, ge=0, le=1)  # vLLM's extra
    include_stop_str_in_output: bool = False  # vLLM's extra
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's extra
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Structured output: OpenAI's response_format, and vLLM's extras (one source per request)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_request(self) -> tuple[dict[str, Any] | None, str | None]:
        """(SamplingParams.structured_outputs as a dict, the body field it came from), or (None, None).
        ApiError(400) naming the fields when more than one asks for a constraint, or a json_schema format has
        no schema."""
        rf = self.response_format
        given: list[tuple[str, dict[str, Any]]] = []
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ApiError(400, "response_format of type json_schema needs json_schema.schema",
                               "response_format.json_schema")
            given.append(("response_format", {"json": rf.json_schema.schema_}))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", dict(self.structured_outputs)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append((name, {key: getattr(self, name)}))
        if len(given) > 1:
            names = [g[0] for g in given]
            raise ApiError(400, f"{' and '.join(names)} each ask for a structured output; give one", names[1])
        return (given[0][1], given[0][0]) if given else (None, None)


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
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True  # vLLM's extra
    continue_final_message: bool = False  # vLLM's extra: the prompt ends inside the last message
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra: more variables for the template
    # The grammar of tool_choice `required` / a named function, set by the server once the prompt is rendered
    _tool_grammar: str | None = PrivateAttr(None)

    def structured_request(self) -> tuple[dict[str, Any] | None, str | None]:
        """As for completions; a tool_choice that sets a grammar is the request's constraint, with the field
        "tool_choice", and an ApiError(400) naming the other field when the body also asks for one."""
        structured, field = super().structured_request()
        if self._tool_grammar is None:
            return structured, field
        if structured is not None:
            what = repr(self.tool_choice) if isinstance(self.tool_choice, str) else "naming a function"
            raise ApiError(400, f"tool_choice {what} constrains the reply to a tool call, and {field} asks for "
                           "another structured output; give one of them", field)
        return {"grammar": self._tool_grammar}, "tool_choice"


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a text prompt, or chat messages rendered with the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # accepted; m3eagle's tokenizer adds none
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def refuse_unsupported(body: _Sampling) -> None:
    """Raise ApiError(400) for an OpenAI field set to a value m3eagle does not implement."""
    checks: list[tuple[bool, str, str]] = [
        (bool(body.logit_bias), "logit_bias", "logit_bias is not supported"),
        (body.stream_options is not None and not body.stream, "stream_options",
         "stream_options is only allowed with stream=true"),
    ]
    if isinstance(body, CompletionRequest):
        checks += [
            (body.echo and body.stream and body.logprobs is not None, "echo",
             "echo=true with logprobs is only supported without stream"),
            (body.suffix is not None, "suffix", "suffix is not supported"),
            (body.best_of not in (None, 1), "best_of", f"best_of={body.best_of}: only best_of=1 is supported"),
        ]
    else:
        checks += [
            (body.top_logprobs is not None and not body.logprobs, "top_logprobs",
             "top_logprobs needs logprobs=true"),
        ]
    for bad, param, message in checks:
        if bad:
            raise ApiError(400, message, param)
