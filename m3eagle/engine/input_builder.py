"""ScheduledBatch (host) -> StepInput (plain device tensors + host ints), through preallocated buffers.

Every step input lives in one device byte buffer allocated once for the engine's maxima (`StepBuffers`)
and is filled in place: the host packs one step's ints, floats and bools into a pinned staging buffer and
makes one non-blocking copy. A StepInput holds typed views of that buffer and a few host ints -- no
Request or ScheduledBatch -- which is what a CUDA graph captures and replays, and what a test builds by
hand.

Layout: the views are carved from the buffer at byte offsets that depend only on the step's host shape
(rows, tokens, widest row). So two steps of the same shape read the same addresses, which is what lets
a captured graph replay on freshly filled inputs. Every value starts 16-byte aligned (the alignment of
its type, and what a vectorised load wants); the values the host has as Python numbers come first, so
that one `struct` call packs them all, and the values it has as numpy arrays (page table, token index)
follow.

Values that depend on the previous step's acceptance (positions, cache slots) are not built here: the
runner derives them on the device (ModelRunner._apply_overlap_correction -> AttnMetadata.with_lengths).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce
from itertools import chain
from operator import or_
from typing import Any

import numpy as np
import torch

from m3eagle.engine.scheduler import ScheduledBatch
from m3eagle.kernels.attention.metadata import TRASH_PAGE, AttnMetadata
from m3eagle.sampling.params import MAX_MIN_TOKENS_STOP_IDS
from m3eagle.sampling.penalties import PenaltyTensors
from m3eagle.sampling.sampler import SamplingTensors
from m3eagle.sampling.structured import bitmask_width


@dataclass
class StepInput:
    num_rows: int  # B (padding rows included)
    num_tokens: int  # T
    input_ids: torch.Tensor  # [T] host-known ids, placeholders where rows gather
    meta: AttnMetadata  # host-projected lengths; positions / slots are derived in execute()
    row_slot: torch.Tensor  # [B] device slot-buffer index of each row's request (the dump slot for padding)
    row_first: torch.Tensor  # [B] flat index of each row's first token
    row_qlen: torch.Tensor  # [B]
    row_num_drafts: torch.Tensor  # [B] 0 or K (a draft tree's: 0, K or its narrow width)
    row_samples: torch.Tensor  # [B] bool
    row_gather: torch.Tensor  # [B] bool: first token + drafts from the slot buffers
    row_correct: torch.Tensor  # [B] bool: kv_len += the slot's deviation (steps in flight) on device
    row_chained: torch.Tensor  # [B] bool: False as built; the device sets it when it advances kv_len itself
    row_next_token: torch.Tensor  # [B] token after a non-sampling chunk
    sampling: SamplingTensors
    any_random: bool  # some row samples with temperature > 0 (draft probs are needed)
    want_logprobs: bool  # some row wants logprobs: the sampled tokens' and the top MAX_LOGPROBS candidates
    penalties: PenaltyTensors | None = None  # some row's distribution depends on its history (penalties.py)
    want_prompt_logprobs: bool = False  # some prompt chunk wants prompt_logprobs (never in graph-shaped steps)
    # The host half of a step that reads device values back as it runs (structured_step.py): a draft tree's
    # TreeGrammarStep, or the chain's GrammarStep under structured_draft_masks. Such steps run eagerly.
    grammar: Any = None
    draft_width: int = -1  # the most drafts any row carries (host int: a draft-tree step's verify width); -1: unknown
    # Some sampling row is constrained: the target's logits at every verify position are masked by
    # verify_mask (int32 [B, K+1, W], a view of StepBuffers.masks' static device buffer, all-allowed on
    # unconstrained and padding rows), which a graph reads like any other input.
    masked: bool = False
    verify_mask: torch.Tensor | None = None

    @property
    def mode(self) -> tuple[bool, bool, bool, bool]:
        """The host choices that change what a step computes (part of a CUDA-graph key): any row samples at
        random, wants logprobs, has penalties, is constrained by a grammar."""
        return self.any_random, self.want_logprobs, self.penalties is not None, self.masked


# Per kind: torch dtype, numpy dtype, struct code, bytes per element.
_KINDS = {"int": (torch.int64, np.int64, "q", 8), "float": (torch.float32, np.float32, "f", 4),
          "bool": (torch.bool, np.bool_, "?", 1)}
_ALIGN = 16  # bytes: where every value starts
# The values packed from Python numbers by one struct call, in layout order (step_layout puts them first).
_PACKED = ("input_ids", "q_lens", "kv_lens", "row_slot", "row_num_drafts", "row_next_token", "seed", "top_k",
           "temperature", "top_p", "min_p", "row_samples", "row_gather", "row_correct", "row_chained", "greedy")
# SlotParams' mode bits: what changes what a step computes (the first three are its mode).
_RANDOM, _LOGPROBS, _PENALTIES, _PROMPT_LOGPROBS = 1, 2, 4, 8
# A padding row's seed, top_k, temperature, top_p, min_p, greedy and mode bits.
_PAD_PARAMS = (0, 0, 0.0, 1.0, 0.0, True, 0)


class SlotParams:
    """Per slot, the sampling constants of the request that holds it: vLLM's persistent batch. A request's
    SamplingParams (and seed) are read once, when a step first sees it in its slot, into one tuple
    (seed, top_k, temperature, top_p, min_p, greedy, mode bits); a step then takes each row's tuple by slot
    instead of reading seven fields and two properties of every row's params.

    An entry is a function of (params, seed) alone, so it is current exactly when the request in the slot
    has the params (the same object, or equal ones) and the seed it was read from; the entry is read again
    otherwise -- when another request turns up in the slot, say. Entries hold the params, not the request
    (a finished request must be garbage). NOTE: so, like vLLM, params changed in place after a request was
    added are not seen.

    Floats are stored as the float32 they are staged as (struct packs no out-of-range float; numpy turned
    such a value into inf, which is what the conversion here does too)."""

    def __init__(self, n: int):
        self.read_params: list[Any] = [None] * n  # what each entry was read from
        self.read_seed: list[int] = [0] * n
        self.params: list[tuple] = [_PAD_PARAMS] * n

    def rows(self, reqs: list, slots: list[int]) -> list[tuple]:
        """Each row's entry, brought up to date."""
        read_params, read_seed = self.read_params, self.read_seed
        try:
            current = ([read_params[s] for s in slots] == [q.params for q in reqs]
                       and [read_seed[s] for s in slots] == [q.seed for q in reqs])
        except IndexError:  # a slot past the table (hand-built steps): grow it
            extra = max(slots) + 1 - len(read_params)
            read_params += [None] * extra
            read_seed += [0] * extra
            self.params += [_PAD_PARAMS] * extra
            current = False
        if not current:
            for q, s in zip(reqs, slots):
                if read_params[s] is not q.params or read_seed[s] != q.seed:
                    self._read(s, q)
            if [read_params[s] for s in slots] != [q.params for q in reqs] or \
                    [read_seed[s] for s in slots] != [q.seed for q in reqs]:
                raise ValueError(f"two requests in one step hold the same slot (slots {slots})")
        params = self.params
        return [params[s] for s in slots]

    def _read(self, s: int, req: Any) -> None:
        p = req.params
        f32 = np.array([p.temperature, p.top_p, p.min_p], np.float32).tolist()
        bits = ((_RANDOM if not p.greedy else 0) | (_LOGPROBS if p.logprobs is not None else 0)
                | (_PENALTIES if p.has_penalties else 0) | (_PROMPT_LOGPROBS if p.prompt_logprobs is not None else 0))
        self.read_params[s], self.read_seed[s] = p, req.seed
        self.params[s] = (req.seed, p.top_k, *f32, p.greedy, bits)


