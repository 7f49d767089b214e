"""A checkpoint directory's tokenizer: tokenizer.json through the `tokenizers` library.

`load_tokenizer` returns None when the directory has no tokenizer.json (prompts are then token ids); a
tokenizer.json that cannot be parsed raises CheckpointError naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from m3eagle.loader.checkpoint import CheckpointError


class Tokenizer:
    """Thin wrapper: encode(text) -> ids, decode(ids) -> text."""

    def __init__(self, tok: Any):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_releasing_gil(self, text: str) -> list[int]:
        """encode(text), through the batch call of `tokenizers`, which releases the GIL while it works (the
        single-text call holds it): a server thread tokenizing a long prompt leaves the event loop running."""
        return self.tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    f = Path(path) / "tokenizer.json"
    if not f.is_file():
        return None
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_file(str(f))
    except Exception as e:  # the Rust side raises a bare Exception for every parse error
        raise CheckpointError(f"{f} is not a valid tokenizer.json ({e}); restore it from the checkpoint, or "
                              "remove it and pass token ids instead of text") from None
    return Tokenizer(tok)
