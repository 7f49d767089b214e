"""A loaded model on this process's rank: its weights (this rank's shard), tokenizer and engine, built from a
checkpoint directory, a config with random weights or the embedded model, and `generate` over it.

`Runtime` is the engine layer's offline API: `m3eagle.LLM` (entrypoints/llm.py) is a Runtime with the chat
template on top, the benchmarks and the training pipeline use a Runtime directly, and a tensor-parallel
worker process builds the same class as its rank (executor.py spawns it by reference, never importing the
entrypoints)."""

from __future__ import annotations

import atexit
import logging
import numbers
import sys
import threading
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from m3eagle.config import M3Config
from m3eagle.distributed.parallel_state import SINGLE, TPGroup
from m3eagle.engine import executor as launch
from m3eagle.engine.draft_tree import TreeSpec
from m3eagle.engine.llm_engine import EngineConfig, LLMEngine, RequestError, check_scheduler_steps
from m3eagle.engine.request import RequestOutput
from m3eagle.kernels.ops import make_ops
from m3eagle.loader.assets import default_model_paths
from m3eagle.loader.checkpoint import load_config, load_target
from m3eagle.loader.dummy import LOAD_FORMATS, dummy_eagle3, dummy_target, eagle3_config, target_config
from m3eagle.loader.eagle3 import load_eagle3, share_target_weights
from m3eagle.loader.hub import resolve_checkpoint
from m3eagle.loader.tokenizer import load_tokenizer as _load_tokenizer
from m3eagle.models.eagle3 import Eagle3Config
from m3eagle.models.minimax_m3 import MiniMaxM3
from m3eagle.models.quant import quantize_online
from m3eagle.sampling.params import SamplingParams

log = logging.getLogger("m3eagle")

QUANTIZATIONS = (None, "fp8")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


