"""Structured output: a request's grammar as a token mask, on xgrammar.

`GrammarCompiler` turns a `StructuredOutputsParams` (JSON schema, regex, choice, EBNF grammar, any JSON
object) into an xgrammar CompiledGrammar, once per distinct spec (a bounded cache). `RequestGrammar` is one
sequence's matcher: it follows the sequence's accepted output tokens, fills the bitmask of the tokens
allowed next, and is advanced through speculative tokens and rolled back again.

Masks are xgrammar's bitmask layout: int32 [rows, ceil(V / 32)], bit (id % 32) of word (id // 32) set when
token id is allowed. `apply_bitmask` sets the logits of disallowed ids to -inf (torch ops on the logits'
device; xgrammar's `apply_token_bitmask_inplace` is the oracle its test holds it equal to).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from m3eagle.sampling.params import StructuredOutputsParams

# Bit b of a word is 1 << b; bit 31 is int32's sign bit, which torch's shifts of int32 handle like the rest.
_BITS = 32


class GrammarError(ValueError):
    """A structured-output spec that xgrammar cannot compile; the message names the field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"structured_outputs.{field} cannot be compiled: {message}")
        self.field = field


def bitmask_width(vocab_size: int) -> int:
    """Words per bitmask row: ceil(V / 32)."""
    return -(-vocab_size // _BITS)


def full_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed host bitmask: int32 [rows, ceil(V / 32)] of -1 (every bit set)."""
    return torch.full((rows, bitmask_width(vocab_size)), -1, dtype=torch.int32)


def allowed_from_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask int32 [..., W] -> bool [..., V]: which token ids are allowed. The words are read as their bytes
    (little-endian, as on every device here: byte b of word w holds ids 32w + 8b ..), so the one intermediate
    is a byte per token, not a word (a masked CUDA graph keeps it in its pool)."""
    byts = bitmask.contiguous().view(torch.uint8)  # [..., 4W]
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = (byts[..., None] >> shifts) & 1  # [..., 4W, 8] uint8
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [..., V] (any float dtype), bitmask int32 [..., W] -> the logits with every disallowed id at -inf
    (a new tensor). A row whose mask allows nothing is left as it is: no token can be forced then, and a row of
    -inf would give NaN probabilities."""
    allowed = allowed_from_bitmask(bitmask, logits.shape[-1])
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    return logits.masked_fill(~allowed, float("-inf"))


def _decoder_vocab_type(tok: Any) -> tuple[Any, bool]:
    """(xgrammar VocabType, add_prefix_space) of a `tokenizers.Tokenizer`, read from its JSON: a ByteLevel
    decoder is byte-level BPE (GPT-2's "Ġ" for a space); a ByteFallback decoder spells bytes as <0xNN>
    (with a Metaspace "▁" prefix space); anything else is raw text."""
    import xgrammar as xgr

    spec = json.loads(tok.to_str())
    dec = json.dumps(spec.get("decoder") or {})
    if '"ByteLevel"' in dec:
        return xgr.VocabType.BYTE_LEVEL, False
    if '"ByteFallback"' in dec:
        return xgr.VocabType.BYTE_FALLBACK, '"Metaspace"' in json.dumps(spec.get("pre_tokenizer") or {}) or \
            '"Prepend"' in json.dumps(spec.get("normalizer") or {})
    return xgr.VocabType.RAW, False


def tokenizer_info(tok: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar TokenizerInfo of a `tokenizers.Tokenizer` for a model of `vocab_size` logits (ids past the
    tokenizer's vocabulary are never allowed) whose generation ends at `stop_token_ids` (the model's EOS)."""
    import xgrammar as xgr

    vocab = tok.get_vocab(with_added_tokens=True)
    encoded = [""] * max(vocab_size, max(vocab.values(), default=-1) + 1)
    for piece, i in vocab.items():
        encoded[i] = piece
    vocab_type, prefix = _decoder_vocab_type(tok)
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids),
                             add_prefix_space=prefix)


_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:line: " prefix


def _clean(e: Exception) -> str:
    msg = _LOG_PREFIX.sub("", str(e).strip())
    return msg.replace("Check failed: (error.empty()) is false: ", "").splitlines()[0] if msg else type(e).__name__


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer and vocabulary, caching the last `cache_size`
    distinct specs (a server sees the same schema many times). Thread-safe as xgrammar's compiler is."""

    def __init__(self, tok: Any, vocab_size: int, stop_token_ids: list[int], cache_size: int = 128):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.info = tokenizer_info(tok, vocab_size, stop_token_ids)
        self._xgr = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        # Guards the cache only, never a compile: a compile can take a second, and a lookup by the engine or
        # the server meanwhile must not wait for it (two threads compiling one new spec both compile it).
        self._lock = threading.Lock()

    def compile(self, so: StructuredOutputsParams) -> Any:
        """The CompiledGrammar of `so`; GrammarError naming the field when xgrammar refuses it."""
        kind = so.kind
        value = getattr(so, kind)
        key = json.dumps([kind, value], sort_keys=True)
        with self._lock:
            got = self._cache.get(key)
            if got is not None:
                self._cache.move_to_end(key)
                return got
        c = self._xgr
        try:
            if kind == "json":
                got = (c.compile_builtin_json_grammar() if value is True
                       else c.compile_json_schema(json.dumps(value), any_whitespace=False))
            elif kind == "json_object":
                got = c.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
            elif kind == "regex":
                got = c.compile_regex(value)
            elif kind == "choice":
                got = c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in value))
            else:
                got = c.compile_grammar(value)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(kind, _clean(e)) from None
        with self._lock:
            self._cache[key] = got
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return got

    def matcher(self, compiled: Any) -> RequestGrammar:
        """A fresh matcher of a compiled grammar: one per sequence (each of n samples has its own)."""
        return RequestGrammar(compiled, self.vocab_size)


class RequestGrammar:
    """One sequence's grammar state. `num_tokens` output tokens have been accepted (host truth); speculative
    tokens are accepted with `advance` and undone with `rollback`. `drafts` are the sequence's drafts in its
    slot buffer as last read back (what its next verify row checks)."""

    def __init__(self, compiled: Any, vocab_size: int):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.num_tokens = 0  # tokens accepted, committed and speculative
        self.drafts: list[int] = []

    @property
    def terminated(self) -> bool:
        """A stop token (the model's EOS) was accepted: the grammar allows nothing after it."""
        return self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Accept one token; False (and nothing changes) when the grammar does not allow it, or after termination."""
        if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
            return False
        self.num_tokens += 1
        return True

    def advance(self, tokens: list[int]) -> int:
        """Accept tokens while the grammar allows them; returns how many it accepted."""
        n = 0
        for t in tokens:
            if not self.accept(t):
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""
        if n:
            self.matcher.rollback(n)
            self.num_tokens -= n

    def rollback_to(self, num_tokens: int) -> None:
        self.rollback(self.num_tokens - num_tokens)

    def sync(self, output: list[int]) -> None:
        """Match the sequence's output: accept the tokens appended since the last sync, or drop speculative
        tokens a fault left accepted (the output is host truth)."""
        if self.num_tokens < len(output):
            self.advance(output[self.num_tokens:])
        elif self.num_tokens > len(output):
            self.rollback_to(len(output))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of a host int32 bitmask [N, W] := the tokens allowed next (all of them once terminated:
        nothing after termination is kept, so any mask will do)."""
        if self.matcher.is_terminated():
            bitmask[row].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)
