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


class _Packer:
    """Appends named arrays into one flat staging array and hands back device views at the same offsets."""

    def __init__(self, host: torch.Tensor, dev: torch.Tensor):
        self.host, self.np, self.dev, self.off = host, host.numpy(), dev, 0

    def put(self, values, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        arr = np.asarray(values).reshape(-1)
        n = arr.size
        self.np[self.off:self.off + n] = arr
        view = self.dev[self.off:self.off + n]
        self.off += n
        return view.view(shape) if shape is not None else view

    def copy(self) -> None:
        if self.off:
            self.dev[: self.off].copy_(self.host[: self.off], non_blocking=self.dev.is_cuda)


def step_mode(params: list) -> tuple[bool, bool, bool]:
    """(any row samples with temperature > 0, any row wants logprobs, any row has penalties / min_tokens):
    the host choices that change what a step computes, hence part of a CUDA-graph key."""
    return (any(not p.greedy for p in params), any(p.logprobs is not None for p in params),
            any(p.has_penalties for p in params))


def build_step_input(batch: ScheduledBatch, page_size: int, table_width: int, device: torch.device,
                     bufs: StepBuffers | None = None, pad_rows_to: int = 0, max_kv: int = 0,
                     dump_slot: int = 0, pad_q: int = 0, ops: Any = None,
                     mode: tuple[bool, bool, bool] | None = None) -> StepInput:
    """Pack one step. `pad_rows_to` appends padding rows (trash page, dump slot, greedy, no sampling) up to
    that many rows, each `pad_q` tokens wide (0: as wide as the first real row); `max_kv` (0: the step's
    own bound) fixes the metadata's kv bound, so that steps of one graph bucket get one launch shape.
    `mode` overrides (any_random, want_logprobs, penalties) -- a graph captured on padding rows alone needs it.
    `ops` are the engine's fast paths, handed to the models with the metadata. `bufs` None allocates
    buffers for exactly this step (tests)."""
    rows = batch.rows
    n_real = len(rows)
    n_rows = max(n_real, pad_rows_to)
    pad_q = pad_q or (rows[0].num_tokens if rows else 1)
    q_lens = [r.num_tokens for r in rows] + [pad_q] * (n_rows - n_real)
    kv_lens = [r.kv_len for r in rows] + [pad_q] * (n_rows - n_real)
    t = sum(q_lens)
    max_q = max(q_lens) if q_lens else 1
    if bufs is None:
        bufs = StepBuffers(max(t, 1), max(n_rows, 1), table_width, device)
    if t > bufs.max_tokens or n_rows > bufs.max_rows:
        raise ValueError(f"step of {n_rows} rows / {t} tokens exceeds the buffers ({bufs.max_rows} / {bufs.max_tokens})")
    par = bufs._parity
    bufs._parity ^= 1
    ints, floats, bools = (_Packer(h[par], d) for h, d in ((bufs.h_int, bufs.d_int), (bufs.h_float, bufs.d_float),
                                                            (bufs.h_bool, bufs.d_bool)))
    ids: list[int] = []
    for r in rows:
        ids += r.tokens
    ids += [0] * (t - len(ids))
    tok_row = np.repeat(np.arange(n_rows), q_lens)
    first = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int64) if n_rows else np.zeros(0, np.int64)
    tok_col = np.arange(t) - first[tok_row] if t else np.zeros(0, np.int64)
    col = np.arange(max_q)
    q_valid = col[None, :] < np.asarray(q_lens)[:, None]
    q_index = np.where(q_valid, first[:, None] + col[None, :], 0)
    table = np.full((n_rows, table_width), TRASH_PAGE, dtype=np.int64)
    for i, r in enumerate(rows):
        table[i, : len(r.req.pages)] = r.req.pages
    pad = n_rows - n_real
    params = [r.req.params for r in rows]

    input_ids = ints.put(ids)
    q_lens_t, kv_lens_t = ints.put(q_lens), ints.put(kv_lens)
    page_table = ints.put(table, (n_rows, table_width))
    tok_row_t, tok_col_t = ints.put(tok_row), ints.put(tok_col)
    q_index_t = ints.put(q_index, (n_rows, max_q))
    row_slot = ints.put([r.req.slot for r in rows] + [dump_slot] * pad)
    row_first = ints.put(first)
    row_nd = ints.put([r.num_drafts for r in rows] + [max(pad_q - 1, 0)] * pad)
    row_next = ints.put([r.next_token for r in rows] + [0] * pad)
    seed = ints.put([r.req.seed for r in rows] + [0] * pad)
    top_k = ints.put([p.top_k for p in params] + [0] * pad)
    temperature = floats.put([p.temperature for p in params] + [0.0] * pad)
    top_p = floats.put([p.top_p for p in params] + [1.0] * pad)
    row_samples = bools.put([r.samples for r in rows] + [False] * pad)
    row_gather = bools.put([r.gather for r in rows] + [False] * pad)
    row_correct = bools.put([r.correct for r in rows] + [False] * pad)
    greedy = bools.put([p.greedy for p in params] + [True] * pad)
    q_valid_t = bools.put(q_valid, (n_rows, max_q))
    any_random, want_logprobs, any_penalty = mode or step_mode(params)
    min_p = floats.put([p.min_p for p in params] + [0.0] * pad)
    pen = _penalty_tensors(rows, pad, dump_slot, ints, floats, bools) if any_penalty else None
    for p in (ints, floats, bools):
        p.copy()

    bound = max_kv or max(kv_lens, default=1)
    meta = AttnMetadata(num_rows=n_rows, max_q=max_q, max_kv=bound, page_size=page_size, q_lens=q_lens_t,
                        kv_lens=kv_lens_t, page_table=page_table, tok_row=tok_row_t, tok_col=tok_col_t,
                        q_index=q_index_t, q_valid=q_valid_t, positions=None, slot_mapping=None, ops=ops)
    st = SamplingTensors(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, greedy=greedy, min_p=min_p)
    want_prompt_lp = any(not r.gather and r.req.params.prompt_logprobs is not None
                         and r.start + 1 < len(r.req.prompt_token_ids) for r in rows)
    return StepInput(
        num_rows=n_rows, num_tokens=t, input_ids=input_ids, meta=meta, row_slot=row_slot, row_first=row_first,
        row_qlen=q_lens_t, row_num_drafts=row_nd, row_samples=row_samples, row_gather=row_gather,
        row_correct=row_correct, row_next_token=row_next, sampling=st,
        any_random=any_random, want_logprobs=want_logprobs, penalties=pen, want_prompt_logprobs=want_prompt_lp)


