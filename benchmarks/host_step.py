"""Host time of one steady engine step, with the device's work taken out.

    python benchmarks/host_step.py [--batch 32] [--k 0] [--steps 200 (100 with --k > 0)] [--repeats 5] [--profile]
                                   [--stream-text] [--no-fast-paths]

At batch 32 the small models' steps are host-bound on the H200 (the GPU idles half the step while Python
schedules, packs inputs and processes outputs). This measures exactly that Python: the embedded model on
the CPU with graph-shaped steps, where every step after warm-up returns the output of an earlier real step
of the same shape instead of running the model (the host code path is the engine's own: schedule, build,
commit, process, deltas). Median of --repeats timings of --steps steps; --profile adds cProfile's top 20.
--no-fast-paths runs the engine's general paths (per-row output processing, the general plan) for an A/B in
one tree. One JSON line at the end.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from m3eagle import LLM, SamplingParams  # noqa: E402


def without_device(run):
    """GraphRunner.run with the device's part taken out: each step returns an earlier real output of its
    shape (fresh host state, so the engine's device->host copies still happen every step)."""
    cache = {}

    def stub(inp, bucket):
        key = (inp.num_rows, inp.num_tokens, inp.mode)
        if key not in cache:
            cache[key] = run(inp, bucket)
        return cache[key].fresh()

    return stub


def print_profile(eng, steps: int, top: int) -> None:
    """cProfile's top functions (builtins included) over `steps` engine steps, by own time, on stderr."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        eng.step()
    pr.disable()
    pstats.Stats(pr, stream=sys.stderr).sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--k", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per timing (default 200, or 100 with --k > 0: every row must fit the 4096-token context)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--num-scheduler-steps", type=int, default=1,
                    help="sub-steps per host iteration (multi-step); times are per device step")
    ap.add_argument("--stream-text", action="store_true",
                    help="detokenize every token as it comes (the server's streaming path); default: text at the "
                         "end, as LLM.generate and `m3eagle bench` run")
    ap.add_argument("--no-fast-paths", action="store_true",
                    help="the general paths only: every row through _process_row, every plan through the general loop")
    a = ap.parse_args()
    if a.steps is None:
        a.steps = 200 if a.k == 0 else 100
    need = (a.steps * (a.repeats + 2) + 20) * (a.k + 1) * a.num_scheduler_steps
    # Pages for every row's whole context: a pool sized by the default budget preempted rows in the last
    # repeat, and their recompute (a new shape) ran the real model -- 1-400 ms per step in that repeat.
    llm = LLM(num_draft_tokens=a.k, device="cpu", max_num_seqs=a.batch, max_model_len=need + 128,
              num_pages=a.batch * -(-(need + 128) // 16) + 16, graph_shapes=True, overlap=True,
              num_scheduler_steps=a.num_scheduler_steps)
    eng = llm.engine
    if a.no_fast_paths:
        eng.fast_paths = eng.scheduler.fast_path = False
    sp = SamplingParams(temperature=0, max_tokens=need, ignore_eos=True)
    for i in range(a.batch):
        eng.add_request(list(range(3 + i, 60 + i)), sp, stream_text=a.stream_text)
    for _ in range(4):
        eng.step()
    eng.graphs.run = without_device(eng.graphs.run)
    for _ in range(10):
        eng.step()
    times = []
    for _ in range(a.repeats):
        n0, t0 = eng.num_steps, time.perf_counter()
        for _ in range(a.steps):
            eng.step()
        times.append((time.perf_counter() - t0) / (eng.num_steps - n0) * 1e3)  # per device step
    ms = statistics.median(times)
    print(f"batch {a.batch} K={a.k}: host {ms:.3f} ms per step (median of {a.repeats}; "
          f"min {min(times):.3f}, max {max(times):.3f}), {ms / a.batch * 1e3:.1f} us per row", file=sys.stderr)
    if a.profile:
        print_profile(eng, a.steps, 20)
    print(json.dumps({"batch": a.batch, "k": a.k, "stream_text": a.stream_text, "fast_paths": not a.no_fast_paths,
                      "host_ms_per_step": ms,
                      "samples_ms": times}))


if __name__ == "__main__":
    main()
