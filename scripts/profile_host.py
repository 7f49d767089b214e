"""Where the host spends a steady decode step (GPU): cProfile over engine.step() at batch 1 and 32, plain and
K=3, plus the host cost of one CUDA-graph replay call. Usage: python scripts/profile_host.py"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch

from m3eagle import LLM, SamplingParams


def main() -> None:
    for k in (0, 3):
        llm = LLM(device="cuda", num_draft_tokens=k, max_num_seqs=32, max_model_len=2048)
        eng = llm.engine
        for b in (1, 32):
            sp = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
            ids = [eng.add_request(llm.encode(f"def f(x):\n    return x + {i}\n"), sp).request_id for i in range(b)]
            for _ in range(8):
                eng.step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            n = 100
            for _ in range(n):
                eng.step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / n * 1e3
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(n):
                eng.step()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
            print(f"=== K={k} batch {b}: {wall:.3f} ms per step (no profiler); replays {eng.graphs.num_replays}")
            print("\n".join(s.getvalue().splitlines()[4:26]))
            for rid in ids:
                eng.abort(rid)
            eng.run()
        g = next(iter(eng.graphs.graphs.values()))[0]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            g.replay()
        host = (time.perf_counter() - t0) / 50 * 1e6
        torch.cuda.synchronize()
        print(f"K={k}: host time of one graph.replay() call {host:.1f} us")


if __name__ == "__main__":
    main()
