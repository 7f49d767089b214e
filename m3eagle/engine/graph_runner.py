"""CUDA graphs over whole decode / verify steps: bucketing, padding, capture and replay.

A step is *graph-shaped* when every row continues a running request with exactly 1 + K tokens (the last
sampled token and K drafts, both gathered on the device from the slot buffers): the steady state of
decoding. Such a step is padded to the next bucket of rows (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, ...
up to max_num_seqs) with rows that read and write only the trash page and the dump slot, and its
metadata carries a fixed KV bound (the page table's width), so every kernel's launch shape depends only
on (bucket, K) -- never on a length of this step. Lengths reach the kernels as device tensors.

What one graph holds: the overlap correction, the target forward with aux capture, the logits of the
sampled positions, verification, the K draft steps with their sampling and the slot-buffer writes --
`ModelRunner.execute` whole. The device->host copy of the outputs runs right after the replay, into
the runner's alternating pinned buffers (a copy captured into the graph would always land in the same
buffer, which the host may still be reading under overlap).

Graphs are keyed by (bucket, mode), mode = (any row samples, any row wants logprobs, any row has
penalties, any sampling row is constrained by a grammar); K is fixed per engine, except that a draft tree's
narrow steps (each row verifying the first D nodes of its tree: draft_tree.verify_width) take buckets of
their own, (NARROW, rows, D), and so do its narrow prefill-shaped steps, (PREFILL, rows, tokens, D): the
verify width is a host int the tree step computes with (StepInput.draft_width), and a graph captured on
padding rows alone would otherwise compute at the full width N. All share one memory pool; the greedy graphs
are captured at startup, largest bucket first, and the others on first use (or by the warm-up: `warm_keys`).
Steps that are neither graph-shaped nor prefill-shaped run eagerly.

A constrained ("masked") step is captured as two graphs (`SplitGraph`): the target forward, which reads no
mask, and the finish, which reads the grammar masks of its verify positions from a static device buffer
(input_builder.VerifyMasks) and masks the target's logits; the host builds and uploads the masks while the
forward runs (docs/design/structured-output.md). Only decode / verify buckets take masked graphs (`masked_modes`,
set by an engine that runs constrained chain steps; all of them are warmed): a prompt or mixed step that
carries a constrained sampling row -- once per constrained request, its last prompt chunk -- runs eagerly, since
warming masked prefill graphs would double the prefill keys and capturing them on first use costs a serving
step more than the eager step does.

Prefill graphs (`prefill=True`, the default on one CUDA device): every other step -- prompt chunks, and
mixed steps of prompt chunks and decode / verify rows -- without penalties or prompt logprobs, of R rows
and L tokens, is padded to the next row bucket R' > R and the next token bucket T >= L + (R' - R)
(`prefill_bucket_sizes`: steps of up to `prefill_cap` real tokens, 2,048 by default, the last bucket with
room for their padding rows; larger steps run eagerly) with
R' - R padding rows on the trash page (one token each, the last one takes the rest), and max_q fixed at
T, so its launch shape is (R' rows, T tokens); it is captured on first use under the key
(("prefill", R', T), mode) (a draft tree's step of narrow verify rows: ("prefill", R', T, D)). Prompt
steps then replay instead of launching eagerly (on the H200 an eager prompt step of the embedded model
costs milliseconds of host time; the one-row case took batch-1 plain from 2,949 to 3,837 tok/s). The real
rows compute what they compute unpadded (tokens of another row never reach them); padding rows sample and
verify nothing. Like
decode buckets, a padded step may round differently from the unpadded one in bf16 (GEMMs of another
width), so greedy tokens can differ from an engine without prefill graphs, never between replay and eager.
Graph-shaped steps get the same padding and KV bound when they run eagerly (enforce_eager), so eager and
replay launch the same kernels on the same shapes and agree token for token.

Tensor parallel: on rank 0 a `driver` (engine/executor.py) broadcasts each step's buffers and each
capture before it runs here, so every rank captures the same graphs and runs the same steps.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from m3eagle.engine.input_builder import StepBuffers, StepInput, build_step_input
from m3eagle.engine.model_runner import Forward, ModelRunner, StepOutput
from m3eagle.engine.scheduler import ScheduledBatch

log = logging.getLogger("m3eagle")


def bucket_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then powers of two and the midpoints between them (16, 24, 32, 48, 64, 96, 128, 192, ...),
    so padding wastes at most a third of a step; capped by and ending at max_rows."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        if b < 16:
            b *= 2
        else:
            b = b + b // 2 if b & (b - 1) == 0 else b // 3 * 4  # 16 -> 24 -> 32 -> 48 -> 64 ...
    return out + [max_rows]


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds n rows, or None when n is larger than every bucket."""
    return next((b for b in buckets if b >= n), None)


