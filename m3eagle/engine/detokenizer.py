"""Incremental detokenization and stop strings: the text of one request's output, a token at a time.

`tokenizers.decoders.DecodeStream` decodes only a short window around each new token, so a request's text
costs O(1) per token instead of re-decoding the whole output every step (O(n^2)). The stream holds a token
back while its bytes do not yet form a whole UTF-8 character; `finish()` flushes such a tail once, so the
final text equals `tokenizer.decode(output_token_ids)`.

Stop strings are matched on the incremental text, across token boundaries: after each token only the
window where a new match can start is searched (the last `max(len(stop)) - 1` characters before the new
piece, plus the piece). The first token whose text completes a stop string is the last token of the
output, and the text is cut before the stop string.

Streaming must never hand out characters that a later stop string would cut, so `safe_length` keeps the
last `max(len(stop)) - 1` characters back until the request finishes (vLLM's rule for
include_stop_str_in_output=False).

Transactions: the engine forks a detokenizer, feeds a step's tokens to the fork and adopts it only once
every decision for that step succeeded (`LLMEngine._append`), so a fault in the middle of a step never
leaves a request's text ahead of its tokens.

`FinalTextDetokenizer` is the same interface for a request whose text nobody reads before it ends
(`LLM.generate`, the offline bench) and that has no stop strings: it decodes once, at the end, instead
of a stream step and a fork per token and step -- a quarter of the host's step time at batch 32 with
speculation (benchmarks/host_step.py). Its final text is `tokenizer.decode(output_token_ids)`, which is
what the incremental text ends as too.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers.decoders import DecodeStream

log = logging.getLogger("m3eagle")

# What tokenizers raises when a window's decode no longer starts with the text already emitted (a decoder
# that is not prefix-stable on some odd byte sequences); the stream can start over from the next token.
_INVALID_PREFIX = "Invalid prefix"


class IncrementalDetokenizer:
    """Text of one output. `tokenizer` is m3eagle's Tokenizer (loader/tokenizer.py): its `.tok` is the
    `tokenizers.Tokenizer` the stream decodes with, its `decode` the full decode used once by `finish`."""

    __slots__ = ("tokenizer", "stop", "hold", "text", "pending", "stopped", "stop_str", "include_stop", "_stream")
    deferred = False  # text as it goes (FinalTextDetokenizer: at the end)

    def __init__(self, tokenizer: Any, stop: list[str] | tuple[str, ...] = (), include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output: cut after the stop string
        # Characters a stop string can still complete from: they stay out of streamed text until the end.
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # decoded output so far (cut before the stop string once one completed)
        self.pending = 0  # tokens fed since the stream last produced text (a partial character, a special token)
        self.stopped = False
        self.stop_str: str | None = None  # the stop string that completed (the first to start, on a tie of ends)
        self._stream = DecodeStream(skip_special_tokens=True)

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy (the stream's small window is copied; the text is an immutable str)."""
        new = object.__new__(IncrementalDetokenizer)  # once per request per step: no __init__, no loop
        new.tokenizer, new.stop, new.hold, new.text = self.tokenizer, self.stop, self.hold, self.text
        new.pending, new.stopped, new.stop_str, new.include_stop = self.pending, self.stopped, self.stop_str, \
            self.include_stop
        new._stream = self._stream.__copy__()  # what copy.copy calls, without its dispatch
        return new

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Feed one token. Returns True when it completed a stop string (the text is then cut before it, or
        after it with include_stop). check_stop=False: stop strings may not end the output yet (min_tokens)."""
        if self.stopped:
            raise RuntimeError("a stopped detokenizer takes no more tokens")
        try:  # the stream's step inline: this runs once per output token
            piece = self._stream.step(self.tokenizer.tok, token_id)
        except Exception as e:  # tokenizers raises a bare Exception
            piece = self._restart(token_id, e)
        if piece is None:
            self.pending += 1
            return False
        self.pending = 0
        text = self.text
        self.text += piece
        if self.stop and check_stop:
            start = max(0, len(text) - self.hold)  # a new match must end inside `piece`
            window = self.text[start:]
            hits = [(i, s) for i, s in ((window.find(s), s) for s in self.stop) if i >= 0]
            if hits:
                first, self.stop_str = min(hits, key=lambda h: h[0])
                self.text = self.text[: start + first + (len(self.stop_str) if self.include_stop else 0)]
                self.stopped = True
                return True
        return False

    def extend(self, token_ids: list[int]) -> None:
        """Feed tokens that cannot end the output (the engine checked: no stop strings here), as `add` would
        one by one: the same stream steps, without add's per-token checks, and the text joined once."""
        if self.stop:
            raise RuntimeError("extend() skips the stop-string check; feed a detokenizer with stop strings by add()")
        if self.stopped and token_ids:
            raise RuntimeError("a stopped detokenizer takes no more tokens")
        stream, tok, pending, pieces = self._stream, self.tokenizer.tok, self.pending, []
        try:
            for t in token_ids:
                try:
                    piece = stream.step(tok, t)
                except Exception as e:  # tokenizers raises a bare Exception
                    piece = self._restart(t, e)
                    stream = self._stream
                if piece is None:
                    pending += 1
                else:
                    pending = 0
                    pieces.append(piece)
        finally:  # what add() would have left, had it been called per token up to the failing one
            self.pending = pending
            if pieces:
                self.text += "".join(pieces)

    def extended(self, token_ids: list[int]) -> IncrementalDetokenizer:
        """A fork fed `token_ids` by `extend` (the engine's step transaction, in one call)."""
        new = self.fork()
        new.extend(token_ids)
        return new

    def finish(self, token_ids: list[int]) -> None:
        """The output ended: flush text the stream still holds back (a trailing partial character decodes
        to U+FFFD, as a full decode gives). One full decode, and only when something is held back."""
        if self.pending and not self.stopped:
            full = self.tokenizer.decode(token_ids)
            if full.startswith(self.text):
                self.text = full
            else:  # never seen with byte-level BPE; keep the streamed text rather than rewrite what was sent
                log.debug("full decode diverges from the incremental text; keeping the incremental text")
        self.pending = 0

    def safe_length(self, finished: bool) -> int:
        """How much of `text` may be streamed now: all of it once finished, else all but the held tail."""
        return len(self.text) if finished or not self.stop else max(0, len(self.text) - self.hold)

    def _restart(self, token_id: int, e: Exception) -> str | None:
        """The stream's step raised `e`: re-raise it, unless the window only stopped being prefix-stable;
        then restart the stream at this token (vLLM does the same)."""
        if not str(e).startswith(_INVALID_PREFIX):
            raise e
        log.warning("detokenizer: %s; restarting the decode stream", e)
        self._stream = DecodeStream(skip_special_tokens=True)
        return self._stream.step(self.tokenizer.tok, token_id)


class FinalTextDetokenizer:
    """IncrementalDetokenizer's interface for a request without stop strings whose text is read only once
    it has finished: `add` only notes that text is pending, `finish` decodes the whole output once. Nothing
    changes before `finish` assigns the decoded text, so a fork is the object itself (a failed step leaves
    it as it was), and streamed deltas carry no text until the last one, which carries all of it."""

    __slots__ = ("tokenizer", "text", "pending")
    stop: tuple[str, ...] = ()
    stopped = False
    stop_str = None
    deferred = True

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.text = ""
        self.pending = 0  # tokens not decoded yet

    def fork(self) -> FinalTextDetokenizer:
        return self

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        self.pending += 1  # an int: a step that fails after this leaves a count, not text, ahead
        return False

    def extend(self, token_ids: list[int]) -> None:
        self.pending += len(token_ids)

    def extended(self, token_ids: list[int]) -> FinalTextDetokenizer:
        """`fork` + `extend`: the object itself (its fork), with the count."""
        self.extend(token_ids)
        return self

    def finish(self, token_ids: list[int]) -> None:
        self.text = self.tokenizer.decode(token_ids)
        self.pending = 0

    def safe_length(self, finished: bool) -> int:
        return len(self.text) if finished else 0
