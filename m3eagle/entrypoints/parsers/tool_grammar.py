"""The grammar of a MiniMax-M3 reply that calls tools: xgrammar EBNF that `tool_choice` `required` and a named
function are enforced with, the inverse of `tool_calls.py`'s parser.

A reply under the grammar is an optional reasoning segment, whitespace, then exactly one block:

    ]<]minimax[>[<tool_call>  (ws  ]<]minimax[>[<invoke name="NAME"> PARAMS ]<]minimax[>[</invoke>)+  ws
    ]<]minimax[>[</tool_call>

and nothing after it (the model's EOS). A named choice allows one invoke of that function (vLLM's named
choice is one call); `required` one or more invokes of any listed function. PARAMS are the function's
`parameters.properties` as tags, in the schema's declared order (as xgrammar's own builders keep them by
default): required properties must appear, optional ones may, none twice, no undeclared one; whitespace
(at most 4 characters, so that a model cannot pad forever) may precede each tag. Values follow the property's
schema, in the subset the parser converts:

- `enum` / `const` of scalars: one of the values, written as the parser reads it back (`true`, `3`, `red`);
- integer `-?(0|[1-9][0-9]{0,17})`, number the same with an optional fraction and a 1-2 digit exponent,
  boolean `true|false`, null `null` (a type list: any of them; with `string` in it, free text);
- an object with `properties`: nested tags, by the same rule; an array: `<item>` tags, each typed by the
  items schema (nesting up to 4 levels, then free text);
- anything else (string, no type, `anyOf`, an object without `properties`): free text, which never holds the
  namespace marker, nor `</TAG>` inside a nested tag (the tree parser would close there), nor `<mm:think>`
  where the reasoning parser could take it for the reasoning's start. Patterns, formats, length and range
  bounds are not enforced; a property whose name a tag cannot carry (`<`, `>`, `/`, blank) is left out.

Reasoning (`reasoning`, from `reasoning.prompt_position`): "inside" (the prompt opened `<mm:think>`) puts
any text without `</mm:think>`, then `</mm:think>`, first; "before" allows `<mm:think>...</mm:think>` or a
lone `</mm:think>` first; "after" or None (no reasoning parser) starts at the block.

"Text without these markers" is xgrammar's `TagDispatch(excludes=...)` with no tags (see `_Grammar.text`).
"""

from __future__ import annotations

import json
from typing import Any

from m3eagle.entrypoints.parsers.reasoning import THINK_END, THINK_START
from m3eagle.entrypoints.parsers.tool_calls import NS, TOOL_CALL_END, TOOL_CALL_START, item_schema, schema_types

MAX_DEPTH = 4  # nested objects / arrays written as tags; deeper values are free text
_WS = "[ \\t\\r\\n]{0,4}"
_INT = '"-"? ("0" | [1-9] [0-9]{0,17})'
_NUM = _INT + ' ("." [0-9]{1,17})? ([eE] [+\\-]? [0-9]{1,2})?'


def _lit(s: str) -> str:
    """An EBNF string literal (JSON's escapes are xgrammar's; non-ASCII stays as written)."""
    return json.dumps(s, ensure_ascii=False)


def _scalar_text(v: Any) -> str | None:
    """An enum / const value as the parser reads it back (None: not a scalar it can carry)."""
    if isinstance(v, str):
        return v
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, int) or (isinstance(v, float) and v == v and abs(v) != float("inf")):
        return json.dumps(v)
    return None


def _tag_name_ok(name: object) -> bool:
    """A property name the parser can read back from a tag."""
    return isinstance(name, str) and bool(name.strip()) and not any(c in name for c in "<>/") and NS not in name


