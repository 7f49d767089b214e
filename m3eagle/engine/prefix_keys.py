"""Prefix-cache keys: one per full page of a request's tokens, chained over everything before it.

Key of page p = SHA-256(key of page p-1 || tokens of page p || the token after page p), as little-endian
int64s. The chain makes a key name the whole prefix, so equal keys mean equal KV. The token after the
page is in the key because the Eagle3 head's KV at a position is computed from the *next* token's
embedding: the draft KV at a page's last position depends on the first token of the next page. So only
pages with a known next token have keys: at most (num_known - 1) // page_size of them.

SHA-256 (truncated to nothing: the full 32-byte digest is the key) makes a collision, which would hand
one request another's KV, negligible (about 2^-128 for any pair), unlike Python's `hash`, which is
64-bit and predictable.
"""

from __future__ import annotations

import hashlib
from array import array

from m3eagle.engine.request import Request

ROOT = hashlib.sha256(b"m3eagle-prefix-cache-v1").digest()


def page_key(parent: bytes, tokens: list[int], next_token: int) -> bytes:
    """The key of one page: its parent's key, its page_size tokens and the token after it."""
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    h.update(next_token.to_bytes(8, "little", signed=True))
    return h.digest()


def tokens_at(req: Request, start: int, end: int) -> list[int]:
    """req's known tokens [start, end) without concatenating its prompt and output."""
    prompt, out = req.prompt_token_ids, req.output_token_ids
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return out[start - n:end - n]
    return prompt[start:] + out[:end - n]


def page_keys(req: Request, num_pages: int, page_size: int) -> list[bytes]:
    """The keys of req's first num_pages pages (computed once per request and extended as it grows;
    tokens are host truth and never change). num_pages must leave the next token known."""
    keys = req.page_keys
    if num_pages * page_size >= req.num_known:
        raise ValueError(f"{num_pages} pages of {page_size} need token {num_pages * page_size}, "
                         f"but {req.request_id} knows {req.num_known}")
    while len(keys) < num_pages:
        p = len(keys)
        toks = tokens_at(req, p * page_size, (p + 1) * page_size + 1)
        keys.append(page_key(keys[-1] if keys else ROOT, toks[:-1], toks[-1]))
    return keys[:num_pages]
