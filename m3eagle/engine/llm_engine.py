"""The engine loop: schedule, run, process -- with overlap, process step N while step N+1 runs.

Without overlap:  schedule N -> execute N -> wait for N's copy -> process N
With overlap:     schedule N+1 (projected lengths) -> execute N+1 -> process N (host work overlaps
                  the device running N+1)

Processing a step -- tokens appended, stops checked, text detokenized, speculation counted, requests
finished, deltas built -- is `OutputProcessor` (output_processor.py), a mixin of `LLMEngine`; this module
holds the loop, the overlap pipeline, multi-step iterations, fault recovery and the integrity checks.

Serving: `add_request` and `abort` may be called from any thread while another thread runs `step()`.
New requests wait in an intake queue that the top of `step()` drains into the scheduler; an abort that
finds a step running is queued and applied by that step. `step()` returns one RequestDelta per request it
changed (new tokens, new text, finished or not); streaming and `LLM.generate()` are both built on them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from m3eagle.distributed.parallel_state import SINGLE, TPGroup
from m3eagle.engine.detokenizer import FinalTextDetokenizer, IncrementalDetokenizer
from m3eagle.engine.draft_tree import (
    TreeSpec,
    check_tree_engine,
    expected_gain,
    narrow_width,
    tree_max_batch_from_costs,
    tree_max_batch_from_shape,
)
from m3eagle.engine.graph_runner import GraphRunner
from m3eagle.engine.input_builder import StepBuffers
from m3eagle.engine.kv_budget import pages_per_seq, resolve_num_pages
from m3eagle.engine.model_runner import ModelRunner, StepOutput
from m3eagle.engine.output_processor import OutputProcessor, SpecCounters
from m3eagle.engine.request import (
    Request,
    RequestDelta,
    RequestError,
    RequestGroup,
    RequestOutput,
    Status,
    StopConditions,
)
from m3eagle.engine.scheduler import NeedSync, ScheduledBatch, Scheduler
from m3eagle.engine.structured_step import GrammarStep, TreeGrammarStep
from m3eagle.engine.tree_runner import TreeModelRunner
from m3eagle.engine.warmup import Warmup
from m3eagle.kernels.ops import Ops, make_ops
from m3eagle.kvcache.page_pool import PagePool
from m3eagle.models.layers import pack_projections
from m3eagle.sampling.params import SamplingParams
from m3eagle.sampling.structured import GrammarCompiler, GrammarError

log = logging.getLogger("m3eagle")


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of n (splitmix64 of seed and index; sample 0 keeps the request's seed), so
    every sample has its own reproducible random stream. In [0, 2^63) like every seed."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    num_pages: int = 0  # 0: sized from max_num_seqs and max_model_len
    max_num_tokens: int = 2048  # token budget per step (prompt chunk size)
    max_num_seqs: int = 64
    max_model_len: int = 2048
    num_draft_tokens: int = 0
    overlap: bool = False
    enforce_eager: bool = False  # never capture CUDA graphs (vLLM's option)
    # Pad steady decode / verify steps to graph buckets with a fixed KV bound (graph_runner.py). None: on
    # for CUDA, where replay and eager must launch identical shapes; tests turn it on for CPU.
    graph_shapes: bool | None = None
    # Prompt and mixed steps of up to max_prefill_graph_tokens tokens replay CUDA graphs too, padded to row
    # and token buckets (graph_runner.py); each new (rows, tokens) bucket is captured on first use. None: on
    # for one CUDA device, as graph_shapes (enforce_eager then pads them alike but never captures); tensor
    # parallel keeps them off (its broadcast carries decode buckets only).
    prefill_graphs: bool | None = None
    # Larger prompt / mixed steps run eagerly. The default step budget: every step of a default engine replays
    # (an eager full-budget step of the embedded pair cost 22-34 ms of host launches, its graph 5-7 ms).
    max_prefill_graph_tokens: int = 2048
    # The share of the device's memory this process may use; the KV pool gets what weights and the
    # activation reserve leave of it (kv_budget.py). CUDA only, and only when num_pages is 0.
    gpu_memory_utilization: float = 0.9
    # Steady decode / verify steps run this many sub-steps per host iteration (vLLM's num_scheduler_steps):
    # the host plans, packs and launches once, the device advances each row's lengths itself between the
    # sub-steps, and the host then processes their outputs in order. The same tokens as one step at a time
    # for the same batches (arrivals wait for an iteration's end, so in bf16 a step may see another batch
    # and round differently); streams get them up to N steps at once. 1: every step is planned by the host.
    # "auto": `resolve_scheduler_steps` (8 for small models replaying CUDA graphs, else 1); the engine's
    # own config holds the resolved int.
    num_scheduler_steps: int | str = 1
    # Automatic prefix caching (vLLM's enable_prefix_caching): full pages of KV (target, index-K and the
    # draft head's) stay cached after their requests finish, keyed by their tokens, and a request whose
    # prefix is cached computes only the rest (scheduler.py, prefix_keys.py).
    enable_prefix_caching: bool = True
    # A draft tree (draft_tree.TreeSpec) instead of the chain: num_draft_tokens is then its node budget N
    # (each verify row carries N nodes); decode and prefill graphs, overlap (draft_tree.check_tree_engine).
    draft_tree: Any = None
    # Draft trees: a step of at most this many rows verifies the full tree, a larger one the first D nodes of
    # each (draft_tree.verify_width). None: chosen at startup (`_choose_tree_max_batch`) from the step costs of
    # the captured decode graphs, or from the tree's shape without graphs; the engine's config holds the choice.
    tree_max_batch: int | None = None
    # The deterministic mode (LLM(deterministic=True)): besides its batch-invariant kernels (the Ops), verification
    # is coupled to decoding without drafts (sampling/verify.py), so a seed gives the same tokens with any drafts.
    deterministic: bool = False
    # Structured output: mask the draft head with the grammar too (LLM(structured_draft_masks=True)). Drafts then
    # stay inside the grammar, which raises acceptance for a weak head, but each constrained step reads device
    # values back K+1 times as it drafts and runs eagerly. Off: drafts are proposed unmasked, the masked target
    # rejects what leaves the grammar, and constrained steps replay CUDA graphs without a read inside the step
    # (docs/design/structured-output.md).
    structured_draft_masks: bool = False


# num_scheduler_steps="auto" (opt-in). A replayed decode step of a model whose weights are a few hundred MB
# takes ~0.1-0.5 ms on an H200, about what the host's Python for one step takes (plan, pack, launch, copy
# back, process: 0.1-0.4 ms on the lent hosts), so on a slow host one plan per step leaves the GPU idle half
# the time (embedded pair, batch 1 K=3: 50% busy, 8,368 tok/s; with 8 sub-steps 97%, 14,488 tok/s). A
# model of a GiB or more streams its weights for longer than the host works, so it keeps one plan per
# step. The rule reads only the weights' size (never a timing), so a given model and config always takes
# the same iterations and the same tokens. Not the default: on a fast host it costs tok/s at larger batches
# (the embedded pair's batch-32 K=3 bench).
AUTO_SCHEDULER_STEPS = 8
AUTO_MAX_WEIGHT_BYTES = 2**30


def check_scheduler_steps(value: Any) -> None:
    """num_scheduler_steps must be "auto" or an int >= 1; the error names the option and the choices."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return
    raise ValueError(f"num_scheduler_steps={value!r} must be 'auto' or an int >= 1 (1: a host plan for every "
                     f"step; auto: {AUTO_SCHEDULER_STEPS} for models of up to {AUTO_MAX_WEIGHT_BYTES >> 20} MiB "
                     "replaying CUDA graphs, else 1)")