class _Grammar:
    """Collects the rules of one grammar; `text`, `value` and `params` return expressions over them."""

    def __init__(self, exclude_think: bool):
        self.rules: list[tuple[str, str]] = [("ws", _WS)]
        self._names: set[str] = {"ws"}
        self._texts: dict[tuple[str, ...], str] = {}
        self._base = (NS, THINK_START) if exclude_think else (NS,)

    def _fresh(self, stem: str) -> str:
        name, i = stem, 0
        while name in self._names:
            i += 1
            name = f"{stem}_{i}"
        self._names.add(name)
        return name

    def rule(self, stem: str, body: str) -> str:
        name = self._fresh(stem)
        self.rules.append((name, body))
        return name

    def text(self, markers: tuple[str, ...]) -> str:
        """A rule for any text that contains none of `markers`: xgrammar's TagDispatch with no tags and
        `excludes`, matched as one automaton over the markers at a flat ~2 us a token (the same automaton
        written as one rule per matched prefix recurses at every marker character and grows slower with the
        text's length: 0.1 ms a token at 5k tokens, 1.3 ms at 40k)."""
        key = tuple(sorted(set(markers)))
        if key not in self._texts:
            excludes = ", ".join(_lit(m) for m in key)
            self._texts[key] = self.rule("text", f"TagDispatch(loop_after_dispatch=false, excludes=({excludes},))")
        return self._texts[key]

    def free(self, closer: str | None) -> str:
        """Free text for a value: no namespace marker (nor `closer`, the `</TAG>` of a nested leaf)."""
        return self.text(self._base + ((closer,) if closer else ()))

    def value(self, schema: Any, tag: str, nested: bool, depth: int) -> str:
        """The body of a tag that holds a value of `schema`."""
        closer = f"</{tag}>" if nested else None
        s = schema if isinstance(schema, dict) else {}
        bad = self._base + ((closer,) if closer else ())
        options = [s["const"]] if "const" in s else s.get("enum") if isinstance(s.get("enum"), list) else None
        if options:
            texts = [t for t in map(_scalar_text, options) if t is not None and not any(b in t for b in bad)]
            if texts:
                return "(" + " | ".join(_lit(t) for t in dict.fromkeys(texts)) + ")"
        types = schema_types(schema)
        if "string" in types or depth >= MAX_DEPTH:
            return self.free(closer)
        alts: list[str] = []
        for t in types:
            if t == "integer":
                alts.append(_INT)
            elif t == "number":
                alts.append(_NUM)
            elif t == "boolean":
                alts.append('"true" | "false"')
            elif t == "null":
                alts.append('"null"')
            elif t == "object":
                if not isinstance(s.get("properties"), dict):
                    return self.free(closer)
                alts.append(self.params(s, depth + 1))
            elif t == "array":
                item = item_schema(schema, 0)
                one = self.rule("item", f"ws {_lit(NS + '<item>')} {self.value(item, 'item', True, depth + 1)} "
                                        f"{_lit(NS + '</item>')}")
                alts.append(f"({one}+ ws)?")
        if not alts:
            return self.free(closer)
        return self.rule("value", " | ".join(f"({a})" for a in alts))

    def params(self, schema: Any, depth: int) -> str:
        """An object's properties as tags, in declared order; required ones present, whitespace between them."""
        s = schema if isinstance(schema, dict) else {}
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        required = set(s.get("required") or []) if isinstance(s.get("required"), list) else set()
        items = [(k, v) for k, v in props.items() if _tag_name_ok(k)]
        if not items:
            return '""'
        # Chain rules from the last property back: `e` when nothing was written yet (an all-optional object may
        # stay empty, without stray whitespace), `n` once a tag was (whitespace may close it).
        nxt_e, nxt_n = '""', "ws"
        for k, v in reversed(items):
            tag = self.rule("param", f"ws {_lit(f'{NS}<{k}>')} {self.value(v, k, depth > 0, depth)} "
                                     f"{_lit(f'{NS}</{k}>')}")
            with_it = f"{tag} {nxt_n}"
            if k in required:
                e = n = self.rule("props", with_it)
            else:
                e = self.rule("props", f"{with_it} | {nxt_e}")
                n = self.rule("props", f"{with_it} | {nxt_n}")
            nxt_e, nxt_n = e, n
        return nxt_e

    def ebnf(self, root: str) -> str:
        return "\n".join([f"root ::= {root}", *(f"{n} ::= {b}" for n, b in self.rules)]) + "\n"


def tool_call_ebnf(tools: list[dict[str, Any]], name: str | None = None, reasoning: str | None = None) -> str:
    """The EBNF of a reply that calls `name` once (a named tool_choice) or, with name None, one or more of the
    tools (`required`). tools: the request's checked tools. reasoning: None (no reasoning parser) or where the
    output starts, "inside" / "before" / "after" the reasoning block (`reasoning.prompt_position`)."""
    if reasoning not in (None, "inside", "before", "after"):
        raise ValueError(f"reasoning={reasoning!r} must be None, 'inside', 'before' or 'after'")
    g = _Grammar(exclude_think=reasoning == "before")
    invokes = []
    for t in tools:
        fn = t["function"]
        if name is not None and fn["name"] != name:
            continue
        body = g.params(fn.get("parameters"), 0)
        start = _lit(f'{NS}<invoke name="{fn["name"]}">')
        invokes.append(g.rule("invoke", f"{start} {body} {_lit(NS + '</invoke>')}"))
    if not invokes:
        raise ValueError(f"no tool is named {name!r}")
    call = g.rule("call", " | ".join(invokes))
    calls = f"{call} ws" if name is not None else f"({call} ws)+"
    block = g.rule("block", f"{_lit(TOOL_CALL_START)} ws {calls} {_lit(TOOL_CALL_END)}")
    if reasoning == "inside":
        pre = f"{g.text((THINK_END,))} {_lit(THINK_END)} "
    elif reasoning == "before":
        pre = f"({_lit(THINK_START)} {g.text((THINK_END,))} {_lit(THINK_END)} | {_lit(THINK_END)})? "
    else:
        pre = ""
    return g.ebnf(f"{pre}ws {block}")