def _mode_bits(entries: list[tuple]) -> int:
    """The OR of the entries' mode bits (a batch has few distinct values: a set first)."""
    return reduce(or_, {e[6] for e in entries}, 0)


class _Shape:
    """One step shape's layout in the byte buffers, and everything derived from it once: typed device
    views, typed host views per staging, the struct that packs the Python values, and the spans to copy."""

    __slots__ = ("layout", "offsets", "nbytes", "views", "host_views", "packer", "d_span", "h_spans")

    def __init__(self, bufs: StepBuffers, layout: list[tuple[str, str, tuple[int, ...]]]):
        self.layout = layout
        self.offsets: dict[str, tuple[str, int, int]] = {}  # name -> (kind, first byte, elements)
        fmt, end = ["="], 0
        for i, (name, kind, shape) in enumerate(layout):
            start = -(-end // _ALIGN) * _ALIGN
            n = math.prod(shape)
            self.offsets[name] = (kind, start, n)
            if i < len(_PACKED):  # step_layout puts them first: the struct skips the alignment gaps
                fmt.append(f"{start - end}x{n}{_KINDS[kind][2]}")
            end = start + n * _KINDS[kind][3]
        self.nbytes = -(-end // _ALIGN) * _ALIGN
        if self.nbytes > bufs.nbytes:
            raise ValueError(f"a step of this shape needs {self.nbytes} bytes of input buffer, more than the "
                             f"{bufs.nbytes} allocated for max_tokens={bufs.max_tokens}, max_rows={bufs.max_rows}")
        self.packer = struct.Struct("".join(fmt))
        self.views = self._carve(bufs.d_bytes, torch)
        self.host_views = [self._carve(h, np) for h in bufs.h_np]
        self.d_span = bufs.d_bytes[:self.nbytes]
        self.h_spans = [h[:self.nbytes] for h in bufs.h_bytes]

    def _carve(self, flat: Any, lib: Any) -> dict[str, Any]:
        """Typed views of a flat byte buffer (torch tensor or numpy array) at the layout's offsets."""
        out = {}
        for name, kind, shape in self.layout:
            _, start, n = self.offsets[name]
            dtype = _KINDS[kind][0] if lib is torch else _KINDS[kind][1]
            view = flat[start:start + n * _KINDS[kind][3]].view(dtype)
            out[name] = view.view(shape) if lib is torch and len(shape) > 1 else view
        return out


class VerifyMasks:
    """The grammar masks of a constrained step's verify positions: one static device buffer, int32
    [max_rows * (K+1), W] (W = ceil(V / 32)), allocated once, and two pinned host stagings used in turn. A step
    of B rows takes the first B * (K+1) rows, so every step of one graph bucket reads the same address and a
    replay sees freshly uploaded masks. Rows nobody fills (unconstrained rows, padding) allow everything."""

    def __init__(self, max_rows: int, k1: int, vocab_size: int, device: torch.device):
        self.k1, self.width = k1, bitmask_width(vocab_size)
        n, pin = max_rows * k1, device.type == "cuda"
        self.dev = torch.full((n, self.width), -1, dtype=torch.int32, device=device)  # [R * (K+1), W]
        self.host = [torch.full((n, self.width), -1, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._parity = 0

    def view(self, n_rows: int) -> torch.Tensor:
        """The device masks of a step of n_rows rows: [n_rows, K+1, W], the buffer's first rows."""
        return self.dev[: n_rows * self.k1].view(n_rows, self.k1, self.width)

    def upload(self, n_rows: int, fill: Callable[[torch.Tensor], None] | None = None) -> None:
        """Fill the next host staging's first n_rows * (K+1) rows -- all-allowed, then `fill(host)` writes the
        constrained rows' masks -- and start their non-blocking copy into `view(n_rows)`. The staging
        alternates: a copy still queued from the previous step reads the other."""
        n = n_rows * self.k1
        host = self.host[self._parity][:n]  # [B * (K+1), W]
        self._parity ^= 1
        host.fill_(-1)
        if fill is not None:
            fill(host)
        dev = self.dev[:n]
        dev.copy_(host, non_blocking=dev.is_cuda)


class StepBuffers:
    """The device byte buffer every step input is carved from, sized for the engine's maxima and allocated
    once, and its host staging. `verify_masks` (K+1, V): also the static grammar masks (`VerifyMasks`) of an
    engine that runs constrained chain steps.

    Host staging is pinned on CUDA and double-buffered: under overlap the host packs step N+1 while the
    copy of step N may still be queued behind step N-1 on the device; with two stagings, the one being
    overwritten (step N-1's) was consumed before step N-1 finished, which the host has waited for."""

    def __init__(self, max_tokens: int, max_rows: int, table_width: int, device: torch.device,
                 verify_masks: tuple[int, int] | None = None):
        self.max_tokens, self.max_rows, self.table_width, self.device = max_tokens, max_rows, table_width, device
        self.masks = VerifyMasks(max_rows, *verify_masks, device) if verify_masks is not None else None
        # ints: ids, tok_row, tok_col (T each); 12 per-row ints; min_tokens stop ids and their rows; the page
        # table; q_index (B x Qmax <= T + B*... ); floats: 6 per row; bools: 7 per row and q_valid; and each
        # of the (at most 40) values' alignment.
        n_int = (3 * max_tokens + (12 + 2 * MAX_MIN_TOKENS_STOP_IDS) * max_rows + max_rows * table_width
                 + max_rows * max_tokens)
        n_float, n_bool = 6 * max_rows, 7 * max_rows + max_rows * max_tokens
        self.nbytes = 8 * n_int + 4 * n_float + n_bool + 40 * _ALIGN
        pin = device.type == "cuda"
        self.d_bytes = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self.h_bytes = [torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self.h_np = [h.numpy() for h in self.h_bytes]
        self._parity = 0
        # Per step shape its layout and views: steps of one shape (every replay of a graph bucket) reuse them
        # instead of re-slicing ~25 tensors.
        self._shapes: dict[tuple, _Shape] = {}
        self._token_index: dict[tuple[int, ...], tuple[np.ndarray, ...]] = {}
        # The last page table built, and per row the page list it was built from and that list's length.
        self._table = np.full((max_rows, table_width), TRASH_PAGE, dtype=np.int64)
        self._table_src: list[tuple[list[int], int] | None] = [None] * max_rows
        self.slot_params = SlotParams(max_rows)
        # The rows list whose entries were last looked up, and those entries: a graph step asks twice (its
        # mode for the graph key, then its inputs), ~5 us of Python each time at 32 rows. Cleared when the
        # inputs are built, so only the lookups of one step share it.
        self._memo_rows: list | None = None
        self._memo_params: list[tuple] = []

    def row_params(self, rows: list) -> list[tuple]:
        """Each row's SlotParams entry (`SlotParams.rows`), once per step for a step's rows list."""
        if rows is not self._memo_rows:
            reqs = [r.req for r in rows]
            self._memo_rows, self._memo_params = rows, self.slot_params.rows(reqs, [q.slot for q in reqs])
        return self._memo_params

    def shape(self, key: tuple) -> _Shape:
        """The layout and views of the step shape `key` = step_layout's arguments."""
        got = self._shapes.get(key)
        if got is None:
            if len(self._shapes) >= 512:  # eager prompt shapes vary; keep the cache bounded
                self._shapes.clear()
            got = self._shapes[key] = _Shape(self, step_layout(*key))
        return got

    def step_mode(self, rows: list) -> tuple[bool, bool, bool]:
        """(any row samples with temperature > 0, any row wants logprobs, any row has penalties / min_tokens):
        the host choices that change what a step computes, hence part of a CUDA-graph key; what
        build_step_input computes for these rows."""
        bits = _mode_bits(self.row_params(rows))
        return bool(bits & _RANDOM), bool(bits & _LOGPROBS), bool(bits & _PENALTIES)

    def page_table(self, rows: list, n_rows: int) -> np.ndarray:
        """[n_rows * table_width]: each row's pages, then the trash page (padding rows: trash only). A row is
        rewritten only when its page list is another list, and only its new tail when the same list grew
        since the last step (a request's list only grows in place or is replaced), so a steady step writes
        the pages rows got, nothing else."""
        table, src = self._table, self._table_src
        for i, r in enumerate(rows):
            pages = r.req.pages
            s = src[i]
            if s is not None and s[0] is pages:
                n0, n = s[1], len(pages)
                if n == n0:
                    continue
                if n > n0:  # grown in place: the row already holds pages[:n0] and trash after them
                    table[i, n0:n] = pages[n0:]
                    src[i] = (pages, n)
                    continue
            n = len(pages)  # another list (or, defensively, a shorter one): the whole row
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


def step_layout(n_rows: int, n_tokens: int, max_q: int, table_width: int, penalties: bool = False,
                n_stop: int = 0) -> list[tuple[str, str, tuple[int, ...]]]:
    """Where one step's values sit in the byte buffer: (name, kind, shape) in order, the _PACKED values
    first. It depends only on the step's host shape (and whether it carries penalties, with how many
    min_tokens stop ids), so a rank that receives the buffer carves the same views (`carve`)."""
    b, t = n_rows, n_tokens
    out = [("input_ids", "int", (t,))] + [(name, "int", (b,)) for name in _PACKED[1:8]]
    out += [(name, "float", (b,)) for name in _PACKED[8:11]] + [(name, "bool", (b,)) for name in _PACKED[11:]]
    out += [("page_table", "int", (b, table_width)), ("tok_row", "int", (t,)), ("tok_col", "int", (t,)),
            ("q_index", "int", (b, max_q)), ("row_first", "int", (b,)), ("q_valid", "bool", (b, max_q))]
    if penalties:
        out += [("min_tokens", "int", (b,)), ("prompt_len", "int", (b,)), ("src_slot", "int", (b,)),
                ("stop_ids", "int", (n_stop,)), ("stop_rows", "int", (n_stop,)), ("presence", "float", (b,)),
                ("frequency", "float", (b,)), ("repetition", "float", (b,)), ("ignore_eos", "bool", (b,)),
                ("reset", "bool", (b,))]
    return out


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
    """The StepInput whose values already sit in `bufs`' device buffer (a tensor-parallel worker's, filled by
    broadcast): the same views `build_step_input` made on the rank that packed them. `mode` is (any_random,
    want_logprobs, penalties, want_prompt_logprobs)."""
    v = bufs.shape((n_rows, n_tokens, max_q, bufs.table_width, mode[2], n_stop)).views
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
        row_chained=v["row_chained"], row_next_token=v["row_next_token"], sampling=st, any_random=any_random,
        want_logprobs=want_logprobs, penalties=pen, want_prompt_logprobs=want_prompt_lp)


def build_step_input(batch: ScheduledBatch, page_size: int, table_width: int, device: torch.device,
                     bufs: StepBuffers | None = None, pad_rows_to: int = 0, max_kv: int = 0,
                     dump_slot: int = 0, pad_q: int | list[int] = 0, ops: Any = None,
                     mode: tuple[bool, ...] | None = None, max_q: int = 0,
                     pad_drafts: int | None = None, masked: bool = False, draft_width: int = 0) -> StepInput:
    """Pack one step. `pad_rows_to` appends padding rows (trash page, dump slot, greedy, no sampling) up to
    that many rows, each `pad_q` tokens wide (0: as wide as the first real row; a list: one width per
    padding row) and "verifying" `pad_drafts` drafts (None: pad_q - 1, a decode row's); `max_kv` (0: the
    step's own bound) and `max_q` (0: the widest row) fix the metadata's bounds, so that steps of one graph
    bucket get one launch shape. `draft_width` is the step's least StepInput.draft_width (a draft tree's
    verify width): a graph captured on padding rows that verify nothing must still compute at the width of
    the real steps it replays.
    `mode` overrides (any_random, want_logprobs, penalties[, masked]) -- a graph captured on padding rows alone
    needs it. `masked`: some sampling row is constrained; the step reads its verify masks from `bufs.masks`,
    which the caller uploads before the part of the step that reads them (`VerifyMasks.upload`: the engine
    builds them once the previous step is processed; a capture's padding rows read whatever is there).
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
    ids = list(chain.from_iterable([r.tokens for r in rows]))
    ids += [0] * (t - len(ids))
    slots = [r.req.slot for r in rows]
    params = bufs.row_params(rows)  # the entries step_mode looked up for these rows, if it did
    bufs._memo_rows = None  # the next step looks its rows up again
    bits = _mode_bits(params)
    any_random, want_logprobs, any_penalty = mode[:3] if mode else (bool(bits & _RANDOM), bool(bits & _LOGPROBS),
                                                                     bool(bits & _PENALTIES))
    masked = bool(mode[3]) if mode is not None and len(mode) > 3 else masked
    want_prompt_lp = bool(bits & _PROMPT_LOGPROBS) and any(
        not r.gather and r.req.params.prompt_logprobs is not None and r.start + 1 < len(r.req.prompt_token_ids)
        for r in rows)
    seed, top_k, temperature, top_p, min_p, greedy, _ = zip(*params, *[_PAD_PARAMS] * pad) if n_rows else [()] * 7
    nd_pad = [max(q - 1, 0) if pad_drafts is None else pad_drafts for q in pad_qs]
    no = [False] * pad
    packed = (ids, q_lens, kv_lens, slots, [dump_slot] * pad, [r.num_drafts for r in rows], nd_pad,
              [r.next_token for r in rows], [0] * pad, seed, top_k, temperature, top_p, min_p,
              [r.samples for r in rows], no, [r.gather for r in rows], no, [r.correct for r in rows], no,
              [False] * n_rows, greedy)
    extra: dict[str, Any] = {}
    n_stop = _penalty_values(rows, pad, dump_slot, extra) if any_penalty else 0
    # Fill the host staging (pinned on CUDA, alternating) -- the Python values in one struct call, the
    # arrays at their views -- then one non-blocking copy.
    shape = bufs.shape((n_rows, t, max_q, table_width, any_penalty, n_stop))
    par = bufs._parity
    bufs._parity ^= 1
    shape.packer.pack_into(bufs.h_np[par], 0, *chain.from_iterable(packed))
    host = shape.host_views[par]
    host["page_table"][:] = bufs.page_table(rows, n_rows)
    (host["tok_row"][:], host["tok_col"][:], host["row_first"][:], host["q_index"][:],
     host["q_valid"][:]) = bufs.token_index(q_lens, max_q)
    for name, v in extra.items():
        host[name][:] = v
    shape.d_span.copy_(shape.h_spans[par], non_blocking=shape.d_span.is_cuda)
    inp = _assemble(shape.views, n_rows, t, max_q, max_kv or max(kv_lens, default=1), page_size, ops,
                    (any_random, want_logprobs, any_penalty, want_prompt_lp))
    inp.draft_width = max(max((r.num_drafts for r in rows), default=0), max(nd_pad, default=0), draft_width)
    if masked:
        if bufs.masks is None:
            raise ValueError("a constrained step needs StepBuffers(verify_masks=(K+1, V)): these buffers hold no masks")
        inp.masked, inp.verify_mask = True, bufs.masks.view(n_rows)  # [B, K+1, W]
    return inp


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
