"""Where a steady engine step's host time goes on the GPU machine: for K = 0 and 3, batch 1 and 32 (the
bench's engine shape: max_num_seqs 32, greedy, stream_text=False), the step's wall time, the time inside
graph.replay(), the CUDA runtime calls' host time (torch.profiler, CPU activity) and cProfile's top 25.

    python docs/results/h200-2026-12-02e/host_api.py [--batch-sizes 1,32] [--k 0,3] [--steps 100]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from m3eagle import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--k", default="0,3")
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args()
    for k in (int(x) for x in a.k.split(",")):
        llm = LLM(device="cuda", num_draft_tokens=k, max_num_seqs=32, max_model_len=4096)
        eng = llm.engine
        for b in (int(x) for x in a.batch_sizes.split(",")):
            sp = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
            ids = [eng.add_request(llm.encode(f"def f(x):\n    return x + {i}\n"), sp, stream_text=False).request_id
                   for i in range(b)]
            for _ in range(10):
                eng.step()
            torch.cuda.synchronize()
            g = eng.graphs
            l0, n0 = g.launch_seconds, eng.num_steps
            t0 = time.perf_counter()
            for _ in range(a.steps):
                eng.step()
            torch.cuda.synchronize()
            n = eng.num_steps - n0
            wall = (time.perf_counter() - t0) / n * 1e3
            launch = (g.launch_seconds - l0) / n * 1e3
            print(f"=== K={k} batch {b}: step {wall:.3f} ms, inside graph.replay() {launch:.3f} ms", flush=True)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(50):
                    eng.step()
                torch.cuda.synchronize()
            rows = [e for e in prof.key_averages() if e.key.startswith("cuda") or e.key.startswith("cu")]
            rows.sort(key=lambda e: -e.self_cpu_time_total)
            for e in rows[:12]:
                print(f"   {e.key:<40} {e.count / 50:6.1f} calls/step  {e.self_cpu_time_total / 50:8.1f} us/step")
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(a.steps):
                eng.step()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
            print("\n".join(s.getvalue().splitlines()[4:34]), flush=True)
            for rid in ids:
                eng.abort(rid)
            eng.run()


if __name__ == "__main__":
    main()
