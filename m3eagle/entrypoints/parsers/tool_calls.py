"""Tool calls in MiniMax-M3's output, turned into OpenAI `tool_calls`.

M3 writes calls as XML whose every tag is prefixed by the namespace marker `]<]minimax[>[`:

    ]<]minimax[>[<tool_call>
    ]<]minimax[>[<invoke name="get_weather">]<]minimax[>[<city>Paris]<]minimax[>[</city>]<]minimax[>[</invoke>
    ]<]minimax[>[<invoke name="search">]<]minimax[>[<tags>]<]minimax[>[<item>a]<]minimax[>[</item>...
    ]<]minimax[>[</tool_call>

One block may hold several `<invoke>`s (parallel calls). A parameter is named by its tag; an object value is
nested tags, an array is `<item>` tags. Values are converted with the tool's JSON schema: a leaf is a string
unless the schema's type says integer / number / boolean / null / object / array and the text parses as one
(else the raw text is kept); a parameter the schema does not describe stays a string.

`ToolCallParser` works chunk by chunk and gives the same result for any split of the text: content outside
the blocks, and per call a header (index, id, name) once its name is read, then one argument fragment per
parameter as its closing tag arrives, then the closing brace; the fragments join into
`json.dumps(arguments)`. What it does with imperfect output:

- text between the block's tags that is not an invoke is dropped (it is markup noise, never content);
- a repeated parameter keeps its first value;
- the whitespace around a block is dropped with it; content that no block touched is returned exactly;
- an output that ends inside a call closes that call with the parameters read so far (the finish reason
  says the output was cut); an output that ends inside a block before any call's name was read returns the
  block's raw text as content, as vLLM does, since there is no call to report.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from m3eagle.entrypoints.parsers.reasoning import held_prefix

NS = "]<]minimax[>["
TOOL_CALL_START = NS + "<tool_call>"
TOOL_CALL_END = NS + "</tool_call>"
INVOKE_START = NS + '<invoke name="'
INVOKE_NAME_END = '">'
INVOKE_END = NS + "</invoke>"

_INT = re.compile(r"[+-]?\d+")


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """A piece of one tool call: its header (id and name, once) and / or a fragment of its JSON arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """The streamed `delta.tool_calls[i]` shape."""
        fn: dict[str, Any] = {"arguments": self.arguments}
        if self.name is not None:
            fn = {"name": self.name, "arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        out["function"] = fn
        return out


@dataclass
class ToolParserDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


# ---- values ----------------------------------------------------------------------------------------


def schema_types(schema: Any) -> list[str]:
    """The JSON types a schema allows, most specific first in the order they are tried."""
    if not isinstance(schema, dict):
        return ["string"]
    t = schema.get("type")
    types: list[str] = []
    if isinstance(t, str):
        types = [t]
    elif isinstance(t, list):
        types = [x for x in t if isinstance(x, str)]
    elif isinstance(schema.get("properties"), dict):
        types = ["object"]
    elif "items" in schema or "prefixItems" in schema:
        types = ["array"]
    else:
        examples = ([schema["const"]] if "const" in schema else
                    schema["enum"] if isinstance(schema.get("enum"), list) else [])
        for v in examples:
            types.append(_json_type(v))
        for key in ("anyOf", "oneOf", "allOf"):
            for sub in schema.get(key) or []:
                types += schema_types(sub)
    return list(dict.fromkeys(types)) or ["string"]


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    return {dict: "object", list: "array"}.get(type(v), "string")


def _branches(schema: Any) -> list[dict[str, Any]]:
    if not isinstance(schema, dict):
        return []
    out = [schema]
    for key in ("anyOf", "oneOf", "allOf"):
        out += [b for sub in schema.get(key) or [] for b in _branches(sub)]
    return out


def property_schema(schema: Any, name: str) -> Any:
    """The schema of property `name` of an object schema (any branch of anyOf / oneOf / allOf)."""
    for b in _branches(schema):
        props = b.get("properties")
        if isinstance(props, dict) and name in props:
            return props[name]
    for b in _branches(schema):
        if isinstance(b.get("additionalProperties"), dict):
            return b["additionalProperties"]
    return None


def item_schema(schema: Any, i: int) -> Any:
    """The schema of item `i` of an array schema (`items`, or `prefixItems` then `additionalItems`)."""
    for b in _branches(schema):
        if isinstance(b.get("items"), dict):
            return b["items"]
        prefix = b.get("prefixItems")
        if isinstance(prefix, list) and prefix:
            return prefix[i] if i < len(prefix) else b.get("additionalItems") or prefix[-1]
    return None


def convert_leaf(text: str, schema: Any) -> Any:
    """A parameter's text as the value its schema describes (the raw text when nothing fits)."""
    types = schema_types(schema)
    if text == "":
        for t, empty in (("object", {}), ("array", []), ("null", None)):
            if t in types:
                return empty
        return ""
    s = text.strip()
    for t in [t for t in ("null", "boolean", "integer", "number", "object", "array") if t in types]:
        if t == "null" and s == "null":
            return None
        if t == "boolean" and s.lower() in ("true", "false"):
            return s.lower() == "true"
        if t == "integer" and _INT.fullmatch(s):
            return int(s)
        if t == "number":
            if _INT.fullmatch(s):
                return int(s)
            try:
                x = float(s)
            except ValueError:
                continue
            if math.isfinite(x):
                return x
        if t in ("object", "array"):
            try:
                v = json.loads(s)
            except ValueError:
                continue
            if isinstance(v, dict if t == "object" else list):
                return v
    return text


@dataclass
class _Node:
    tag: str
    texts: list[str] = field(default_factory=list)
    children: list[_Node] = field(default_factory=list)


def _parse_tree(body: str, tag: str) -> _Node:
    """Nested `NS<tag>...NS</tag>` markup as a tree (unclosed tags close at the end; a stray closer closes up
    to its own tag)."""
    root = _Node(tag)
    stack = [root]
    for i, piece in enumerate(body.split(NS)):
        if i == 0:
            if piece.strip():
                root.texts.append(piece)
            continue
        m = re.match(r"<(/?)([^<>/]+)>", piece)
        if m is None:
            stack[-1].texts.append(piece)
            continue
        rest = piece[m.end():]
        if m.group(1):  # a closing tag closes up to its own tag; one that matches nothing is dropped
            if m.group(2) in [n.tag for n in stack[1:]]:
                while stack.pop().tag != m.group(2):
                    pass
            if rest.strip():
                stack[-1].texts.append(rest)
            continue
        node = _Node(m.group(2))
        stack[-1].children.append(node)
        stack.append(node)
        value, closed, after = rest.partition(f"</{node.tag}>")  # a leaf closed without the marker
        if closed:
            stack.pop()
            node.texts.append(value)
            if after.strip():
                stack[-1].texts.append(after)
        elif rest:
            node.texts.append(rest)
    return root


def _convert_node(node: _Node, schema: Any) -> Any:
    if not node.children:
        return convert_leaf("".join(node.texts), schema)
    types = schema_types(schema) if schema is not None else []
    as_list = "array" in types or (not {"object", "array"} & set(types) and all(c.tag == "item" for c in node.children))
    if as_list and node.children[0].tag == "item":
        return [_convert_node(c, item_schema(schema, i)) for i, c in enumerate(node.children)]
    out: dict[str, Any] = {}
    for c in node.children:
        v = _convert_node(c, property_schema(schema, c.tag))
        if c.tag not in out:
            out[c.tag] = v
        elif isinstance(out[c.tag], _Repeated):
            out[c.tag].append(v)
        else:
            out[c.tag] = _Repeated([out[c.tag], v])
    return {k: list(v) if isinstance(v, _Repeated) else v for k, v in out.items()}


class _Repeated(list):
    """A tag repeated inside one object: its values are collected into a list."""


def convert_parameter(body: str, schema: Any, name: str = "") -> Any:
    """One parameter's raw body (between its tags) as a JSON value: nested tags make an object or an
    array, plain text a leaf converted by the schema."""
    if body.lstrip().startswith(NS + "<"):
        return _convert_node(_parse_tree(body, name), schema)
    return convert_leaf(body, schema)


# ---- the parser --------------------------------------------------------------------------------------


class ToolCallParser:
    """Streams content and tool calls out of M3 output (`feed` chunks, then `finish`).

    tools: the request's tools (OpenAI shape), for their parameter schemas. id_factory: makes call ids."""

    name = "minimax_m3"

    def __init__(self, tools: list[dict[str, Any]] | None = None,
                 id_factory: Callable[[], str] = new_tool_call_id):
        self._schemas: dict[str, Any] = {}
        for t in tools or []:
            fn = t.get("function") if isinstance(t, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                self._schemas[fn["name"]] = fn.get("parameters")
        self._new_id = id_factory
        self._buf = ""
        self._state = "text"  # text | block | name | params | value
        self._block_raw = ""  # the current block's text while it has no call yet (an unfinished block's content)
        self._block_calls = 0
        self._lstrip = False  # after a block: drop the whitespace that follows it
        self.num_calls = 0
        self._call_name = ""
        self._params: set[str] = set()
        self._param = ""

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> ToolParserDelta:
        out = ToolParserDelta()
        self._buf += text
        if self._state != "text" and self._block_calls == 0:
            self._block_raw += text
        while self._step(out):
            pass
        return out

    def finish(self) -> ToolParserDelta:
        out = ToolParserDelta()
        if self._state == "text":
            out.content = self._buf
        elif self._state in ("params", "value"):
            self._close_call(out)
        elif self._block_calls == 0:  # a block cut off before any call: give its text back
            out.content = self._block_raw
        self._buf, self._state = "", "text"
        return out

    # One transition; False when the buffer holds too little to decide.
    def _step(self, out: ToolParserDelta) -> bool:
        buf = self._buf
        if not buf:
            return False
        if self._state == "text":
            if self._lstrip:
                self._buf = buf = buf.lstrip()
                if not buf:
                    return False
                self._lstrip = False
            at = buf.find(TOOL_CALL_START)
            if at < 0:  # hold back a partial marker, and the whitespace before it (dropped if a block follows)
                keep = held_prefix(buf, TOOL_CALL_START)
                body = buf[:len(buf) - keep].rstrip()
                out.content += body
                self._buf = buf[len(body):]
                return False
            out.content += buf[:at].rstrip()
            self._buf = buf[at + len(TOOL_CALL_START):]
            self._state, self._block_calls, self._block_raw = "block", 0, TOOL_CALL_START + self._buf
            return True
        if self._state == "name":
            at = buf.find(INVOKE_NAME_END)
            if at < 0:
                return False
            self._call_name, self._params = buf[:at].strip(), set()
            self._buf, self._state = buf[at + len(INVOKE_NAME_END):], "params"
            out.tool_calls.append(ToolCallDelta(self.num_calls, self._new_id(), self._call_name))
            self._block_calls += 1
            return True
        if self._state == "value":
            end = f"{NS}</{self._param}>"
            at = buf.find(end)
            if at < 0:
                return False
            self._buf, self._state = buf[at + len(end):], "params"
            if self._param not in self._params:
                schema = property_schema(self._schemas.get(self._call_name), self._param)
                value = convert_parameter(buf[:at], schema, self._param)
                lead = "{" if not self._params else ", "
                self._params.add(self._param)
                out.tool_calls.append(ToolCallDelta(self.num_calls, arguments=(
                    f"{lead}{json.dumps(self._param, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")))
            return True
        if buf[0].isspace():  # between tags
            self._buf = buf = buf.lstrip()
            if not buf:
                return False
        if self._state == "block":
            if buf.startswith(INVOKE_START):
                self._buf, self._state = buf[len(INVOKE_START):], "name"
                return True
            if buf.startswith(TOOL_CALL_END):
                self._buf, self._state, self._lstrip = buf[len(TOOL_CALL_END):], "text", True
                return True
            if INVOKE_START.startswith(buf) or TOOL_CALL_END.startswith(buf):
                return False
            return self._skip_stray()
        # params: a parameter's opening tag, the invoke's end (or the block's, if the invoke's is missing)
        if buf.startswith(NS + "<"):
            gt = buf.find(">", len(NS))
            if gt < 0:
                return False
            closing, tag = buf[len(NS) + 1] == "/", buf[len(NS) + 1:gt].lstrip("/")
            self._buf = buf[gt + 1:]
            if not closing:
                self._param, self._state = tag, "value"
            elif tag in ("invoke", "tool_call"):
                self._close_call(out)
                self._state = "block" if tag == "invoke" else "text"
                self._lstrip = tag == "tool_call"
            return True  # a stray closing tag is dropped
        if (NS + "<").startswith(buf):
            return False
        return self._skip_stray()

    def _skip_stray(self) -> bool:
        """Drop text that is not markup, up to the next namespace marker (or all but a partial one)."""
        at = self._buf.find(NS, 1)
        if at < 0:
            keep = held_prefix(self._buf, NS)
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._buf = self._buf[at:]
        return True

    def _close_call(self, out: ToolParserDelta) -> None:
        out.tool_calls.append(ToolCallDelta(self.num_calls, arguments="}" if self._params else "{}"))
        self.num_calls += 1
