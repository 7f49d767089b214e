"""The step's bookkeeping ops behind one interface: the overlap scheduler's input correction, where a step
samples, the greedy acceptance count and the commit of a step's outputs into the slot buffers the next step
reads. `reference` runs the plain torch of step_reference.py (and sampling.verify.greedy_accept); `triton` runs
each as one launch (step_kernels.py), bit-equal (int64). An engine takes the implementation named like its
fused-ops backend: both are 'triton' on CUDA and 'reference' on the CPU unless chosen otherwise.

Every method syncs nothing with the host and keeps shapes fixed by its inputs: CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import torch

from m3eagle.engine import step_reference
from m3eagle.kernels.attention.metadata import AttnMetadata, derive_positions_and_slots
from m3eagle.sampling.verify import greedy_accept


class StepOps(Protocol):
    name: str

    def positions_slots(self, kv_lens: torch.Tensor, q_lens: torch.Tensor, tok_row: torch.Tensor,
                        tok_col: torch.Tensor, page_table: torch.Tensor, page_size: int,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """attention.metadata.derive_positions_and_slots: positions [T] and cache slots [T] from lengths."""
        ...

    def overlap_inputs(self, input_ids: torch.Tensor, meta: AttnMetadata, row_slot: torch.Tensor,
                       row_first: torch.Tensor, row_gather: torch.Tensor, row_num_drafts: torch.Tensor,
                       row_correct: torch.Tensor, row_chained: torch.Tensor, slot_tokens: torch.Tensor,
                       slot_num_new: torch.Tensor, slot_dev: torch.Tensor, slot_drafts: torch.Tensor, k: int,
                       ) -> tuple[torch.Tensor, AttnMetadata]:
        """step_reference.overlap_ids_kv, then the metadata's positions and slots from the corrected lengths."""
        ...

    def sample_positions(self, row_first: torch.Tensor, row_qlen: torch.Tensor, row_num_drafts: torch.Tensor,
                         positions: torch.Tensor, ids: torch.Tensor, k: int,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """step_reference.sample_positions."""
        ...

    def commit_outputs(self, *args: Any, tok_row: torch.Tensor | None = None, chain: tuple | None = None,
                       pages: tuple[torch.Tensor, int] | None = None) -> tuple:
        """step_reference.commit_outputs (tok_row [T]: the flat tokens' rows, which a fast path may use)."""
        ...

    def greedy_accept(self, greedy_tok: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                      ) -> torch.Tensor:
        """sampling.verify.greedy_accept."""
        ...


class ReferenceStepOps:
    """The plain torch bookkeeping: the CPU path and the oracle. Stateless."""

    name = "reference"

    def positions_slots(self, kv_lens, q_lens, tok_row, tok_col, page_table, page_size):
        return derive_positions_and_slots(kv_lens, q_lens, tok_row, tok_col, page_table, page_size)

    def overlap_inputs(self, input_ids, meta, row_slot, row_first, row_gather, row_num_drafts, row_correct,
                       row_chained, slot_tokens, slot_num_new, slot_dev, slot_drafts, k):
        ids, kv = step_reference.overlap_ids_kv(input_ids, meta.kv_lens, row_slot, row_first, row_gather,
                                                row_num_drafts, row_correct, row_chained, slot_tokens, slot_num_new,
                                                slot_dev, slot_drafts, k)
        return ids, meta.with_lengths(kv)

    def sample_positions(self, row_first, row_qlen, row_num_drafts, positions, ids, k):
        return step_reference.sample_positions(row_first, row_qlen, row_num_drafts, positions, ids, k)

    def commit_outputs(self, *args, tok_row=None, chain=None, pages=None):
        return step_reference.commit_outputs(*args, chain=chain, pages=pages)

    def greedy_accept(self, greedy_tok, drafts, num_drafts):
        return greedy_accept(greedy_tok, drafts, num_drafts)


class TritonStepOps:
    """Each op as one Triton launch (step_kernels.py). Stateless; triton is imported when this is built."""

    name = "triton"

    def __init__(self) -> None:
        from m3eagle.engine import step_kernels  # imports triton: only when an engine asks for this backend

        self._k = step_kernels

    def positions_slots(self, kv_lens, q_lens, tok_row, tok_col, page_table, page_size):
        return self._k.step_inputs(kv_lens, q_lens, tok_row, tok_col, page_table, page_size)[2:]

    def overlap_inputs(self, input_ids, meta, row_slot, row_first, row_gather, row_num_drafts, row_correct,
                       row_chained, slot_tokens, slot_num_new, slot_dev, slot_drafts, k):
        ids, kv, pos, slots = self._k.step_inputs(
            meta.kv_lens, meta.q_lens, meta.tok_row, meta.tok_col, meta.page_table, meta.page_size,
            (input_ids, row_slot, row_first, row_gather, row_num_drafts, row_correct, row_chained, slot_tokens,
             slot_num_new, slot_dev, slot_drafts, k))
        return ids, replace(meta, kv_lens=kv, positions=pos, slot_mapping=slots)

    def sample_positions(self, row_first, row_qlen, row_num_drafts, positions, ids, k):
        return self._k.sample_positions(row_first, row_qlen, row_num_drafts, positions, ids, k)

    def commit_outputs(self, *args, tok_row=None, chain=None, pages=None):
        return self._k.commit_outputs(*args, tok_row=tok_row, chain=chain, pages=pages)

    def greedy_accept(self, greedy_tok, drafts, num_drafts):
        return self._k.greedy_accept(greedy_tok, drafts, num_drafts)


def create(name: str) -> StepOps:
    """The bookkeeping implementation named like an engine's fused-ops backend ('triton' or 'reference';
    'batch_invariant' takes the triton kernels: integer index arithmetic, the same bits for any batch)."""
    if name in ("triton", "batch_invariant"):
        return TritonStepOps()
    if name == "reference":
        return ReferenceStepOps()
    raise ValueError(f"step ops {name!r} are unknown; choose 'reference' or 'triton'")