def _penalty_tensors(rows: list, pad: int, dump_slot: int, ints: _Packer, floats: _Packer, bools: _Packer,
                     ) -> PenaltyTensors:
    """Per-row penalty parameters. A row starts its request's history (reset) when it is the first chunk:
    position 0, or the first position a sample of n computes itself after sharing its parent's prompt pages
    (then it copies the parent's prompt mask). The stop ids of resetting rows travel as a flat list (at most
    MAX_MIN_TOKENS_STOP_IDS per row, in the packed buffers), which only prompt steps have -- never
    graph-shaped ones, so graph shapes stay fixed."""
    params = [r.req.params for r in rows]
    reset = [not r.gather and r.start == r.req.fork_len for r in rows]
    src = [r.req.fork_src.slot if (x and r.req.fork_src is not None) else dump_slot for r, x in zip(rows, reset)]
    stop_ids, stop_rows = [], []
    for i, (r, x) in enumerate(zip(rows, reset)):
        if x and r.req.params.min_tokens:
            stop_ids += r.req.params.stop_token_ids
            stop_rows += [i] * len(r.req.params.stop_token_ids)
    return PenaltyTensors(
        presence=floats.put([p.presence_penalty for p in params] + [0.0] * pad),
        frequency=floats.put([p.frequency_penalty for p in params] + [0.0] * pad),
        repetition=floats.put([p.repetition_penalty for p in params] + [1.0] * pad),
        min_tokens=ints.put([p.min_tokens for p in params] + [0] * pad),
        prompt_len=ints.put([len(r.req.prompt_token_ids) for r in rows] + [0] * pad),
        ignore_eos=bools.put([p.ignore_eos for p in params] + [True] * pad),
        reset=bools.put(reset + [False] * pad),
        src_slot=ints.put(src + [dump_slot] * pad),
        stop_ids=ints.put(stop_ids), stop_rows=ints.put(stop_rows))
