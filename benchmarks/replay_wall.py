"""Is a steady decode step bound by the device or by the host? (GPU only)

    python benchmarks/replay_wall.py [--batch-sizes 1,32] [--k 0,3] [--steps 100] [--repeats 5]
                                     [--num-scheduler-steps N] [--json FILE]

For each (K, batch) it prints four times per step on the embedded pair: the engine's steady step
(`engine.step()`, overlap on, graphs); the same loop with the replay taken out (each step returns an earlier
output of its shape, as `benchmarks/host_step.py` does on the CPU, but here with the pinned copies, events
and H2D staging of the real device path); the wall time of the bucket's CUDA graph replayed back to back
with no host work; and the profiler's kernel time of one replay. Reading: engine step ~ host-only step =>
host-bound (then the host-only step vs host_step.py's CPU number says whether CUDA calls or Python cost
it); engine step ~ replay wall >> kernel time => gaps inside the graph; engine step ~ host-only + replay
=> host and device are not overlapping. Each time is the median of --repeats timings (the engine and
host-only loops split --steps into --repeats windows, so the requests' lengths do not grow with --repeats).
One JSON line per case on stdout, and with --json one document of every case (machine, versions, command);
--profile adds cProfile's top 25 of the host-only loop (builtins included). With --num-scheduler-steps N the
engine and host-only times are per device step (an engine step runs N).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from host_step import print_profile, without_device  # noqa: E402  (benchmarks/, the script's directory)

from m3eagle import LLM, SamplingParams  # noqa: E402
from m3eagle.engine.graph_runner import bucket_for  # noqa: E402


def timed(fn, n: int) -> float:
    """Milliseconds per call of fn, n calls between two device synchronisations."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def per_device_step(eng, steps: int) -> float:
    """Milliseconds per device step of `steps` engine steps (an engine step runs N sub-steps under multi-step)."""
    n0 = eng.num_steps
    return timed(eng.step, steps) * steps / (eng.num_steps - n0)


def kernel_ms(graph: torch.cuda.CUDAGraph, n: int = 20) -> float:
    """Profiler kernel time of one replay (the sum of its kernels' durations)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return sum(e.device_time for e in prof.events() if e.device_type == cuda) / n / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--k", default="0,3", help="draft tokens per step, comma-separated")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--num-scheduler-steps", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="timings per measure; the median is reported")
    ap.add_argument("--json", metavar="FILE", default=None, help="also write every case as one JSON document")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("replay_wall.py needs a CUDA device (it times CUDA-graph replays)")
    cases: list[dict] = []
    for k in (int(x) for x in a.k.split(",")):
        n = a.num_scheduler_steps
        llm = LLM(device="cuda", num_draft_tokens=k, max_num_seqs=32, max_model_len=4096, num_scheduler_steps=n)
        eng = llm.engine
        for b in (int(x) for x in a.batch_sizes.split(",")):
            sp = SamplingParams(temperature=0, max_tokens=min(a.steps * (k + 1) * 3 * n + 100, 3900),
                                ignore_eos=True)
            ids = [eng.add_request(llm.encode(f"def f(x):\n    return x + {i}\n"), sp, stream_text=False).request_id
                   for i in range(b)]  # text at the end, as `m3eagle bench` runs
            for _ in range(10):  # prompts done, this bucket's graph captured
                eng.step()
            window = max(1, a.steps // a.repeats)
            step = statistics.median(per_device_step(eng, window) for _ in range(a.repeats))
            real = eng.graphs.run
            eng.graphs.run = without_device(real)
            eng.step()
            host_only = statistics.median(per_device_step(eng, window) for _ in range(a.repeats))
            if a.profile:
                print_profile(eng, a.steps, 25)
            eng.graphs.run = real
            key = next(key for key in eng.graphs.graphs if key[0] == bucket_for(b, eng.graphs.buckets))
            graph = eng.graphs.graphs[key][0]
            replay = statistics.median(timed(graph.replay, 2 * a.steps) for _ in range(a.repeats))
            busy = statistics.median(kernel_ms(graph) for _ in range(a.repeats))
            print(f"K={k} batch {b} N={n}: engine step {step:.3f} ms | host-only step {host_only:.3f} ms | back-to-back "
                  f"replay {replay:.3f} ms | kernel time {busy:.3f} ms", file=sys.stderr)
            case = {"k": k, "batch": b, "num_scheduler_steps": n, "engine_step_ms": step,
                    "host_only_step_ms": host_only, "replay_ms": replay, "kernel_ms": busy}
            cases.append(case)
            print(json.dumps(case))
            for rid in ids:  # the replays rewrote these rows' state: they are dropped, not finished
                eng.abort(rid)
            eng.run()
    if a.json:
        doc = {"benchmark": "replay_wall", "command": "python " + " ".join(sys.argv), "repeats": a.repeats,
               "steps": a.steps, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "python": platform.python_version(), "cases": cases}
        Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
