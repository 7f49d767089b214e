"""Tools in a chat request: the `tools` list and `tool_choice` checked, and the tool calls of earlier assistant
turns made ready for the chat template. One implementation for `LLM.chat(tools=...)` and the server.

A ToolsError names the field (`tools[1].function.name`, `tool_choice`, `messages[2].tool_calls[0]...`) and
the fix; the server answers it as a 400, `LLM.chat` raises it as a RequestError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from m3eagle.entrypoints.parsers.tool_grammar import tool_call_ebnf

TOOL_CHOICES = ("none", "auto", "required")


class ToolsError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    """What the request asked for: mode "none" (tools rendered, calls never parsed), "auto", "required" (at
    least one call) or "named" (calls of `name`)."""

    mode: str
    name: str | None = None

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"


def check_tools(tools: object, name: str = "tools") -> list[dict[str, Any]]:
    """A non-empty list of {"type": "function", "function": {"name", "description"?, "parameters"?}} with
    distinct names that M3's markup can carry (`<invoke name="...">`)."""
    if not isinstance(tools, list) or not tools:
        raise ToolsError(f"{name} must be a non-empty list of {{'type': 'function', 'function': {{'name': ...}}}} "
                         "objects (leave it out for no tools)", name)
    seen: set[str] = set()
    for i, t in enumerate(tools):
        where = f"{name}[{i}]"
        if not isinstance(t, dict):
            raise ToolsError(f"{where} must be an object, got {type(t).__name__}", where)
        if t.get("type", "function") != "function":
            raise ToolsError(f"{where}.type={t.get('type')!r}: only 'function' tools are supported", f"{where}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ToolsError(f"{where}.function must be an object with a 'name'", f"{where}.function")
        fname = fn.get("name")
        if not isinstance(fname, str) or not fname.strip():
            raise ToolsError(f"{where}.function.name is missing: give each tool a non-empty name", f"{where}.function.name")
        if any(c in fname for c in '"<>') or fname != fname.strip():
            raise ToolsError(f"{where}.function.name={fname!r} holds quotes, angle brackets or surrounding spaces, "
                             "which a tool call cannot carry; rename the tool", f"{where}.function.name")
        if fname in seen:
            raise ToolsError(f"{where}.function.name={fname!r} is used by an earlier tool; tool names must be unique",
                             f"{where}.function.name")
        seen.add(fname)
        for key, kind in (("parameters", dict), ("description", str)):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise ToolsError(f"{where}.function.{key} must be a{' JSON schema object' if kind is dict else ' string'}"
                                 f", got {type(fn[key]).__name__}", f"{where}.function.{key}")
    return tools


def resolve_tool_choice(tool_choice: object, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """OpenAI's tool_choice (None: "auto" with tools, "none" without). `required` and a named function need
    tools, and the name must be one of them."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise ToolsError(f"tool_choice={tool_choice!r} must be one of {', '.join(TOOL_CHOICES)} or "
                             "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if tool_choice == "required" and not tools:
            raise ToolsError("tool_choice='required' needs tools: give the tools the model must choose from", "tool_choice")
        return ToolChoice(tool_choice if tools else "none")
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ToolsError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                         "{'name': ...}}", "tool_choice")
    names = [t["function"]["name"] for t in tools or []]
    if name not in names:
        raise ToolsError(f"tool_choice names the function {name!r}, which is not among the tools "
                         f"({', '.join(map(repr, names)) or 'none given'})", "tool_choice.function.name")
    return ToolChoice("named", name)


def tool_call_grammar(choice: ToolChoice, tools: list[dict[str, Any]] | None,
                      reasoning: str | None = None) -> str | None:
    """The EBNF grammar (xgrammar's dialect) that makes the reply a call for `required` / a named function, as
    vLLM constrains them on its structured-output backend; None for `auto` and `none`. reasoning: where the
    output starts against the reasoning block ("inside", "before", "after": `reasoning.prompt_position`), or
    None when no reasoning parser reads the reply. The grammar's shape: `parsers/tool_grammar.py`."""
    if choice.mode not in ("required", "named") or not tools:
        return None
    return tool_call_ebnf(tools, choice.name if choice.mode == "named" else None, reasoning)


def prepare_tool_calls(message: dict[str, Any], where: str) -> dict[str, Any]:
    """An earlier assistant turn's tool calls as templates read them: `function.arguments` given as a JSON
    string (the OpenAI wire form) parsed to an object, as vLLM and transformers hand them to templates."""
    calls = message.get("tool_calls")
    if calls is None:
        return message
    if not isinstance(calls, list):
        raise ToolsError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolsError(f"{where}.tool_calls[{j}] must be {{'type': 'function', 'function': {{'name', "
                             "'arguments'}}}}", f"{where}.tool_calls[{j}]")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ToolsError(f"{where}.tool_calls[{j}].function.arguments is not valid JSON ({e})",
                                 f"{where}.tool_calls[{j}].function.arguments") from None
        if not isinstance(args, dict):
            raise ToolsError(f"{where}.tool_calls[{j}].function.arguments must be a JSON object",
                             f"{where}.tool_calls[{j}].function.arguments")
        out.append({**c, "function": {**fn, "arguments": args}})
    return {**message, "tool_calls": out}
