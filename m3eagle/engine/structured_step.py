"""GrammarStep: the token masks of one step that holds constrained rows (structured output).

Verification scores K+1 positions per row; position j predicts the token after drafts d_1..d_j, so its mask
is the grammar's state after them. The host builds all K+1 masks before the step (`fill_verify`): it advances
the row's matcher through the drafts the row verifies (kept from the previous step's output by
`keep_drafts`), fills a mask after each, and rolls back. A draft the grammar refuses ends the walk: the
target's masked distribution gives it probability 0, so it is rejected and the positions after it are never
read (they repeat the last mask). The engine uploads the masks into the step's static mask buffer
(input_builder.VerifyMasks), so the step reads no host object and a CUDA graph replays it.

By default the draft head proposes unmasked, as for unconstrained rows, and the masked target rejects what
leaves the grammar; nothing is read back inside the step. With `structured_draft_masks` the head is masked
too (acceptance): draft depth j's mask is the state after the step's emitted tokens and d_1..d_j, all device
values of this very step, so such a step reads them back as it drafts: `draft_mask(j)` waits for the emitted
tokens (j = 0) or for d_j, advances the matchers, fills the masks; `finish` reads the last drafts, keeps them
for the next step's verify masks and rolls every matcher back to the accepted output. Those are the step's
host syncs (K + 1 with K drafts, none without drafts), and why that option runs eagerly
(docs/design/structured-output.md).

A draft tree (`TreeGrammarStep`) reads its tree inside the step instead: node i's verify mask is the state after
the node's path (its ancestors, then itself), built by advancing the matcher along the path, filling and rolling
back; the head's level-0 mask is the state after the emitted tokens, and each later level's frontier node is
masked with the state after its own path. One host sync per tree level, plus one for the verify masks.
"""

from __future__ import annotations

import torch

from m3eagle.sampling.structured import RequestGrammar, full_bitmask


class GrammarStep:
    """Masks of one step's rows. rows: the step's ScheduledRows (padding rows after them get all-ones
    masks); k: the engine's K; vocab_size: V. Brings every constrained row's matcher to its output."""

    def __init__(self, rows: list, num_rows: int, k: int, vocab_size: int, device: torch.device):
        self.k, self.vocab_size, self.device = k, vocab_size, device
        self.rows = rows
        # Per real row: its grammar when it samples and is constrained, else None.
        self.grammars: list[RequestGrammar | None] = [
            r.req.grammar if r.samples and r.req.grammar is not None else None for r in rows]
        self.num_rows = num_rows
        self._mark: list[int] = []  # per row: the matcher's accepted count before the draft walk
        self._alive: list[bool] = []  # per row: the walk is still inside the grammar
        self.emitted: tuple[torch.Tensor, torch.Tensor] | None = None  # (new_tokens [B, K+1], num_new [B])
        self._verify: torch.Tensor | None = None
        for row, g in zip(rows, self.grammars):
            if g is not None:
                g.sync(row.req.output_token_ids)

    def fill_verify(self, host: torch.Tensor) -> None:
        """Write each constrained row's K+1 verify masks into `host`, an all-allowed int32 bitmask
        [B' * (K+1), W] (B' >= the real rows: padding rows stay all-allowed): row j of row i is the grammar's
        state after the first j of the drafts the row verifies (g.drafts). Every matcher ends where it began."""
        k = self.k
        for i, (row, g) in enumerate(zip(self.rows, self.grammars)):
            if g is None:
                continue
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

    @property
    def verify_mask(self) -> torch.Tensor:
        """The verify masks on the step's device, int32 [B, K+1, W] (built on first use; the engine uploads
        them through its static buffer instead, `fill_verify`)."""
        if self._verify is None:
            host = full_bitmask(self.num_rows * (self.k + 1), self.vocab_size)  # [B * (K+1), W]
            self.fill_verify(host)
            self._verify = host.view(self.num_rows, self.k + 1, -1).to(self.device)
        return self._verify

    @property
    def rows_constrained(self) -> bool:
        return any(g is not None for g in self.grammars)

    def draft_mask(self, depth: int, drafts: torch.Tensor) -> torch.Tensor:
        """The draft head's mask at `depth` (0..K-1): int32 [B, W] on the device. drafts [B, K] (columns < depth
        filled); `emitted` holds this step's verification outputs (new_tokens [B, K+1], num_new [B]), set by
        the runner before it drafts. Reads back what it needs (a host sync)."""
        host = full_bitmask(self.num_rows, self.vocab_size)
        if depth == 0:
            self._advance_emitted()
        else:
            col = drafts[:, depth - 1].tolist()
            for i, g in enumerate(self.grammars):
                if g is not None and self._alive[i]:
                    self._alive[i] = g.accept(col[i]) and not g.terminated
        for i, g in enumerate(self.grammars):
            if g is not None and self._alive[i]:
                g.fill(host, i)
        return host.to(self.device, non_blocking=self.device.type == "cuda")

    def _advance_emitted(self) -> None:
        """Advance every matcher through this step's emitted tokens (read back: a host sync), remembering where
        each stood before (finish rolls back to it)."""
        toks, counts = self.emitted[0].tolist(), self.emitted[1].tolist()
        self._mark = [g.num_tokens if g is not None else 0 for g in self.grammars]
        self._alive = [False] * len(self.grammars)
        for i, g in enumerate(self.grammars):
            if g is not None:
                n = counts[i]
                self._alive[i] = g.advance(toks[i][:n]) == n and not g.terminated

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


