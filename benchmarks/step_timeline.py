"""Where a whole generate() batch spends its wall time, step by step: graph replays vs eager steps.

The bench's tok/s covers prefill, the steady state and the tail; its steady-state columns cover only the
middle. This script splits one timed batch by step kind, so the gap between the two is explained:

    python benchmarks/step_timeline.py --geometry embedded --batch-sizes 1,32 --max-tokens 128 [--k 3]

Per batch size and mode (plain; spec when the geometry has a head): wall time per kind of step (replay /
replay-prefill (prefill graphs, on by default on CUDA) / eager-prefill / eager-mixed / eager-decode), the count, the
tokens they scheduled, and the step wall time's median per kind. Wall time of a step is measured
host-side between step() calls, so under overlap a step's time includes waiting for the previous one --
the sum is exact, the split is approximate.
One JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from m3eagle.bench import geometries  # noqa: E402
from m3eagle.bench.offline import _plain_engine, make_prompts  # noqa: E402
from m3eagle.config import M3Config  # noqa: E402
from m3eagle.entrypoints.llm import LLM  # noqa: E402
from m3eagle.sampling.params import SamplingParams  # noqa: E402


def timeline(engine, prompts: list[list[int]], max_tokens: int, dev: torch.device) -> dict:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    kinds: list[str] = []
    orig_run = engine.graphs.run

    def run(inp, bucket):
        if bucket is not None and engine.graphs.use_graphs:
            kinds.append("replay-prefill" if isinstance(bucket, tuple) else "replay")
        else:
            kinds.append("eager")
        return orig_run(inp, bucket)

    engine.graphs.run = run
    sched_tokens: list[int] = []
    prefill_rows: list[bool] = []
    orig_commit = engine.scheduler.commit

    def commit(batch):
        sched_tokens.append(sum(r.num_tokens for r in batch.rows))
        prefill_rows.append(any(not r.gather for r in batch.rows))
        return orig_commit(batch)

    engine.scheduler.commit = commit
    try:
        reqs = [engine.add_request(list(p), sp, stream_text=False) for p in prompts]  # as `m3eagle bench`
        walls: list[float] = []
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t_start = time.perf_counter()
        t = t_start
        while engine.has_work():
            n0 = len(kinds)
            engine.step()
            now = time.perf_counter()
            if len(kinds) > n0:
                walls.append(now - t)
            elif walls:
                walls[-1] += now - t  # a drain-only step: charge it to the step it waited for
            t = now
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        total = time.perf_counter() - t_start
    finally:
        engine.graphs.run = orig_run
        engine.scheduler.commit = orig_commit
    by: dict[str, dict] = defaultdict(lambda: {"steps": 0, "wall_ms": 0.0, "tokens": 0, "walls": []})
    for kind, w, tok, pre in zip(kinds, walls, sched_tokens, prefill_rows):
        key = kind if kind.startswith("replay") else ("eager-prefill" if pre and tok > len(prompts) * 2 else
                                             "eager-mixed" if pre else "eager-decode")
        b = by[key]
        b["steps"] += 1
        b["wall_ms"] += w * 1e3
        b["tokens"] += tok
        b["walls"].append(w * 1e3)
    out = {k: {"steps": v["steps"], "wall_ms": round(v["wall_ms"], 2), "tokens": v["tokens"],
               "median_step_ms": round(statistics.median(v["walls"]), 3)} for k, v in by.items()}
    gen = sum(len(q.output_token_ids) for q in reqs)
    return {"total_ms": round(total * 1e3, 2), "tok_s": gen / total, "generated": gen, "kinds": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="embedded")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-num-tokens", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="prompt and mixed steps replay graphs too (default: the engine's, on for CUDA)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    bs = [int(x) for x in a.batch_sizes.split(",")]
    geo = geometries.resolve(a.geometry)
    kw = {"max_num_tokens": a.max_num_tokens} if a.max_num_tokens else {}
    llm = LLM(geo.model, geo.draft, num_draft_tokens=a.k, device=a.device, max_num_seqs=max(bs),
              max_model_len=a.prompt_len + a.max_tokens + 4 * (a.k + 1) + 8, load_format=geo.load_format,
              prefill_graphs=a.prefill_graphs, **kw)
    vocab = geo.model.vocab_size if isinstance(geo.model, M3Config) else llm.target.cfg.vocab_size
    prompts, _ = make_prompts(llm.tokenizer, vocab, 2 * max(bs), a.prompt_len, 0)
    engines = {"plain": _plain_engine(llm), "spec": llm.engine} if a.k else {"plain": llm.engine}
    res = []
    for b in bs:
        for mode, eng in engines.items():
            timeline(eng, prompts[:b], a.max_tokens, dev)  # warm-up (captures, autotune)
            r = timeline(eng, prompts[b:2 * b], a.max_tokens, dev)
            r.update(batch=b, mode=mode)
            res.append(r)
            parts = ", ".join(f"{k} {v['steps']} steps {v['wall_ms']:.1f} ms (median {v['median_step_ms']:.2f}, "
                              f"{v['tokens']} tok)" for k, v in sorted(r["kinds"].items()))
            print(f"b{b} {mode}: {r['tok_s']:.0f} tok/s, {r['total_ms']:.1f} ms: {parts}", file=sys.stderr)
    print(json.dumps({"geometry": a.geometry, "device": str(dev), "results": res}))


if __name__ == "__main__":
    main()