class Runtime:
    """A loaded model and its engine (m3eagle.LLM is this class with the chat template on top).

    model: a checkpoint directory (config.json + safetensors [+ tokenizer.json]) or a Hugging Face Hub id
    ("MiniMaxAI/MiniMax-M3": its cached snapshot, downloaded when online; HF_HUB_OFFLINE=1 reads the cache
    only); None uses the embedded model and its Eagle3 head. draft: an Eagle3 head directory (or Hub id);
    num_draft_tokens: K (1..8; 0 = off). draft_tree: "D,K,N" drafts a dynamic tree instead of the chain (depth D,
    the K best children per expanded node, N nodes verified; docs/design/speculative.md); overlap off unless asked.
    tree_max_batch: steps of at most this many rows verify the full tree, larger ones its first D nodes (None: chosen
    at startup from the captured graphs' step costs, or from the tree's shape without graphs).
    overlap: None = on for CUDA, off for CPU. attention_backend / moe_backend / fused_backend (norms, RoPE,
    activations, router): 'auto' (triton on CUDA, reference on CPU) | 'reference' | 'triton'.
    enforce_eager: never capture CUDA graphs (they are on by default on CUDA).
    warmup: before returning, capture every CUDA-graph bucket x mode and run dummy prompts of every chunk class
    and sampling path through the engine (LLMEngine.warmup), so first-use compiles and captures happen at
    startup, not in the middle of serving.
    graph_shapes: pad steady decode steps to graph buckets (None: on for CUDA; True on CPU for tests).
    prefill_graphs: prompt and mixed steps of up to max_prefill_graph_tokens tokens (2048) replay CUDA graphs
    too, padded to row and token buckets, each captured on first use (None: on for one CUDA device; False:
    they run eagerly). Padded steps round like their bucket in bf16, as decode buckets do.
    num_scheduler_steps: N > 1 runs steady decode / verify steps N at a time per host iteration (vLLM's
    multi-step scheduling): one plan, one input copy and N graph replays, the device advancing each row's
    lengths between them; the host then processes the N outputs. Same tokens as N = 1; streamed output
    arrives up to N steps at a time, and the last steps before a request's length limit run one at a time.
    For host-bound batches (small models, many rows). Under tensor parallelism rank 0 broadcasts each sub-step.
    'auto': 8 when CUDA graphs replay a model whose weights (target and head, per rank) are at most 1 GiB --
    its steps are about as short as the host's Python for them -- else 1 (engine.cfg holds the choice; a rule
    on the weights' size, never on timings, so a model always takes the same iterations).
    load_format: 'auto' reads the checkpoints; 'dummy' builds random seeded weights on the device from the
    configs alone (vLLM's dummy format, for benchmarks) -- then model / draft may also be an M3Config /
    Eagle3Config or a config.json dict.
    tokenizer: a directory holding tokenizer.json to use instead of the model directory's own (vLLM's
    `tokenizer=`): a config-only model (load_format='dummy') gets text in and out through it.
    quantization: None serves the checkpoint's weights as stored (the MXFP8 release stays MXFP8 on the device and
    runs the W8A16 kernels); 'fp8' quantizes a bf16 / fp32 target to the same MXFP8 layout at load (the decoder
    layers' projections and experts; embeddings, lm_head, routers, norms and the draft head stay as they are).
    enable_prefix_caching: keep full pages of KV (the target's, index-K and the draft head's) cached after
    their requests finish and let a request with the same prefix compute only the rest (vLLM's option, on
    by default); RequestOutput.num_cached_tokens says how many prompt tokens a request found.
    tensor_parallel_size: N > 1 splits the target over N ranks (attention heads, MLPs, vocabulary; experts
    expert-parallel; the Eagle3 head replicated). This process is rank 0 and spawns N-1 workers, one per
    GPU (cuda:0..N-1), or joins a torchrun group when RANK / WORLD_SIZE are set (docs/design/parallel.md). Call
    shutdown() to stop the workers (done at exit too).
    deterministic: every kernel computes each row in an order that does not depend on the batch, its chunking
    or its verify count ('auto' backends become 'batch_invariant' on CUDA; docs/design/deterministic.md), so
    greedy speculative output equals plain output and a request's output is the same alone or in any batch,
    in bf16 on the GPU too; under tensor parallelism the ranks' partial sums are added in rank order. Not with
    MXFP8 weights.
    structured_draft_masks: constrained requests (structured output) mask the draft head with their grammar too,
    so drafts stay inside it: higher acceptance for a weak draft head, but each constrained step reads device
    values back K+1 times as it drafts and runs eagerly. Off (the default): drafts are proposed unmasked, the
    grammar-masked target rejects the ones it refuses (the output is the same either way), and constrained
    steps replay CUDA graphs with no host read inside the step (docs/design/structured-output.md)."""

    def __init__(self, model: str | Path | M3Config | dict | None = None,
                 draft: str | Path | Eagle3Config | dict | None = None,
                 num_draft_tokens: int | None = None, dtype: str | torch.dtype = "auto",
                 device: str | None = None, page_size: int = 16, max_num_tokens: int = 2048,
                 max_model_len: int | None = None, max_num_seqs: int = 64, num_pages: int = 0,
                 overlap: bool | None = None, attention_backend: str = "auto", load_format: str = "auto",
                 moe_backend: str = "auto", enforce_eager: bool = False, graph_shapes: bool | None = None,
                 fused_backend: str = "auto", tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.9, warmup: bool = False, prefill_graphs: bool | None = None,
                 max_prefill_graph_tokens: int = 2048, num_scheduler_steps: int | str = 1,
                 quantization: str | None = None, enable_prefix_caching: bool = True,
                 tokenizer: str | Path | None = None, draft_tree: str | tuple | None = None,
                 deterministic: bool = False, tree_max_batch: int | None = None,
                 structured_draft_masks: bool = False,
                 _worker: tuple[int, int, str] | None = None):
        # What a spawned worker needs to build its rank of this same LLM (_worker: its rank, size, rendezvous).
        spawn_kwargs = {k: v for k, v in locals().items() if k not in ("self", "_worker")}
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device; use device='cpu'")
        self.device = dev
        self.dtype = _resolve_dtype(dtype, dev)
        if model is None:
            model, default_draft = default_model_paths()
            if draft is None and num_draft_tokens != 0:
                draft = default_draft
        tree = None
        if draft_tree is not None:  # a tree's verify rows carry its node budget N as their drafts
            tree = TreeSpec.parse(draft_tree)
            if num_draft_tokens is not None:
                raise ValueError(f"num_draft_tokens={num_draft_tokens!r} and draft_tree='{tree}': pass one (the chain "
                                 "of K drafts, or the tree)")
            if draft is None:
                raise ValueError(f"draft_tree='{tree}' needs a draft head: pass draft=DIR (an Eagle3 checkpoint)")
            if overlap is None:
                overlap = False
        if tree_max_batch is not None and (tree is None or not isinstance(tree_max_batch, int)
                                           or isinstance(tree_max_batch, bool) or tree_max_batch < 0):
            raise ValueError(f"tree_max_batch={tree_max_batch!r} needs draft_tree= and an int >= 0 (the largest batch "
                             "that verifies the full tree; 0: never) or None (chosen at startup)")
        self._tree_max_batch = tree_max_batch
        if num_draft_tokens is None:
            num_draft_tokens = tree.nodes if tree is not None else (3 if draft is not None else 0)
        elif not isinstance(num_draft_tokens, int) or not 0 <= num_draft_tokens <= 8:
            raise ValueError(f"num_draft_tokens={num_draft_tokens!r} must be an int in 0..8 (0 disables "
                             "speculation)")
        if num_draft_tokens > 0 and draft is None:
            raise ValueError(f"num_draft_tokens={num_draft_tokens} needs a draft head: pass draft=DIR "
                             "(an Eagle3 checkpoint) or num_draft_tokens=0")
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        check_scheduler_steps(num_scheduler_steps)
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={enable_prefix_caching!r} must be True or False")
        self.enable_prefix_caching = enable_prefix_caching
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={quantization!r}: choose None (the checkpoint's own weights: an MXFP8 "
                             "release stays MXFP8) or 'fp8' (quantize a bf16 checkpoint to MXFP8 at load)")
        self.quantization = quantization
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={load_format!r}: choose 'auto' (read the checkpoint) or 'dummy' "
                             "(random weights built on the device)")
        if load_format == "auto" and not all(isinstance(x, (str, Path)) for x in (model, draft or "")):
            raise ValueError("model= / draft= given as a config has no weights to read: pass checkpoint "
                             "directories, or load_format='dummy' for random weights")
        # a Hub repository id ("MiniMaxAI/MiniMax-M3") becomes its local snapshot (cache, or a download)
        if isinstance(model, (str, Path)):
            model = resolve_checkpoint(model, "model")
        if isinstance(draft, (str, Path)) and num_draft_tokens > 0:
            draft = resolve_checkpoint(draft, "draft")
        self.model_path = Path(model) if isinstance(model, (str, Path)) else None
        self.tokenizer_path = Path(tokenizer) if tokenizer is not None else self.model_path
        if tokenizer is not None and not (self.tokenizer_path / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer={str(tokenizer)!r}: no tokenizer.json there; pass a directory holding one "
                             "(none: the model directory's own)")
        if not isinstance(deterministic, bool):
            raise ValueError(f"deterministic={deterministic!r} must be True or False")
        if deterministic and quantization is not None:
            raise ValueError(f"deterministic=True with quantization={quantization!r}: the batch-invariant kernels "
                             "take bf16 / fp16 / fp32 weights, not MXFP8; drop one of the two")
        self.deterministic = deterministic
        if not isinstance(structured_draft_masks, bool):
            raise ValueError(f"structured_draft_masks={structured_draft_masks!r} must be True or False")
        self.structured_draft_masks = structured_draft_masks
        # This LLM's own fast paths (no module global): built before the weights so a bad name fails fast.
        self.ops = make_ops(attention_backend, moe_backend, dev, fused_backend, deterministic)
        self._driver: launch.Driver | None = None
        self.tp: TPGroup = SINGLE
        if tensor_parallel_size != 1 or _worker is not None:
            dev = self._join_group(tensor_parallel_size, model, load_format, dev, spawn_kwargs, _worker)
            self.device = dev
        try:
            self._build(model, draft, num_draft_tokens, load_format, dev, page_size, max_num_tokens, max_model_len,
                        max_num_seqs, num_pages, overlap, enforce_eager, graph_shapes, gpu_memory_utilization,
                        prefill_graphs, max_prefill_graph_tokens, num_scheduler_steps, tree)
        except BaseException:
            self.shutdown()
            raise
        if not self.tp.is_driver:  # a worker rank: serve rank 0's steps until it stops the group
            try:
                launch.serve(self.engine, lambda: self._plain_engine(None))
            finally:
                launch.leave_group(launch.LEAVE_TIMEOUT_S)  # a stuck teardown must not keep the worker alive
            if _worker is None:  # torchrun: this process's whole job was to serve rank 0
                raise SystemExit(0)
            return
        self._log_loaded(model, draft, load_format)
        if warmup:
            self.engine.warmup()
        self._stats = SpecStats(self.config.num_draft_tokens)
        self._lock = threading.RLock()  # one generate() at a time: the engine loop is not re-entrant

    def _join_group(self, size: int, model: Any, load_format: str, dev: torch.device, spawn_kwargs: dict[str, Any],
                    worker: tuple[int, int, str] | None) -> torch.device:
        """Become one rank of a tensor-parallel group: a spawned worker, a torchrun rank, or rank 0 spawning its
        workers. Returns this rank's device. User errors are raised before anything is spawned."""
        env = launch.torchrun_env() if worker is None else None
        if worker is not None:
            rank, size, init = worker
            local = rank
        else:
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"tensor_parallel_size={size!r} must be an int >= 1")
            cfg = target_config(model) if load_format == "dummy" else load_config(self.model_path)
            with torch.device("meta"):
                MiniMaxM3(cfg, TPGroup(rank=0, size=size))  # raises TPError when size does not divide the model
            if env is not None:  # torchrun: one process per GPU, maybe several hosts
                rank, world, local = env
                if world != size:
                    raise ValueError(f"tensor_parallel_size={size} but torchrun started WORLD_SIZE={world} "
                                     "processes; make them equal (one process per GPU)")
                init = "env://"
            else:
                if dev.type == "cuda" and size > torch.cuda.device_count():
                    raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs but torch sees "
                                     f"{torch.cuda.device_count()}; lower tensor_parallel_size")
                rank = local = 0
                init = launch.free_tcp_address()
        dev = launch.rank_device(dev, local, size)
        workers = launch.Workers(size, init, type(self), spawn_kwargs) if worker is None and env is None else None
        try:
            self.tp = launch.init_group(rank, size, init, dev, self.deterministic)
        except BaseException:
            if workers is not None:
                workers.stop(wait_s=1.0)
            raise
        if rank == 0:
            self._driver = launch.Driver(self.tp, workers)
            self._finalizer = weakref.finalize(self, self._driver.shutdown)
            # Also an atexit hook of our own, registered after multiprocessing's (atexit runs last-in first-out):
            # the workers get their STOP before multiprocessing terminates its daemonic children.
            atexit.register(self._finalizer)
        return dev

    def _build(self, model: Any, draft: Any, num_draft_tokens: int, load_format: str, dev: torch.device,
               page_size: int, max_num_tokens: int, max_model_len: int | None, max_num_seqs: int, num_pages: int,
               overlap: bool | None, enforce_eager: bool, graph_shapes: bool | None,
               gpu_memory_utilization: float, prefill_graphs: bool | None = None,
               max_prefill_graph_tokens: int = 2048, num_scheduler_steps: int | str = 1,
               draft_tree: TreeSpec | None = None) -> None:
        """Weights (this rank's shard), tokenizer and engine."""
        tp = self.tp
        if load_format == "dummy":
            self.target = dummy_target(target_config(model), self.dtype, dev, tp=tp)
        else:
            self.target = load_target(self.model_path, self.dtype, dev, tp=tp)
        if self.quantization == "fp8":  # before the engine packs the projections
            quantize_online(self.target)
        self.draft = None
        if draft is not None and num_draft_tokens > 0:
            # The Eagle3 head is small: every rank holds all of it and drafts the same tokens.
            if load_format == "dummy":
                self.draft = dummy_eagle3(eagle3_config(draft, self.target.cfg), self.dtype, dev)
            else:
                self.draft = load_eagle3(draft, self.target.cfg, self.dtype, dev)
            # the embedding / lm_head a head's checkpoint leaves out are the target's (vocab-parallel under TP)
            share_target_weights(self.draft, self.target)
        self.tokenizer = (_load_tokenizer(self.tokenizer_path) if self.tokenizer_path is not None and tp.is_driver
                          else None)
        mml = max_model_len if max_model_len is not None else min(self.target.cfg.max_position_embeddings, 2048)
        if mml > self.target.cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={mml} exceeds the model's max_position_embeddings="
                             f"{self.target.cfg.max_position_embeddings}")
        self.config = EngineConfig(page_size=page_size, num_pages=num_pages, max_num_tokens=max_num_tokens,
                                   max_num_seqs=max_num_seqs, max_model_len=mml,
                                   num_draft_tokens=num_draft_tokens if self.draft is not None else 0,
                                   overlap=(dev.type == "cuda") if overlap is None else overlap,
                                   enforce_eager=enforce_eager, graph_shapes=graph_shapes,
                                   gpu_memory_utilization=gpu_memory_utilization, prefill_graphs=prefill_graphs,
                                   max_prefill_graph_tokens=max_prefill_graph_tokens,
                                   num_scheduler_steps=num_scheduler_steps,
                                   enable_prefix_caching=self.enable_prefix_caching, draft_tree=draft_tree,
                                   deterministic=self.deterministic, tree_max_batch=self._tree_max_batch,
                                   structured_draft_masks=self.structured_draft_masks)
        self.engine = LLMEngine(self.target, self.draft, self.tokenizer, self.config, self.dtype, dev, self.ops,
                                tp=tp, driver=self._driver)

    def plain_engine(self) -> LLMEngine:
        """A second engine over the same target weights with speculation off (its own KV pool, sized alike):
        the bench's baseline. Under tensor parallelism every rank builds its own."""
        return self._plain_engine(self._driver.new_engine() if self._driver is not None else None)

    def _plain_engine(self, driver: launch.Driver | None) -> LLMEngine:
        return LLMEngine(self.target, None, self.tokenizer, replace(self.config, num_draft_tokens=0, draft_tree=None),
                         self.dtype, self.device, self.ops, tp=self.tp, driver=driver)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and leave the process group (nothing to do with one rank). The LLM
        cannot generate afterwards. Runs at interpreter exit too."""
        if self._driver is not None:
            self._finalizer()

    def _log_loaded(self, model: object, draft: object, load_format: str) -> None:
        """What was loaded and what the KV pool holds: the first lines to read when memory or speed surprise."""
        def n_params(m: torch.nn.Module | None) -> int:
            return sum(p.numel() for p in m.parameters()) if m is not None else 0

        where = str(model) if isinstance(model, (str, Path)) else f"a {type(model).__name__} config"
        shard = f" (rank 0's shard of {self.tp.size})" if self.tp.size > 1 else ""
        fp8 = sum(p.numel() for p in self.target.parameters() if p.dtype == torch.float8_e4m3fn)
        mx = f" ({fp8 / 1e6:.2f}M of them MXFP8: W8A16 kernels)" if fp8 else ""
        log.info("loaded target %s (%s weights): %.2fM parameters%s%s, %s on %s", where, load_format,
                 n_params(self.target) / 1e6, mx, shard, str(self.dtype).removeprefix("torch."), self.device)
        if self.draft is not None:
            dwhere = str(draft) if isinstance(draft, (str, Path)) else f"a {type(draft).__name__} config"
            log.info("loaded Eagle3 draft %s: %.2fM parameters, K=%d", dwhere, n_params(self.draft) / 1e6,
                     self.config.num_draft_tokens)
        runner = self.engine.runner
        caches = list(runner.caches) + ([runner.draft_cache] if runner.draft_cache is not None else [])
        kv_bytes = sum(t.numel() * t.element_size() for c in caches for t in (c.k, c.v, c.idx_k) if t is not None)
        pool = self.engine.pool
        log.info("KV pool: %d pages of %d tokens = %d tokens, %.1f MiB", pool.num_usable, pool.page_size,
                 pool.num_usable * pool.page_size, kv_bytes / 2**20)
        if self.device.type == "cuda":
            log.info("device memory: %.2f GiB allocated, %.2f GiB reserved",
                     torch.cuda.memory_allocated(self.device) / 2**30, torch.cuda.memory_reserved(self.device) / 2**30)

    # ---- generation -----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        check_text(text, "the prompt")
        if self.tokenizer is None:
            where = self.tokenizer_path if self.tokenizer_path is not None else "this LLM (built from a config)"
            raise ValueError(f"{where} has no tokenizer.json; pass token-id lists instead of text, or tokenizer=DIR "
                             "(--tokenizer)")
        return self.tokenizer.encode(text)

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt (text, or a list of int token ids -- numpy/torch ints accepted) or a list
        of prompts. Every prompt and its parameters are validated before any is admitted. Calls from
        several threads are serialised. use_tqdm: a progress bar on stderr (requests, output tok/s, ETA),
        shown only when stderr is a terminal. If the loop is interrupted (an exception, Ctrl-C), this call's
        unfinished requests are aborted and the engine stays usable."""
        prompt_list = _as_prompt_list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompt_list)
        if len(plist) != len(prompt_list):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompt_list)} prompts")
        for p in {id(p): p for p in plist}.values():  # fields may have changed since construction: check again
            if isinstance(p, SamplingParams):
                p.validate()
        if self.engine.owner is not None:
            raise RuntimeError(f"this LLM is being served ({self.engine.owner} steps its engine, and a second "
                               "stepper would take its outputs): send the request to the server, or build "
                               "another LLM for offline generate()")
        with self._lock:
            encoded = []
            for i, p in enumerate(prompt_list):  # validate everything before anything runs
                try:
                    ids = self.encode(p) if isinstance(p, str) else _token_ids(p)
                    self.engine.validate(ids, plist[i])
                except RequestError as e:
                    raise RequestError(f"prompt {i}: {e}") from None
                encoded.append((ids, p if isinstance(p, str) else None))
            # Only finished outputs are read here: text is decoded once per request, at its end.
            reqs = [self.engine.add_request(ids, plist[i], text, stream_text=False)
                    for i, (ids, text) in enumerate(encoded)]
            try:
                outs = self._collect(reqs, use_tqdm)
            except BaseException:
                for r in reqs:
                    self.engine.abort(r.request_id)
                raise
            self._stats.add(outs)
            return outs

    def _collect(self, reqs: list, use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every one of `reqs` has handed back its finishing delta (the same deltas
        the server streams) and the engine is idle (under overlap a last step may still be in flight, holding
        pages of finished requests); outputs in the order of `reqs`."""
        index = {r.request_id: i for i, r in enumerate(reqs)}
        outs: list[RequestOutput | None] = [None] * len(reqs)
        left = len(reqs)
        # disable=None: tqdm turns itself off when stderr is not a terminal (a log file, a pipe, CI).
        with tqdm(total=len(reqs), desc="generate", unit="req", disable=None if use_tqdm else True,
                  file=sys.stderr, dynamic_ncols=True) as bar:
            n_out = 0
            while left or self.engine.has_work():
                if left and not (self.engine.has_work() or self.engine.has_output()):
                    raise RuntimeError(f"the engine went idle with {left} requests of this call unfinished")
                for d in self.engine.step():
                    i = index.get(d.request_id)
                    if i is None:
                        continue
                    n_out += len(d.token_ids)
                    if d.output is not None and outs[i] is None:
                        outs[i] = d.output
                        left -= 1
                        bar.update(1)
                if not bar.disable:
                    elapsed = bar.format_dict["elapsed"]
                    bar.set_postfix_str(f"output {n_out / elapsed if elapsed else 0.0:.1f} tok/s", refresh=False)
        return outs  # type: ignore[return-value]

    # ---- metrics ------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Speculative metrics over every request generated since the last reset_stats()."""
        return self._stats.as_dict()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's LLM.reset_prefix_cache); True once done."""
        return self.engine.reset_prefix_cache()

    def reset_stats(self) -> None:
        self._stats = SpecStats(self.config.num_draft_tokens)


class SpecStats:
    """Running sums of the per-request speculation counts: constant memory however long the LLM lives."""

    def __init__(self, k: int):
        self.k = k
        self.num_requests = self.num_generated_tokens = 0
        self.drafted = self.accepted = self.steps = 0
        self.drafted_at = [0] * k
        self.accepted_at = [0] * k

    def add(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            m = o.metrics
            self.num_requests += 1
            self.num_generated_tokens += sum(len(c.token_ids) for c in o.outputs)
            self.drafted += m.num_drafted
            self.accepted += m.num_accepted
            self.steps += m.num_verify_steps
            for j in range(min(self.k, len(m.drafted_per_position))):
                self.drafted_at[j] += m.drafted_per_position[j]
                self.accepted_at[j] += m.accepted_per_position[j]

    def as_dict(self) -> dict[str, Any]:
        d, a, s = self.drafted, self.accepted, self.steps
        return {"num_requests": self.num_requests, "num_generated_tokens": self.num_generated_tokens,
                "num_draft_tokens": self.k, "num_drafted": d, "num_accepted": a, "num_verify_steps": s,
                "acceptance_rate": a / d if d else 0.0, "mean_acceptance_length": 1 + a / s if s else 1.0,
                "per_position_rates": [x / y if y else 0.0 for x, y in zip(self.accepted_at, self.drafted_at)]}


def aggregate_stats(outputs: list[RequestOutput], k: int) -> dict[str, Any]:
    """Speculation metrics of a list of outputs (as LLM.stats() reports them)."""
    st = SpecStats(k)
    st.add(outputs)
    return st.as_dict()


def _is_token_id(t: object) -> bool:
    """An int, a numpy integer or a 0-d integer torch tensor -- never a bool."""
    if isinstance(t, torch.Tensor):
        return t.dim() == 0 and not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool
    return isinstance(t, numbers.Integral) and not isinstance(t, bool) and type(t).__name__ not in ("bool", "bool_")


def _is_id_array(p: object) -> bool:
    """A 1-D numpy or torch integer array (one prompt of token ids)."""
    if isinstance(p, torch.Tensor):
        return p.dim() == 1 and not p.dtype.is_floating_point and not p.dtype.is_complex and p.dtype != torch.bool
    return type(p).__module__ == "numpy" and getattr(p, "ndim", None) == 1 and getattr(p.dtype, "kind", "") in "iu"


def _as_prompt_list(prompts: object) -> list:
    """str | ids | list of those -> a list of prompts; anything else is a RequestError naming its type."""
    if isinstance(prompts, str) or _is_id_array(prompts):
        return [prompts]
    if isinstance(prompts, list):
        if prompts and not any(isinstance(t, (str, list, tuple)) or _is_id_array(t) for t in prompts):
            return [prompts]  # one prompt of (what should be) token ids
        return prompts
    raise RequestError(f"prompts must be a str, a list of int token ids, or a list of those; got "
                       f"{type(prompts).__name__}")


def check_text(text: object, what: str) -> None:
    """A RequestError naming `what` unless `text` is a str that UTF-8 can encode (no lone surrogates, which
    JSON's \\ud800 escapes and undecodable command-line bytes produce; the tokenizer refuses them with a
    bare TypeError)."""
    if not isinstance(text, str):
        raise RequestError(f"{what} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{what} is not valid Unicode: a lone surrogate {text[e.start]!a} at character "
                           f"{e.start} (text must encode as UTF-8)") from None


def _token_ids(p: object) -> list[int]:
    """One prompt of token ids -> list[int]; bools, floats, nesting and other types are refused."""
    if _is_id_array(p):
        return [int(t) for t in p.tolist()]
    if not isinstance(p, list):
        raise RequestError(f"a prompt must be a str or a list of int token ids, got {type(p).__name__}")
    bad = [t for t in p if not _is_token_id(t)]
    if bad:
        raise RequestError(f"token ids must be ints (numpy/torch integers accepted); got {type(bad[0]).__name__} "
                           f"{bad[0]!r}")
    return [int(t) for t in p]
