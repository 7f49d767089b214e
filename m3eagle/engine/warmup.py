"""The engine's start-up warm-up: the work a serving step would otherwise do on first use (CUDA-graph captures,
Triton compiles of every prompt-chunk class, the long-context sparse path and a burst of prefix-cache hits, each
sampling variant, the indexer's merge variants), done before serving and then forgotten.

`Warmup` is a mixin of `LLMEngine` (engine/llm_engine.py): its methods read the engine's config, graphs, scheduler
and counters and run dummy requests through `add_request` / `step`, so they live beside the engine without the
engine's module growing, and without this module importing it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from m3eagle.engine.request import RequestError
from m3eagle.kernels.compile_watch import add_compile_listener
from m3eagle.sampling.params import SamplingParams, StructuredOutputsParams

log = logging.getLogger("m3eagle")

# Suffix tokens of the long-context warm-up's cache hits (the rows of a burst of hits differ in length by one).
LONG_SUFFIX = 16


class WarmupStopped(Exception):
    """`LLMEngine.warmup` was told to stop (its `should_stop` answered True); the engine is idle and clean."""


class Warmup:
    """The warm-up methods of `LLMEngine` (a mixin: every attribute it reads is the engine's)."""

    def warmup_shapes(self) -> list[tuple[int, int]]:
        """(rows, tokens per row) of the warm-up's prompt batches: for each power-of-two step size from 16 up to
        the step budget (and the budget itself), one row of that length where a sequence can hold it, and as
        many rows as fit (up to 8) splitting it -- the prompt-chunk shape classes whose Triton tile variants
        (attention BLOCK_Q, the MoE's per-T-bucket blocks) would otherwise compile on first use, in the middle
        of serving. The full-budget step is what a burst of arrivals fills (8 prompts of 256 tokens)."""
        cfg, shapes = self.cfg, []
        per_row = cfg.max_model_len - self.k - 3
        sizes, n = [], 16
        while n < cfg.max_num_tokens:
            sizes.append(n)
            n *= 2
        sizes.append(cfg.max_num_tokens)
        for n in sizes:
            if n <= per_row:
                shapes.append((1, n))
            rows = max(1, min(8, cfg.max_num_seqs, n // 8))
            while rows < cfg.max_num_seqs and n // rows > per_row:
                rows += 1
            if rows > 1 and n // rows <= per_row:
                shapes.append((rows, n // rows))
        return shapes

    def warmup_variants(self) -> list[tuple[str, SamplingParams]]:
        """The sampling variants the warm-up runs through the engine after the greedy chunk classes: each takes
        another path through a step (fp32 logits, the sampling and draft-sampling kernels, logprobs, the
        penalty history, n > 1 samples, prompt logprobs' every-position logits, a grammar's masks)."""
        k, sampled = self.k + 2, dict(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=0)
        out = [("sampled", SamplingParams(max_tokens=k, ignore_eos=True, **sampled)),
               ("logprobs", SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True, logprobs=5)),
               ("sampled+logprobs", SamplingParams(max_tokens=k, ignore_eos=True, logprobs=5, **sampled)),
               ("penalties", SamplingParams(temperature=0.0, max_tokens=k, min_tokens=2, presence_penalty=0.5,
                                            frequency_penalty=0.5, repetition_penalty=1.1)),
               ("prompt_logprobs", SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True, prompt_logprobs=2)),
               ("n=2", SamplingParams(max_tokens=k, ignore_eos=True, n=min(2, self.cfg.max_num_seqs), **sampled))]
        if self.tokenizer is not None and self.tp.size == 1:  # the grammar compiler is built on first use
            out.append(("json_object", SamplingParams(temperature=0.0, max_tokens=k,
                                                      structured_outputs=StructuredOutputsParams(json_object=True))))
        return out

    def warmup(self, graphs: bool = True, should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Do at startup the work a serving step would otherwise do on first use, then forget it (speculation
        counters and step counts restored, every page free again):

        1. `graphs`: every (bucket, mode) of `GraphRunner.warm_keys` -- each decode / verify bucket in all 8
           modes, each prefill (rows, tokens) bucket in its 4 (a draft tree's narrow ones too) -- is captured
           (with graphs off: run once eagerly), which compiles their Triton variants too;
        2. dummy greedy prompts of every shape of `warmup_shapes`, their prompt steps eager (unpadded: the
           variants of steps no prefill graph takes), K + 2 new tokens each, so verify and draft steps run too;
           then, past the sparse layers' selection bound, `warmup_long_context`'s prompt and its burst of hits;
        3. one short request per `warmup_variants` entry, at a short and at the longest chunk length.

        Returns what it ran: shapes, long_context (prompt tokens, rows, prompt tokens the burst found cached;
        None when skipped), variants, graphs (keys warmed), steps, seconds. `should_stop` (a server that
        stops while warming up) is asked before each graph key, prompt batch and variant: True raises WarmupStopped
        with the engine idle and clean, so its thread ends within one item, not under a compile at process exit."""
        if not self.is_idle_and_clean():
            raise RuntimeError("warmup() runs on an idle engine only (before any request)")
        t0, counters, steps, iters = time.perf_counter(), self.counters.snapshot(), self.num_steps, self.num_iterations
        cache_counts = (self.scheduler.prefix_cache_queries, self.scheduler.prefix_cache_hits)

        def check() -> None:
            if should_stop is not None and should_stop():
                self.counters, self.num_steps, self.num_iterations = counters, steps, iters
                self.scheduler.reset_prefix_cache()
                self.scheduler.prefix_cache_queries, self.scheduler.prefix_cache_hits = cache_counts
                raise WarmupStopped("the warm-up was stopped before it finished")

        warmed = 0
        if graphs and self.graph_shapes:
            for b, m in self.graphs.warm_keys():
                check()
                warmed += self.graphs.warm(b, m)
        t_graphs = time.perf_counter() - t0
        shapes = self.warmup_shapes()
        greedy = SamplingParams(temperature=0.0, max_tokens=self.k + 2, ignore_eos=True)
        # The prompt shapes run eagerly even where a prefill graph would take them: the captures above compiled
        # the padded shapes, and a step no graph takes (a constrained row's prompt, penalties) runs unpadded.
        self.graphs.eager_prefill = True
        long_info = None
        try:
            for rows, length in shapes:
                check()
                self._warm_batch([(f"{rows}x{length}-{r}", length, greedy) for r in range(rows)])
            long = self.warmup_long_context()
            if long is not None:
                check()
                prefix = self._warm_batch([("long", long[0], greedy)])[0]
                check()
                hits = self.scheduler.prefix_cache_hits
                self._warm_batch([(f"hit-{r}", LONG_SUFFIX + r, greedy) for r in range(long[1])], prefix=prefix)
                long_info = {"prompt": long[0], "rows": long[1], "hit_tokens": self.scheduler.prefix_cache_hits - hits}
        finally:
            self.graphs.eager_prefill = False
        check()
        merges = self._warm_index_merges()
        lengths = sorted({16, max((n for r, n in shapes if r == 1), default=16)})
        variants = []
        for name, sp in self.warmup_variants():
            check()
            try:
                self._warm_batch([(f"{name}-{n}", n, sp) for n in lengths])
                variants.append(name)
            except (RequestError, ImportError) as e:  # a variant this engine cannot run (no grammar backend)
                log.info("warm-up: skipped %s (%s)", name, e)
        info = {"shapes": shapes, "long_context": long_info, "variants": variants, "graphs": warmed,
                "steps": self.num_steps - steps, "index_merges": merges, "seconds": time.perf_counter() - t0}
        self.counters, self.num_steps, self.num_iterations = counters, steps, iters
        sched = self.scheduler
        sched.reset_prefix_cache()  # dummy prompts: nothing a user would hit, nothing counted
        sched.prefix_cache_queries, sched.prefix_cache_hits = cache_counts
        self.graphs.warmed = True
        if self.device.type == "cuda" and self._unwatch_compiles is None:
            self._unwatch_compiles = add_compile_listener(self._first_use_compile)
        log.info("warm-up in %.1f s: %d graph buckets x modes %s in %.1f s (%d captured in all), %d prompt "
                 "batches (rows x tokens: %s), sampling variants %s", info["seconds"], warmed,
                 "captured" if self.graphs.use_graphs else "run eagerly", t_graphs, len(self.graphs.graphs),
                 len(shapes), ", ".join(f"{r}x{n}" for r, n in shapes), ", ".join(variants))
        return info

    def _warm_index_merges(self) -> int:
        """Compile the indexer's split-merge variants (one per split-count class, `index_plan.merge_classes`) up to
        max_model_len: an eager prompt step's row count and contexts pick its split count, so the warm-up's prompt
        shapes do not reach every class. CUDA with Triton attention only (nothing compiles elsewhere)."""
        warm = getattr(self.ops.attention, "warm_index_merges", None)
        if warm is None or not self.index_heads or self.device.type != "cuda":
            return 0
        c = self.target_cfg
        return warm(self.index_heads, c.index_block_size, c.index_topk_blocks, c.index_local_blocks,
                    self.cfg.max_model_len, self.device)

    def _first_use_compile(self, variant: str) -> None:
        """A Triton compile after the warm-up: first-use work the warm-up did not cover, paid by a serving step."""
        self.first_use_compiles += 1
        log.warning("Triton compiled %s on first use, after the warm-up (its compile delays a serving step)",
                    variant)

    def warmup_long_context(self) -> tuple[int, int] | None:
        """(prompt tokens, rows) of the warm-up's long-context batches, or None (no sparse layers, or
        max_model_len too short). A sparse layer's prompt path -- the indexer, then attention over each token's
        selected blocks -- runs only once a row's context passes index_topk_blocks x index_block_size keys
        (below that every block is selected: dense attention), and `warmup_shapes` stops at max_num_tokens
        tokens per row. So one prompt a block past that bound, then `rows` requests that repeat it with a short
        suffix each: with prefix caching on, a burst of hits (short rows over a long cached context, the shape of
        agent and chat traffic); with it off, the same prompts in chunks."""
        c = self.target_cfg
        if not self.index_heads:
            return None
        length = (c.index_topk_blocks + 1) * c.index_block_size
        if length + LONG_SUFFIX + 8 > self.cfg.max_model_len - self.k - 3:
            return None
        return length, max(1, min(8, self.cfg.max_num_seqs))

    def _warm_batch(self, reqs: list[tuple[str, int, SamplingParams]],
                    prefix: list[int] | None = None) -> list[list[int]]:
        """Run dummy prompts (id suffix, length, params) together until they finish; returns their token ids.
        Without `prefix` the prefix cache is emptied first: the batches' prompts share prefixes, and a hit would
        leave their shapes unwarmed. With it, each prompt is `prefix` + its own tokens, and the cache is kept."""
        if prefix is None:
            self.scheduler.reset_prefix_cache()
        vocab, cap = self.target_cfg.vocab_size, self.cfg.max_model_len - self.k - 3
        prompts = []
        for i, (name, length, sp) in enumerate(reqs):
            length = max(1, min(length, cap - len(prefix or ())))
            prompts.append((prefix or []) + [1 + (i * 7919 + j) % (vocab - 1) for j in range(length)])
            self.add_request(list(prompts[-1]), sp, request_id=f"warmup-{name}", stream_text=False)
        while self.has_work() or self.has_output():
            for d in self.step():
                if d.finish_reason not in (None, "length", "stop"):
                    raise RuntimeError(f"warm-up request {d.request_id} ended with {d.finish_reason}: {d.error}")
        return prompts
