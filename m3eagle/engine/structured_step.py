"""GrammarStep: the token masks of one step that holds constrained rows (structured output).

Verification scores K+1 positions per row; position j predicts the token after drafts d_1..d_j, so its mask
is the grammar's state after them. The host builds all K+1 masks before the step: it advances the row's
matcher through the drafts it read back from the previous step, fills a mask after each, and rolls back. A
draft the grammar refuses ends the walk: the target's masked distribution gives it probability 0, so it is
rejected and the positions after it are never read (they repeat the last mask).

The draft head is masked too, so that drafts stay in the grammar (acceptance): draft depth j's mask is the
state after the step's emitted tokens and d_1..d_j, all device values of this very step. So a constrained
step reads them back as it drafts: `draft_mask(j)` waits for the emitted tokens (j = 0) or for d_j, advances
the matchers, fills the masks; `finish` reads the last drafts, keeps them for the next step's verify masks
and rolls every matcher back to the accepted output. Those are the step's host syncs (K + 1 with K drafts,
none without drafts), and why a constrained step runs eagerly (docs/design/structured-output.md).
"""

from __future__ import annotations

import torch

from m3eagle.sampling.structured import RequestGrammar, full_bitmask


class GrammarStep:
    """Masks of one step's rows. rows: the step's ScheduledRows (padding rows after them get all-ones
    masks); k: the engine's K; vocab_size: V."""

    def __init__(self, rows: list, num_rows: int, k: int, vocab_size: int, device: torch.device):
        self.k, self.vocab_size, self.device = k, vocab_size, device
        # Per real row: its grammar when it samples and is constrained, else None.
        self.grammars: list[RequestGrammar | None] = [
            r.req.grammar if r.samples and r.req.grammar is not None else None for r in rows]
        self.num_rows = num_rows
        self._mark: list[int] = []  # per row: the matcher's accepted count before the draft walk
        self._alive: list[bool] = []  # per row: the walk is still inside the grammar
        self.emitted: tuple[torch.Tensor, torch.Tensor] | None = None  # (new_tokens [B, K+1], num_new [B])
        host = full_bitmask(num_rows * (k + 1), vocab_size)  # [B * (K+1), W]
        for i, (row, g) in enumerate(zip(rows, self.grammars)):
            if g is None:
                continue
            g.sync(row.req.output_token_ids)
            base, nd, last, accepted = i * (k + 1), row.num_drafts, 0, 0
            for j in range(nd + 1):
                g.fill(host, base + j)
                last = j
                if j == nd or j >= len(g.drafts) or not g.accept(g.drafts[j]):
                    break
                accepted += 1
            for j in range(last + 1, k + 1):  # unreachable positions: the last mask again
                host[base + j] = host[base + last]
            g.rollback(accepted)
        # [B, K+1, W] int32 on the step's device
        self.verify_mask = host.view(num_rows, k + 1, -1).to(device, non_blocking=device.type == "cuda")

    @property
    def rows_constrained(self) -> bool:
        return any(g is not None for g in self.grammars)

    def draft_mask(self, depth: int, drafts: torch.Tensor) -> torch.Tensor:
        """The draft head's mask at `depth` (0..K-1): int32 [B, W] on the device. drafts [B, K] (columns < depth
        filled); `emitted` holds this step's verification outputs (new_tokens [B, K+1], num_new [B]), set by
        the runner before it drafts. Reads back what it needs (a host sync)."""
        host = full_bitmask(self.num_rows, self.vocab_size)
        if depth == 0:
            toks, counts = self.emitted[0].tolist(), self.emitted[1].tolist()
            self._mark = [g.num_tokens if g is not None else 0 for g in self.grammars]
            self._alive = [False] * len(self.grammars)
            for i, g in enumerate(self.grammars):
                if g is not None:
                    n = counts[i]
                    self._alive[i] = g.advance(toks[i][:n]) == n and not g.terminated
        else:
            col = drafts[:, depth - 1].tolist()
            for i, g in enumerate(self.grammars):
                if g is not None and self._alive[i]:
                    self._alive[i] = g.accept(col[i]) and not g.terminated
        for i, g in enumerate(self.grammars):
            if g is not None and self._alive[i]:
                g.fill(host, i)
        return host.to(self.device, non_blocking=self.device.type == "cuda")

    def finish(self, drafts: torch.Tensor | None) -> None:
        """After drafting: keep each constrained row's drafts [B, K] for the next step's verify masks (None:
        no drafts this step), and roll every matcher back to its accepted output."""
        got = drafts.tolist() if drafts is not None and self.rows_constrained else None
        for i, g in enumerate(self.grammars):
            if g is None:
                continue
            g.drafts = got[i] if got is not None else []
            if self._mark:
                g.rollback_to(self._mark[i])