def max_scheduler_steps(value: int | str) -> int:
    """The most sub-steps an iteration may run under this setting (what to size a run's token budget for)."""
    check_scheduler_steps(value)
    return AUTO_SCHEDULER_STEPS if value == "auto" else int(value)


def resolve_scheduler_steps(value: int | str, device: torch.device, graphs: bool, weight_bytes: int) -> int:
    """The sub-steps per iteration an engine runs: an int as given; "auto" -> AUTO_SCHEDULER_STEPS on a CUDA
    device replaying graphs when the weights a step reads (target and head, this rank's share) are at most
    AUTO_MAX_WEIGHT_BYTES, else 1 (eager steps and CPU steps are slower than the host's part of them)."""
    check_scheduler_steps(value)
    if value != "auto":
        return int(value)
    small = weight_bytes <= AUTO_MAX_WEIGHT_BYTES
    return AUTO_SCHEDULER_STEPS if device.type == "cuda" and graphs and small else 1


def weight_bytes(*models: torch.nn.Module | None) -> int:
    """Bytes of the distinct parameters and buffers of `models` (a table two models share counts once)."""
    seen: dict[int, int] = {}
    for m in models:
        if m is None:
            continue
        for t in itertools.chain(m.parameters(), m.buffers()):
            seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
    return sum(seen.values())


