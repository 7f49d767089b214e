"""ScheduledBatch (host) -> StepInput (device tensors + host shapes).

Host arrays are built here and copied with non_blocking copies; every value that depends on the
previous step's acceptance is left for the device to fill in (ModelRunner._apply_overlap_correction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.metadata import TRASH_PAGE, AttnMetadata, build_metadata
from ..sampling.sampler import SamplingTensors
from .scheduler import ScheduledBatch


@dataclass
class StepInput:
    batch: ScheduledBatch
    input_ids: torch.Tensor  # [T] host-known ids, placeholders where rows gather
    meta: AttnMetadata  # built from host-projected lengths
    row_slot: torch.Tensor  # [B] device slot-buffer index of each row's request
    row_first: torch.Tensor  # [B] flat index of each row's first token
    row_qlen: torch.Tensor  # [B]
    row_num_drafts: torch.Tensor  # [B] 0 or K
    row_samples: torch.Tensor  # [B] bool
    row_gather: torch.Tensor  # [B] bool: first token + drafts from the slot buffers
    row_correct: torch.Tensor  # [B] bool: kv_len += num_new_prev - expected_prev on device
    row_next_token: torch.Tensor  # [B] token after a non-sampling chunk
    sampling: SamplingTensors
    any_random: bool  # some row samples with temperature > 0 (draft probs are needed)
    want_logprobs: bool


def build_step_input(batch: ScheduledBatch, page_size: int, table_width: int, device: torch.device,
                     ) -> StepInput:
    rows = batch.rows
    q_lens = [r.num_tokens for r in rows]
    ids: list[int] = []
    for r in rows:
        ids += r.tokens
    table = torch.full((len(rows), table_width), TRASH_PAGE, dtype=torch.int64)
    for i, r in enumerate(rows):
        table[i, : len(r.req.pages)] = torch.tensor(r.req.pages, dtype=torch.int64)
    kv_lens = torch.tensor([r.kv_len for r in rows], dtype=torch.int64)
    max_kv = max(r.kv_len for r in rows)
    meta = build_metadata(q_lens, kv_lens, table, page_size, device, max_kv)
    first, acc = [], 0
    for n in q_lens:
        first.append(acc)
        acc += n

    def dev(x, dtype=torch.int64):
        return torch.tensor(x, dtype=dtype).to(device, non_blocking=True)

    params = [r.req.params for r in rows]
    st = SamplingTensors(
        temperature=dev([p.temperature for p in params], torch.float32),
        top_k=dev([p.top_k for p in params]), top_p=dev([p.top_p for p in params], torch.float32),
        seed=dev([r.req.seed for r in rows]), greedy=dev([p.greedy for p in params], torch.bool))
    return StepInput(
        batch=batch, input_ids=dev(ids), meta=meta, row_slot=dev([r.req.slot for r in rows]),
        row_first=dev(first), row_qlen=dev(q_lens), row_num_drafts=dev([r.num_drafts for r in rows]),
        row_samples=dev([r.samples for r in rows], torch.bool), row_gather=dev([r.gather for r in rows], torch.bool),
        row_correct=dev([r.correct for r in rows], torch.bool), row_next_token=dev([r.next_token for r in rows]),
        sampling=st, any_random=any(not p.greedy for p in params),
        want_logprobs=any(p.logprobs for p in params))
