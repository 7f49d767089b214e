"""Reasoning in MiniMax-M3's output: the text between `<mm:think>` and `</mm:think>`, apart from the answer.

M3 thinks in one block, `<mm:think>reasoning</mm:think>answer`. Its chat template may prefill the opening
tag in the generation prompt (thinking mode "enabled"), so the output can start inside the block, and with
thinking "disabled" it prefills the closing tag, after which a model may still repeat a stray `</mm:think>`
first. The rules, applied the same way to a whole text and to any split of it into chunks:

- started inside the block (the prompt ends with `<mm:think>`): everything up to the first `</mm:think>` is
  reasoning, the rest is content; without a closing tag the whole output is reasoning;
- otherwise a `</mm:think>` at the very start of the output is dropped; text before a `<mm:think>` is
  content, the block is reasoning, text after its `</mm:think>` is content again (an unclosed block
  reasons to the end);
- only the first block is reasoning: later tags are left in the content as the model wrote them;
- the whitespace the model writes after the block (or after a prefilled / stray `</mm:think>`) is dropped;
  content that no tag touched is returned exactly as written.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<mm:think>"
THINK_END = "</mm:think>"


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (text to hold back, as
    the next chunk may complete the marker)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def prompt_position(prompt: str | None) -> str:
    """Where the output of this prompt starts: "inside" the reasoning block (the prompt ends by opening it),
    "after" it (the prompt closes it: thinking disabled) or "before" it (the output may open one)."""
    end = prompt.rstrip() if prompt is not None else ""
    return "inside" if end.endswith(THINK_START) else "after" if end.endswith(THINK_END) else "before"


@dataclass
class ReasoningDelta:
    """What one chunk of output added: reasoning text and content text (either may be empty)."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Splits MiniMax-M3 output into reasoning and content, chunk by chunk (`feed`, then `finish`).

    starts_in_reasoning: the prompt already opened the block (see `for_prompt`)."""

    name = "minimax_m3"

    def __init__(self, starts_in_reasoning: bool = False, after_reasoning: bool = False):
        # start -> content | after; content -> reasoning -> after
        self._state = "reasoning" if starts_in_reasoning else "after" if after_reasoning else "start"
        self._buf = ""
        self._lstrip = after_reasoning  # drop the whitespace that follows the block's end

    @classmethod
    def for_prompt(cls, prompt: str | None) -> ReasoningParser:
        """A parser for the output of this prompt: inside the block when the prompt ends by opening it, past
        it when the prompt closes it (thinking disabled)."""
        at = prompt_position(prompt)
        return cls(starts_in_reasoning=at == "inside", after_reasoning=at == "after")

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        out = ReasoningDelta()
        while self._buf:
            if self._state == "start":
                # A stray closer may open the output (thinking disabled); decide once enough text is here.
                if THINK_END.startswith(self._buf) and self._buf != THINK_END:
                    break
                if self._buf.startswith(THINK_END):
                    self._buf, self._state, self._lstrip = self._buf[len(THINK_END):], "after", True
                else:
                    self._state = "content"
            elif self._state == "content":
                at = self._buf.find(THINK_START)
                if at >= 0:
                    out.content += self._buf[:at]
                    self._buf, self._state = self._buf[at + len(THINK_START):], "reasoning"
                    continue
                keep = held_prefix(self._buf, THINK_START)
                out.content += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                break
            elif self._state == "reasoning":
                at = self._buf.find(THINK_END)
                if at >= 0:
                    out.reasoning += self._buf[:at]
                    self._buf, self._state, self._lstrip = self._buf[at + len(THINK_END):], "after", True
                    continue
                keep = held_prefix(self._buf, THINK_END)
                out.reasoning += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                break
            else:  # after the block: all content
                if self._lstrip:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        break
                    self._lstrip = False
                out.content += self._buf
                self._buf = ""
        return out

    def finish(self) -> ReasoningDelta:
        """The end of the output: text held back for a marker that never completed goes where it stood."""
        rest, self._buf = self._buf, ""
        if self._state == "reasoning":
            return ReasoningDelta(reasoning=rest)
        return ReasoningDelta(content=rest)
