"""Chat templates: a model's `chat_template` (tokenizer_config.json, or chat_template.jinja beside it)
rendered with jinja2 the way transformers' `apply_chat_template` renders it: a sandboxed environment with
trim_blocks / lstrip_blocks and loop controls, `raise_exception`, a `tojson` that keeps non-ASCII text,
`strftime_now`, and the tokenizer's special tokens (bos_token, eos_token, ...) as variables.
One implementation for both users: `LLM.chat()` and the server's /v1/chat/completions.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


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

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **{**self.variables, **kwargs})
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat_template failed on these messages: {e}") from None

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
