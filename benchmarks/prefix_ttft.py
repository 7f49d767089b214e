"""Engine-side time to first token with and without the prefix cache: no HTTP, no text (a token counts when
the step that made it returns), so it isolates what the cache saves from what serving adds.

    python benchmarks/prefix_ttft.py --geometry m3-mini --prefix-len 4096 --suffix-len 128 --concurrency 8
    python benchmarks/prefix_ttft.py --device cpu --geometry tiny --prefix-len 64 --suffix-len 16 --concurrency 2

For each setting (cache on, then off; one engine each, random `--load-format dummy` weights of the geometry
and its random Eagle3 head, K = --k): one request fills the cache, then waves of --concurrency requests (the
shared prefix + a unique random suffix each) are submitted at once and stepped to the end; the first wave
warms shapes, the next --waves are measured. Then the same requests one at a time ("alone"). TTFT per request:
submission -> the step() that returns its first token. Prints p50 / max per setting and writes --json.
With --profile, one more wave per setting runs under torch.profiler: its GPU kernels by total time (where a
hit's prefill spends its time) go to the JSON as "profile" and to stdout.
"""

from __future__ import annotations

import sys

from _interpreter import use_interpreter_for_cpu  # noqa: E402  (the script's own folder)

use_interpreter_for_cpu(sys.argv)  # before anything imports triton

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3eagle import LLM, SamplingParams  # noqa: E402
from m3eagle.bench import geometries  # noqa: E402


def wave(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> list[float]:
    """Submit every prompt at once, step to the end; seconds from submission to each one's first token."""
    eng = llm.engine
    t0 = time.perf_counter()
    reqs = [eng.add_request(p, sp) for p in prompts]
    first: dict[str, float] = {}
    ids = {r.request_id for r in reqs}
    done: set[str] = set()
    while done != ids:
        for d in eng.step():
            if d.token_ids and d.request_id not in first:
                first[d.request_id] = time.perf_counter() - t0
            if d.finished:
                done.add(d.request_id)
    return [first[r.request_id] for r in reqs]


def profile_wave(llm: LLM, prompts: list[list[int]], sp: SamplingParams, top: int = 15) -> dict[str, Any]:
    """One wave under torch.profiler (CUDA kernels only): wall ms, GPU kernel ms, and the top kernels by total
    device time (name, calls, total us)."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wave(llm, prompts, sp)
    wall = time.perf_counter() - t0
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            entry = totals.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])
    return {"wall_ms": wall * 1e3, "kernel_ms": sum(v[1] for v in totals.values()) / 1e3,
            "kernels": sum(int(v[0]) for v in totals.values()),
            "top": [{"name": n[:120], "calls": int(c), "total_us": round(us, 1)} for n, (c, us) in ranked[:top]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometry", default="m3-mini")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--suffix-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--waves", type=int, default=3)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-prefill-graph-tokens", type=int, default=512,
                   help="prompt / mixed steps up to this many tokens replay CUDA graphs (the engine's default: 512)")
    p.add_argument("--attention-backend", default="auto",
                   help="LLM(attention_backend=...): auto, triton, or triton_sparse_prefill (the tiled sparse "
                        "prompt kernel)")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true", help="profile one more wave per setting (CUDA kernels)")
    args = p.parse_args(argv)
    geo = geometries.resolve(args.geometry)

    def make_batches(vocab: int) -> list[list[list[int]]]:
        """Warm-up, measured and profiled waves: one shared prefix + a random suffix per prompt (seed 0)."""
        rng = random.Random(0)
        prefix = [rng.randrange(vocab) for _ in range(args.prefix_len)]
        return [[prefix + [rng.randrange(vocab) for _ in range(args.suffix_len)] for _ in range(args.concurrency)]
                for _ in range(args.waves + 2)]

    batches: list[list[list[int]]] | None = None  # made once the first engine says its vocabulary
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    doc: dict[str, Any] = {"command": " ".join(["python", "benchmarks/prefix_ttft.py", *(argv or sys.argv[1:])]),
                           "settings": vars(args), "results": {}}
    for caching in (True, False):
        llm = LLM(model=geo.model, draft=geo.draft if args.k else None, load_format=geo.load_format, device=args.device,
                  num_draft_tokens=args.k, enable_prefix_caching=caching, max_num_seqs=args.concurrency,
                  max_model_len=args.prefix_len + args.suffix_len + args.output_len + 64,
                  max_prefill_graph_tokens=args.max_prefill_graph_tokens, attention_backend=args.attention_backend)
        if batches is None:
            batches = make_batches(llm.engine.target_cfg.vocab_size)
        llm.generate([batches[0][0]], sp, use_tqdm=False)  # the prefix is cached (with caching on)
        wave(llm, batches[0], sp)  # shapes warmed
        waved = [t for b in batches[1:-1] for t in wave(llm, b, sp)]
        alone = [wave(llm, [q], sp)[0] for q in batches[1][:args.concurrency]]
        res = {"wave_ttft_ms": [t * 1e3 for t in waved], "alone_ttft_ms": [t * 1e3 for t in alone]}
        for key in ("wave_ttft_ms", "alone_ttft_ms"):
            res[key.replace("_ms", "_p50_ms")] = statistics.median(res[key])
            res[key.replace("_ms", "_max_ms")] = max(res[key])
        if args.profile and args.device != "cpu":
            res["profile"] = profile_wave(llm, batches[-1], sp)
            print(json.dumps(res["profile"]))
        doc["results"]["on" if caching else "off"] = res
        print(f"cache {'on ' if caching else 'off'}: wave of {args.concurrency} TTFT p50 {res['wave_ttft_p50_ms']:.1f} "
              f"max {res['wave_ttft_max_ms']:.1f} ms; alone p50 {res['alone_ttft_p50_ms']:.1f} "
              f"max {res['alone_ttft_max_ms']:.1f} ms")
        del llm
    on, off = doc["results"]["on"], doc["results"]["off"]
    doc["speedup"] = {"wave_p50": off["wave_ttft_p50_ms"] / on["wave_ttft_p50_ms"],
                      "alone_p50": off["alone_ttft_p50_ms"] / on["alone_ttft_p50_ms"]}
    print(f"TTFT p50 speedup: wave {doc['speedup']['wave_p50']:.2f}x, alone {doc['speedup']['alone_p50']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