def is_graph_shaped(batch: ScheduledBatch, k: int, narrow: int | None = None) -> bool:
    """Every row continues a running request with its last token + K drafts, all from the slot buffers (or, with
    `narrow`, every row with that many drafts: a draft-tree step verifying its trees' first nodes)."""
    if not batch.rows:
        return False
    w = batch.rows[0].num_drafts
    return (w == k or w == narrow) and all(r.samples and r.gather and r.num_drafts == w and r.num_tokens == w + 1
                                           for r in batch.rows)


PREFILL = "prefill"  # the first field of a prefill graph's bucket key: (PREFILL, rows, tokens)
NARROW = "narrow"  # the first field of a narrow draft-tree step's bucket key: (NARROW, rows, drafts per row)


def prefill_bucket_sizes(max_tokens: int, cap: int = 4096, slack: int = 0) -> list[int]:
    """Token buckets of prefill graphs, up to top = min(max_tokens, cap): 16, then every 32 tokens to 256,
    then 1.5x steps (384, 512, 768, 1024, ...), and top itself last. A step of L tokens whose padding needs
    p rows takes the first bucket >= L + p (each padding row holds a token), so a 128-token prompt pads to
    160, not 256. `slack` > 0 adds a last bucket of min(max_tokens, cap + slack): room for the padding rows
    of a step of cap real tokens (a full-budget step of a cap >= the token budget fits)."""
    top = min(max_tokens, cap)
    extra = min(max_tokens, cap + slack)
    if slack and extra > top:
        return prefill_bucket_sizes(max_tokens, cap) + [extra]
    out = [16] + list(range(32, 257, 32))
    t = 256
    while t < top:
        t = t + t // 2 if t & (t - 1) == 0 else t // 3 * 4  # 256 -> 384 -> 512 -> 768 -> 1024 ...
        out.append(t)
    out = [b for b in out if b < top]
    return out + [top] if top >= 16 else []


def is_prefill_shaped(batch: ScheduledBatch) -> bool:
    """A step a prefill graph can replay: any rows (prompt chunks, decode / verify rows), none with
    penalties (their min_tokens stop ids change the step's buffer layout) or prompt logprobs (they read
    every position). Steps whose rows are all decode rows of 1 + K tokens take the decode buckets first."""
    return bool(batch.rows) and all(not r.req.params.has_penalties and r.req.params.prompt_logprobs is None
                                    for r in batch.rows)


def pdl_in_graph(bucket: Any) -> bool:
    """Whether the graph of `bucket` is captured with programmatic dependent launch under M3EAGLE_PDL=auto:
    decode / verify buckets of up to pdl.AUTO_MAX_BUCKET rows (prefill graphs' buckets are tuples)."""
    from m3eagle.kernels import pdl  # here, not at the top: pdl.py defines a jit helper, and the engine must not import
    # triton before a CPU test sets TRITON_INTERPRET (kernels and helpers decorate for the GPU otherwise)

    rows = bucket[1] if isinstance(bucket, tuple) and bucket[0] == NARROW else bucket
    return isinstance(rows, int) and rows <= pdl.AUTO_MAX_BUCKET


class SplitGraph:
    """A masked step captured as two graphs in one pool: the target forward and the finish, with the forward's
    outputs (`hand`, a ModelRunner.Forward of static tensors) read by the finish. The engine replays the forward,
    builds and uploads the step's masks meanwhile, then replays the finish; `replay` / `reset` treat the pair as
    one graph."""

    def __init__(self, forward: torch.cuda.CUDAGraph, hand: Forward, finish: torch.cuda.CUDAGraph):
        self.forward, self.hand, self.finish = forward, hand, finish

    def replay(self) -> None:
        self.forward.replay()
        self.finish.replay()

    def reset(self) -> None:
        self.forward.reset()
        self.finish.reset()


