"""The parsers by the names the server's flags take (`--tool-call-parser`, `--reasoning-parser`), as in vLLM."""

from __future__ import annotations

from m3eagle.entrypoints.parsers.reasoning import ReasoningParser
from m3eagle.entrypoints.parsers.tool_calls import ToolCallParser

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {"minimax_m3": ToolCallParser}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {"minimax_m3": ReasoningParser}
DEFAULT_PARSER = "minimax_m3"  # m3eagle serves MiniMax-M3-family models; "none" turns a parser off


def check_parser_name(kind: str, name: str | None) -> str | None:
    """`name` if it is a known parser of this kind ("tool-call" or "reasoning"), None for "none" / None; a
    ValueError naming the flag otherwise."""
    if name is None or name == "none":
        return None
    known = TOOL_CALL_PARSERS if kind == "tool-call" else REASONING_PARSERS
    if name not in known:
        raise ValueError(f"--{kind}-parser {name!r} is not known; choose one of {', '.join(sorted(known))} or none")
    return name
