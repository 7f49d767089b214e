"""Where the host spends a steady decode step (GPU): cProfile over engine.step() at batch 1 and 32, plain and
K=3, plus the host cost of one CUDA-graph replay call. Usage: python scripts/profile_host.py [--time-only]

With --eager-prefill: where an eager prompt step's time goes instead -- batches of 128-token prompts (1 and
16 rows) with max_tokens=1 and prefill graphs off, timed, then under cProfile (host) and torch.profiler
(kernels launched per prompt step)."""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch

from m3eagle import LLM, SamplingParams


def _prompt_batch(eng, prompts: list[list[int]], sp: SamplingParams) -> int:
    """Run one batch of prompts to the end; the engine steps it took."""
    for p in prompts:
        eng.add_request(list(p), sp)
    n0 = eng.num_steps
    while eng.has_work():
        eng.step()
    return eng.num_steps - n0


def eager_prefill() -> None:
    from torch.profiler import ProfilerActivity, profile

    for k in (0, 3):
        llm = LLM(device="cuda", num_draft_tokens=k, max_num_seqs=32, max_model_len=512, prefill_graphs=False)
        eng = llm.engine
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for b in (1, 16):
            prompts = [[(7 * i + 13 * j) % 500 + 3 for j in range(128)] for i in range(b)]

            for _ in range(3):
                _prompt_batch(eng, prompts, sp)
            torch.cuda.synchronize()
            n, t0 = 20, time.perf_counter()
            steps = sum(_prompt_batch(eng, prompts, sp) for _ in range(n))
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / n * 1e3
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(n):
                _prompt_batch(eng, prompts, sp)
            pr.disable()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                _prompt_batch(eng, prompts, sp)
                torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            gpu_ms = sum(e.device_time for e in kernels) / 1e3
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
            print(f"=== eager prefill K={k} batch {b} x 128 tokens: {wall:.2f} ms per batch of {steps / n:.1f} "
                  f"steps (no profiler); {len(kernels)} GPU kernels / copies per batch, {gpu_ms:.2f} ms of GPU time")
            print("\n".join(s.getvalue().splitlines()[4:36]))
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(30)
            print("--- by cumulative time")
            print("\n".join(s.getvalue().splitlines()[4:40]))


def main() -> None:
    if "--eager-prefill" in sys.argv[1:]:
        eager_prefill()
        return
    time_only = "--time-only" in sys.argv[1:]  # the steady step's wall time only (A/B runs), no cProfile
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
            print(f"=== K={k} batch {b}: {wall:.3f} ms per step (no profiler); replays {eng.graphs.num_replays}")
            if not time_only:
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(n):
                    eng.step()
                pr.disable()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
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
