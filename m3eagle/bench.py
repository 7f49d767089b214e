"""`m3eagle bench`: tokens/s with and without speculation, in one run, on the same prompts.

Prompts are held-out text when the model has a tokenizer (stdlib source, which the embedded model never
trained on), else random token ids. Each configuration gets a warm-up batch, then `num_batches` timed
batches; the speedup is spec tokens/s over plain tokens/s at the same batch size. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import random
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch


def _prompts(llm, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if llm.tokenizer is not None:
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        out = []
        while len(out) < n:
            text = rng.choice(files).read_text(errors="ignore")
            ids = llm.tokenizer.encode(text)
            if len(ids) > length + 8:
                s = rng.randrange(0, len(ids) - length)
                out.append(ids[s:s + length])
        return out
    v = llm.target.cfg.vocab_size
    return [[rng.randrange(3, v) for _ in range(length)] for _ in range(n)]


def _time(llm, prompts: list[list[int]], max_tokens: int, batch: int, num_batches: int) -> dict[str, Any]:
    from m3eagle import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:batch], sp)  # warm-up (kernel compilation, allocator)
    llm.reset_stats()
    toks, secs = 0, 0.0
    for i in range(num_batches):
        chunk = prompts[(i + 1) * batch:(i + 2) * batch] or prompts[:batch]
        if llm.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(chunk, sp)
        if llm.device.type == "cuda":
            torch.cuda.synchronize()
        secs += time.perf_counter() - t0
        toks += sum(len(o.token_ids) for o in outs)
    st = llm.stats()
    return {"tokens": toks, "seconds": round(secs, 4), "tokens_per_s": round(toks / secs, 2),
            "mean_acceptance_length": round(st["mean_acceptance_length"], 4),
            "acceptance_rate": round(st["acceptance_rate"], 4)}


def run_bench(a: argparse.Namespace) -> dict[str, Any]:
    from m3eagle import LLM

    kw = dict(model=a.model, device=a.device, dtype=a.dtype, max_model_len=a.max_model_len,
              max_num_tokens=a.max_num_tokens, page_size=a.page_size)
    overlap = None if a.overlap == "auto" else a.overlap == "on"
    spec = LLM(draft=a.draft, num_draft_tokens=a.num_draft_tokens, overlap=overlap, **kw)
    k = spec.config.num_draft_tokens
    if k == 0:
        raise ValueError("bench compares speculation on vs off: give --draft (or use the embedded model)")
    plain = LLM(num_draft_tokens=0, overlap=overlap, **kw)
    batches = [int(x) for x in a.batch_sizes.split(",")]
    prompts = _prompts(plain, max(batches) * (a.num_batches + 1), a.prompt_len, 0)
    rows = []
    for bs in batches:
        base = _time(plain, prompts, a.max_tokens, bs, a.num_batches)
        sp = _time(spec, prompts, a.max_tokens, bs, a.num_batches)
        row = {"batch": bs, "plain_tok_s": base["tokens_per_s"], "spec_tok_s": sp["tokens_per_s"],
               "speedup": round(sp["tokens_per_s"] / base["tokens_per_s"], 3),
               "mean_acceptance_length": sp["mean_acceptance_length"], "acceptance_rate": sp["acceptance_rate"]}
        if a.overlap_compare:
            for name, llm_ov in (("spec_overlap_on", True), ("spec_overlap_off", False)):
                llm = LLM(draft=a.draft, num_draft_tokens=a.num_draft_tokens, overlap=llm_ov, **kw)
                row[name + "_tok_s"] = _time(llm, prompts, a.max_tokens, bs, a.num_batches)["tokens_per_s"]
        rows.append(row)
        print(f"batch {bs:3d}: plain {row['plain_tok_s']:9.1f} tok/s | spec K={k} {row['spec_tok_s']:9.1f} tok/s"
              f" | speedup {row['speedup']:.2f}x | mean acceptance length {row['mean_acceptance_length']:.3f}")
    return {"device": str(spec.device), "dtype": str(spec.dtype), "num_draft_tokens": k,
            "overlap": spec.config.overlap, "attention_backend": _backend_name(), "results": rows}


def _backend_name() -> str:
    from m3eagle.attention import backend

    return backend.get().name