@dataclass(frozen=True)
class EngineLoad:
    """Gauges as of the end of the last step (or abort): read from any thread without the engine lock."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable KV pages held (0..1)


class LLMEngine(OutputProcessor, Warmup):
    """Owns the scheduler, the page pool and the model runner; `step()` is the whole loop body. Its output
    processing (`_process_iteration`, `_deltas`, `_finish`, `_fail`) is inherited from `OutputProcessor`.

    Thread-safety: `step()` and the other state-changing methods take the engine's lock, so they never
    interleave. `add_request` does not wait for a running step: it validates, then queues the request in
    the intake (its own short lock). `abort` finishes the request at once when no step is running, else the
    running step applies it before returning. Fault tolerance: an exception raised while one request's
    output is processed (detokenization, say) finishes that request with finish_reason "error"; anything
    else raised inside `step()` -- KeyboardInterrupt included -- rolls the engine back to host truth
    (`_recover`) before it propagates, so the next call works."""

    def __init__(self, target, draft, tokenizer, cfg: EngineConfig, dtype: torch.dtype, device: torch.device,
                 ops: Ops | None = None, tp: TPGroup = SINGLE, driver=None):
        """`tp` / `driver`: tensor parallel (m3eagle.distributed). Rank 0 steps through `driver`, which
        broadcasts each step to the workers; a worker's engine only executes what rank 0 sends it."""
        for name in ("max_num_tokens", "max_num_seqs", "max_model_len", "page_size"):
            if getattr(cfg, name) < 1:
                raise ValueError(f"{name}={getattr(cfg, name)} must be >= 1")
        k = cfg.num_draft_tokens if draft is not None else 0
        if k and cfg.max_num_tokens < k + 1:
            raise ValueError(f"max_num_tokens={cfg.max_num_tokens} cannot hold one verify row of 1 + "
                             f"num_draft_tokens={k} tokens; raise max_num_tokens")
        self.cfg, self.k, self.tokenizer = cfg, k, tokenizer
        self.target_cfg = target.cfg
        # this rank's lightning-indexer heads (0: no sparse layer), for the warm-up's indexer merge variants
        self.index_heads = next((m.indexer.n_heads for m in target.modules() if getattr(m, "indexer", None) is not None),
                                0)
        self.device = device
        if not 0.0 < cfg.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={cfg.gpu_memory_utilization} must be in (0, 1]")
        check_scheduler_steps(cfg.num_scheduler_steps)
        if cfg.max_prefill_graph_tokens < 16:
            raise ValueError(f"max_prefill_graph_tokens={cfg.max_prefill_graph_tokens} must be >= 16 (the "
                             "smallest prefill-graph bucket); turn prefill graphs off with prefill_graphs=False")
        # Prefill graphs: on by default on one CUDA device (with enforce_eager too: eager pads as a replay would),
        # draft trees included (their narrow prompt / mixed steps take buckets of their own: GraphRunner.bucket).
        pg = cfg.prefill_graphs if cfg.prefill_graphs is not None else device.type == "cuda" and tp.size == 1
        num_pages = resolve_num_pages(replace(cfg, prefill_graphs=pg), target, draft if k else None, dtype,
                                      device, k, tp)
        replays = not cfg.enforce_eager and cfg.graph_shapes is not False  # graph-shaped steps replay graphs
        steps = resolve_scheduler_steps(cfg.num_scheduler_steps, device, replays,
                                        weight_bytes(target, draft if k else None))
        # The choices, so an engine built from this config agrees.
        cfg = self.cfg = replace(cfg, num_pages=num_pages, prefill_graphs=pg, num_scheduler_steps=steps)
        self.pool = PagePool(num_pages, cfg.page_size)
        self.table_width = pages_per_seq(cfg, k) + 1
        if self.table_width - 1 > self.pool.num_usable:
            raise ValueError(f"num_pages={num_pages} cannot hold one sequence of max_model_len="
                             f"{cfg.max_model_len} (needs {self.table_width - 1} pages of {cfg.page_size}); "
                             "raise num_pages or lower max_model_len")
        self.scheduler = Scheduler(self.pool, cfg.max_num_tokens, cfg.max_num_seqs, k, self.table_width - 1,
                                   cfg.enable_prefix_caching)
        self.ops = ops if ops is not None else make_ops("auto", "auto", device)
        # Projections that read the same input become one GEMM each (fewer launches per step); the weights
        # become views of the packed tensors, so nothing else changes.
        for model in (target, draft):
            if model is not None:
                pack_projections(model)
        # Step buffers hold the widest step: the token budget, or every sequence padded to 1 + K tokens;
        # with prefill graphs, a full-budget step plus a padding token for every row it may add, and one
        # row more than max_num_seqs (a step of every sequence still gets its padding row).
        max_tokens = max(cfg.max_num_tokens + (cfg.max_num_seqs + 1 if pg else 0), cfg.max_num_seqs * (k + 1))
        max_rows = cfg.max_num_seqs + int(pg)
        tree = cfg.draft_tree if k else None
        if tree is not None:
            check_tree_engine(tree, steps, tp.size)
        runner_cls, extra = (TreeModelRunner, {"tree": tree}) if tree is not None else (ModelRunner, {})
        self.runner = runner_cls(target, draft, k, num_pages, cfg.page_size, cfg.max_num_seqs, dtype, device,
                                 max_num_tokens=max_tokens, max_rows=max_rows,
                                 host_sets=2 * cfg.num_scheduler_steps, coupled=cfg.deterministic, **extra)
        # Constrained chain steps take their verify masks from a static buffer (a tokenizer to compile grammars
        # with, one rank: structured output is refused otherwise; a draft tree builds its masks inside the step).
        chain_masks = tokenizer is not None and tp.size == 1 and tree is None
        self.buffers = StepBuffers(max_tokens, max_rows, self.table_width, device,
                                   verify_masks=(k + 1, target.cfg.vocab_size) if chain_masks else None)
        graph_shapes = cfg.graph_shapes if cfg.graph_shapes is not None else device.type == "cuda"
        self.graphs = GraphRunner(self.runner, self.buffers, k, cfg.max_num_seqs, cfg.page_size, self.table_width,
                                  graphs=not cfg.enforce_eager, ops=self.ops, driver=driver,
                                  prefill=pg, prefill_cap=cfg.max_prefill_graph_tokens)
        self.graph_shapes = graph_shapes
        # Constrained steps that mask the draft head too (a draft tree's, structured_draft_masks') build those
        # masks inside the step, reading back: eager, and the previous step is processed before they are planned.
        self._masks_in_step = bool(k) and (tree is not None or cfg.structured_draft_masks)
        # the others replay masked graphs, so they are warmed
        self.graphs.masked_modes = chain_masks and not self._masks_in_step
        self.tp = tp
        if tree is not None:
            self.graphs.narrow = narrow_width(tree)
        if tp.is_driver:  # a worker captures when rank 0 tells it to, in rank 0's order
            self.graphs.capture_startup()
        if tree is not None:
            self._choose_tree_max_batch(tree)
        self.eos_ids = set(target.cfg.eos_token_ids)
        self._max_model_len = cfg.max_model_len  # read into each request's StopConditions
        self._ids = itertools.count()
        # Under overlap, the iteration launched last: its plan and one output per sub-step.
        self._pending: tuple[ScheduledBatch, list[StepOutput]] | None = None
        self._steady = False  # the last iteration's rows all continued from slot buffers (no prompt rows)
        self._lock = threading.RLock()  # the step lock
        # Intake, guarded by its own lock so that adding or aborting never waits for a step:
        # - _live: every unfinished request by id (intake, waiting or running); finished requests are
        #   handed back by one delta of step() and forgotten, so nothing grows in a long-lived process;
        # - _intake: added, not yet seen by the scheduler (drained at the top of step());
        # - _aborts: aborts that arrived while a step was running (applied before that step returns).
        self._intake_lock = threading.Lock()
        self._live: dict[str, Request] = {}
        self._groups: dict[str, RequestGroup] = {}  # unfinished groups of n > 1 samples, by the user's id
        self._intake: deque[Request] = deque()
        self._aborts: list[tuple[Request, str | None]] = []
        # Requests changed since the last step() returned (each gets one delta), in order of change.
        self._touched: dict[str, Request] = {}
        self.counters = SpecCounters(accept_hist=[0] * (k + 1))
        # Triton compiles after the warm-up (CUDA; see _first_use_compile) and the hook's remover.
        self.first_use_compiles = 0
        self._unwatch_compiles = None
        # Structured output: the compiler (built on first use, from the tokenizer) and the ids of the live
        # constrained requests; while there are any, steps wait for the previous step's tokens (`_step`).
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._constrained: set[str] = set()
        self._load = EngineLoad()
        self.num_steps = 0  # device steps launched (each sub-step of a multi-step iteration counts)
        self.num_iterations = 0  # host iterations that launched steps (< num_steps with num_scheduler_steps > 1)
        # Who steps this engine when not the caller of LLM.generate: the server's engine thread sets it while
        # it runs (it alone may call step(); deltas of requests it does not know are dropped).
        self.owner: str | None = None
        self.sync_debug = False  # on CUDA: run execute() under torch.cuda.set_sync_debug_mode("error")
        # Steady rows of a step without logprobs take `_process_plain`'s tight path; tests turn it off to hold
        # it equal to the per-row path (tests/engine/test_host_fast_paths.py).
        self.fast_paths = True

    def _choose_tree_max_batch(self, tree: TreeSpec) -> None:
        """The batch size up to which steps verify the full tree: the config's, else the largest graph bucket up to
        which a replay of the full-tree step costs at most the shape's expected MAL gain times the narrow step's
        (both timed once here, on the graphs capture_startup made), else the shape rule (CPU, graphs off). Timed
        once at startup and then fixed, so a request's tokens never depend on a timing of its own steps."""
        value, source = self.cfg.tree_max_batch, "set"  # validated by Runtime
        if value is None:
            costs = self.graphs.step_costs() if self.graph_shapes else {}
            if costs:
                value, source = tree_max_batch_from_costs(costs, expected_gain(tree)), "measured"
                log.info("draft tree %s: step costs (full, narrow) ms per bucket %s; expected MAL gain %.3f", tree,
                         {b: (round(f * 1e3, 3), round(n * 1e3, 3)) for b, (f, n) in costs.items()},
                         expected_gain(tree))
            else:
                value, source = tree_max_batch_from_shape(tree), "shape rule"
        self.cfg = replace(self.cfg, tree_max_batch=value)
        self.scheduler.tree_max_batch = self.graphs.tree_max_batch = value
        self.scheduler.narrow_drafts = narrow_width(tree)
        log.info("draft tree %s: steps of up to %d rows verify the full tree, larger ones its first %d nodes (%s)",
                 tree, value, narrow_width(tree), source)

    # ---- requests -----------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()  # again: its fields may have been changed since it was built
        if not isinstance(prompt_ids, list) or any(type(t) is not int for t in prompt_ids):
            raise RequestError("prompt token ids must be a list of int (use prompt_token_ids() to convert "
                               f"numpy or torch ids), got {type(prompt_ids).__name__}")
        if len(prompt_ids) == 0:
            raise RequestError("the prompt is empty; give at least one token")
        if len(prompt_ids) >= self.cfg.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens but max_model_len="
                               f"{self.cfg.max_model_len} leaves no room to generate; shorten the prompt or "
                               "raise max_model_len")
        v = self.target_cfg.vocab_size
        bad = [t for t in prompt_ids if t < 0 or t >= v]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {v})")
        if params.stop and self.tokenizer is None:
            raise RequestError(f"stop={params.stop!r} needs a tokenizer to detokenize, and this model directory has "
                               "no tokenizer.json; add one or use stop_token_ids")
        bad = [t for t in params.stop_token_ids if t >= v]
        if bad:
            raise RequestError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {v})")
        if params.n > self.cfg.max_num_seqs:
            raise RequestError(f"n={params.n} samples cannot run together with max_num_seqs={self.cfg.max_num_seqs}; "
                               "lower n or raise max_num_seqs")
        if params.structured_outputs is not None:
            self.compile_grammar(params)

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled grammar of params.structured_outputs (cached by spec); RequestError naming the field
        when it cannot be compiled or this engine cannot constrain (no tokenizer, tensor parallel)."""
        if self.tokenizer is None:
            raise RequestError("structured_outputs needs the model's tokenizer.json (grammars are over text), and "
                               "this model directory has none")
        if self.tp.size > 1:
            raise RequestError("structured_outputs is not available with tensor_parallel_size > 1 (the masks are "
                               "not broadcast to the workers); serve constrained requests with one GPU")
        with self._compiler_lock:  # construction only: compiles run outside it (GrammarCompiler guards its cache)
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer.tok, self.target_cfg.vocab_size,
                                                 sorted(self.eos_ids))
        try:
            return self._compiler.compile(params.structured_outputs)
        except GrammarError as e:
            raise RequestError(str(e)) from None

    def add_request(self, prompt_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, stream_text: bool = True) -> Request:
        """Validate, then queue in the intake. Nothing is admitted before every check has passed. Safe from
        any thread; it never waits for a running step. stream_text=False: the caller reads the text only
        from the finished output (LLM.generate), so a request without stop strings is detokenized once at
        the end instead of token by token (its deltas carry no text until the last)."""
        self.validate(prompt_ids, params)
        compiled = self.compile_grammar(params) if params.structured_outputs is not None else None
        if request_id is not None and not isinstance(request_id, str):
            raise RequestError(f"request_id={request_id!r} must be a str")
        with self._intake_lock:
            if request_id in self._live or request_id in self._groups:
                raise RequestError(f"request_id={request_id!r} is already in use by an unfinished request; "
                                   "give a unique id or None")
            n = next(self._ids)
            rid = request_id or f"req-{n}"
            while rid in self._live or rid in self._groups:  # an auto id taken by a caller's explicit id
                rid = f"req-{n}-{next(self._ids)}"
            group = RequestGroup(rid) if params.n > 1 else None
            seed = params.seed if params.seed is not None else random.getrandbits(31)
            for i in range(params.n):
                # Sample i's stream: reproducible from the seed, distinct per sample; sample 0 is what n=1 gives.
                seed_i = sample_seed(seed, i) if params.seed is not None or i == 0 else random.getrandbits(31)
                req = Request(rid if i == 0 else f"{rid}#{i}", list(prompt_ids), params, seed_i, n, prompt,
                              index=i, group=group)
                req.proj_known = req.num_known
                req.draft_hist, req.accept_hist = [0] * (self.k + 1), [0] * (self.k + 1)
                if self.tokenizer is not None and not stream_text and not params.stop:
                    req.detok = FinalTextDetokenizer(self.tokenizer)
                elif self.tokenizer is not None:
                    req.detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
                else:
                    req.text = None
                # Read once here (params changed in place later are not seen, as for the sampling constants).
                if compiled is not None:  # each sample has its own matcher
                    req.grammar = self._compiler.matcher(compiled)
                    self._constrained.add(req.request_id)
                req.stops = StopConditions.of(params, len(prompt_ids), self._max_model_len, self.eos_ids,
                                              (req.detok is not None and bool(req.detok.stop)) or compiled is not None)
                if group is not None:
                    group.members.append(req)
                self._live[req.request_id] = req
                self._intake.append(req)
            if group is not None:
                self._groups[rid] = group
            return group.members[0] if group is not None else req

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Finish an unfinished request ("abort", or "error" with `error`); unknown or finished ids are
        ignored. Safe from any thread: with no step running it happens now (its pages are free when this
        returns); otherwise the running step applies it before it returns. Its last delta comes from the
        next step()."""
        with self._intake_lock:
            group = self._groups.get(request_id)
            reqs = [r for r in group.members if not r.finished] if group is not None else \
                [r for r in [self._live.get(request_id)] if r is not None]
            if not reqs:
                return
            if not self._lock.acquire(blocking=False):
                self._aborts += [(r, error) for r in reqs]
                return
        try:
            for req in reqs:
                self._abort(req, error)
            self._publish_load()
        finally:
            self._lock.release()

    def _abort(self, req: Request, error: str | None) -> None:
        if req.finished:
            return
        if error is not None:
            self._fail(req, error)
        else:
            self._finish(req, "abort")

    def has_work(self) -> bool:
        """Requests to run, or a step in flight."""
        with self._lock:
            return bool(self._intake) or self.scheduler.has_work() or self._pending is not None

    def request_ids(self) -> list[str]:
        """Ids of every unfinished request (intake, waiting, running); from any thread."""
        with self._intake_lock:
            return list(self._live)

    def has_output(self) -> bool:
        """Deltas waiting for the next step() to hand them out (an abort made between steps, say)."""
        return bool(self._touched)

    def load(self) -> EngineLoad:
        """Running / waiting counts and KV usage, from any thread (no lock): the last step's snapshot, with
        requests still in the intake counted as waiting."""
        ld = self._load
        return EngineLoad(ld.num_running, ld.num_waiting + len(self._intake), ld.kv_cache_usage)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """One iteration; returns a delta for every request that changed since the last step() returned
        (new tokens or text, or finished). A finished request gets its last delta exactly once and is then
        forgotten."""
        with self._lock:
            try:
                self._admit()
                self._step()
                self._admit()  # aborts that arrived during the step free their pages before it returns
            except BaseException:
                self._recover()
                raise
            return self._collect()

    def _admit(self) -> None:
        """Drain the intake into the scheduler (FCFS) and apply the aborts queued during a step."""
        with self._intake_lock:
            new, self._intake = list(self._intake), deque()
            aborts, self._aborts = self._aborts, []
        for req in new:
            if not req.finished:  # aborted while in the intake
                self.scheduler.add(req)
        for req, error in aborts:
            self._abort(req, error)

    def _collect(self) -> list[RequestDelta]:
        touched, self._touched = list(self._touched.values()), {}
        self._publish_load()
        return self._deltas(touched)

    def _forget(self, req: Request) -> None:
        with self._intake_lock:
            self._live.pop(req.request_id, None)
            self._constrained.discard(req.request_id)
            if req.group is not None and req.group.finished:
                self._groups.pop(req.group.request_id, None)

    def _publish_load(self) -> None:
        sched = self.scheduler
        running = len(sched.running) - [r.status for r in sched.running].count(Status.FINISHED)
        used = 1.0 - self.pool.num_free / self.pool.num_usable if self.pool.num_usable else 0.0
        self._load = EngineLoad(running, sched.num_waiting, max(0.0, used))

    def _step(self) -> None:
        # After a step with prompt rows, one sub-step first: under overlap the previous step's outputs (a
        # prompt's first token) are processed once this iteration is launched, and launching N replays
        # first holds them back by N launches (H200, embedded pair, batch 1 with 8: first token 0.7 ms with
        # one step per plan, 1.8-1.9 without this, 0.8-0.9 with it). The plan still depends on the schedule
        # alone.
        # A constrained request's masks need its accepted tokens and the drafts its next row verifies, so while one
        # is live the previous step is processed before the masks are built (one step per plan): a wait on the
        # event of its outputs' asynchronous copy, as overlap's processing is, never a read inside a step. A chain
        # step plans and launches its target forward first and processes the previous step while that runs
        # (`_launch_masked`); a draft tree's or structured_draft_masks' step builds masks inside the step from
        # what the previous one left, so it processes that one before planning. Without a live constrained request
        # the overlap runs ahead as before (docs/design/structured-output.md).
        constrained = bool(self._constrained)
        if constrained and self._pending is not None and self._masks_in_step:
            self._drain()
        steps = self.cfg.num_scheduler_steps if self._steady and not constrained else 1
        try:
            batch = self.scheduler.schedule(steps)
        except NeedSync:
            self._drain()
            batch = self.scheduler.schedule(steps)
        if not batch.rows:
            if self._pending is not None:
                self._drain()
            elif (req := self.scheduler.head()) is not None:
                # Nothing runs and the oldest waiting request still does not fit: it never will. Fail it
                # alone; the others keep their turn.
                self._fail(req, f"request {req.request_id} ({req.num_known} tokens) cannot be scheduled: the KV "
                           f"pool has {self.pool.num_usable} pages of {self.cfg.page_size}; raise num_pages")
            return
        if self.cfg.num_scheduler_steps > 1:  # (one step per plan never reads it: no loop over rows then)
            self._steady = all(r.gather for r in batch.rows)  # every row continues from the slot buffers
        # A constrained sampling row: the host builds its verify masks from the drafts it verifies (kept from the
        # previous step's output) into the step's static mask buffer; the step then reads nothing back and
        # replays a masked graph. A draft tree, or the structured_draft_masks option, masks the head too: that
        # step reads back as it drafts (its GrammarStep rides in inp.grammar) and runs eagerly.
        masked = host_half = False
        if constrained and any(r.samples and r.req.grammar is not None for r in batch.rows):
            masked = not (self.k and self.cfg.draft_tree is not None)
            host_half = self._masks_in_step
        bucket = self.graphs.bucket(batch, masked) if self.graph_shapes and not host_half else None
        self.graphs.ensure(batch, bucket, masked)
        inp = self.graphs.build(batch, bucket, masked)
        # A multi-step iteration runs the same inputs batch.steps times: each sub-step's commit advances the
        # rows' lengths in the input buffer on the device (ModelRunner.execute), and each is folded into the
        # host's projection like a step of its own (all drafts accepted).
        self.scheduler.commit(batch, batch.steps)
        if masked and not host_half:
            outs = [self._launch_masked(batch, inp, bucket)]
        else:
            if host_half:
                inp.grammar = self._grammar_step(batch)
                if masked:
                    self.buffers.masks.upload(inp.num_rows, inp.grammar.fill_verify)
            outs = [self.runner.to_host(self._execute(inp, bucket)) for _ in range(batch.steps)]
        self.num_steps += batch.steps
        self.num_iterations += 1
        if self.cfg.overlap:
            pending, self._pending = self._pending, (batch, outs)
            if pending is not None:
                self._process_iteration(*pending)
        else:
            self._process_iteration(batch, outs)

    def _launch_masked(self, batch: ScheduledBatch, inp, bucket: Any) -> StepOutput:
        """A constrained chain step in two launches: the target forward (it reads no mask), then -- while it runs
        -- the previous step's outputs processed (matchers and drafts up to date) and this step's masks built and
        uploaded, then the finish (logits, masks, verification, commit, drafts). The step's drafts come back
        with its tokens: the next step's masks walk them."""
        with self._sync_checked(inp):
            hand = self.graphs.forward(inp, bucket)
        self._drain()
        grammar = self._grammar_step(batch)
        self.buffers.masks.upload(inp.num_rows, grammar.fill_verify)  # [B * (K+1), W], non-blocking
        with self._sync_checked(inp):
            out = self.graphs.finish(inp, bucket, hand)
        return self.runner.to_host(out, self.k > 0)

    def _grammar_step(self, batch: ScheduledBatch) -> GrammarStep:
        """The host half of a constrained step's masks, its matchers brought to the outputs processed so far."""
        if self.k and self.cfg.draft_tree is not None:
            return TreeGrammarStep(batch.rows, len(batch.rows), self.target_cfg.vocab_size, self.device)
        return GrammarStep(batch.rows, len(batch.rows), self.k, self.target_cfg.vocab_size, self.device)

    @contextlib.contextmanager
    def _sync_checked(self, inp) -> Iterator[None]:
        """Under sync_debug on CUDA, a host sync inside the block raises. A step with a host half (a draft tree's
        grammar, structured_draft_masks) reads back by design; every other step -- constrained chain steps
        included -- must not."""
        on = self.sync_debug and self.device.type == "cuda" and inp.grammar is None
        if on:
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            if on:
                torch.cuda.set_sync_debug_mode(0)

    def _execute(self, inp, bucket: int | None) -> StepOutput:
        with self._sync_checked(inp):
            return self.graphs.run(inp, bucket)

    def _drain(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._process_iteration(*pending)

    # ---- prefix cache ---------------------------------------------------------------------------
    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache at admission, so far (vLLM's counter)."""
        return self.scheduler.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, tokens found cached (vLLM's counter)."""
        return self.scheduler.prefix_cache_hits

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page (vLLM's reset_prefix_cache): later requests recompute their prefixes.
        Pages that running requests hold stay theirs. Safe from any thread; True once done."""
        with self._lock:
            self.scheduler.reset_prefix_cache()
        return True

    def run(self) -> list[RequestOutput]:
        """Step until idle; returns the outputs of the requests that finished meanwhile."""
        done: list[RequestOutput] = []
        while self.has_work() or self.has_output():
            done += [d.output for d in self.step() if d.output is not None]
        return done

    # ---- fault recovery -------------------------------------------------------------------------
    def _recover(self) -> None:
        """Roll back to host truth after a fault anywhere in a step.

        Host truth is each request's accepted tokens (prompt + output_token_ids); everything else -- KV
        pages, device slots, rows in flight, a half-made plan -- is derived and can be dropped. So every
        unfinished request goes back to waiting (FCFS by arrival) to be recomputed, exactly as a
        preemption would, every finished one lets go of what it held, and the pool and slot list start
        over. A step that was in flight on the device writes only pages that later steps overwrite
        (one stream, in order), so no device state needs undoing. The prefix cache starts empty too: what
        a faulted step left in a page is not trusted."""
        sched = self.scheduler
        with self._intake_lock:  # the intake is untouched by a step: its requests stay there
            queued = {id(r) for r in self._intake}
            live = [r for r in self._live.values() if id(r) not in queued]
        reqs = {id(r): r for r in [*live, *sched.queued()]}.values()
        for req in reqs:
            req.inflight_rows.clear()
            req.pages, req.slot, req.pending_free, req.slot_valid = [], -1, False, False
            req.fork_src, req.fork_len, req.num_registered = None, 0, 0
            req.num_computed = req.proj_computed = 0
            req.proj_known = req.num_known
            if not req.finished:
                req.status = Status.WAITING
        unfinished = sorted((r for r in reqs if not r.finished), key=lambda r: r.arrival)
        with self._intake_lock:  # repair the live table too: exactly the unfinished requests
            for r in reqs:
                if r.finished and self._live.get(r.request_id) is r:
                    del self._live[r.request_id]
            for r in unfinished:
                self._live.setdefault(r.request_id, r)
            for gid in [g for g, grp in self._groups.items() if grp.finished]:
                del self._groups[gid]
        sched.reset(unfinished)
        self.pool.reset()
        self._pending = None
        with self._intake_lock:
            self._constrained &= set(self._live)
        self._publish_load()
        log.warning("engine rolled back after a fault: %d unfinished requests will be recomputed", len(unfinished))

    # ---- checks -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every piece of engine state agrees with every other (tests call this after runs and faults):
        each unfinished request sits in exactly one queue with a status to match; waiting requests hold
        no pages, slot or rows in flight; slots are each held once or free; no page is leaked or owned
        twice; rows in flight exist only while a step is pending. Raises AssertionError naming the fault."""
        with self._lock:
            sched = self.scheduler
            with self._intake_lock:
                intake, live = list(self._intake), dict(self._live)
            waiting, running = intake + list(sched.waiting), list(sched.running)
            ids = [id(r) for r in waiting + running]
            if len(ids) != len(set(ids)):
                raise AssertionError("a request is queued twice (intake, waiting and/or running)")
            for rid, r in live.items():
                if r.finished or rid != r.request_id:
                    raise AssertionError(f"live table holds {rid!r} ({r.status}) wrongly")
                if id(r) not in set(ids):
                    raise AssertionError(f"request {rid!r} is unfinished but in no queue (lost)")
            for r in waiting:
                if r.status is not Status.WAITING or r.pages or r.slot >= 0 or r.inflight_rows:
                    raise AssertionError(f"waiting request {r.request_id!r} holds state: status={r.status}, "
                                         f"pages={r.pages}, slot={r.slot}, rows in flight={r.inflight}")
                if live.get(r.request_id) is not r:
                    raise AssertionError(f"waiting request {r.request_id!r} is not live")
            for r in running:
                if r.finished and not (r.pending_free and r.inflight):
                    raise AssertionError(f"finished request {r.request_id!r} still holds pages/slot with nothing "
                                         "in flight")
                if not r.finished and (r.status is not Status.RUNNING or live.get(r.request_id) is not r):
                    raise AssertionError(f"running request {r.request_id!r} has status {r.status} / not live")
                if r.slot < 0:
                    raise AssertionError(f"running request {r.request_id!r} has no slot")
            held = [r.slot for r in running]
            slots = held + list(sched.free_slots)
            if sorted(slots) != list(range(self.cfg.max_num_seqs)):
                raise AssertionError(f"slots held {sorted(held)} + free {sorted(sched.free_slots)} != "
                                     f"0..{self.cfg.max_num_seqs - 1} (leaked or doubled)")
            if self._pending is None and any(r.inflight_rows for r in running):
                raise AssertionError("rows in flight but no step pending")
            self.pool.check_integrity(sched.table_snapshot())

    def is_idle_and_clean(self) -> bool:
        return (not self.has_work() and not self._live and self.pool.num_free == self.pool.num_usable
                and len(self.scheduler.free_slots) == self.cfg.max_num_seqs)
