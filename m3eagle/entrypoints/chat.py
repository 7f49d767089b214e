"""Chat templates: a model's `chat_template` (tokenizer_config.json, or chat_template.jinja beside it)
rendered with jinja2 the way transformers' `apply_chat_template` renders it: a sandboxed environment with
trim_blocks / lstrip_blocks and loop controls, `raise_exception`, a `tojson` that keeps non-ASCII text,
`strftime_now`, and the tokenizer's special tokens (bos_token, eos_token, ...) as variables.
One implementation for both users: `LLM.chat()` and the server's /v1/chat/completions.

`check_messages` validates a conversation (a RequestError naming `messages[i].field`); `render` takes the
request's tools (the template's `tools` variable, as transformers passes them) and the template's extra
variables (vLLM's chat_template_kwargs), where `add_generation_prompt` and
`continue_final_message` override the arguments of the same name and the names the renderer owns
(`messages`, `tools`, ...) are refused with a ChatTemplateError naming the key.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from m3eagle.engine.llm_engine import RequestError
from m3eagle.engine.runtime import check_text
from m3eagle.entrypoints.tools import ToolsError, prepare_tool_calls

# Template variables the renderer owns (or that name features m3eagle does not implement): never taken from
# chat_template_kwargs, where they would collide with the renderer's own arguments.
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "chat_template", "raise_exception", "strftime_now")


class ChatTemplateError(ValueError):
    """A chat request this model's template cannot render (or a model without a template)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, variables: dict[str, Any] | None = None):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat_template does not compile: {e}") from None
        self.variables = dict(variables or {})

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None, /,
               **kwargs: Any) -> str:
        """The prompt text. tools: the checked tools (tools.check_tools). kwargs are extra template variables;
        `add_generation_prompt` /
        `continue_final_message` among them override the arguments (as vLLM merges chat_template_kwargs).
        continue_final_message: end the prompt inside the last message (no end-of-turn after it), so the
        model continues it; it excludes add_generation_prompt."""
        for key in kwargs:
            if key in RESERVED_TEMPLATE_KWARGS:
                raise ChatTemplateError(f"chat_template_kwargs: {key!r} cannot be set there; it collides with the "
                                        f"renderer's own arguments ({', '.join(RESERVED_TEMPLATE_KWARGS)})")
        add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
        for name, v in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
            if not isinstance(v, bool):
                raise ChatTemplateError(f"{name}={v!r} must be true or false")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true: set "
                                    "add_generation_prompt to false to continue the final message")
        try:
            text = self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                        **{**self.variables, **kwargs})
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat_template failed on these messages: {e}") from None
        if continue_final_message:
            last = messages[-1].get("content") if messages and isinstance(messages[-1], dict) else None
            at = text.rfind(last) if isinstance(last, str) and last else -1
            if at < 0:
                raise ChatTemplateError("continue_final_message needs a final message with non-empty text content "
                                        "that the template renders verbatim")
            text = text[:at + len(last)]
        return text

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None) -> ChatTemplate | None:
        """The model's template, or None when it ships none. A template given as a list of named
        templates (transformers' format) uses the one named "default"."""
        if model_dir is None:
            return None
        d = Path(model_dir)
        conf: dict[str, Any] = {}
        f = d / "tokenizer_config.json"
        if f.is_file():
            try:
                conf = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                raise ChatTemplateError(f"{f} is not valid JSON ({e})") from None
        source = conf.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja_file = d / "chat_template.jinja"
        if source is None and jinja_file.is_file():
            source = jinja_file.read_text()
        if not isinstance(source, str):
            return None
        special = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = conf.get(key)
            if isinstance(v, dict):  # the AddedToken form
                v = v.get("content")
            special[key] = v if isinstance(v, str) else ""
        return cls(source, special)


def check_messages(messages: object, name: str = "messages") -> list[dict[str, Any]]:
    """One conversation, validated: a non-empty list of dicts with a str `role` and a `content` that is a
    str or a list of {"type": "text", "text": str} parts (flattened to its text, as the server does). Every
    string must be valid Unicode. A RequestError names the message and field (`messages[1].content`). Only an
    assistant message with tool_calls may have a None content (rendered as ""); its calls' JSON-string
    arguments are parsed for the template (tools.prepare_tool_calls)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"{name} must be a non-empty list of {{'role', 'content'}} dicts")
    out = []
    for i, m in enumerate(messages):
        where = f"{name}[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be a dict with 'role' and 'content', got {type(m).__name__}")
        role, content = m.get("role"), m.get("content", None)
        if not isinstance(role, str):
            raise RequestError(f"{where}.role must be a str, got {type(role).__name__}")
        check_text(role, f"{where}.role")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise RequestError(f"{where}.content[{j}] must be a {{'type': 'text', 'text': str}} part")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None and role == "assistant" and m.get("tool_calls"):
            content = ""
        if content is None:
            raise RequestError(f"{where}.content is None: give the message's text (a str); only an assistant "
                               "message with tool_calls may leave it out")
        if not isinstance(content, str):
            raise RequestError(f"{where}.content must be a str or a list of text parts, got "
                               f"{type(content).__name__}")
        check_text(content, f"{where}.content")
        bad = find_invalid_text({k: v for k, v in m.items() if k not in ("role", "content")})
        if bad is not None:
            raise RequestError(f"{where}.{bad} is not valid Unicode (a lone surrogate)")
        try:
            out.append(prepare_tool_calls({**m, "content": content}, where))
        except ToolsError as e:
            raise RequestError(str(e)) from None
    return out


def find_invalid_text(obj: Any, path: str = "") -> str | None:
    """The path (`a.b[2]`) of the first string in nested dicts / lists that UTF-8 cannot encode, or None."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path or "(value)"
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            bad = find_invalid_text(k, path) if isinstance(k, str) else None
            bad = bad or find_invalid_text(v, f"{path}.{k}" if path else str(k))
            if bad is not None:
                return bad
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            bad = find_invalid_text(v, f"{path}[{i}]")
            if bad is not None:
                return bad
    return None