class GraphRunner:
    """Captures and replays `runner.execute` for graph-shaped steps. `graphs=False` keeps the bucketing
    and padding (so enforce_eager computes exactly what a replay computes) but never captures."""

    def __init__(self, runner: ModelRunner, bufs: StepBuffers, k: int, max_rows: int, page_size: int,
                 table_width: int, graphs: bool, ops=None, driver=None, prefill: bool = False,
                 prefill_cap: int = 4096):
        self.runner, self.bufs, self.k, self.driver = runner, bufs, k, driver
        self.page_size, self.table_width, self.ops = page_size, table_width, ops
        self.max_kv = table_width * page_size  # the fixed KV bound of every graph-shaped step
        # A bucket must fit the step buffers once padded: rows x (1 + K) tokens.
        self.buckets = [b for b in bucket_sizes(max_rows) if b * (k + 1) <= bufs.max_tokens]
        # A draft tree's narrow verify width (draft_tree.verify_width): its decode steps get buckets of their own,
        # and so do its prefill-shaped steps of narrow rows, which only steps of more than tree_max_batch rows
        # are (the engine sets both; warm_keys reads the second).
        self.narrow: int | None = None
        self.tree_max_batch = 0
        # Prefill graphs need a padding row (so at least two rows); tensor parallel keeps them off (the
        # driver's broadcast protocol carries decode buckets only).
        # A step of up to prefill_cap real tokens replays: the last bucket has room for its padding rows.
        self.prefill_cap = prefill_cap
        self.prefill_buckets = (prefill_bucket_sizes(bufs.max_tokens, prefill_cap, bufs.max_rows)
                                if prefill and bufs.max_rows >= 2 and driver is None else [])
        self.prefill_rows = bucket_sizes(bufs.max_rows)
        # The engine's warm-up sets it while it runs its prompt shapes: prefill-shaped steps then run eagerly at
        # their unpadded shapes -- the Triton variants of the steps no prefill graph takes (a constrained row's
        # prompt step, penalties, prompt logprobs), which the captures, at padded shapes, do not compile.
        self.eager_prefill = False
        self.use_graphs = graphs and runner.device.type == "cuda"
        # Decode / verify buckets take masked (constrained) graphs too; the engine sets it when it runs
        # constrained chain steps replayable (a tokenizer, one rank, no draft tree, no structured_draft_masks).
        self.masked_modes = False
        # (bucket, mode) -> (its graph -- a SplitGraph for a masked mode --, its static outputs)
        self.graphs: dict[tuple[Any, tuple[bool, ...]], tuple[Any, StepOutput]] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.num_replays = 0
        # Set once the engine's warm-up has run: a capture after it is first-use work in the middle of serving.
        self.warmed = False
        self.first_use_captures = 0
        self.launch_seconds = 0.0  # host time inside graph.replay() (cudaGraphLaunch), summed over replays
        if driver is not None:
            driver.attach(self)  # its shutdown releases these graphs before NCCL's teardown (release())

    # ---- planning -------------------------------------------------------------------------------
    def bucket(self, batch: ScheduledBatch, masked: bool = False) -> Any:
        """The step's graph bucket: rows (a decode / verify step), (NARROW, rows, D) (a draft tree's narrow
        one), (PREFILL, rows, tokens) (a prefill graph's; (PREFILL, rows, tokens, D) when its tree rows verify
        the narrow width D), or None (eager). `masked`: a sampling row is constrained (prefill-shaped: eager)."""
        if is_graph_shaped(batch, self.k, self.narrow):
            b, w = bucket_for(len(batch.rows), self.buckets), batch.rows[0].num_drafts
            return b if w == self.k or b is None else (NARROW, b, w)
        if self.prefill_buckets and not masked and not self.eager_prefill and is_prefill_shaped(batch):
            n = len(batch.rows)
            rows = bucket_for(n + 1, self.prefill_rows)  # >= 1 padding row
            if rows is None:
                return None
            real = sum(r.num_tokens for r in batch.rows)
            if real > self.prefill_cap:
                return None
            t = bucket_for(real + rows - n, self.prefill_buckets)  # >= 1 token each
            if t is None:
                return None
            w = max(r.num_drafts for r in batch.rows)
            return (PREFILL, rows, t, w) if self.narrow is not None and 0 < w < self.k else (PREFILL, rows, t)
        return None

    def build(self, batch: ScheduledBatch, bucket: Any, masked: bool = False) -> StepInput:
        """The step's inputs: padded to its bucket with the fixed KV bound, or as they are (a multi-step
        iteration's KV bound then covers its last sub-step, whose rows end (steps - 1) x (1 + K) further).
        `masked`: the step reads the static verify masks (the caller uploads them: VerifyMasks.upload)."""
        if bucket is None:
            max_kv = 0 if batch.steps == 1 else (max(r.kv_len for r in batch.rows)
                                                  + (batch.steps - 1) * (self.k + 1))
            return build_step_input(batch, self.page_size, self.table_width, self.runner.device, self.bufs,
                                    dump_slot=self.runner.dump_slot, ops=self.ops, max_kv=max_kv, masked=masked)
        return build_step_input(batch, self.page_size, self.table_width, self.runner.device, self.bufs,
                                max_kv=self.max_kv, dump_slot=self.runner.dump_slot, ops=self.ops, masked=masked,
                                **self._padding(bucket, batch))

    def _padding(self, bucket: Any, batch: ScheduledBatch) -> dict[str, Any]:
        """build_step_input's padding arguments of a bucket for `batch` (empty when capturing). Decode: rows
        of 1 + K tokens up to `bucket` rows. Prefill (PREFILL, rows, t[, w]): `rows` rows and t tokens in all,
        max_q t -- the real rows, then padding rows of one token each but the last, which takes the rest;
        padding rows verify nothing, and the step's verify width is w (a capture has no row that says it)."""
        if isinstance(bucket, tuple) and bucket[0] == NARROW:  # rows of 1 + w tokens
            return dict(pad_rows_to=bucket[1], pad_q=bucket[2] + 1)
        if isinstance(bucket, tuple):
            _, rows, t, *width = bucket
            pad = rows - len(batch.rows)
            rest = t - sum(r.num_tokens for r in batch.rows) - (pad - 1)
            return dict(pad_rows_to=rows, pad_q=[1] * (pad - 1) + [rest], pad_drafts=0, max_q=t,
                        draft_width=width[0] if width else 0)
        return dict(pad_rows_to=bucket, pad_q=self.k + 1)

    # ---- running --------------------------------------------------------------------------------
    def ensure(self, batch: ScheduledBatch, bucket: Any, masked: bool = False) -> None:
        """Capture the step's graph if it is missing -- before its inputs are built, since capturing fills
        the same buffers with padding rows."""
        if bucket is not None and self.use_graphs:
            mode = (*self.bufs.step_mode(batch.rows), masked)
            if (bucket, mode) not in self.graphs:
                self.capture(bucket, mode)

    def run(self, inp: StepInput, bucket: Any) -> StepOutput:
        """Execute one step: replay its graph, or run eagerly. The outputs are not yet copied to the host."""
        if self.driver is not None:  # tensor parallel, rank 0: the workers run the same step
            with self.driver.guard():
                self.driver.step(inp, bucket, self.bufs)
                return self._run(inp, bucket)
        return self._run(inp, bucket)

    def _run(self, inp: StepInput, bucket: Any) -> StepOutput:
        if bucket is None or not self.use_graphs:
            return self.runner.execute(inp)
        graph, static = self.graphs[(bucket, inp.mode)]
        t0 = time.perf_counter()
        graph.replay()
        self.launch_seconds += time.perf_counter() - t0
        self.num_replays += 1
        return static.fresh()

    def forward(self, inp: StepInput, bucket: Any) -> Forward:
        """Launch a masked step's first half (ModelRunner.forward: the target forward, which reads no mask):
        replay its SplitGraph's forward graph, or run it eagerly. -> what `finish` takes. One rank only (masked
        steps never run under tensor parallelism)."""
        if self.driver is not None:
            raise ValueError("a constrained (masked) step under tensor parallelism: its masks are not broadcast")
        if bucket is None or not self.use_graphs:
            return self.runner.forward(inp)
        split = self.graphs[(bucket, inp.mode)][0]
        t0 = time.perf_counter()
        split.forward.replay()
        self.launch_seconds += time.perf_counter() - t0
        return split.hand

    def finish(self, inp: StepInput, bucket: Any, hand: Forward) -> StepOutput:
        """Launch a masked step's second half (ModelRunner.finish: logits, masks, verification, commit, drafts),
        once its masks are uploaded. The outputs are not yet copied to the host."""
        if bucket is None or not self.use_graphs:
            return self.runner.finish(inp, hand)
        split, static = self.graphs[(bucket, inp.mode)]
        t0 = time.perf_counter()
        split.finish.replay()
        self.launch_seconds += time.perf_counter() - t0
        self.num_replays += 1
        return static.fresh()

    def release(self) -> None:
        """Destroy the captured graphs (after the device has finished with them); later graph-shaped steps
        capture afresh. Tensor parallel needs this before leaving the process group: ncclCommDestroy blocks
        while a live CUDA graph still holds a captured collective (pytorch/pytorch#115388), which hung every
        TP=2 shutdown on 2 x H200 until the 20 s teardown limit abandoned the group."""
        if not self.graphs:
            return
        torch.cuda.synchronize(self.runner.device)
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.pool = None

    def capture_startup(self) -> None:
        """Capture the greedy graph of every bucket, largest first (the smaller ones reuse its pool)."""
        if not self.use_graphs:
            return
        free0 = torch.cuda.mem_get_info(self.runner.device)[0]
        for b in self.decode_buckets():
            self.capture(b, (False, False, False, False))
        used = (free0 - torch.cuda.mem_get_info(self.runner.device)[0]) / 2**20
        log.info("captured %d CUDA graphs (buckets %s, K=%d) in %.1f s; graph memory %.0f MiB",
                 len(self.graphs), self.buckets, self.k, self.capture_seconds, used)

    def warm_keys(self) -> list[tuple[Any, tuple[bool, ...]]]:
        """Every (bucket, mode) a serving step can take, largest first: each decode / verify bucket in each of
        the 8 modes (16 with `masked_modes`: each also constrained), and each prefill bucket (R' >= 2 rows,
        T >= R' tokens: every row holds a token) in the 4 modes a prefill graph has (no penalties, never
        masked); a draft tree's also at its narrow width where R' - 1 real rows exceed tree_max_batch. The step
        whose graph `warm` captures is built of padding rows only, so what it compiles and captures is exactly
        what the first real step of that key would."""
        flags = (False, True)
        masks = flags if self.masked_modes else (False,)
        decode = [(b, (r, lp, pen, m)) for b in self.decode_buckets()
                  for m in masks for r in flags for lp in flags for pen in flags]
        narrow = self.narrow is not None and self.narrow != self.k
        prefill = [(key, (r, lp, False, False)) for t in sorted(self.prefill_buckets, reverse=True)
                   for rows in sorted(self.prefill_rows, reverse=True) if 2 <= rows <= t
                   for key in [(PREFILL, rows, t)] + ([(PREFILL, rows, t, self.narrow)]
                                                      if narrow and rows - 1 > self.tree_max_batch else [])
                   for r in flags for lp in flags]
        return decode + prefill

    def decode_buckets(self) -> list[Any]:
        """Every decode / verify bucket, largest first; with a narrow draft-tree width, each row bucket twice
        (the full tree's, then the narrow step's)."""
        out: list[Any] = []
        for b in sorted(self.buckets, reverse=True):
            out += [b] + ([(NARROW, b, self.narrow)] if self.narrow is not None and self.narrow != self.k else [])
        return out

    def step_costs(self, reps: int = 5) -> dict[int, tuple[float, float]]:
        """Per row bucket, the device seconds of one replay of its greedy full-tree graph and of its narrow graph
        (captured by capture_startup; the median of `reps` replays after one untimed). The replays run padding
        rows only: the trash page and the dump slot. {} when graphs are off or there is no narrow width."""
        if not self.use_graphs or self.narrow is None or self.narrow == self.k:
            return {}
        dev = self.runner.device
        mode = (False, False, False, False)

        def cost(bucket: Any) -> float:
            if (bucket, mode) not in self.graphs:
                self.capture(bucket, mode)
            graph = self.graphs[(bucket, mode)][0]
            # the step buffers hold the last step's layout: lay out this bucket's padding rows before replaying
            self.padding_input(bucket, mode)
            graph.replay()
            times = []
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return sorted(times)[len(times) // 2]

        with torch.cuda.device(dev):
            costs = {b: (cost(b), cost((NARROW, b, self.narrow))) for b in sorted(self.buckets)}
        torch.cuda.synchronize(dev)
        return costs

    def warm(self, bucket: Any, mode: tuple[bool, ...]) -> bool:
        """Make the first real step of (bucket, mode) cost what later ones do: capture its graph (its two eager
        warm-up runs compile the Triton variants), or, where graphs are off (enforce_eager, CPU), run the
        padding-only step once eagerly. Returns whether it did anything (False: already captured)."""
        if self.use_graphs:
            if (bucket, mode) in self.graphs:
                return False
            self.capture(bucket, mode)
            return True
        if self.driver is not None:  # tensor parallel: an eager step here must run on every rank; skip it
            return False
        self.runner.execute(self.padding_input(bucket, mode))
        return True

    def padding_input(self, bucket: Any, mode: tuple[bool, ...]) -> StepInput:
        """The step of `bucket` built of padding rows only, in `mode`: what a capture records. Its host ints
        (rows, tokens, bounds, mode, verify width) are baked into the graph; every real step the graph replays
        must have the same ones (a CPU test replays these inputs over real steps' buffers)."""
        empty = ScheduledBatch([], [])
        return build_step_input(empty, self.page_size, self.table_width, self.runner.device, self.bufs,
                                max_kv=self.max_kv, dump_slot=self.runner.dump_slot, ops=self.ops, mode=mode,
                                **self._padding(bucket, empty))

    def capture(self, bucket: Any, mode: tuple[bool, ...]) -> None:
        """Capture `execute` on padding rows only (they touch nothing but the trash page and the dump
        slot), so capturing in the middle of serving changes no request's state."""
        if self.driver is not None:
            with self.driver.guard():
                self.driver.capture(bucket, mode)
                return self._capture(bucket, mode)
        self._capture(bucket, mode)

    def _capture(self, bucket: Any, mode: tuple[bool, ...]) -> None:
        t0 = time.perf_counter()
        inp = self.padding_input(bucket, mode)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.runner.device)
        side.wait_stream(torch.cuda.current_stream(self.runner.device))
        # Programmatic dependent launch inside the graphs of small decode buckets (m3eagle/kernels/pdl.py, "auto")
        from m3eagle.kernels import pdl  # (see pdl_in_graph)

        small = pdl_in_graph(bucket)
        with pdl.scope(small), torch.cuda.stream(side):  # warm-up: triton compiles, cuBLAS picks its kernels
            for _ in range(2):
                self.runner.execute(inp)
        torch.cuda.current_stream(self.runner.device).wait_stream(side)
        # Tensor parallel: NCCL's watchdog thread queries events while we capture; "thread_local" keeps its
        # calls from invalidating the capture (only this thread's unsafe calls are errors).
        tp = getattr(self.runner.target, "tp", None)
        errors = "thread_local" if tp is not None and tp.size > 1 else "global"
        if len(mode) > 3 and mode[3]:  # masked: the forward and the finish, so the masks may come in between
            fwd, fin = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with pdl.scope(small), torch.cuda.graph(fwd, pool=self.pool, capture_error_mode=errors):
                hand = self.runner.forward(inp)
            with pdl.scope(small), torch.cuda.graph(fin, pool=self.pool, capture_error_mode=errors):
                static = self.runner.finish(inp, hand)
            graph: Any = SplitGraph(fwd, hand, fin)
        else:
            graph = torch.cuda.CUDAGraph()
            with pdl.scope(small), torch.cuda.graph(graph, pool=self.pool, capture_error_mode=errors):
                static = self.runner.execute(inp)
        self.graphs[(bucket, mode)] = (graph, static)
        self.capture_seconds += time.perf_counter() - t0
        if self.warmed:
            self.first_use_captures += 1
            log.warning("CUDA graph bucket=%s mode=%s captured on first use, after the warm-up (%.2f s in a "
                        "serving step)", bucket, mode, time.perf_counter() - t0)
        else:
            log.debug("captured graph bucket=%s mode=%s in %.2f s", bucket, mode, time.perf_counter() - t0)
