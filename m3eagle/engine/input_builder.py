"""ScheduledBatch (host) -> StepInput (plain device tensors + host ints), through preallocated buffers.

Every step input lives in a device buffer allocated once for the engine's maxima (`StepBuffers`) and is
filled in place: the host packs one step's ints, floats and bools into pinned staging arrays and makes
three non-blocking copies. A StepInput holds views of those buffers and a few host ints -- no Request or
ScheduledBatch -- which is what a CUDA graph captures and replays, and what a test builds by hand.

Layout: the views are carved from the buffers at offsets that depend only on the step's host shape
(rows, tokens, widest row). So two steps of the same shape read the same addresses, which is what lets
a captured graph replay on freshly filled inputs.

Values that depend on the previous step's acceptance (positions, cache slots) are not built here: the
runner derives them on the device (ModelRunner._apply_overlap_correction -> AttnMetadata.with_lengths).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..attention.metadata import TRASH_PAGE, AttnMetadata
from ..sampling.params import MAX_MIN_TOKENS_STOP_IDS
from ..sampling.penalties import PenaltyTensors
from ..sampling.sampler import SamplingTensors
from .scheduler import ScheduledBatch


@dataclass
class StepInput:
    num_rows: int  # B (padding rows included)
    num_tokens: int  # T
    input_ids: torch.Tensor  # [T] host-known ids, placeholders where rows gather
    meta: AttnMetadata  # host-projected lengths; positions / slots are derived in execute()
    row_slot: torch.Tensor  # [B] device slot-buffer index of each row's request (the dump slot for padding)
    row_first: torch.Tensor  # [B] flat index of each row's first token
    row_qlen: torch.Tensor  # [B]
    row_num_drafts: torch.Tensor  # [B] 0 or K
    row_samples: torch.Tensor  # [B] bool
    row_gather: torch.Tensor  # [B] bool: first token + drafts from the slot buffers
    row_correct: torch.Tensor  # [B] bool: kv_len += num_new_prev - expected_prev on device
    row_next_token: torch.Tensor  # [B] token after a non-sampling chunk
    sampling: SamplingTensors
    any_random: bool  # some row samples with temperature > 0 (draft probs are needed)
    want_logprobs: bool  # some row wants logprobs: the sampled tokens' and the top MAX_LOGPROBS candidates
    penalties: PenaltyTensors | None = None  # some row's distribution depends on its history (penalties.py)
    want_prompt_logprobs: bool = False  # some prompt chunk wants prompt_logprobs (never in graph-shaped steps)

    @property
    def mode(self) -> tuple[bool, bool, bool]:
        """The host choices that change what a step computes (part of a CUDA-graph key)."""
        return self.any_random, self.want_logprobs, self.penalties is not None


class StepBuffers:
    """Device buffers for every step input, sized for the engine's maxima and allocated once.

    Host staging is pinned on CUDA and double-buffered: under overlap the host packs step N+1 while the
    copy of step N may still be queued behind step N-1 on the device; with two stagings, the one being
    overwritten (step N-1's) was consumed before step N-1 finished, which the host has waited for."""

    def __init__(self, max_tokens: int, max_rows: int, table_width: int, device: torch.device):
        self.max_tokens, self.max_rows, self.table_width, self.device = max_tokens, max_rows, table_width, device
        # ints: ids, tok_row, tok_col (T each); 12 per-row ints; min_tokens stop ids and their rows; the page
        # table; q_index (B x Qmax <= T + B*... )
        self.n_int = (3 * max_tokens + (12 + 2 * MAX_MIN_TOKENS_STOP_IDS) * max_rows + max_rows * table_width
                      + max_rows * max_tokens)
        self.n_float, self.n_bool = 6 * max_rows, 6 * max_rows + max_rows * max_tokens
        pin = device.type == "cuda"
        self.d_int = torch.zeros(self.n_int, dtype=torch.int64, device=device)
        self.d_float = torch.zeros(self.n_float, dtype=torch.float32, device=device)
        self.d_bool = torch.zeros(self.n_bool, dtype=torch.bool, device=device)
        self.h_int = [torch.zeros(self.n_int, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.h_float = [torch.zeros(self.n_float, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self.h_bool = [torch.zeros(self.n_bool, dtype=torch.bool, pin_memory=pin) for _ in range(2)]
        self._parity = 0
        # numpy views of the stagings, and per step shape its layout, sizes, device views and staging plan:
        # steps of one shape (every replay of a graph bucket) reuse them instead of re-slicing ~25 tensors.
        self.h_np = [{"int": self.h_int[i].numpy(), "float": self.h_float[i].numpy(), "bool": self.h_bool[i].numpy()}
                     for i in range(2)]
        self._shapes: dict[tuple, tuple[dict, dict[str, int], dict[str, torch.Tensor], list]] = {}
        self._token_index: dict[tuple[int, ...], tuple[np.ndarray, ...]] = {}
        # The last page table built, and per row the page list it was built from and that list's length.
        self._table = np.full((max_rows, table_width), TRASH_PAGE, dtype=np.int64)
        self._table_src: list[tuple[list[int], int] | None] = [None] * max_rows

    def shape(self, key: tuple) -> tuple[dict, dict[str, int], dict[str, torch.Tensor], list]:
        """(layout, elements per buffer, device views, staging plan) of the step shape `key` = step_layout's
        arguments."""
        got = self._shapes.get(key)
        if got is None:
            if len(self._shapes) >= 512:  # eager prompt shapes vary; keep the cache bounded
                self._shapes.clear()
            layout = step_layout(*key)
            flat = {"int": self.d_int, "float": self.d_float, "bool": self.d_bool}
            got = self._shapes[key] = (layout, layout_sizes(layout), _carve_views(flat, layout), _stage_plan(layout))
        return got

    def page_table(self, rows: list, n_rows: int) -> np.ndarray:
        """[n_rows * table_width]: each row's pages, then the trash page (padding rows: trash only). A row is
        rewritten only when its page list is another list or has grown since the last step (a request's list
        only grows in place or is replaced), so a steady step rewrites the rows that got a page, not all."""
        table, src = self._table, self._table_src
        for i, r in enumerate(rows):
            pages = r.req.pages
            s = src[i]
            if s is None or s[0] is not pages or s[1] != len(pages):
                n = len(pages)
                table[i, :n] = pages
                table[i, n:] = TRASH_PAGE
                src[i] = (pages, n)
        for i in range(len(rows), n_rows):
            if src[i] is not None:
                table[i] = TRASH_PAGE
                src[i] = None
        return table[:n_rows].reshape(-1)

    def token_index(self, q_lens: list[int], max_q: int = 0) -> tuple[np.ndarray, ...]:
        """(tok_row, tok_col, row_first, q_index, q_valid) of rows of these lengths, the last two flat
        [B * max_q] (max_q: at least the widest row). Steps with the same row lengths (every replay of a
        graph bucket) share them: read-only."""
        key = (*q_lens, -max_q)
        got = self._token_index.get(key)
        if got is None:
            if len(self._token_index) >= 512:  # prompt steps' lengths vary; keep the cache bounded
                self._token_index.clear()
            got = self._token_index[key] = _token_index(q_lens, max_q)
        return got


_KINDS = ("int", "float", "bool")


def step_layout(n_rows: int, n_tokens: int, max_q: int, table_width: int, penalties: bool = False,
                n_stop: int = 0) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Where one step's values sit in the flat int / float / bool buffers: (name, shape) in order. It depends
    only on the step's host shape (and whether it carries penalties, with how many min_tokens stop ids), so
    a rank that receives the buffers carves the same views (`carve`)."""
    b, t = n_rows, n_tokens
    out = {"int": [("input_ids", (t,)), ("q_lens", (b,)), ("kv_lens", (b,)), ("page_table", (b, table_width)),
                   ("tok_row", (t,)), ("tok_col", (t,)), ("q_index", (b, max_q)), ("row_slot", (b,)),
                   ("row_first", (b,)), ("row_num_drafts", (b,)), ("row_next_token", (b,)), ("seed", (b,)),
                   ("top_k", (b,))],
           "float": [("temperature", (b,)), ("top_p", (b,)), ("min_p", (b,))],
           "bool": [("row_samples", (b,)), ("row_gather", (b,)), ("row_correct", (b,)), ("greedy", (b,)),
                    ("q_valid", (b, max_q))]}
    if penalties:
        out["int"] += [("min_tokens", (b,)), ("prompt_len", (b,)), ("src_slot", (b,)), ("stop_ids", (n_stop,)),
                       ("stop_rows", (n_stop,))]
        out["float"] += [("presence", (b,)), ("frequency", (b,)), ("repetition", (b,))]
        out["bool"] += [("ignore_eos", (b,)), ("reset", (b,))]
    return out


def layout_sizes(layout: dict[str, list[tuple[str, tuple[int, ...]]]]) -> dict[str, int]:
    """Elements used in each flat buffer."""
    return {kind: sum(math.prod(shape) for _, shape in fields) for kind, fields in layout.items()}


def _carve_views(flat: dict[str, torch.Tensor], layout: dict[str, list[tuple[str, tuple[int, ...]]]],
                 ) -> dict[str, torch.Tensor]:
    """Views of the flat buffers at the layout's offsets."""
    out = {}
    for kind, fields in layout.items():
        off, dev = 0, flat[kind]
        for name, shape in fields:
            n = math.prod(shape)
            view = dev[off:off + n]  # a view (contiguous slice)
            out[name] = view.view(shape) if len(shape) > 1 else view
            off += n
    return out


def _stage_plan(layout: dict[str, list[tuple[str, tuple[int, ...]]]]) -> list[tuple[str, str, int, int]]:
    """(kind, name, start, end) of each value in the flat buffers."""
    plan = []
    for kind, fields in layout.items():
        off = 0
        for name, shape in fields:
            n = math.prod(shape)
            plan.append((kind, name, off, off + n))
            off += n
    return plan


def _stage(host: dict[str, np.ndarray], plan: list[tuple[str, str, int, int]], values: dict[str, Any]) -> None:
    """Write each value (a list or a 1-D array) into the numpy staging arrays at its place in the plan."""
    for kind, name, start, end in plan:
        host[kind][start:end] = values[name]


def _token_index(q_lens: list[int], max_q: int = 0) -> tuple[np.ndarray, ...]:
    """Per token its row and column, per row its first token, and the [B, max_q] map of row columns to
    tokens with its validity mask (flattened); max_q at least the widest row."""
    n_rows, t = len(q_lens), sum(q_lens)
    max_q = max(max(q_lens, default=1), max_q)
    tok_row = np.repeat(np.arange(n_rows), q_lens)
    first = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int64) if n_rows else np.zeros(0, np.int64)
    tok_col = np.arange(t) - first[tok_row] if t else np.zeros(0, np.int64)
    col = np.arange(max_q)
    q_valid = col[None, :] < np.asarray(q_lens)[:, None]
    q_index = np.where(q_valid, first[:, None] + col[None, :], 0)
    out = (tok_row, tok_col, first, q_index.reshape(-1), q_valid.reshape(-1))
    for a in out:
        a.flags.writeable = False
    return out


def carve(bufs: StepBuffers, n_rows: int, n_tokens: int, max_q: int, max_kv: int, page_size: int, ops: Any,
          mode: tuple[bool, bool, bool, bool], n_stop: int = 0) -> StepInput:
    """The StepInput whose values already sit in `bufs`' device buffers (a tensor-parallel worker's, filled by
    broadcast): the same views `build_step_input` made on the rank that packed them. `mode` is (any_random,
    want_logprobs, penalties, want_prompt_logprobs)."""
    v = bufs.shape((n_rows, n_tokens, max_q, bufs.table_width, mode[2], n_stop))[2]
    return _assemble(v, n_rows, n_tokens, max_q, max_kv, page_size, ops, mode)


def _assemble(v: dict[str, torch.Tensor], n_rows: int, t: int, max_q: int, max_kv: int, page_size: int, ops: Any,
              mode: tuple[bool, bool, bool, bool]) -> StepInput:
    any_random, want_logprobs, any_penalty, want_prompt_lp = mode
    meta = AttnMetadata(num_rows=n_rows, max_q=max_q, max_kv=max_kv, page_size=page_size, q_lens=v["q_lens"],
                        kv_lens=v["kv_lens"], page_table=v["page_table"], tok_row=v["tok_row"], tok_col=v["tok_col"],
                        q_index=v["q_index"], q_valid=v["q_valid"], positions=None, slot_mapping=None, ops=ops)
    st = SamplingTensors(temperature=v["temperature"], top_k=v["top_k"], top_p=v["top_p"], seed=v["seed"],
                         greedy=v["greedy"], min_p=v["min_p"])
    pen = (PenaltyTensors(presence=v["presence"], frequency=v["frequency"], repetition=v["repetition"],
                          min_tokens=v["min_tokens"], prompt_len=v["prompt_len"], ignore_eos=v["ignore_eos"],
                          reset=v["reset"], src_slot=v["src_slot"], stop_ids=v["stop_ids"], stop_rows=v["stop_rows"])
           if any_penalty else None)
    return StepInput(
        num_rows=n_rows, num_tokens=t, input_ids=v["input_ids"], meta=meta, row_slot=v["row_slot"],
        row_first=v["row_first"], row_qlen=v["q_lens"], row_num_drafts=v["row_num_drafts"],
        row_samples=v["row_samples"], row_gather=v["row_gather"], row_correct=v["row_correct"],
        row_next_token=v["row_next_token"], sampling=st, any_random=any_random, want_logprobs=want_logprobs,
        penalties=pen, want_prompt_logprobs=want_prompt_lp)


def step_mode(params: list) -> tuple[bool, bool, bool]:
    """(any row samples with temperature > 0, any row wants logprobs, any row has penalties / min_tokens):
    the host choices that change what a step computes, hence part of a CUDA-graph key."""
    return (any(not p.greedy for p in params), any(p.logprobs is not None for p in params),
            any(p.has_penalties for p in params))


def build_step_input(batch: ScheduledBatch, page_size: int, table_width: int, device: torch.device,
                     bufs: StepBuffers | None = None, pad_rows_to: int = 0, max_kv: int = 0,
                     dump_slot: int = 0, pad_q: int | list[int] = 0, ops: Any = None,
                     mode: tuple[bool, bool, bool] | None = None, max_q: int = 0,
                     pad_drafts: int | None = None) -> StepInput:
    """Pack one step. `pad_rows_to` appends padding rows (trash page, dump slot, greedy, no sampling) up to
    that many rows, each `pad_q` tokens wide (0: as wide as the first real row; a list: one width per
    padding row) and "verifying" `pad_drafts` drafts (None: pad_q - 1, a decode row's); `max_kv` (0: the
    step's own bound) and `max_q` (0: the widest row) fix the metadata's bounds, so that steps of one graph
    bucket get one launch shape.
    `mode` overrides (any_random, want_logprobs, penalties) -- a graph captured on padding rows alone needs it.
    `ops` are the engine's fast paths, handed to the models with the metadata. `bufs` None allocates
    buffers for exactly this step (tests)."""
    rows = batch.rows
    n_real = len(rows)
    n_rows = max(n_real, pad_rows_to)
    pad = n_rows - n_real
    pad_qs = list(pad_q) if isinstance(pad_q, list) else [pad_q or (rows[0].num_tokens if rows else 1)] * pad
    if len(pad_qs) != pad or min(pad_qs, default=1) < 1:
        raise ValueError(f"pad_q={pad_q!r} must give each of the {pad} padding rows at least one token")
    q_lens = [r.num_tokens for r in rows] + pad_qs
    kv_lens = [r.kv_len for r in rows] + pad_qs
    t = sum(q_lens)
    max_q = max(max(q_lens) if q_lens else 1, max_q)
    if bufs is None:
        bufs = StepBuffers(max(t, 1), max(n_rows, 1), table_width, device)
    if t > bufs.max_tokens or n_rows > bufs.max_rows:
        raise ValueError(f"step of {n_rows} rows / {t} tokens exceeds the buffers ({bufs.max_rows} / {bufs.max_tokens})")
    ids: list[int] = []
    for r in rows:
        ids += r.tokens
    ids += [0] * (t - len(ids))
    tok_row, tok_col, first, q_index, q_valid = bufs.token_index(q_lens, max_q)
    params = [r.req.params for r in rows]
    any_random, want_logprobs, any_penalty = mode or step_mode(params)
    want_prompt_lp = any(not r.gather and r.req.params.prompt_logprobs is not None
                         and r.start + 1 < len(r.req.prompt_token_ids) for r in rows)
    values = {
        "input_ids": ids, "q_lens": q_lens, "kv_lens": kv_lens, "page_table": bufs.page_table(rows, n_rows),
        "tok_row": tok_row, "tok_col": tok_col, "q_index": q_index,
        "row_slot": [r.req.slot for r in rows] + [dump_slot] * pad,
        "row_first": first,
        "row_num_drafts": [r.num_drafts for r in rows] + [max(q - 1, 0) if pad_drafts is None else pad_drafts
                                                          for q in pad_qs],
        "row_next_token": [r.next_token for r in rows] + [0] * pad, "seed": [r.req.seed for r in rows] + [0] * pad,
        "top_k": [p.top_k for p in params] + [0] * pad,
        "temperature": [p.temperature for p in params] + [0.0] * pad, "top_p": [p.top_p for p in params] + [1.0] * pad,
        "min_p": [p.min_p for p in params] + [0.0] * pad,
        "row_samples": [r.samples for r in rows] + [False] * pad, "row_gather": [r.gather for r in rows] + [False] * pad,
        "row_correct": [r.correct for r in rows] + [False] * pad, "greedy": [p.greedy for p in params] + [True] * pad,
        "q_valid": q_valid}
    n_stop = _penalty_values(rows, pad, dump_slot, values) if any_penalty else 0
    # Fill the host staging (pinned on CUDA, alternating) at the layout's offsets, then three non-blocking copies.
    _, sizes, views, plan = bufs.shape((n_rows, t, max_q, table_width, any_penalty, n_stop))
    par = bufs._parity
    bufs._parity ^= 1
    _stage(bufs.h_np[par], plan, values)
    host = {"int": bufs.h_int[par], "float": bufs.h_float[par], "bool": bufs.h_bool[par]}
    dev = {"int": bufs.d_int, "float": bufs.d_float, "bool": bufs.d_bool}
    for kind, n in sizes.items():
        if n:
            dev[kind][:n].copy_(host[kind][:n], non_blocking=dev[kind].is_cuda)
    return _assemble(views, n_rows, t, max_q, max_kv or max(kv_lens, default=1), page_size, ops,
                     (any_random, want_logprobs, any_penalty, want_prompt_lp))


def _penalty_values(rows: list, pad: int, dump_slot: int, values: dict[str, Any]) -> int:
    """Per-row penalty parameters into `values`; returns the number of min_tokens stop ids. A row starts its
    request's history (reset) when it is the first chunk: position 0, or the first position a sample of n
    computes itself after sharing its parent's prompt pages (then it copies the parent's prompt mask). The
    stop ids of resetting rows travel as a flat list (at most MAX_MIN_TOKENS_STOP_IDS per row, in the packed
    buffers), which only prompt steps have -- never graph-shaped ones, so graph shapes stay fixed."""
    params = [r.req.params for r in rows]
    reset = [not r.gather and r.start == r.req.fork_len for r in rows]
    src = [r.req.fork_src.slot if (x and r.req.fork_src is not None) else dump_slot for r, x in zip(rows, reset)]
    stop_ids, stop_rows = [], []
    for i, (r, x) in enumerate(zip(rows, reset)):
        if x and r.req.params.min_tokens:
            stop_ids += r.req.params.stop_token_ids
            stop_rows += [i] * len(r.req.params.stop_token_ids)
    values.update(
        presence=[p.presence_penalty for p in params] + [0.0] * pad,
        frequency=[p.frequency_penalty for p in params] + [0.0] * pad,
        repetition=[p.repetition_penalty for p in params] + [1.0] * pad,
        min_tokens=[p.min_tokens for p in params] + [0] * pad,
        prompt_len=[len(r.req.prompt_token_ids) for r in rows] + [0] * pad,
        ignore_eos=[p.ignore_eos for p in params] + [True] * pad,
        reset=reset + [False] * pad, src_slot=src + [dump_slot] * pad, stop_ids=stop_ids, stop_rows=stop_rows)
    return len(stop_ids)
