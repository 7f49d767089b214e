"""The MiniMax-M3 reasoning parser (`<mm:think>` ... `</mm:think>`): table tests on M3-shaped replies, each streamed
split at every position (and a character at a time) equal to the whole parse."""

from __future__ import annotations

import pytest

from m3eagle.entrypoints.parsers import ReasoningParser, parse_output
from tests.entrypoints.parsers._split import assert_every_split

CASES = [
    # (output, prompt's end, reasoning, content)
    ("<mm:think>\nThe user wants 2+3.\n</mm:think>\n\nIt is 5.", "]~b]ai\n", "The user wants 2+3.", "It is 5."),
    ("The user wants 2+3.\n</mm:think>\n\nIt is 5.", "]~b]ai\n<mm:think>", "The user wants 2+3.", "It is 5."),
    ("still thinking when the budget ran out", "]~b]ai\n<mm:think>", "still thinking when the budget ran out", None),
    ("</mm:think>\n\nIt is 5.", "]~b]ai\n", None, "It is 5."),  # a stray closer opens the output
    ("\n\nIt is 5.", "]~b]ai\n</mm:think>", None, "It is 5."),  # thinking disabled: the prompt closed the block
    ("It is 5.", "]~b]ai\n", None, "It is 5."),
    ("  keeps <its> spacing\n", "]~b]ai\n", None, "  keeps <its> spacing\n"),  # no markup: content as written
    ("Hmm. <mm:think>why</mm:think> So 5.", "]~b]ai\n", "why", "Hmm. So 5."),
    ("<mm:think>a</mm:think>b<mm:think>c</mm:think>", "]~b]ai\n", "a", "b<mm:think>c</mm:think>"),  # one block
    ("<mm:think>cut off", "]~b]ai\n", "cut off", None),
    ("<mm:thin", "]~b]ai\n", None, "<mm:thin"),  # an unfinished tag that never completes is text
    ("</mm:thi", "]~b]ai\n", None, "</mm:thi"),
    ("5 </mm:think>", "]~b]ai\n", None, "5 </mm:think>"),  # only a closer at the very start is stray
]


@pytest.mark.parametrize("text,prompt,reasoning,content", CASES)
def test_reasoning_table_every_split(text, prompt, reasoning, content):
    got = assert_every_split(text, None, prompt=prompt)
    assert (got.reasoning_content, got.content, got.tool_calls) == (reasoning, content, [])


def test_for_prompt_reads_the_generation_prompt():
    assert ReasoningParser.for_prompt("]~b]ai\n<mm:think>\n").feed("x").reasoning == "x"
    assert ReasoningParser.for_prompt("]~b]ai\n").feed("x").content == "x"
    assert ReasoningParser.for_prompt(None).feed("x").content == "x"


def test_parse_output_offline_helper():
    m = parse_output("<mm:think>plan</mm:think>answer")
    assert (m.reasoning_content, m.content, m.tool_calls) == ("plan", "answer", [])
    assert parse_output("<mm:think>plan</mm:think>answer", reasoning=False).content == "<mm:think>plan</mm:think>answer"