class TreeGrammarStep(GrammarStep):
    """Masks of one draft-tree step's rows (rows, num_rows, vocab_size, device as GrammarStep's)."""

    def __init__(self, rows: list, num_rows: int, vocab_size: int, device: torch.device):
        super().__init__(rows, num_rows, 0, vocab_size, device)

    def tree_verify_mask(self, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
        """The verify masks of every node: int32 [B, N+1, W] on the device; node i's is the grammar's state after
        its path (ancestors, then itself; the root's after the accepted output). tokens / parents [B, N] (target
        ids; parent storage index, 0 = root), num_nodes [B]. A node whose path leaves the grammar is unreachable
        (the masked distribution of its parent gives it probability 0) and keeps an all-allowed mask."""
        b, n = tokens.shape
        host = full_bitmask(b * (n + 1), self.vocab_size)
        if not self.rows_constrained:
            return host.view(b, n + 1, -1).to(self.device)
        toks, pars, counts = tokens.tolist(), parents.tolist(), num_nodes.tolist()
        for i, g in enumerate(self.grammars):
            if g is None:
                continue
            base = i * (n + 1)
            g.fill(host, base)
            paths: list[list[int]] = [[]]  # storage index -> the node's path tokens (parents precede children)
            for j in range(counts[i]):
                path = paths[pars[i][j]] + [toks[i][j]]
                paths.append(path)
                self._fill_after(g, path, host, base + j + 1)
        return host.view(b, n + 1, -1).to(self.device, non_blocking=self.device.type == "cuda")

    def frontier_mask(self, paths: torch.Tensor) -> torch.Tensor:
        """The head's masks of a tree level's frontier: paths [B, F, L] target ids (each frontier node's path from
        depth 1, itself last) -> int32 [B, F, W] on the device: the state after the emitted tokens (advanced by
        draft_mask(0)) and the path. A row that left its grammar drafts unmasked, as the chain's does."""
        b, f, _ = paths.shape
        host = full_bitmask(b * f, self.vocab_size)
        got = paths.tolist() if self.rows_constrained else None
        for i, g in enumerate(self.grammars):
            if g is not None and self._alive[i]:
                for c in range(f):
                    self._fill_after(g, got[i][c], host, i * f + c)
        return host.view(b, f, -1).to(self.device, non_blocking=self.device.type == "cuda")

    @staticmethod
    def _fill_after(g: RequestGrammar, path: list[int], host: torch.Tensor, row: int) -> None:
        """host[row] := the mask after accepting `path` (left all-allowed when the grammar refuses a token of it);
        the matcher is rolled back to where it stood."""
        n = g.advance(path)
        if n == len(path):
            g.fill(host, row)
        g.rollback(n)


def keep_drafts(rows: list, drafts: list[list[int]]) -> None:
    """After a constrained step whose drafts were proposed unmasked: keep each constrained sampling row's
    drafts (read from the step's host copy, drafts [B][K]) for the next step's verify masks -- the drafts its
    slot buffer now holds."""
    for row, d in zip(rows, drafts):
        g = row.req.grammar
        if g is not None and row.samples:
            g.drafts = d
